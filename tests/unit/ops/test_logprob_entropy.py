"""Vocab-parallel log-prob/entropy equal torch's log_softmax on the unsharded logits, in float64,
at TP = 1, 2, 4, for both the chunked (logits) and fused (hidden @ weight) paths; fp32 and bf16
logits near +-1e4 keep fp32 precision at TP = 1, 2, 3; one collective in the forward and none in
the backward; bad input gives one clear error."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from tolerance import logprob_tol, rounding_tol

from megatron_entropy.ops import logprob_entropy
from megatron_entropy.ops.logprob_entropy import (fused_linear_logprob_entropy,
                                                  vocab_parallel_logprob_entropy)

T, V_PAD, H = 23, 256, 16
CHUNK = 5  # several chunks and a ragged last one


def _case(vocab: int, seed: int = 0):
    """Full padded logits [T, V_PAD] with extreme rows, garbage in the padding, targets, hidden,
    weight and upstream gradients — all float64, the same in every process."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V_PAD, generator=g, dtype=torch.float64) * 3
    logits[0] *= 1e3                      # huge spread: a near one-hot softmax
    logits[1] += 1e4                      # huge common offset: cancellation trap for H
    logits[2, :vocab] = -1e4              # all tiny except one real column
    logits[2, 7] = 50.0
    logits[3, :vocab] = 0.0               # uniform: H = log(vocab)
    # Padding (columns >= vocab) must never be read: fill it with values that would wreck it.
    logits[::2, vocab:] = float("nan")
    logits[1::2, vocab:] = 1e30
    targets = torch.randint(0, vocab, (T,), generator=g)
    targets[2] = 7
    hidden = torch.randn(T, H, generator=g, dtype=torch.float64)
    hidden[0] *= 300                      # extreme logits on the fused path too
    hidden[3] = 0.0                       # uniform there
    weight = torch.randn(V_PAD, H, generator=g, dtype=torch.float64)
    weight[vocab:] = 1e30                 # padded rows of the output layer: never read
    up_logp = torch.randn(T, generator=g, dtype=torch.float64)
    up_ent = torch.randn(T, generator=g, dtype=torch.float64)
    return logits, targets, hidden, weight, up_logp, up_ent


def _reference(logits: torch.Tensor, targets, vocab, temperature, up_logp, up_ent):
    x = logits[:, :vocab].clone().requires_grad_()
    logsm = torch.log_softmax(x / temperature, dim=-1)
    logp = logsm.gather(1, targets[:, None]).squeeze(1)
    ent = -(logsm.exp() * logsm).sum(-1)
    (logp * up_logp + ent * up_ent).sum().backward()
    return logp.detach(), ent.detach(), x.grad


def _worker(path: str, vocab: int, temperature: float):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets, hidden, weight, up_logp, up_ent = _case(vocab)
    cols = slice(rank * V_PAD // world, (rank + 1) * V_PAD // world)
    group = dist.group.WORLD if world > 1 else None
    kw = dict(vocab_size=vocab, group=group, temperature=temperature, chunk_tokens=CHUNK)
    if path == "chunked":
        local = logits[:, cols].clone().requires_grad_()
        logp, ent = vocab_parallel_logprob_entropy(local, targets, **kw)
        (logp * up_logp + ent * up_ent).sum().backward()
        return logp.detach(), ent.detach(), local.grad
    h = hidden.clone().requires_grad_()
    w = weight[cols].clone().requires_grad_()
    logp, ent = fused_linear_logprob_entropy(h, w, targets, **kw)
    (logp * up_logp + ent * up_ent).sum().backward()
    return logp.detach(), ent.detach(), (h.grad, w.grad)


@pytest.mark.parametrize("path", ["chunked", "fused"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("vocab,temperature", [(250, 1.0), (150, 0.7)])
def test_equals_log_softmax_float64(path, tp, vocab, temperature):
    # vocab 150 at TP=4 leaves rank 3 with nothing but padding.
    logits, targets, hidden, weight, up_logp, up_ent = _case(vocab)
    if path == "fused":
        logits = hidden @ weight[:vocab].t()
    ref_logp, ref_ent, ref_grad = _reference(logits, targets, vocab, temperature, up_logp, up_ent)
    assert ref_ent.min() < 1e-3 and ref_ent.max() > 4.9  # the extremes are really there

    outs = run_distributed(_worker, tp, path, vocab, temperature)
    for logp, ent, _ in outs:  # every rank returns the full result, bit-identical
        torch.testing.assert_close(logp, ref_logp, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(ent, ref_ent, rtol=1e-12, atol=1e-9)
        assert torch.equal(logp, outs[0][0]) and torch.equal(ent, outs[0][1])
    if path == "chunked":
        grad = torch.cat([g for _, _, g in outs], dim=1)
        torch.testing.assert_close(grad[:, :vocab], ref_grad, rtol=1e-10, atol=1e-12)
        assert torch.equal(grad[:, vocab:], torch.zeros_like(grad[:, vocab:]))
    else:
        # Reference grads of hidden and weight through the full logits.
        h = hidden.clone().requires_grad_()
        w = weight[:vocab].clone().requires_grad_()
        logsm = torch.log_softmax((h @ w.t()) / temperature, dim=-1)
        ent = -(logsm.exp() * logsm).sum(-1)
        (logsm.gather(1, targets[:, None]).squeeze(1) * up_logp + ent * up_ent).sum().backward()
        # Each TP rank's hidden grad is its vocab shard's part: their sum is the full grad.
        grad_h = sum(g[0] for _, _, g in outs)
        grad_w = torch.cat([g[1] for _, _, g in outs], dim=0)
        torch.testing.assert_close(grad_h, h.grad, rtol=1e-10, atol=1e-9)
        torch.testing.assert_close(grad_w[:vocab], w.grad, rtol=1e-10, atol=1e-9)
        assert torch.equal(grad_w[vocab:], torch.zeros_like(grad_w[vocab:]))


_COLLECTIVES = ["all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter",
                "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "reduce",
                "gather", "scatter", "send", "recv", "isend", "irecv", "barrier",
                "all_gather_object", "broadcast_object_list", "batch_isend_irecv"]


def _count_worker(path: str):
    import torch.distributed as dist

    counts = {"n": 0}
    for name in _COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            counts["n"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, targets, hidden, weight, up_logp, up_ent = _case(250)
    cols = slice(rank * V_PAD // world, (rank + 1) * V_PAD // world)
    kw = dict(vocab_size=250, group=dist.group.WORLD, chunk_tokens=4)
    if path == "chunked":
        leaf = logits[:, cols].clone().requires_grad_()
        logp, ent = vocab_parallel_logprob_entropy(leaf, targets, **kw)
    else:
        leaf = hidden.clone().requires_grad_()
        logp, ent = fused_linear_logprob_entropy(leaf, weight[cols].clone().requires_grad_(),
                                                 targets, **kw)
    forward = counts["n"]
    (logp * up_logp + ent * up_ent).sum().backward()
    assert leaf.grad is not None and leaf.grad.abs().sum() > 0
    return forward, counts["n"] - forward


@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_one_collective_forward_none_backward(path):
    # 23 tokens in chunks of 4: six chunks, still a single all-gather.
    for forward, backward in run_distributed(_count_worker, 2, path):
        assert (forward, backward) == (1, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_inputs_compute_in_float32(dtype):
    logits, targets, hidden, weight, up_logp, up_ent = _case(250)
    x = logits[4:, :250]  # the ordinary rows
    ref_logp, ref_ent, ref_grad = _reference(x.to(dtype).double(), targets[4:], 250, 1.0,
                                             up_logp[4:], up_ent[4:])
    leaf = x.to(dtype).requires_grad_()
    logp, ent = vocab_parallel_logprob_entropy(leaf, targets[4:], chunk_tokens=CHUNK)
    assert logp.dtype == ent.dtype == torch.float32
    (logp * up_logp[4:].float() + ent * up_ent[4:].float()).sum().backward()
    assert leaf.grad.dtype == dtype
    # The inputs are exact in float32: only the op's float32 sums over the vocabulary round,
    # and the gradient once more where it is returned in the input dtype.
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=logprob_tol(x, ref_logp, 250))
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=logprob_tol(x, ref_ent, 250))
    g_scale = float(x.abs().max()) * float(up_logp.abs().max() + up_ent.abs().max())
    torch.testing.assert_close(leaf.grad.double(), ref_grad, rtol=0, atol=rounding_tol(
        g_scale, 250) + rounding_tol(ref_grad, 1, dtype))

    h, w = hidden[4:].to(dtype).requires_grad_(), weight[:250].to(dtype).requires_grad_()
    flogp, fent = fused_linear_logprob_entropy(h, w, targets[4:], chunk_tokens=CHUNK)
    z = (h.detach() @ w.detach().t())  # the logits the output layer would produce
    clogp, cent = vocab_parallel_logprob_entropy(z, targets[4:])
    # Both paths compute these logits in the input dtype, the fused one chunk by chunk: a GEMM
    # of other rows may add the H float32 products in another order, and a logit then round
    # to the dtype the other way (one ulp). A logit moved by dz moves log p by at most 2 dz and
    # the entropy by at most dz * sum_v p_v |z_v - E_p z| (its gradient is -p (z - E_p z)).
    z64 = z.double()
    dz = rounding_tol(z64, H, torch.float32) + rounding_tol(z64, 1, dtype)
    p64 = torch.softmax(z64, -1)
    spread = float((p64 * (z64 - (p64 * z64).sum(-1, keepdim=True)).abs()).sum(-1).max())
    torch.testing.assert_close(flogp, clogp, rtol=0, atol=2 * dz + logprob_tol(z, clogp, 250))
    torch.testing.assert_close(fent, cent, rtol=0, atol=spread * dz + logprob_tol(z, cent, 250))


def _fused_run(dtype: torch.dtype, only: str | None):
    """The fused op at TP=1 on _case(250) in ``dtype``: (log p, entropy, grad hidden, grad
    weight), the loss taking both outputs or ``only`` one."""
    _, targets, hidden, weight, up_logp, up_ent = _case(250)
    h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    logp, ent = fused_linear_logprob_entropy(h, w, targets, vocab_size=250, temperature=0.7,
                                             chunk_tokens=CHUNK)
    loss = {None: logp * up_logp.to(logp.dtype) + ent * up_ent.to(ent.dtype),
            "logp": logp * up_logp.to(logp.dtype), "entropy": ent * up_ent.to(ent.dtype)}[only]
    loss.sum().backward()
    return logp.detach(), ent.detach(), h.grad, w.grad


@pytest.mark.parametrize("only", [None, "logp", "entropy"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_fused_rows_in_passes_change_nothing(monkeypatch, dtype, only):
    # The fused op keeps one chunk-sized buffer (its logits, then their gradient in place) and
    # works through it a few rows at a time: here passes of 2 rows in chunks of 5 (the ragged
    # last pass and chunk included) against one pass per chunk. Every value is a per-row
    # function of the chunk's GEMM output, so the results must be bit for bit the same.
    one_pass = _fused_run(dtype, only)
    monkeypatch.setattr(logprob_entropy, "CPU_CHUNK_ELEMENTS", 2 * 250)
    in_passes = _fused_run(dtype, only)
    for what, ours, ref in zip(("logp", "entropy", "grad hidden", "grad weight"), in_passes,
                               one_pass):
        assert ours.dtype == ref.dtype and torch.equal(ours, ref), what


@pytest.mark.parametrize("only", ["logp", "entropy"])
@pytest.mark.parametrize("path", ["chunked", "fused"])
def test_gradient_of_one_output_alone(path, only):
    # The other output takes no part in the loss: its upstream gradient is None, not zeros.
    logits, targets, hidden, weight, up_logp, up_ent = _case(250)
    h, w = hidden.clone().requires_grad_(), weight[:250].clone().requires_grad_()
    x = (h.detach() @ w.detach().t() if path == "fused" else logits[:, :250]).requires_grad_()
    zero = torch.zeros_like(up_logp)
    up = (up_logp, zero) if only == "logp" else (zero, up_ent)
    _, _, ref_grad = _reference(x.detach(), targets, 250, 0.7, *up)
    if path == "chunked":
        logp, ent = vocab_parallel_logprob_entropy(x, targets, temperature=0.7, chunk_tokens=CHUNK)
    else:
        logp, ent = fused_linear_logprob_entropy(h, w, targets, temperature=0.7,
                                                 chunk_tokens=CHUNK)
    ((logp * up_logp) if only == "logp" else (ent * up_ent)).sum().backward()
    if path == "chunked":
        torch.testing.assert_close(x.grad, ref_grad, rtol=1e-10, atol=1e-12)
    else:
        torch.testing.assert_close(h.grad, ref_grad @ w.detach(), rtol=1e-10, atol=1e-9)
        torch.testing.assert_close(w.grad, ref_grad.t() @ h.detach(), rtol=1e-10, atol=1e-9)


def test_no_grad_and_empty_inputs():
    logits, targets, *_ = _case(250)
    with torch.no_grad():
        logp, ent = vocab_parallel_logprob_entropy(logits[:, :250], targets)
    assert logp.shape == ent.shape == (T,)
    empty_logp, empty_ent = vocab_parallel_logprob_entropy(
        torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    assert empty_logp.shape == empty_ent.shape == (0,)


def test_bad_input_raises_one_clear_error():
    logits, targets, hidden, weight, *_ = _case(250)
    x = logits[:, :250].clone()
    with pytest.raises(ValueError, match=r"targets must have shape \[23\]"):
        vocab_parallel_logprob_entropy(x, targets[:-1])
    with pytest.raises(ValueError, match=r"token ids in \[0, 250\)"):
        vocab_parallel_logprob_entropy(x, torch.full((T,), 250))
    with pytest.raises(ValueError, match="integer token ids"):
        vocab_parallel_logprob_entropy(x, targets.float())
    with pytest.raises(ValueError, match="vocab_size=300"):
        vocab_parallel_logprob_entropy(x, targets, vocab_size=300)
    with pytest.raises(ValueError, match="temperature"):
        vocab_parallel_logprob_entropy(x, targets, temperature=0.0)
    x[5, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        vocab_parallel_logprob_entropy(x, targets)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        fused_linear_logprob_entropy(hidden, weight[:, :-1], targets)
    with pytest.raises(ValueError, match="share one float dtype"):
        fused_linear_logprob_entropy(hidden, weight.float(), targets)


# ----------------------------------------------------------------------------- common offsets
# Rows of logits near +1e4 and -1e4 (and near 0), where half an fp32 step is 5e-4: the op must
# still give log-probs and gradients to fp32 precision, at TP = 1, 2, 3, with a vocabulary of 251
# (prime: divisible by no TP size) padded to 264, so that the last shard holds padding.
V_OFF, V_PAD_OFF, H_OFF = 251, 264, 16
T_OFF = 24
EPS32 = torch.finfo(torch.float32).eps / 2   # fp32 unit roundoff, 2^-24
U_BF16 = torch.finfo(torch.bfloat16).eps / 2  # bf16 unit roundoff, 2^-8
# fp32 work: a few roundings per value plus sums over <= 264 columns (vectorised, so their error
# grows far slower than their length): 1e-6 is ~17 units of roundoff relative to the scale.
RTOL32 = 1e-6


def _offset_case(path: str, dtype: torch.dtype, seed: int = 1) -> dict:
    """The op's inputs in ``dtype`` (exactly representable, so float64 sees the same numbers)
    and, in float64, the logits they imply."""
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([1e4, -1e4, 0.0], dtype=torch.float64).repeat(T_OFF // 3)
    targets = torch.randint(0, V_OFF, (T_OFF,), generator=g)
    # First and last column of every shard at TP = 2 (132 columns) and TP = 3 (88 columns).
    targets[:8] = torch.tensor([0, 87, 88, 131, 132, 175, 176, V_OFF - 1])
    up_logp = torch.randn(T_OFF, generator=g, dtype=torch.float64)
    up_ent = torch.randn(T_OFF, generator=g, dtype=torch.float64)
    case = dict(targets=targets, up_logp=up_logp, up_ent=up_ent)
    if path == "chunked":
        logits = (torch.randn(T_OFF, V_PAD_OFF, generator=g, dtype=torch.float64) * 3
                  + offsets[:, None]).to(dtype)
        logits[::2, V_OFF:] = float("nan")  # padding: never read
        logits[1::2, V_OFF:] = 1e30
        case.update(logits=logits, z=logits[:, :V_OFF].double())
        return case
    # Small integers times multiples of 1/32, offset by +-100 * 100: every partial sum of the
    # GEMM is exact in fp32, in any order, so the op's logits are those of float64 rounded once
    # to the input dtype (bf16 steps are 64 at 1e4: ties there, so log S > 0 in those rows).
    hidden = torch.randint(-4, 5, (T_OFF, H_OFF), generator=g).double()
    hidden[:, 0] = offsets / 100
    weight = torch.randint(-16, 17, (V_PAD_OFF, H_OFF), generator=g).double() / 32
    weight[:, 0] = 100.0
    weight[V_OFF:] = float("nan")
    hidden, weight = hidden.to(dtype), weight.to(dtype)
    z = (hidden.double() @ weight[:V_OFF].double().t()).to(dtype).double()
    case.update(hidden=hidden, weight=weight, z=z)
    return case


def _offset_worker(path: str, dtype: torch.dtype, temperature: float):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    case = _offset_case(path, dtype)
    cols = slice(rank * V_PAD_OFF // world, (rank + 1) * V_PAD_OFF // world)
    kw = dict(vocab_size=V_OFF, group=dist.group.WORLD if world > 1 else None,
              temperature=temperature, chunk_tokens=CHUNK)
    up_logp, up_ent = case["up_logp"].float(), case["up_ent"].float()
    if path == "chunked":
        leaves = [case["logits"][:, cols].clone().requires_grad_()]
        logp, ent = vocab_parallel_logprob_entropy(leaves[0], case["targets"], **kw)
    else:
        leaves = [case["hidden"].clone().requires_grad_(),
                  case["weight"][cols].clone().requires_grad_()]
        logp, ent = fused_linear_logprob_entropy(*leaves, case["targets"], **kw)
    (logp * up_logp + ent * up_ent).sum().backward()
    return logp.detach(), ent.detach(), [leaf.grad for leaf in leaves]


def _bf16_half_ulp(x: torch.Tensor) -> torch.Tensor:
    """Half the bf16 spacing at each value of the bf16 tensor x: the most that rounding to
    nearest moved the value it was rounded from (0 where x is 0)."""
    _, exponent = torch.frexp(x.double())
    return torch.where(x == 0, 0.0, torch.ldexp(torch.ones_like(x, dtype=torch.float64),
                                                 exponent - 9))


def _assert_within(ours: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor | float,
                   what: str) -> None:
    assert torch.isfinite(ours).all(), f"{what}: not finite (padding read?)"
    err = (ours.double() - ref).abs()
    over = err > bound
    assert not over.any(), (f"{what}: {int(over.sum())} of {err.numel()} elements exceed the "
                            f"bound; max abs err {float(err.max()):.3e}, max |ref| "
                            f"{float(ref.abs().max()):.3e}")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["chunked", "fused"])
@pytest.mark.parametrize("tp", [1, 2, 3])
def test_common_offset_keeps_fp32_precision(tp, path, dtype, temperature):
    case = _offset_case(path, dtype)
    ref_logp, ref_ent, ref_gz = _reference(case["z"], case["targets"], V_OFF, temperature,
                                           case["up_logp"], case["up_ent"])
    outs = run_distributed(_offset_worker, tp, path, dtype, temperature)
    for logp, ent, _ in outs:
        assert torch.equal(logp, outs[0][0]) and torch.equal(ent, outs[0][1])
    # Log-probs and entropies are float32 whatever the input: 1e-6 relative (absolute below 1).
    torch.testing.assert_close(outs[0][0].double(), ref_logp, rtol=RTOL32, atol=RTOL32)
    torch.testing.assert_close(outs[0][1].double(), ref_ent, rtol=RTOL32, atol=RTOL32)

    def output_rounding(parts: list[torch.Tensor]) -> torch.Tensor | float:
        # A bf16 gradient is the float32 one rounded to nearest once per returned tensor (for
        # the hidden grad, one per rank: the test adds the ranks' parts in float64).
        return sum(_bf16_half_ulp(g) for g in parts) if dtype == torch.bfloat16 else 0.0

    if path == "chunked":
        grad = torch.cat([g for _, _, (g,) in outs], dim=1)
        assert torch.equal(grad[:, V_OFF:], torch.zeros_like(grad[:, V_OFF:]))
        grad = grad[:, :V_OFF]
        bound = RTOL32 * ref_gz.abs().max() + output_rounding([grad])
        _assert_within(grad, ref_gz, bound, "grad logits")
        return

    # The premise of the reference: this machine's GEMM gives exactly those logits.
    assert torch.equal((case["hidden"] @ case["weight"][:V_OFF].t()).double(), case["z"])
    hidden, weight = case["hidden"].double(), case["weight"][:V_OFF].double()
    grads_h = [g[0] for _, _, g in outs]
    grad_h = sum(g.double() for g in grads_h)
    grad_w = torch.cat([g[1] for _, _, g in outs], dim=0)
    assert torch.isfinite(grad_w[:V_OFF]).all()
    assert torch.equal(grad_w[V_OFF:], torch.zeros_like(grad_w[V_OFF:]))
    # Through the GEMMs gz @ W and gz^T @ X: the logits' gradient gz carries RTOL32 of its scale
    # (checked on the chunked path); each GEMM adds at most n * EPS32 of the sum of its terms'
    # magnitudes (n = its length, any summation order; doubled for second-order terms); in bf16,
    # gz is rounded to bf16 before each GEMM (U_BF16 of those terms), the weight grad's per-chunk
    # parts are rounded to bf16 before their float32 sum (U_BF16 again), and each result is
    # rounded once more on return.
    gz_err = RTOL32 * ref_gz.abs().max()
    u_in = U_BF16 if dtype == torch.bfloat16 else 0.0
    for what, ours, ref, terms, spread, n, roundings, parts in [
            ("grad hidden", grad_h, ref_gz @ weight, ref_gz.abs() @ weight.abs(),
             weight.abs().sum(0, keepdim=True), V_OFF, 1, grads_h),
            ("grad weight", grad_w[:V_OFF], ref_gz.t() @ hidden, ref_gz.abs().t() @ hidden.abs(),
             hidden.abs().sum(0, keepdim=True), T_OFF, 2, [grad_w[:V_OFF]])]:
        rounding = roundings * u_in * (1 + u_in) + 2 * n * EPS32
        bound = rounding * terms + 2 * gz_err * spread + output_rounding(parts)
        _assert_within(ours, ref, bound, what)
