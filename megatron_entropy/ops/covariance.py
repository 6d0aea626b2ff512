"""Covariance of log-probability and advantage per token, and the token selections built on it.

Cov_i = (A_i - mean A) * (logp_i - mean logp), means over the valid tokens of a population; logp
is detached (Cov only chooses tokens). Two populations:

- one micro-batch (``micro_batch`` scope, the paper's code and verl): the plain functions below on
  [B, S] tensors;
- the whole optimizer step over the data-parallel group (``global`` scope, the paper's
  definition): the ``global_*`` functions, each taking this rank's micro-batches as lists of
  [B_i, S_i] tensors. They equal the one-process functions applied to the concatenation of every
  rank's micro-batches in the order (DP rank, micro-batch, row, column).

Tie rule for top-k (both scopes): among equal scores the token that comes first in that order wins.
(torch.topk leaves the order among exact ties unspecified, so verl may pick other tied tokens.)

Every rank computes from all-gathered (not all-reduced) partial results, summed in rank order, so
all ranks holding the same tokens (e.g. the TP ranks of one DP replica) get bit-identical
selections.

The top-k and k-th-value machinery (``top_k_mask``, ``global_kth_largest``, ``global_top_k``) is
not specific to Cov: ``ops/quantile.py`` builds the entropy rules' quantiles on it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` where ``mask`` is set; NaN/garbage at masked-out positions is ignored."""
    valid = mask.bool()
    return torch.where(valid, values, 0).sum() / valid.sum()


def token_covariance(logp: Tensor, advantages: Tensor, mask: Tensor,
                     mean_logp: Optional[Tensor] = None,
                     mean_adv: Optional[Tensor] = None) -> Tensor:
    """Cov_i per token [B, S]; the means default to this tensor's valid tokens. 0 where masked."""
    logp = logp.detach()
    advantages = advantages.detach()
    if mean_logp is None:
        mean_logp = masked_mean(logp, mask)
    if mean_adv is None:
        mean_adv = masked_mean(advantages, mask)
    cov = (advantages - mean_adv.to(advantages.dtype)) * (logp - mean_logp.to(logp.dtype))
    return torch.where(mask.bool(), cov, 0)


def clip_cov_candidates(cov: Tensor, mask: Tensor, clipped: Tensor, lb: float, ub: float) -> Tensor:
    """Clip-Cov candidates: valid, not already clipped by PPO, and lb < Cov < ub (strict)."""
    return mask.bool() & ~clipped & (cov > lb) & (cov < ub)


def clip_cov_count(ratio: float, num_valid: int, num_candidates: int) -> int:
    """n = min(max(int(ratio * N_valid), 1), n_candidates), as the paper's code."""
    if num_candidates == 0:
        return 0
    return min(max(int(ratio * float(num_valid)), 1), num_candidates)


def kl_cov_count(ratio: float, num_valid: int) -> int:
    """k = max(1, int(N_valid * ratio)); none when there is no valid token."""
    return 0 if num_valid == 0 else max(1, int(num_valid * ratio))


def random_subset(candidates: Tensor, n: int,
                  generator: Optional[torch.Generator] = None) -> Tensor:
    """Mask of ``n`` candidates drawn uniformly: randperm over the candidates in row-major order,
    first n (the paper's code, with ``generator`` in place of the global RNG)."""
    flat = candidates.reshape(-1)
    idx = flat.nonzero().squeeze(1)
    out = torch.zeros_like(flat)
    if n > 0 and idx.numel() > 0:
        perm = torch.randperm(idx.numel(), generator=generator,
                              device=generator.device if generator is not None else "cpu")
        out[idx[perm[:n].to(idx.device)]] = True
    return out.view_as(candidates)


def kth_largest(values: Tensor, k: int) -> Tensor:
    """The k-th largest entry of a non-empty 1-D tensor (1 <= k <= numel)."""
    return torch.topk(values, k, sorted=False).values.min()


def _stable_top_k_flat(scores: Tensor, k: int, offset_of_ties: int = 0,
                       kth: Optional[Tensor] = None, take_ties: Optional[int] = None) -> Tensor:
    """Mask of the k largest entries of a 1-D tensor, ties to the lowest index.

    In the global scope ``kth`` (the k-th largest value overall), ``take_ties`` (how many tokens
    equal to it are taken overall) and ``offset_of_ties`` (how many equal tokens lower ranks hold)
    come from the gathered counts, so each rank takes its share of the ties in global order.
    """
    sel = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    if k <= 0 or scores.numel() == 0:
        return sel
    if kth is None:
        kth = kth_largest(scores, k)
    above = scores > kth
    ties = scores == kth
    if take_ties is None:
        take_ties = k - int(above.sum())
    tie_rank = ties.long().cumsum(0) - 1 + offset_of_ties  # position among all ranks' ties
    return above | (ties & (tie_rank < take_ties))


def top_k_mask(scores: Tensor, mask: Tensor, k: int) -> Tensor:
    """Mask of the k valid tokens with the largest score (ties: first in row-major order)."""
    valid = mask.bool().reshape(-1)
    idx = valid.nonzero().squeeze(1)
    out = torch.zeros_like(valid)
    out[idx] = _stable_top_k_flat(scores.reshape(-1)[idx], min(k, idx.numel()))
    return out.view_as(mask)


# ------------------------------------------------------------------------- the global scope


def gather_in_rank_order(t: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """[world, *t.shape]; a single process (or no group) is world 1."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t.unsqueeze(0)
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.stack(parts)


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def flat_valid(values: Sequence[Tensor], masks: Sequence[Tensor]) -> Tensor:
    parts = [v.detach().reshape(-1)[m.bool().reshape(-1)] for v, m in zip(values, masks)]
    return torch.cat(parts) if parts else torch.zeros(0)


def scatter_flat(flags: Tensor, masks: Sequence[Tensor]) -> list[Tensor]:
    """Inverse of ``flat_valid``: a flag per valid token back to one [B_i, S_i] mask each."""
    out, start = [], 0
    for m in masks:
        valid = m.bool()
        n = int(valid.sum())
        sel = torch.zeros_like(valid)
        sel[valid] = flags[start:start + n]
        out.append(sel)
        start += n
    return out


def global_population_means(logps: Sequence[Tensor], advantages: Sequence[Tensor],
                            masks: Sequence[Tensor], group: Optional[dist.ProcessGroup]
                            ) -> tuple[Tensor, Tensor, int]:
    """(mean logp, mean advantage, number of valid tokens) over every rank's micro-batches.

    Partial sums are float64 and combined in rank order (one all-gather).
    """
    device = masks[0].device if masks else torch.device("cpu")
    local = torch.zeros(3, dtype=torch.float64, device=device)
    for lp, adv, m in zip(logps, advantages, masks):
        valid = m.bool()
        local[0] += torch.where(valid, lp.detach(), 0).double().sum()
        local[1] += torch.where(valid, adv.detach(), 0).double().sum()
        local[2] += valid.sum()
    total = gather_in_rank_order(local, group).sum(dim=0)
    count = int(total[2])
    if count == 0:
        raise ValueError("the optimizer step has no valid (mask = 1) token on any data-parallel "
                         "rank: nothing to select from")
    return total[0] / count, total[1] / count, count


def global_valid_count(masks: Sequence[Tensor], group: Optional[dist.ProcessGroup]) -> int:
    """Valid tokens of every rank's micro-batches (one all-gather)."""
    device = masks[0].device if masks else torch.device("cpu")
    local = torch.tensor([sum(int(m.bool().sum()) for m in masks)], dtype=torch.long,
                         device=device)
    return int(gather_in_rank_order(local, group).sum())


def global_kth_largest(flat: Tensor, k: int, group: Optional[dist.ProcessGroup]) -> Tensor:
    """The k-th largest of every rank's 1-D ``flat`` values, as a float64 scalar (exact: the
    global top k are among the ranks' own top k; one all-gather of k values per rank, padded
    with -inf). Every rank must pass the same k >= 1; k above the total gives -inf."""
    top = torch.full((k,), -float("inf"), dtype=torch.float64, device=flat.device)
    n_local = min(k, flat.numel())
    if n_local:
        top[:n_local] = torch.topk(flat.double(), n_local, sorted=False).values
    return kth_largest(gather_in_rank_order(top, group).reshape(-1), k)


def global_counts_at(flat: Tensor, value: Tensor, group: Optional[dist.ProcessGroup]) -> Tensor:
    """[world, 2] long: each rank's count of ``flat`` values above ``value`` and equal to it, in
    rank order (one all-gather)."""
    flat64 = flat.double()
    counts = torch.stack([(flat64 > value).sum(), (flat64 == value).sum()])
    return gather_in_rank_order(counts, group)


def global_top_k(scores: Sequence[Tensor], masks: Sequence[Tensor], k: int,
                 group: Optional[dist.ProcessGroup]) -> list[Tensor]:
    """Masks of the k valid tokens with the largest score over every rank's micro-batches.

    Two all-gathers: each rank's own top-k values (the global top k is among them) give the k-th
    largest value; then the per-rank counts above it and equal to it place the ties in global
    order.
    """
    device = masks[0].device if masks else torch.device("cpu")
    flat = flat_valid(scores, masks).to(device)
    if k <= 0:
        return scatter_flat(torch.zeros(flat.shape, dtype=torch.bool, device=device), masks)
    kth = global_kth_largest(flat, k, group)
    all_counts = global_counts_at(flat, kth, group)
    rank = group_rank(group)
    take_ties = k - int(all_counts[:, 0].sum())
    ties_before = int(all_counts[:rank, 1].sum())
    flags = _stable_top_k_flat(flat.double(), k, offset_of_ties=ties_before, kth=kth,
                               take_ties=take_ties)
    return scatter_flat(flags, masks)


def global_random_subset(candidates: Sequence[Tensor], ratio: float, num_valid: int,
                         generator: Optional[torch.Generator],
                         group: Optional[dist.ProcessGroup],
                         row_keys: Optional[Sequence[Tensor]] = None) -> list[Tensor]:
    """Clip-Cov's draw over every rank's candidates: n = clip_cov_count(ratio, N_valid, n_cand),
    then the first n of one randperm over all candidates in global order. Every rank draws the
    same permutation from the same seeded ``generator`` and keeps the indices in its range.

    The global order is (rank, micro-batch, row, column), or with ``row_keys`` (an integer per
    row of each micro-batch: its place in the whole step, e.g. its group's index) the rows of
    every rank sorted by key (equal keys: rank, then local order), then column: the same draw
    however the step's rows are split over ranks and micro-batches."""
    device = candidates[0].device if candidates else torch.device("cpu")
    local_count = torch.tensor([sum(int(c.sum()) for c in candidates)], dtype=torch.long,
                               device=device)
    counts = gather_in_rank_order(local_count, group).reshape(-1)
    total = int(counts.sum())
    rank = group_rank(group)
    n = clip_cov_count(ratio, num_valid, total)
    if row_keys is None:
        offset = int(counts[:rank].sum())
        position = torch.arange(offset, offset + int(local_count), device=device)
    else:
        position = _keyed_positions(candidates, row_keys, group).to(device)
    flags = torch.zeros(int(local_count), dtype=torch.bool, device=device)
    if n > 0:
        perm = torch.randperm(total, generator=generator,
                              device=generator.device if generator is not None else "cpu")
        chosen = torch.zeros(total, dtype=torch.bool, device=perm.device)
        chosen[perm[:n]] = True
        flags = chosen[position.to(chosen.device)].to(device)
    return scatter_flat(flags, candidates)


def _keyed_positions(candidates: Sequence[Tensor], row_keys: Sequence[Tensor],
                     group: Optional[dist.ProcessGroup]) -> Tensor:
    """The global position of each of this rank's candidates (in ``flat_valid`` order) when
    every rank's rows are sorted by key (then rank, then local order) and read row by row; one
    object all-gather of each rank's (key, candidate count) per row."""
    rows = [(int(k), int(c.sum())) for cand, keys in zip(candidates, row_keys)
            for k, c in zip(keys.tolist(), cand.reshape(cand.shape[0], -1))]
    world = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
    every: list = [rows]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, rows, group=group)
    ordered = sorted((key, r, i) for r, part in enumerate(every)
                     for i, (key, _) in enumerate(part))
    start, offset = {}, 0
    for _, r, i in ordered:
        start[(r, i)] = offset
        offset += every[r][i][1]
    rank = group_rank(group)
    if not rows:
        return torch.zeros(0, dtype=torch.long)
    return torch.cat([torch.arange(start[(rank, i)], start[(rank, i)] + n)
                      for i, (_, n) in enumerate(rows)])
