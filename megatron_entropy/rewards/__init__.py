"""Rewards for rollouts."""

from megatron_entropy.rewards.math import last_boxed, math_reward, math_rewards

__all__ = ["last_boxed", "math_reward", "math_rewards"]
