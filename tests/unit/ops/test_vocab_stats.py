"""The vocab statistics of ops/vocab_stats.py against plain torch on the whole vocabulary, in
float64, at TP = 1, 2, 3: SIREN's top-p entropy (value and gradient; a flat row needs the second
all-gather, the others one), Lp-Reg's min-p proxy log-prob and the lemma's entropy change
(exact entropies and the first-order prediction)."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed

from megatron_entropy.ops.vocab_stats import (TOP_P_CANDIDATES, vocab_parallel_entropy_change,
                                              vocab_parallel_min_p_shift,
                                              vocab_parallel_top_p_entropy)

T, V_PAD, VOCAB = 9, 384, 377


def _logits(seed: int = 0) -> torch.Tensor:
    """[T, V_PAD]: peaked rows, a flat row (its nucleus spans hundreds of tokens: beyond the
    first all-gather's candidates), a row whose top token alone passes top_p, tied logits, and
    garbage in the padding columns."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(T, V_PAD, generator=g, dtype=torch.float64) * 3
    z[1] = torch.randn(V_PAD, generator=g, dtype=torch.float64) * 0.01  # flat
    z[2, 5] = 40.0                                                      # one-hot: empty nucleus
    z[3, 10:14] = 9.0                                                   # ties at the top
    z[4] *= 0.3
    z[:, VOCAB:] = float("nan")
    return z


def _reference_top_p(z: torch.Tensor, temperature: float, top_p: float, top_k: int):
    """SIREN's nucleus on the whole vocabulary: sort by probability (ties: lower id first), keep
    the prefix of the first top_k whose inclusive cumulative sum stays below top_p, renormalise."""
    x = z[:, :VOCAB].clone().requires_grad_()
    p = torch.softmax(x / temperature, dim=-1)
    out = []
    for t in range(x.shape[0]):
        row = x[t].detach()
        order = sorted(range(VOCAB), key=lambda i: (-float(row[i]), i))[:top_k]
        cum = torch.cumsum(p[t, order].detach(), 0)
        keep = [order[i] for i in range(len(order)) if cum[i] < top_p]
        if not keep:
            out.append(x[t].sum() * 0.0)
            continue
        q = p[t, keep] / p[t, keep].sum()
        out.append(-(q * q.log()).sum())
    h = torch.stack(out)
    return h, x


def _shard(z: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return z[:, rank * V_PAD // world:(rank + 1) * V_PAD // world].clone()


def _top_p_worker(temperature: float, top_p: float, top_k: int, up: torch.Tensor):
    import torch.distributed as dist

    from megatron_entropy.ops import vocab_stats

    rank, world = dist.get_rank(), dist.get_world_size()
    calls = []
    gather = vocab_stats._gather_stats

    def counting(local, group, w):
        calls.append(tuple(local.shape))
        return gather(local, group, w)

    vocab_stats._gather_stats = counting
    local = _shard(_logits(), rank, world).requires_grad_()
    h, size = vocab_parallel_top_p_entropy(local, vocab_size=VOCAB, group=dist.group.WORLD,
                                           temperature=temperature, top_p=top_p, top_k=top_k)
    (h * up).sum().backward()
    return h.detach(), size, local.grad, calls


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("temperature,top_p,top_k", [(1.0, 0.8, 10000), (0.7, 0.95, 50)])
def test_top_p_entropy_equals_the_nucleus_on_the_whole_vocabulary(world, temperature, top_p,
                                                                  top_k):
    up = torch.linspace(-1.0, 2.0, T, dtype=torch.float64)
    want, x = _reference_top_p(_logits(), temperature, top_p, top_k)
    (want * up).sum().backward()
    results = run_distributed(_top_p_worker, world, temperature, top_p, top_k, up)
    grad = torch.cat([g for _, _, g, _ in results], dim=1)
    for h, size, _, calls in results:
        torch.testing.assert_close(h, want.detach(), rtol=0, atol=1e-12)
        assert int(size[2]) == 0 and float(h[2]) == 0.0  # the top token alone passes top_p
        assert int(size[1]) > TOP_P_CANDIDATES * world or top_k < TOP_P_CANDIDATES * world
        # One all-gather; the flat rows (and only they) take a second one, unless the first
        # already sent every rank's top_k.
        if top_k <= TOP_P_CANDIDATES:
            assert len(calls) == 1, calls
        else:
            assert len(calls) == 2 and 1 <= calls[1][0] <= 2, calls
    torch.testing.assert_close(grad[:, :VOCAB], x.grad, rtol=0, atol=1e-12)
    assert torch.equal(grad[:, VOCAB:], torch.zeros_like(grad[:, VOCAB:]))


def test_top_p_entropy_of_a_peaked_batch_takes_one_collective():
    z = _logits()[[0, 2, 3]]
    calls = []
    from megatron_entropy.ops import vocab_stats

    gather = vocab_stats._gather_stats
    vocab_stats._gather_stats = lambda *a: calls.append(1) or gather(*a)
    try:
        vocab_parallel_top_p_entropy(z, vocab_size=VOCAB, top_p=0.8)
    finally:
        vocab_stats._gather_stats = gather
    assert len(calls) == 1


def _reference_min_p(z: torch.Tensor, targets, min_p: float, temperature: float):
    """log pi_proxy(target) - log pi(target): the authors' proxy (filtered logits set to -1e4)."""
    x = z[:, :VOCAB]
    p1 = torch.softmax(x, dim=-1)
    kept = p1 >= min_p * p1.max(dim=-1, keepdim=True).values
    proxy = torch.log_softmax(torch.where(kept, x, -1e4) / temperature, dim=-1)
    full = torch.log_softmax(x / temperature, dim=-1)
    shift = (proxy - full).gather(1, targets[:, None]).squeeze(1)
    return torch.where(kept.gather(1, targets[:, None]).squeeze(1), shift, -torch.inf)


def _min_p_worker(targets, min_p, temperature):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return vocab_parallel_min_p_shift(_shard(_logits(), rank, world), targets, min_p=min_p,
                                      vocab_size=VOCAB, group=dist.group.WORLD,
                                      temperature=temperature)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_min_p_proxy_equals_the_filtered_distribution(world):
    """The proxy's log-prob minus the policy's, of each target: -inf where the filter drops it,
    and exactly 0 where it keeps the whole vocabulary (min_p small enough for the flat row)."""
    z = _logits()
    targets = z[:, :VOCAB].argsort(dim=1, descending=True)[:, 3]  # kept in some rows only
    targets[3] = 11
    want = _reference_min_p(z, targets, 0.02, 0.8)
    assert torch.isinf(want).any() and torch.isfinite(want).any()
    for got in run_distributed(_min_p_worker, world, targets, 0.02, 0.8):
        torch.testing.assert_close(got, want.float(), rtol=0, atol=1e-6)
    for got in run_distributed(_min_p_worker, world, targets, 0.5, 0.8):
        assert float(got[1]) == 0.0  # the flat row: nothing filtered


def _change_worker(after: torch.Tensor, temperature: float):
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    return vocab_parallel_entropy_change(_shard(_logits(), rank, world), _shard(after, rank, world),
                                         vocab_size=VOCAB, group=dist.group.WORLD,
                                         temperature=temperature)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_entropy_change_and_its_first_order_prediction(world):
    """Exact entropies before/after, and the lemma's prediction -Cov_pi(log pi, dz), which for a
    small change of the logits matches the exact change to second order."""
    before = _logits()
    dz = torch.randn(T, V_PAD, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    after = before + 1e-4 * dz
    temperature = 0.9
    x = before[:, :VOCAB] / temperature
    logp = torch.log_softmax(x, -1)
    p = logp.exp()
    d = (after - before)[:, :VOCAB] / temperature
    cov = (p * logp * d).sum(-1) - (p * logp).sum(-1) * (p * d).sum(-1)
    h_before = -(p * logp).sum(-1)
    logp_after = torch.log_softmax(after[:, :VOCAB] / temperature, -1)
    h_after = -(logp_after.exp() * logp_after).sum(-1)
    for hb, ha, pred in run_distributed(_change_worker, world, after, temperature):
        torch.testing.assert_close(hb, h_before, rtol=0, atol=1e-12)
        torch.testing.assert_close(ha, h_after, rtol=0, atol=1e-12)
        torch.testing.assert_close(pred, -cov, rtol=0, atol=1e-15)
        # First order: the exact change and the prediction agree far below the change itself.
        assert float((ha - hb - pred).abs().max()) < 1e-3 * float(pred.abs().max())
