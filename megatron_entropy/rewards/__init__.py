"""Rewards for rollouts: the registry, the configured scorer and the math reward."""

from megatron_entropy.rewards.math import last_boxed, math_reward, math_rewards
from megatron_entropy.rewards.registry import (RewardFunction, get_reward, register_reward,
                                               registered_rewards, resolve_reward,
                                               reward_function)
from megatron_entropy.rewards.scorer import RewardScorer

__all__ = ["RewardFunction", "RewardScorer", "get_reward", "last_boxed", "math_reward",
           "math_rewards", "register_reward", "registered_rewards", "resolve_reward",
           "reward_function"]
