"""Log-probability of the target and full-vocabulary entropy from vocab-parallel logits.

Under tensor parallelism each rank holds the logits of one vocab shard, columns
``[rank * V_local, (rank + 1) * V_local)`` of the padded vocabulary. Per token, a rank reduces its
shard of raw logits x to four numbers (tau = 1 / temperature, d_j = (x_j - m_r) tau):

    m_r = max_j x_j                      s_r = sum_j exp(d_j)
    u_r = sum_j exp(d_j) d_j             t_r = x_target if the target is in the shard, else 0

and those merge exactly by log-sum-exp (M = max_r m_r, c_r = (m_r - M) tau, w_r = exp(c_r),
S = sum_r s_r w_r, so that log Z = M tau + log S):

    log p(target) = (sum_r t_r - M) tau - log S
    H = log S - q,   q = E_p[(x - M) tau] = sum_r w_r (u_r + s_r c_r) / S

The maximum M and the log-sum log S are never added into one number: at |x| ~ 1e4 half an fp32
step is 5e-4, so ``x_t - (M + log S)`` would lose that much, and ``x / temperature`` would round
as much again before the maximum is taken. Every difference is formed as (x - max) first, exact or
nearly so for logits near the maximum, then scaled, so a large common offset costs no precision.
So the forward needs ONE collective, an all-gather of the packed [T, 4] statistics, and the
backward none: with p_j = exp((x_j - M) tau) / S,

    d log p / dx_j = tau (onehot_j - p_j)      dH / dx_j = -tau p_j ((x_j - M) tau - q)

only need this rank's logits and the per-token M, S and q saved from the forward.

Both functions work token-chunk by token-chunk so that no [T, V_local] temporary beyond one chunk
is alive; the fused variant computes each chunk's logits from the final hidden states and the
output-layer shard and recomputes them in the backward, so the full logits never exist. It holds
ONE chunk-sized buffer, in the input dtype: the GEMM writes the chunk's logits into it, the
statistics (and, in the backward, the logits' gradient, written over the logits) are computed a
few rows at a time in small compute-dtype scratch, and the backward GEMMs read the gradient from
it.

Columns at or beyond ``vocab_size`` (the padding of the vocabulary to a multiple of 128) are never
read: they are a suffix of the padded vocabulary, so each rank simply uses a prefix of its shard.
Statistics are computed in float32 (float64 for float64 inputs) whatever the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["vocab_parallel_logprob_entropy", "fused_linear_logprob_entropy"]


# On CPU the chunk's fp32 work buffers should stay cache-resident: at most this many elements per
# buffer (4 MiB), whatever ``chunk_tokens`` says (on a shared 2-core VM, 6 tokens x 152k vocab
# per chunk needed ~10-30% less CPU time than 512 tokens). GPUs use ``chunk_tokens`` as given.
CPU_CHUNK_ELEMENTS = 1 << 20
# The fused path's chunk feeds a GEMM that streams the whole weight shard once per chunk, so it
# keeps at least 64 rows; on CPU its logits buffer is capped at 32M elements (~220 tokens at 152k
# vocab).
FUSED_CPU_CHUNK_ELEMENTS = 1 << 25
# The fused path holds one chunk-sized buffer (the GEMM's output, then the logits' gradient in
# place) and works through it a few rows at a time in small compute-dtype scratch: on CPU rows of
# at most CPU_CHUNK_ELEMENTS (cache-sized), on GPU this fraction of the chunk.
GPU_SUB_BLOCKS = 16


def _chunk_rows(chunk_tokens: int, n_real: int, device: torch.device, fused: bool = False) -> int:
    if device.type == "cpu" and n_real > 0:
        if fused:
            return max(1, min(chunk_tokens, max(64, FUSED_CPU_CHUNK_ELEMENTS // n_real)))
        return max(1, min(chunk_tokens, CPU_CHUNK_ELEMENTS // n_real))
    return chunk_tokens


def _sub_rows(rows: int, n_real: int, device: torch.device) -> int:
    """Rows per pass of the fused path's per-row work inside one chunk of ``rows`` rows."""
    if device.type == "cpu":
        return max(1, min(rows, CPU_CHUNK_ELEMENTS // max(1, n_real)))
    return max(1, -(-rows // GPU_SUB_BLOCKS))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _group_layout(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _real_columns(vocab_size: Optional[int], local_vocab: int, rank: int, world: int) -> int:
    """How many leading columns of this rank's shard are real vocabulary (not padding)."""
    if vocab_size is None:
        return local_vocab
    if not 0 < vocab_size <= local_vocab * world:
        raise ValueError(f"vocab_size={vocab_size} must be in [1, {local_vocab * world}] "
                         f"(shards of {local_vocab} columns on {world} rank(s))")
    return max(0, min(local_vocab, vocab_size - rank * local_vocab))


class _ChunkBuffers:
    """Two [rows, n_real] work buffers in the compute dtype, reused by every chunk of a call.

    Fresh chunk-sized temporaries per chunk would cost an allocation each (and, on CPU, page
    faults on every new mapping); in-place ops on two buffers also avoid the slow mixed-dtype
    kernels (bf16 input, fp32 result) by copying the chunk once, then working in one dtype.
    With ``in_place`` the caller's own buffer, when already in the compute dtype, is worked on
    directly (its values are consumed) and only the scratch exists: the caller's buffer must
    then be in the compute dtype.
    """

    def __init__(self, rows: int, cols: int, dtype: torch.dtype, device: torch.device,
                 in_place: bool = False) -> None:
        self.a = None if in_place else torch.empty(rows, cols, dtype=dtype, device=device)
        self.b = torch.empty(rows, cols, dtype=dtype, device=device)

    def load(self, z: Tensor) -> tuple[Tensor, Tensor]:
        """(z in the compute dtype: a copy, or z itself in place; scratch of the same shape)."""
        b = self.b[:z.shape[0]]
        if self.a is None:
            return z, b
        a = self.a[:z.shape[0]]
        a.copy_(z)
        return a, b


def _shard_stats(z: Tensor, local_targets: Tensor, owned: Tensor, inv_t: float,
                 bufs: Optional[_ChunkBuffers], out: Tensor) -> None:
    """Write [m, s, u, t] of one chunk of raw logits z [c, n_real] into ``out`` [c, 4]."""
    if bufs is None:  # a shard made only of padding contributes nothing
        out.zero_()
        out[:, 0] = -float("inf")
        return
    d, e = bufs.load(z)
    m = d.amax(dim=1, keepdim=True)
    picked = d.gather(1, local_targets.clamp(0, z.shape[1] - 1).unsqueeze(1)).squeeze(1)
    out[:, 3] = torch.where(owned, picked, 0.0)
    d.sub_(m)  # before the temperature: x - m is exact near the maximum, x / temperature is not
    if inv_t != 1.0:
        d.mul_(inv_t)
    torch.exp(d, out=e)
    out[:, 0] = m.squeeze(1)
    out[:, 1] = e.sum(dim=1)
    out[:, 2] = e.mul_(d).sum(dim=1)


def _merge_stats(stats: Tensor, inv_t: float) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """[world, T, 4] per-rank statistics -> (log p(target), entropy, M, S, q), each [T].

    The same arithmetic in the same rank order on every rank, so all ranks get identical bits.
    """
    m, s, u, t = stats.unbind(dim=-1)
    big_m = m.amax(dim=0)
    shift = (m - big_m) * inv_t
    w = torch.exp(shift)  # 0 for a padding-only shard (m = -inf)
    shift = torch.where(w > 0, shift, 0.0)
    total = (s * w).sum(dim=0)
    log_total = torch.log(total)
    mean_shifted = (w * (u + s * shift)).sum(dim=0) / total
    logp = (t.sum(dim=0) - big_m) * inv_t - log_total
    return logp, log_total - mean_shifted, big_m, total, mean_shifted


def _gather_stats(local: Tensor, group: Optional[dist.ProcessGroup], world: int) -> Tensor:
    if world == 1:
        return local.unsqueeze(0)
    out = local.new_empty((world * local.shape[0],) + tuple(local.shape[1:]))
    dist.all_gather_into_tensor(out, local.contiguous(), group=group)
    return out.view((world,) + tuple(local.shape))


def _check_outputs(logp: Tensor, entropy: Tensor, targets: Tensor,
                   vocab_size: int, what: str) -> None:
    """One host sync for every input problem that only shows in values."""
    bad_target = (targets < 0).any() | (targets >= vocab_size).any()
    bad_value = ~(torch.isfinite(logp).all() & torch.isfinite(entropy).all())
    flags = torch.stack([bad_target, bad_value]).tolist()
    if flags[0]:
        lo, hi = int(targets.min()), int(targets.max())
        raise ValueError(f"targets must be token ids in [0, {vocab_size}); got ids in [{lo}, {hi}]")
    if flags[1]:
        raise ValueError(f"{what} contain NaN or inf in the real vocabulary: log-probs/entropies "
                         "are not finite")


def _row_factors(total: Tensor, mean_shifted: Tensor, g_logp: Optional[Tensor],
                 g_ent: Optional[Tensor], owned: Tensor, inv_t: float
                 ) -> tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Per-token factors (alpha, beta, at_target) of the logits' gradient, each [T] or None.

    With d_j = (x_j - M) tau, e_j = exp(d_j) = S p_j and q = ``mean_shifted``:
        d loss / dx_j = e_j (alpha + beta d_j) + at_target onehot_j,
        alpha = -tau (g_logp - g_ent q) / S,  beta = -tau g_ent / S,  at_target = tau g_logp
    (at_target 0 where another rank owns the target), so p = e / S is never formed.
    """
    scale = -inv_t / total
    if g_ent is None:
        return scale * g_logp, None, torch.where(owned, g_logp * inv_t, 0.0)
    alpha = scale * (-g_ent * mean_shifted if g_logp is None else g_logp - g_ent * mean_shifted)
    at_target = None if g_logp is None else torch.where(owned, g_logp * inv_t, 0.0)
    return alpha, scale * g_ent, at_target


def _grad_chunk(z: Tensor, big_m: Tensor, alpha: Tensor, beta: Optional[Tensor],
                at_target: Optional[Tensor], local_targets: Tensor, inv_t: float,
                bufs: _ChunkBuffers) -> Tensor:
    """d loss / d raw logits of one chunk [c, n_real], in the compute dtype, from the chunk's
    rows of ``_row_factors``: written over ``bufs.load(z)``'s copy of z (over z itself in place)."""
    d, e = bufs.load(z)
    d.sub_(big_m.unsqueeze(1))
    if inv_t != 1.0:
        d.mul_(inv_t)
    if beta is not None:
        torch.exp(d, out=e)
        grad = d.mul_(beta.unsqueeze(1)).add_(alpha.unsqueeze(1)).mul_(e)
    else:
        grad = d.exp_().mul_(alpha.unsqueeze(1))
    if at_target is not None:
        cols = local_targets.clamp(0, grad.shape[1] - 1).unsqueeze(1)
        grad.scatter_add_(1, cols, at_target.unsqueeze(1).to(grad.dtype))
    return grad


def _rows(x: Optional[Tensor], sl: slice) -> Optional[Tensor]:
    return None if x is None else x[sl]


def _buffers(rows: int, n_real: int, cdtype: torch.dtype, device: torch.device,
             in_place: bool = False) -> Optional[_ChunkBuffers]:
    return _ChunkBuffers(rows, n_real, cdtype, device, in_place) if n_real > 0 and rows > 0 \
        else None


def _fused_buffers(rows: int, n_real: int, hidden: Tensor, cdtype: torch.dtype
                   ) -> tuple[Tensor, Optional[_ChunkBuffers], int]:
    """The fused path's one chunk-sized buffer [rows, n_real] in the input dtype (the chunk's
    logits, as the output layer would produce them, then their gradient in place), the small
    scratch that its rows are worked through in, and the rows per pass of that scratch."""
    sub = _sub_rows(rows, n_real, hidden.device)
    return (hidden.new_empty(rows, n_real),
            _buffers(sub, n_real, cdtype, hidden.device, in_place=hidden.dtype == cdtype), sub)


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, vocab_size: Optional[int], group,
                temperature: float, chunk_tokens: int):
        rank, world = _group_layout(group)
        num_tokens, local_vocab = logits.shape
        n_real = _real_columns(vocab_size, local_vocab, rank, world)
        vocab = vocab_size if vocab_size is not None else local_vocab * world
        cdtype = _compute_dtype(logits.dtype)
        chunk_tokens = _chunk_rows(chunk_tokens, n_real, logits.device)
        inv_t = 1.0 / temperature
        local_targets = targets - rank * local_vocab
        owned = (local_targets >= 0) & (local_targets < n_real)

        stats = torch.empty(num_tokens, 4, dtype=cdtype, device=logits.device)
        bufs = _buffers(min(chunk_tokens, num_tokens), n_real, cdtype, logits.device)
        for c0 in range(0, num_tokens, chunk_tokens):
            c1 = min(c0 + chunk_tokens, num_tokens)
            _shard_stats(logits[c0:c1, :n_real], local_targets[c0:c1], owned[c0:c1], inv_t,
                         bufs, stats[c0:c1])
        del bufs
        ctx.no_tokens = num_tokens == 0
        if ctx.no_tokens:  # every TP rank holds the same (no) tokens: nothing to exchange
            ctx.save_for_backward(logits)  # a zero gradient still flows (context parallelism)
            empty = stats.new_empty(0)
            return empty, empty.clone()
        logp, entropy, *row_stats = _merge_stats(_gather_stats(stats, group, world), inv_t)
        _check_outputs(logp, entropy, targets, vocab, "logits")

        ctx.save_for_backward(logits, local_targets, owned, *row_stats)
        ctx.n_real, ctx.inv_t, ctx.chunk_tokens, ctx.cdtype = n_real, inv_t, chunk_tokens, cdtype
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Optional[Tensor], g_ent: Optional[Tensor]):
        if ctx.no_tokens:
            return torch.zeros_like(ctx.saved_tensors[0]), None, None, None, None, None
        logits, local_targets, owned, big_m, total, mean_shifted = ctx.saved_tensors
        grad = torch.empty_like(logits)
        grad[:, ctx.n_real:] = 0  # padding columns
        if g_logp is None and g_ent is None:
            grad.zero_()
            return grad, None, None, None, None, None
        n_real, step = ctx.n_real, ctx.chunk_tokens
        factors = _row_factors(total, mean_shifted, g_logp, g_ent, owned, ctx.inv_t)
        bufs = _buffers(min(step, logits.shape[0]), n_real, ctx.cdtype, logits.device)
        for c0 in range(0, logits.shape[0] if bufs is not None else 0, step):
            sl = slice(c0, min(c0 + step, logits.shape[0]))
            grad[sl, :n_real].copy_(_grad_chunk(
                logits[sl, :n_real], big_m[sl], *(_rows(f, sl) for f in factors),
                local_targets[sl], ctx.inv_t, bufs))
        return grad, None, None, None, None, None


class _FusedLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, vocab_size: Optional[int],
                group, temperature: float, chunk_tokens: int):
        rank, world = _group_layout(group)
        num_tokens = hidden.shape[0]
        local_vocab = weight.shape[0]
        n_real = _real_columns(vocab_size, local_vocab, rank, world)
        vocab = vocab_size if vocab_size is not None else local_vocab * world
        cdtype = _compute_dtype(hidden.dtype)
        chunk_tokens = _chunk_rows(chunk_tokens, n_real, hidden.device, fused=True)
        inv_t = 1.0 / temperature
        local_targets = targets - rank * local_vocab
        owned = (local_targets >= 0) & (local_targets < n_real)
        w = weight[:n_real]

        stats = torch.empty(num_tokens, 4, dtype=cdtype, device=hidden.device)
        z_buf, bufs, sub = _fused_buffers(min(chunk_tokens, num_tokens), n_real, hidden, cdtype)
        for c0 in range(0, num_tokens, chunk_tokens):
            c1 = min(c0 + chunk_tokens, num_tokens)
            # The chunk's logits exactly as the output layer would produce them (input dtype).
            z = torch.mm(hidden[c0:c1], w.t(), out=z_buf[:c1 - c0])
            for s0 in range(c0, c1, sub):
                s1 = min(s0 + sub, c1)
                _shard_stats(z[s0 - c0:s1 - c0], local_targets[s0:s1], owned[s0:s1], inv_t,
                             bufs, stats[s0:s1])
        del bufs, z_buf
        ctx.no_tokens = num_tokens == 0
        if ctx.no_tokens:  # a zero gradient still flows (a context-parallel rank's share)
            ctx.save_for_backward(hidden, weight)
            empty = stats.new_empty(0)
            return empty, empty.clone()
        logp, entropy, *row_stats = _merge_stats(_gather_stats(stats, group, world), inv_t)
        _check_outputs(logp, entropy, targets, vocab, "logits (hidden @ weight.T)")

        ctx.save_for_backward(hidden, weight, local_targets, owned, *row_stats)
        ctx.n_real, ctx.inv_t, ctx.chunk_tokens, ctx.cdtype = n_real, inv_t, chunk_tokens, cdtype
        ctx.set_materialize_grads(False)
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Optional[Tensor], g_ent: Optional[Tensor]):
        if ctx.no_tokens:
            hidden, weight = ctx.saved_tensors
            return (torch.zeros_like(hidden), torch.zeros_like(weight), None, None, None, None,
                    None)
        hidden, weight, local_targets, owned, big_m, total, mean_shifted = ctx.saved_tensors
        n_real, step = ctx.n_real, ctx.chunk_tokens
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros_like(hidden) if need_h else None
        if (g_logp is None and g_ent is None) or n_real == 0:
            return grad_h, torch.zeros_like(weight) if need_w else None, None, None, None, None, \
                None
        w = weight[:n_real]
        # Low-precision weight grads accumulate over chunks in fp32 (one rounding at the end,
        # as Megatron's single full-batch GEMM would have); the returned copy in the input dtype
        # is made once the chunk's buffers are freed.
        acc_w = w_part = grad_w = None
        if need_w and weight.dtype == ctx.cdtype:
            grad_w = torch.zeros_like(weight)
            acc_w = grad_w[:n_real]
        elif need_w:
            acc_w = torch.zeros(w.shape, dtype=ctx.cdtype, device=w.device)
            w_part = torch.empty_like(w)  # one chunk's weight grad, before fp32 accumulation
        factors = _row_factors(total, mean_shifted, g_logp, g_ent, owned, ctx.inv_t)
        z_buf, bufs, sub = _fused_buffers(min(step, hidden.shape[0]), n_real, hidden, ctx.cdtype)
        for c0 in range(0, hidden.shape[0], step):
            c1 = min(c0 + step, hidden.shape[0])
            sl = slice(c0, c1)
            h = hidden[sl]
            gz = torch.mm(h, w.t(), out=z_buf[:c1 - c0])
            # Each row's logits are replaced by their gradient, in the input dtype: the GEMMs'
            # operand, as Megatron's output layer would receive it.
            for s0 in range(c0, c1, sub):
                rs = slice(s0, min(s0 + sub, c1))
                z = gz[s0 - c0:rs.stop - c0]
                g = _grad_chunk(z, big_m[rs], *(_rows(f, rs) for f in factors),
                                local_targets[rs], ctx.inv_t, bufs)
                if g is not z:
                    z.copy_(g)
            if need_h:
                torch.mm(gz, w, out=grad_h[sl])
            if need_w:
                if w_part is None:
                    acc_w.addmm_(gz.t(), h)
                else:
                    acc_w.add_(torch.mm(gz.t(), h, out=w_part))
        del bufs, z_buf, w_part
        if need_w and grad_w is None:
            grad_w = torch.zeros_like(weight)
            grad_w[:n_real] = acc_w
        return grad_h, grad_w, None, None, None, None, None


def _check_common(num_tokens: int, targets: Tensor, temperature: float, chunk_tokens: int) -> None:
    if targets.dim() != 1 or targets.shape[0] != num_tokens:
        raise ValueError(f"targets must have shape [{num_tokens}] (one id per token); "
                         f"got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids; got dtype {targets.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")


def vocab_parallel_logprob_entropy(logits: Tensor, targets: Tensor, *,
                                   vocab_size: Optional[int] = None,
                                   group: Optional[dist.ProcessGroup] = None,
                                   temperature: float = 1.0,
                                   chunk_tokens: int = 1024) -> tuple[Tensor, Tensor]:
    """Log-prob of each target and entropy of each position, from this rank's vocab shard.

    logits: [T, V_local], any float dtype; rank r of ``group`` holds columns
        [r * V_local, (r + 1) * V_local) of the padded vocabulary.
    targets: [T] global token ids (the same on every rank of the group).
    vocab_size: the real vocabulary; columns >= it are padding and are ignored.
    group: the tensor-parallel group; None (or size 1) means the whole vocab is here.
    Returns (logp [T], entropy [T]) of softmax(logits / temperature), float32 (float64 for
    float64 logits), identical on every rank and differentiable w.r.t. ``logits``.
    One all-gather in the forward, no collective in the backward.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, local_vocab]; got shape {tuple(logits.shape)}")
    if not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be floating point; got dtype {logits.dtype}")
    _check_common(logits.shape[0], targets, temperature, chunk_tokens)
    return _VocabParallelLogprobEntropy.apply(logits, targets, vocab_size, group,
                                              float(temperature), int(chunk_tokens))


def fused_linear_logprob_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, *,
                                 vocab_size: Optional[int] = None,
                                 group: Optional[dist.ProcessGroup] = None,
                                 temperature: float = 1.0,
                                 chunk_tokens: int = 1024) -> tuple[Tensor, Tensor]:
    """Same as ``vocab_parallel_logprob_entropy(hidden @ weight.T, ...)`` without the logits.

    hidden: [T, H] final hidden states (after the final norm); weight: [V_local, H] this rank's
    output-layer shard, same dtype. Logits exist one chunk at a time and are recomputed in the
    backward; gradients flow to ``hidden`` and ``weight``.

    Under TP the gradient w.r.t. ``hidden`` is this rank's partial sum (its vocab shard only),
    exactly what a column-parallel layer's GEMM yields: the caller reduces it over TP the way
    Megatron's output layer does (see ``models.output_head``), outside this op.
    """
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"hidden must be [tokens, hidden] and weight [local_vocab, hidden]; got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden {tuple(hidden.shape)} vs weight "
                         f"{tuple(weight.shape)}")
    if hidden.dtype != weight.dtype or not hidden.dtype.is_floating_point:
        raise ValueError(f"hidden and weight must share one float dtype; got {hidden.dtype} and "
                         f"{weight.dtype}")
    _check_common(hidden.shape[0], targets, temperature, chunk_tokens)
    return _FusedLinearLogprobEntropy.apply(hidden, weight, targets, vocab_size, group,
                                            float(temperature), int(chunk_tokens))
