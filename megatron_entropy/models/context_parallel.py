"""Causal attention over packed sequences and over a context-parallel (CP) group, for the local
layer spec's SDPA attention (models/attention.py) on any device.

Packed rows (the THD layout, trainer/packing.py): sequences back to back, bounded by
``cu_seqlens`` [n + 1]; each attends causally to itself only. One SDPA call per sequence, so the
work is the sum of len^2, not (sum len)^2 as one masked call over the row would be.

Context parallelism: every sequence (a row of the padded layout, or each packed sequence) is
split into 2 x CP equal chunks and CP rank r holds chunks r and 2CP-1-r (so that causal work is
even over the ranks), at their own positions. Each rank's queries need the keys and values of
the chunks before them: the ranks all-gather K and V (one collective per layer, K and V
together), put each sequence's chunks back in order and attend, chunk by chunk, to the prefix
that ends with the chunk: every key before the chunk, then the chunk's own keys causally (on the
CPU two flash-attention calls merged by their log-sum-exps, so that no [queries, keys] mask is
built). In the backward the gradient of the gathered K/V is the sum of every rank's (each rank's
queries read every rank's keys): the all-gather's adjoint, a reduce-scatter.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float, gqa: bool,
          prefix: int = 0) -> Tensor:
    """Causal attention of [s, b, h, d] queries over [prefix + s, b, g, d] keys and values: query
    i sees keys up to prefix + i. -> [s, b, h, d]."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if not prefix:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                             enable_gqa=gqa)
    elif q.device.type == "cpu":
        out = _PrefixCausalAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(),
                                           prefix, scale)
    else:  # the local spec on a GPU (Transformer Engine's CP attention is the GPU path)
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.tril(prefix), scale=scale,
                                             enable_gqa=gqa)
    return out.permute(2, 0, 1, 3)


class _PrefixCausalAttention(torch.autograd.Function):
    """[b, h, c, d] queries that follow ``prefix`` keys, all of which they see, then the c keys
    of their own chunk, causally ([b, g, prefix + c, d] keys and values), on the CPU without a
    [queries, keys] mask: torch's flash kernel over the prefix (not causal) and over the chunk
    (causal), merged by their log-sum-exps; the backward runs the flash backward of each part
    with the merged output and log-sum-exp, which gives the gradients of one softmax over both
    key sets (as ring attention does). Memory stays linear in the sequence."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, prefix: int, scale: float) -> Tensor:
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        o1, l1 = flash(q, k[:, :, :prefix], v[:, :, :prefix], 0.0, False, scale=scale)
        o2, l2 = flash(q, k[:, :, prefix:], v[:, :, prefix:], 0.0, True, scale=scale)
        lse = torch.logaddexp(l1, l2)
        out = (o1.float() * torch.exp(l1 - lse)[..., None]
               + o2.float() * torch.exp(l2 - lse)[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prefix, ctx.scale = prefix, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        p, scale = ctx.prefix, ctx.scale
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        grad = grad.contiguous()
        dq1, dk1, dv1 = flash_backward(grad, q, k[:, :, :p], v[:, :, :p], out, lse, 0.0, False,
                                       scale=scale)
        dq2, dk2, dv2 = flash_backward(grad, q, k[:, :, p:], v[:, :, p:], out, lse, 0.0, True,
                                       scale=scale)
        return dq1 + dq2, torch.cat([dk1, dk2], dim=2), torch.cat([dv1, dv2], dim=2), None, None


def packed_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, scale: float,
                     gqa: bool) -> Tensor:
    """[t, h, d] queries of sequences back to back ([t, g, d] keys and values) -> [t, h, d]:
    each sequence attends causally to itself."""
    bounds = cu_seqlens.tolist()
    parts = [_sdpa(q[a:b, None], k[a:b, None], v[a:b, None], scale, gqa)[:, 0]
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return torch.cat(parts) if parts else q.new_zeros(q.shape)


class _GatherOverCp(torch.autograd.Function):
    """[s, ...] -> [cp, s, ...] gathered in CP rank order; backward: the sum of every rank's
    gradient of this rank's part."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Optional[Tensor], None]:
        group = ctx.group
        grad = grad.contiguous()
        if dist.get_backend(group) == "nccl":
            out = torch.empty_like(grad[0])
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        dist.all_reduce(grad, group=group)  # gloo has no reduce-scatter
        return grad[dist.get_rank(group)], None


def _in_order(kv: Tensor, cp: int) -> Tensor:
    """[cp, 2c, ...] every rank's two chunks of one sequence -> [2cp c, ...] in sequence order
    (chunk j on rank j, first half, for j < cp; else on rank 2cp-1-j, second half)."""
    c = kv.shape[1] // 2
    chunks = [kv[j, :c] if j < cp else kv[2 * cp - 1 - j, c:] for j in range(2 * cp)]
    return torch.cat(chunks)


def _cp_sequence(q: Tensor, kv: Tensor, rank: int, cp: int, scale: float, gqa: bool) -> Tensor:
    """This rank's [2c, b, h, d] queries of one sequence (chunks rank and 2cp-1-rank) over its
    keys/values gathered from every rank, [cp, 2c, b, g, 2d] -> [2c, b, h, d]."""
    full = _in_order(kv, cp)
    k, v = full.chunk(2, dim=-1)
    c = q.shape[0] // 2
    out = []
    for half, chunk in ((0, rank), (1, 2 * cp - 1 - rank)):
        end = (chunk + 1) * c
        out.append(_sdpa(q[half * c:(half + 1) * c], k[:end], v[:end], scale, gqa,
                         prefix=end - c))
    return torch.cat(out)


def cp_attention(q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup, scale: float,
                 gqa: bool, cu_seqlens: Optional[Tensor] = None) -> Tensor:
    """Causal attention of this CP rank's chunks: [s, b, h, d] queries with [s, b, g, d] keys and
    values (each row one sequence), or, given ``cu_seqlens`` (the whole sequences' padded
    bounds, each a multiple of 2 x CP), [t, h, d] and [t, g, d] of packed sequences; the
    output has the queries' shape."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    packed = cu_seqlens is not None
    if packed:
        q, k, v = q[:, None], k[:, None], v[:, None]
    kv = _GatherOverCp.apply(torch.cat([k, v], dim=-1), group)  # [cp, s, b, g, 2d]
    if not packed:
        return _cp_sequence(q, kv, rank, cp, scale, gqa)
    bounds = [b // cp for b in cu_seqlens.tolist()]  # each sequence's part on every rank
    parts = [_cp_sequence(q[a:b], kv[:, a:b], rank, cp, scale, gqa)
             for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    return (torch.cat(parts) if parts else q.new_zeros(q.shape))[:, 0]
