"""Context parallelism (CP) on the trainer's side: each CP rank's part of a micro-batch, and the
per-token statistics put back together.

Every sequence (a padded row, or each sequence of a packed row) is split into 2 x CP equal chunks
and rank r takes chunks r and 2CP-1-r, in that order, at their own positions (Megatron's
load-balanced layout, which its RoPE and Transformer Engine's CP attention expect); a padded
row is first padded to a multiple of 2 x CP. A response token's log-prob and entropy are computed
by the rank that holds the position predicting it.

Everything downstream of the log-probs and entropies (the loss and its token counts in every
aggregation mode, sequence-level ratios, Cov means, top-k and draws at either scope, token
rules, the entropy methods' vocab statistics, metrics) needs the whole micro-batch:
``gather_token_stats`` all-gathers the ranks' [N_r, 2] statistics (one small collective per
micro-batch forward, the only one CP adds to them; ``gather_rows`` any other per-token values), so every CP rank holds the micro-batch's [N] exactly as at CP = 1 and computes the same
loss. The gather's backward hands each rank the gradient of its own tokens only (not the sum of
the ranks' identical ones): every rank's loss is the whole loss, and each token's gradient must
reach the model once; the data-parallel x CP grad reduce then sums the ranks' parameter
gradients, each from its own tokens (and, through the attention's K/V gather, from the others').
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.trainer.batch import MicroBatch


def chunk_positions(start: int, length: int, rank: int, cp: int) -> list[int]:
    """Positions (from ``start``) that CP rank ``rank`` holds of a sequence of ``length`` (a
    multiple of 2 x cp): chunk rank, then chunk 2cp-1-rank."""
    c = length // (2 * cp)
    return [start + p for k in (rank, 2 * cp - 1 - rank) for p in range(k * c, (k + 1) * c)]


def shard_micro_batch(mb: MicroBatch, rank: int, cp: int, pad_id: int = 0) -> MicroBatch:
    """This CP rank's part of ``mb`` (module docstring): its tokens and positions, the flat
    positions and targets of the response tokens it computes, and ``stat_owner``."""
    if mb.attention_mask is not None:
        raise ValueError("context parallelism takes padded or packed micro-batches, not "
                         "shared-prompt rows (trainer.micro_batch_layout)")
    rows, S = mb.tokens.shape
    tokens, positions, padding = mb.tokens, mb.position_ids, mb.padding
    if mb.cu_seqlens_padded is not None:
        bounds = mb.cu_seqlens_padded.tolist()
        width = S
    else:  # each row one sequence, padded to a multiple of 2 x CP
        width = -(-S // (2 * cp)) * 2 * cp
        if width > S:
            tokens = torch.cat([tokens, tokens.new_full((rows, width - S), pad_id)], dim=1)
            positions = torch.cat([positions, positions[:, -1:] + torch.arange(
                1, width - S + 1).expand(rows, -1)], dim=1)
            if padding is not None:
                padding = torch.cat([padding, padding.new_ones(rows, width - S)], dim=1)
        bounds = [0, width]
    owners = [torch.full((width,), -1, dtype=torch.long) for _ in range(cp)]
    mine = []
    for r in range(cp):
        held = [p for a, b in zip(bounds[:-1], bounds[1:]) for p in chunk_positions(a, b - a, r,
                                                                                      cp)]
        owners[r][held] = torch.arange(len(held))
        if r == rank:
            mine = held
    local_width = len(mine)
    flat = mb.flat_positions
    row, col = flat // S, flat % S
    owner = torch.full_like(flat, -1)
    local = torch.full_like(flat, -1)
    for r in range(cp):
        at = owners[r][col]
        owner = torch.where(at >= 0, r, owner)
        local = torch.where(at >= 0, row * local_width + at, local)
    own = owner == rank
    return replace(mb, tokens=tokens[:, mine], position_ids=positions[:, mine],
                   flat_positions=local[own], targets=mb.targets[own], stat_owner=owner,
                   cp_columns=torch.tensor(mine, dtype=torch.long),
                   padding=None if padding is None else padding[:, mine])


class _GatherTokens(torch.autograd.Function):
    """[N_r, k] on each CP rank -> [N, k] in the micro-batch's order (``owner`` [N]: the rank of
    each row); backward: this rank's rows of the gradient (module docstring)."""

    @staticmethod
    def forward(ctx, values: Tensor, owner: Tensor, group: dist.ProcessGroup) -> Tensor:
        rank, cp = dist.get_rank(group), dist.get_world_size(group)
        ctx.rank = rank
        ctx.save_for_backward(owner)
        counts = torch.bincount(owner, minlength=cp).tolist()
        padded = values.new_zeros(max(counts), values.shape[1])
        padded[:values.shape[0]] = values
        parts = [torch.empty_like(padded) for _ in range(cp)]
        dist.all_gather(parts, padded, group=group)
        out = values.new_empty(owner.shape[0], values.shape[1])
        for r, (part, n) in enumerate(zip(parts, counts)):
            out[owner == r] = part[:n]
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        (owner,) = ctx.saved_tensors
        return grad[owner == ctx.rank], None, None


def gather_rows(values: Tensor, mb: MicroBatch, group: dist.ProcessGroup) -> Tensor:
    """This CP rank's [N_r, ...] per-response-token values -> the micro-batch's [N, ...] (module
    docstring); as they are where the micro-batch is not sharded."""
    if mb.stat_owner is None:
        return values
    # (math.prod, not -1: a rank may hold no response token, and -1 cannot size 0 rows)
    flat = values.reshape(values.shape[0], math.prod(values.shape[1:]))
    out = _GatherTokens.apply(flat, mb.stat_owner.to(values.device), group)
    return out.reshape(out.shape[0], *values.shape[1:])


def gather_token_stats(logp: Tensor, entropy: Tensor, mb: MicroBatch,
                       group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """This CP rank's [N_r] log-probs and entropies -> the micro-batch's [N] (one gather)."""
    if mb.stat_owner is None:
        return logp, entropy
    both = gather_rows(torch.stack([logp, entropy.to(logp.dtype)], dim=1), mb, group)
    return both[:, 0], both[:, 1].to(entropy.dtype)
