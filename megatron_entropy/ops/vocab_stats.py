"""Per-position statistics over a TP-sharded vocabulary beyond log-prob and entropy: the entropy of
the top-p nucleus (SIREN), the log-prob of the target under a min-p filtered proxy (Lp-Reg), and
the first-order entropy change of one update (the paper's lemma).

Every function takes this rank's raw logits [T, V_local] (columns [rank * V_local, ...) of the
padded vocabulary; columns at or beyond ``vocab_size`` are padding and never read) and works at
``temperature`` (d = (z - M) / temperature, M the global maximum logit of the position). Every
TP rank gets bit-identical results: they merge the same all-gathered numbers in rank order.

Top-p entropy (``vocab_parallel_top_p_entropy``, with gradient). With the full-vocabulary
probabilities p sorted in decreasing order (ties: lower token id first) and restricted to the
first ``top_k``, the nucleus N is the longest prefix whose inclusive cumulative sum stays below
``top_p`` (so a top token with p >= top_p leaves N empty, entropy 0), and
H_p = -sum_{v in N} q_v log q_v, q = p / sum_N p = exp(d) / s_N, i.e. H_p = log s_N - u_N / s_N
with s_N = sum_N exp(d), u_N = sum_N exp(d) d. Collectives in the forward: ONE all-gather of
[T, 2 + 2 k0] per chunk (each rank's max, sum-exp and its k0 = 64 largest logits with their
ids), which decides the nucleus exactly wherever it ends above every rank's k0-th logit; only the
positions where it does not (a flat distribution) take a second all-gather, of each rank's
min(top_k, V_local) largest logits: at most 2. The backward needs none: N is a fixed set, and
dH_p/dz_v = -q_v (d_v - u_N / s_N) / temperature on v in N, 0 elsewhere.

Min-p proxy (``vocab_parallel_min_p_shift``, forward only). The proxy keeps the tokens whose
probability at temperature 1 is at least ``min_p`` times the top token's, z_v - M >= log(min_p),
and renormalises the tempered distribution over them: log q(target) = log p(target) - log(kept
mass), or -inf where the target is filtered out. The op returns that shift, so that a proxy
which keeps everything is exactly the policy (not up to rounding). Two all-gathers of [T, 2]
(the maximum and target logit, then the kept and total mass).

Entropy change (``vocab_parallel_entropy_change``, forward only). From the logits of one
position before and after an update: H_before, H_after (exact) and the first-order prediction
-Cov_{a ~ pi_before}(log pi_before(a), dz(a)), dz = (z_after - z_before) / temperature. Two
all-gathers: the merged log-sum-exp statistics of both (as ops/logprob_entropy.py), then the
covariance's two partial sums (one collective for the covariance).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.ops.logprob_entropy import (_gather_stats, _group_layout, _merge_stats,
                                                  _real_columns)

__all__ = ["vocab_parallel_top_p_entropy", "vocab_parallel_min_p_shift",
           "vocab_parallel_entropy_change"]

# Candidates each rank sends in the first all-gather of the top-p entropy.
TOP_P_CANDIDATES = 64


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _local_top(z: Tensor, k: int, offset: int) -> tuple[Tensor, Tensor]:
    """This shard's k largest logits [c, k] and their global ids (padded with -inf / -1)."""
    c, n = z.shape
    vals = z.new_full((c, k), -math.inf)
    ids = torch.full((c, k), -1, dtype=torch.long, device=z.device)
    take = min(k, n)
    if take > 0:
        v, i = torch.topk(z, take, dim=1)
        vals[:, :take], ids[:, :take] = v, i + offset
    return vals, ids


def _sorted_candidates(vals: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
    """[c, K] candidates sorted by value, largest first, ties by lower id (padding last)."""
    ids_key = torch.where(ids < 0, torch.iinfo(torch.long).max, ids)
    order = torch.argsort(ids_key, dim=1)
    vals, ids = vals.gather(1, order), ids.gather(1, order)
    order = torch.argsort(-vals, dim=1, stable=True)
    return vals.gather(1, order), ids.gather(1, order)


def _nucleus(vals: Tensor, ids: Tensor, big_m: Tensor, total: Tensor, inv_t: float,
             top_p: float, top_k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """From sorted candidates: (members [c], last member's logit and id, s_N, u_N / s_N)."""
    k = min(top_k, vals.shape[1])
    v = vals[:, :k]
    d = (v - big_m[:, None]) * inv_t
    e = torch.where(torch.isfinite(v), torch.exp(d), 0.0)
    cum = torch.cumsum(e / total[:, None], dim=1)
    members = (cum < top_p).sum(dim=1)
    last = (members - 1).clamp(min=0)
    keep = torch.arange(k, device=v.device)[None, :] < members[:, None]
    s_n = torch.where(keep, e, 0.0).sum(dim=1)
    u_n = torch.where(keep, e * torch.where(torch.isfinite(d), d, 0.0), 0.0).sum(dim=1)
    mean_d = torch.where(members > 0, u_n / s_n.clamp(min=torch.finfo(s_n.dtype).tiny), 0.0)
    return (members, v.gather(1, last[:, None]).squeeze(1), ids[:, :k].gather(1, last[:, None])
            .squeeze(1), s_n, mean_d)


def _exact(vals: Tensor, members: Tensor, floor: Tensor, top_k: int) -> Tensor:
    """Whether the merged candidates decide the nucleus: the elements up to the crossing one (or
    the top_k-th) are all above every truncated rank's smallest candidate (``floor``)."""
    need = torch.minimum(members, torch.full_like(members, top_k - 1))
    have = need < vals.shape[1]
    v = vals.gather(1, need.clamp(max=vals.shape[1] - 1)[:, None]).squeeze(1)
    return torch.isneginf(floor) | (have & (v > floor))


def _merge_top(stats: Tensor, inv_t: float) -> tuple[Tensor, Tensor]:
    """[world, c, 2] (local max, local sum-exp) -> the position's global max M and sum-exp S."""
    m, s = stats.unbind(dim=-1)
    big_m = m.amax(dim=0)
    w = torch.exp((m - big_m) * inv_t)
    return big_m, (s * torch.where(torch.isfinite(m), w, 0.0)).sum(dim=0)


class _TopPEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, vocab_size: Optional[int], group, temperature: float,
                top_p: float, top_k: int):
        rank, world = _group_layout(group)
        local_vocab = logits.shape[1]
        n_real = _real_columns(vocab_size, local_vocab, rank, world)
        z = logits[:, :n_real].to(_stats_dtype(logits.dtype))
        inv_t = 1.0 / temperature
        offset = rank * local_vocab
        c = z.shape[0]
        local_m = z.amax(dim=1) if n_real > 0 else z.new_full((c,), -math.inf)
        local_s = torch.exp((z - local_m[:, None]) * inv_t).sum(dim=1) if n_real > 0 \
            else z.new_zeros(c)
        k0 = min(TOP_P_CANDIDATES, top_k)
        vals, ids = _local_top(z, k0, offset)
        packed = torch.cat([local_m[:, None], local_s[:, None], vals, ids.to(z.dtype)], dim=1)
        g = _gather_stats(packed, group, world)  # the one collective of the common case
        big_m, total = _merge_top(g[..., :2], inv_t)
        all_vals = g[..., 2:2 + k0].permute(1, 0, 2).reshape(c, world * k0)
        all_ids = g[..., 2 + k0:].permute(1, 0, 2).reshape(c, world * k0).long()
        # A rank whose shard has more real columns than it sent may hold more candidates.
        sent_all = torch.tensor([_real_columns(vocab_size, local_vocab, r, world) <= k0
                                 for r in range(world)], device=z.device)
        floor = torch.where(sent_all[None, :], -math.inf,
                            g[..., 2 + k0 - 1].transpose(0, 1)).amax(dim=1)
        vals_s, ids_s = _sorted_candidates(all_vals, all_ids)
        members, last_v, last_i, s_n, mean_d = _nucleus(vals_s, ids_s, big_m, total, inv_t,
                                                       top_p, top_k)
        redo = ~_exact(vals_s, members, floor, top_k)
        k1 = min(top_k, max(_real_columns(vocab_size, local_vocab, r, world)
                            for r in range(world)))
        # Every rank computed ``redo`` from the same gathered numbers: they agree without a vote.
        if k1 > k0 and bool(redo.any()):
            rows = redo.nonzero().squeeze(1)
            v1, i1 = _local_top(z[rows], k1, offset)
            g1 = _gather_stats(torch.cat([v1, i1.to(z.dtype)], dim=1), group, world)
            n = rows.numel()
            v1 = g1[..., :k1].permute(1, 0, 2).reshape(n, world * k1)
            i1 = g1[..., k1:].permute(1, 0, 2).reshape(n, world * k1).long()
            v1, i1 = _sorted_candidates(v1, i1)
            fixed = _nucleus(v1, i1, big_m[rows], total[rows], inv_t, top_p, top_k)
            for out, new in zip((members, last_v, last_i, s_n, mean_d), fixed):
                out[rows] = new
        entropy = torch.where(members > 0,
                              torch.log(s_n.clamp(min=torch.finfo(s_n.dtype).tiny)) - mean_d,
                              0.0)
        ctx.mark_non_differentiable(members)
        ctx.save_for_backward(logits, big_m, s_n, mean_d, members, last_v, last_i)
        ctx.n_real, ctx.inv_t, ctx.offset = n_real, inv_t, offset
        return entropy.to(torch.float64 if logits.dtype == torch.float64 else torch.float32), \
            members

    @staticmethod
    def backward(ctx, g_ent: Optional[Tensor], _g_members):
        logits, big_m, s_n, mean_d, members, last_v, last_i = ctx.saved_tensors
        grad = torch.zeros_like(logits)
        if g_ent is None or ctx.n_real == 0:
            return grad, None, None, None, None, None
        z = logits[:, :ctx.n_real].to(big_m.dtype)
        cols = torch.arange(ctx.n_real, device=z.device)[None, :] + ctx.offset
        inside = (z > last_v[:, None]) | ((z == last_v[:, None]) & (cols <= last_i[:, None]))
        inside &= (members > 0)[:, None]
        d = (z - big_m[:, None]) * ctx.inv_t
        q = torch.exp(d) / s_n.clamp(min=torch.finfo(s_n.dtype).tiny)[:, None]
        gz = torch.where(inside, -ctx.inv_t * q * (d - mean_d[:, None]), 0.0)
        grad[:, :ctx.n_real] = (gz * g_ent[:, None].to(gz.dtype)).to(grad.dtype)
        return grad, None, None, None, None, None


def vocab_parallel_top_p_entropy(logits: Tensor, *, vocab_size: Optional[int] = None,
                                 group: Optional[dist.ProcessGroup] = None,
                                 temperature: float = 1.0, top_p: float = 0.8,
                                 top_k: int = 10000) -> tuple[Tensor, Tensor]:
    """(entropy of the top-p nucleus [T], nucleus size [T]) of softmax(logits / temperature) from
    this rank's vocab shard (module docstring); differentiable w.r.t. ``logits``."""
    if logits.dim() != 2 or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a float [tokens, local_vocab] tensor; got "
                         f"{tuple(logits.shape)} {logits.dtype}")
    if not 0 < top_p <= 1 or top_k < 1 or not temperature > 0:
        raise ValueError(f"need 0 < top_p <= 1, top_k >= 1, temperature > 0; got {top_p}, "
                         f"{top_k}, {temperature}")
    return _TopPEntropy.apply(logits, vocab_size, group, float(temperature), float(top_p),
                              int(top_k))


@torch.no_grad()
def vocab_parallel_min_p_shift(logits: Tensor, targets: Tensor, *, min_p: float,
                               vocab_size: Optional[int] = None,
                               group: Optional[dist.ProcessGroup] = None,
                               temperature: float = 1.0) -> Tensor:
    """[T] log pi_proxy(target) - log pi(target) under the min-p proxy (module docstring):
    -log(kept mass), exactly 0 where the filter keeps the whole vocabulary (the kept and the
    total mass are the same sum then), -inf where it drops the target."""
    if not 0 < min_p <= 1:
        raise ValueError(f"min_p must be in (0, 1]; got {min_p}")
    rank, world = _group_layout(group)
    local_vocab = logits.shape[1]
    n_real = _real_columns(vocab_size, local_vocab, rank, world)
    z = logits[:, :n_real].to(_stats_dtype(logits.dtype))
    c = z.shape[0]
    local_t = targets - rank * local_vocab
    owned = (local_t >= 0) & (local_t < n_real)
    picked = z.gather(1, local_t.clamp(0, max(n_real - 1, 0))[:, None]).squeeze(1) \
        if n_real > 0 else z.new_zeros(c)
    local_m = z.amax(dim=1) if n_real > 0 else z.new_full((c,), -math.inf)
    g = _gather_stats(torch.stack([local_m, torch.where(owned, picked, 0.0)], dim=1), group,
                      world)
    big_m, target = g[..., 0].amax(dim=0), g[..., 1].sum(dim=0)
    e = torch.exp((z - big_m[:, None]) / temperature)
    kept = (z - big_m[:, None]) >= math.log(min_p)
    mass = torch.stack([torch.where(kept, e, 0.0).sum(dim=1), e.sum(dim=1)], dim=1)
    total = _gather_stats(mass, group, world).sum(dim=0)
    shift = torch.log(total[:, 1]) - torch.log(total[:, 0])
    inside = (target - big_m) >= math.log(min_p)
    return torch.where(inside, shift, -math.inf).to(torch.float32)


@torch.no_grad()
def vocab_parallel_entropy_change(before: Tensor, after: Tensor, *,
                                  vocab_size: Optional[int] = None,
                                  group: Optional[dist.ProcessGroup] = None,
                                  temperature: float = 1.0) -> tuple[Tensor, Tensor, Tensor]:
    """(H_before [T], H_after [T], prediction [T]) from this rank's shards of the logits of the
    same positions before and after an update: the prediction is -Cov_{a ~ pi_before}(log
    pi_before(a), (z_after(a) - z_before(a)) / temperature), float64."""
    if before.shape != after.shape:
        raise ValueError(f"logits before {tuple(before.shape)} and after {tuple(after.shape)} "
                         "must cover the same positions and vocabulary shard")
    rank, world = _group_layout(group)
    n_real = _real_columns(vocab_size, before.shape[1], rank, world)
    inv_t = 1.0 / temperature
    zb = before[:, :n_real].double()
    za = after[:, :n_real].double()
    stats = []
    for z in (zb, za):
        m = z.amax(dim=1, keepdim=True)
        d = (z - m) * inv_t
        e = torch.exp(d)
        stats.append(torch.cat([m, e.sum(1, keepdim=True), (e * d).sum(1, keepdim=True),
                                torch.zeros_like(m)], dim=1))
    g = _gather_stats(torch.cat(stats, dim=1), group, world)
    _, h_before, m_b, s_b, _ = _merge_stats(g[..., :4], inv_t)
    _, h_after, _, _, _ = _merge_stats(g[..., 4:], inv_t)
    d_b = (zb - m_b[:, None]) * inv_t
    p = torch.exp(d_b) / s_b[:, None]
    logp = d_b - torch.log(s_b)[:, None]
    dz = (za - zb) * inv_t
    part = _gather_stats(torch.stack([(p * logp * dz).sum(1), (p * dz).sum(1)], dim=1), group,
                        world).sum(dim=0)
    # Cov = E[log pi dz] - E[log pi] E[dz], E[log pi] = -H_before.
    cov = part[:, 0] + h_before * part[:, 1]
    return h_before, h_after, -cov
