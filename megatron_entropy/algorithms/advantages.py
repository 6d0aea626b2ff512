"""Outcome advantages from one scalar reward per response, grouped by prompt.

- ``grpo``: (r - mean_g) / (std_g + eps), std unbiased; without ``norm_by_std``: r - mean_g.
- ``drgrpo`` (Dr. GRPO): r - mean_g, never divided by the std (``norm_by_std`` is ignored).
- ``rloo``: r - mean of the other responses of the group = n/(n-1) (r - mean_g).
A group of one response keeps mean 0 and std 1 (GRPO) or its reward (RLOO), as verl does.
"""

from __future__ import annotations

import torch
from torch import Tensor

ESTIMATORS = ("grpo", "drgrpo", "rloo")


def compute_advantages(estimator: str, rewards: Tensor, group_ids: Tensor, *,
                       norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """One advantage per response [N] from rewards [N] and prompt ids [N] (long)."""
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {estimator!r}; choose one of "
                         f"{', '.join(ESTIMATORS)}")
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"rewards and group_ids must both be [N]; got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be integer prompt ids; got dtype {group_ids.dtype}")
    if rewards.numel() == 0:
        raise ValueError("no rewards: cannot compute advantages of an empty batch")
    rewards = rewards.float() if not rewards.dtype.is_floating_point else rewards
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards contain NaN or inf")

    _, inverse = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(inverse).to(rewards.dtype)
    sums = torch.zeros_like(counts).index_add_(0, inverse, rewards)
    n = counts[inverse]
    single = n == 1
    mean = torch.where(single, 0.0, (sums / counts)[inverse])
    centered = rewards - mean

    if estimator == "rloo":
        return torch.where(single, rewards, centered * n / (n - 1).clamp(min=1))
    if estimator == "drgrpo" or not norm_by_std:
        return centered
    sq = torch.zeros_like(counts).index_add_(0, inverse, centered.square())
    std = torch.where(single, 1.0, (sq[inverse] / (n - 1).clamp(min=1)).sqrt())
    return centered / (std + eps)
