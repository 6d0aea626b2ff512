"""Outcome advantages from one scalar reward per response, grouped by prompt.

- ``grpo``: (r - mean_g) / (std_g + eps), std unbiased; without ``norm_by_std``: r - mean_g.
- ``drgrpo`` (Dr. GRPO): r - mean_g, never divided by the std (``norm_by_std`` is ignored).
- ``rloo``: r - mean of the other responses of the group = n/(n-1) (r - mean_g).
- ``reinforce_plus_plus`` (Hu, "REINFORCE++", arXiv 2501.03262): r whitened over the batch's
  response tokens (every token of a response carries its return r, discount 1):
  (r - mu) / sqrt(var + 1e-8), mu and the unbiased var over tokens, so each response weighs
  by its length, as verl's ``masked_whiten``. The paper's per-token KL penalty in the reward
  is not here: r is the outcome reward alone, and a KL to the reference model goes into the
  loss (``kl_coef``, ``kl_type``).
- ``reinforce_plus_plus_baseline`` (same paper): r - mean_g, then whitened as above.
- ``opo`` (Hao et al., "On-Policy RL with Optimal Reward Baseline", arXiv 2505.23585):
  r - sum_g(len r) / sum_g(len), the length-weighted group mean.
- ``grpo_passk`` (Chen et al., "Pass@k Training", arXiv 2503.19595 as verl): only the group's
  best response (the first of equal bests) gets r_max - r_second, divided by (std_g + eps)
  with ``norm_by_std``; the others 0. Needs >= 2 responses per prompt.
- ``remax`` (Li et al., "ReMax", arXiv 2310.10505): r - b, b the reward of the prompt's greedy
  response (``baselines``, one per response; the rollout generates it).
A group of one response keeps mean 0 and std 1 (GRPO) or its reward (RLOO), as verl does.
"""

from __future__ import annotations

import typing
from typing import Optional

import torch
from torch import Tensor

from megatron_entropy.algorithms.settings import AdvantageName

ESTIMATORS = typing.get_args(AdvantageName)
# The estimators that weigh responses by their number of tokens.
NEEDS_LENGTHS = ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo")


def compute_advantages(estimator: str, rewards: Tensor, group_ids: Tensor, *,
                       norm_by_std: bool = True, eps: float = 1e-6,
                       lengths: Optional[Tensor] = None,
                       baselines: Optional[Tensor] = None) -> Tensor:
    """One advantage per response [N] from rewards [N] and prompt ids [N] (long); ``lengths``
    [N] (response tokens) for the estimators in ``NEEDS_LENGTHS``, ``baselines`` [N] (the
    greedy response's reward of each response's prompt) for ``remax``."""
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
    if estimator in NEEDS_LENGTHS:
        if lengths is None or lengths.shape != rewards.shape or bool((lengths < 0).any()):
            raise ValueError(f"{estimator} needs the response lengths [N] (>= 0); got "
                             f"{None if lengths is None else tuple(lengths.shape)}")
        lengths = lengths.to(rewards.dtype)
    if estimator == "remax":
        if baselines is None or baselines.shape != rewards.shape or \
                not bool(torch.isfinite(baselines).all()):
            raise ValueError(f"remax needs a finite greedy baseline [N] per response; got "
                             f"{None if baselines is None else tuple(baselines.shape)}")
        return rewards - baselines.to(rewards.dtype)

    _, inverse = torch.unique(group_ids, return_inverse=True)
    counts = torch.bincount(inverse).to(rewards.dtype)
    sums = torch.zeros_like(counts).index_add_(0, inverse, rewards)
    n = counts[inverse]
    single = n == 1
    mean = torch.where(single, 0.0, (sums / counts)[inverse])
    centered = rewards - mean

    if estimator == "rloo":
        return torch.where(single, rewards, centered * n / (n - 1).clamp(min=1))
    if estimator == "reinforce_plus_plus":
        return _whiten_over_tokens(rewards, lengths)
    if estimator == "reinforce_plus_plus_baseline":
        return _whiten_over_tokens(centered, lengths)
    if estimator == "opo":
        weighted = torch.zeros_like(counts).index_add_(0, inverse, lengths * rewards)
        tokens = torch.zeros_like(counts).index_add_(0, inverse, lengths)
        baseline = torch.where(tokens > 0, weighted / tokens.clamp(min=1), 0.0)[inverse]
        return rewards - torch.where(single, 0.0, baseline)
    sq = torch.zeros_like(counts).index_add_(0, inverse, centered.square())
    std = torch.where(single, 1.0, (sq[inverse] / (n - 1).clamp(min=1)).sqrt())
    if estimator == "grpo_passk":
        return _pass_at_k(rewards, inverse, counts, std if norm_by_std else None, eps)
    if estimator == "drgrpo" or not norm_by_std:
        return centered
    return centered / (std + eps)


def _whiten_over_tokens(values: Tensor, lengths: Tensor) -> Tensor:
    """(v - mu) / sqrt(var + 1e-8) with mu and the unbiased var over all response tokens."""
    tokens = lengths.sum()
    mu = (lengths * values).sum() / tokens.clamp(min=1)
    var = (lengths * (values - mu).square()).sum() / (tokens - 1).clamp(min=1)
    return (values - mu) * torch.rsqrt(var + 1e-8)


def _pass_at_k(rewards: Tensor, inverse: Tensor, counts: Tensor, std: Optional[Tensor],
               eps: float) -> Tensor:
    if bool((counts < 2).any()):
        raise ValueError("grpo_passk needs at least 2 responses per prompt (rollout.n >= 2)")
    out = torch.zeros_like(rewards)
    for g in range(counts.numel()):
        members = (inverse == g).nonzero().flatten()
        r = rewards[members]
        order = torch.sort(r, descending=True, stable=True).indices
        gap = r[order[0]] - r[order[1]]
        out[members[order[0]]] = gap if std is None else gap / (std[members[0]] + eps)
    return out
