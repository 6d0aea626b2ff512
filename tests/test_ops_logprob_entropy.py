"""Vocab-parallel log-prob/entropy equal torch's log_softmax on the unsharded logits, in float64,
at TP = 1, 2, 4, for both the chunked (logits) and fused (hidden @ weight) paths; one collective in
the forward and none in the backward; bad input gives one clear error."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed

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
    torch.testing.assert_close(logp.double(), ref_logp, rtol=0, atol=1e-4)
    torch.testing.assert_close(ent.double(), ref_ent, rtol=0, atol=1e-4)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(leaf.grad.double(), ref_grad, rtol=0, atol=tol)

    h, w = hidden[4:].to(dtype).requires_grad_(), weight[:250].to(dtype).requires_grad_()
    flogp, fent = fused_linear_logprob_entropy(h, w, targets[4:], chunk_tokens=CHUNK)
    z = (h.detach() @ w.detach().t())  # the logits the output layer would produce
    clogp, cent = vocab_parallel_logprob_entropy(z, targets[4:])
    torch.testing.assert_close(flogp, clogp, rtol=0, atol=1e-5)
    torch.testing.assert_close(fent, cent, rtol=0, atol=1e-5)


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
