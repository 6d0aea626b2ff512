"""Reward functions for tests/unit/rewards/test_registry.py, in a module of their own: the pool's
workers import it, and it imports nothing heavy (a worker starts in about a second)."""

from __future__ import annotations

import os
import time

from megatron_entropy.rewards import reward_function


def length_reward(response: str, ground_truth: str, source: str = "") -> float:
    return len(response) + (0.5 if source == "b" else 0.0)


@reward_function(batched=True)
def batched_length(responses: list[str], ground_truths: list[str]) -> list[float]:
    return [float(len(r)) for r in responses]


def hang_or_length(response: str, ground_truth: str) -> float:
    if response == "hang":
        time.sleep(3600)
    return float(len(response))


def mark_and_hang(response: str, ground_truth: str) -> float:
    """Creates the file named by the response, then hangs (a worker busy when its parent dies)."""
    with open(response, "w"):
        pass
    time.sleep(3600)
    return 0.0


def raise_or_length(response: str, ground_truth: str) -> float:
    if response == "raise":
        return 1 / 0
    return float(len(response))


def returns_text(response: str, ground_truth: str):
    return "yes"


def returns_nan(response: str, ground_truth: str) -> float:
    return float("nan")


@reward_function(batched=True)
def batched_one_short(responses: list[str], ground_truths: list[str]) -> list[float]:
    return [0.0] * (len(responses) - 1)


def one_argument(response: str) -> float:
    return 0.0


def worker_pid(response: str, ground_truth: str) -> float:
    return float(os.getpid())


def die_or_pid(response: str, ground_truth: str) -> float:
    if response == "die":
        os._exit(3)
    return float(os.getpid())


NOT_CALLABLE = 3
