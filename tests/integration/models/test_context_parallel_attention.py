"""Packed and context-parallel attention (models/context_parallel.py) against causal SDPA on
whole sequences: packed sequences attend to themselves only; CP ranks holding chunks i and
2CP-1-i of each sequence give those chunks' outputs, and together the input gradients (the K/V
gather's backward reduces every rank's part), of the whole sequence's attention, up to rounding,
for padded rows and packed sequences, with grouped-query heads. Then the tiny GPTModel at CP=2
against CP=1: logits of each rank's chunks and the parameter gradients summed over the ranks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness import init_megatron, run_distributed
from tiny_models import tiny_hf_config
from tolerance import grad_terms, rounding_tol, transformer_terms

HEADS, GROUPS, DIM = 4, 2, 8
LENGTHS = [12, 4, 20]  # packed sequences, each a multiple of 2 x CP = 4


def _terms(seq: int) -> int:
    """Roundings along one attention output: a score (DIM), the softmax and P.V (seq each)."""
    return DIM + 2 * seq


def _inputs(seq: int, rows: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, rows, HEADS, DIM, generator=g)
    k = torch.randn(seq, rows, GROUPS, DIM, generator=g)
    v = torch.randn(seq, rows, GROUPS, DIM, generator=g)
    return q, k, v, torch.randn(seq, rows, HEADS, DIM, generator=g)


def _reference(q, k, v) -> torch.Tensor:
    """Causal attention of whole [s, b, ...] rows."""
    out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                         v.permute(1, 2, 0, 3), is_causal=True, scale=0.3,
                                         enable_gqa=True)
    return out.permute(2, 0, 1, 3)


def _with_grads(fn, q, k, v, upstream):
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*inputs)
    (out * upstream).sum().backward()
    return out.detach(), [t.grad for t in inputs]


def test_packed_sequences_attend_to_themselves():
    from megatron_entropy.models.context_parallel import packed_attention

    q, k, v, up = _inputs(sum(LENGTHS), 1)
    cu = torch.tensor([0, 12, 16, 36], dtype=torch.int32)
    out, grads = _with_grads(lambda q, k, v: packed_attention(q[:, 0], k[:, 0], v[:, 0], cu, 0.3,
                                                              True), q, k, v, up[:, 0])
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        ref, ref_grads = _with_grads(_reference, q[a:b], k[a:b], v[a:b], up[a:b])
        torch.testing.assert_close(out[a:b], ref[:, 0], rtol=0,
                                   atol=rounding_tol(ref, _terms(b - a)))
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g[a:b], r, rtol=0,
                                       atol=rounding_tol(r, grad_terms(_terms(b - a), b - a)))


def _positions(length: int, rank: int, cp: int) -> list[int]:
    c = length // (2 * cp)
    return [p for j in (rank, 2 * cp - 1 - rank) for p in range(j * c, (j + 1) * c)]


def _cp_worker(packed: bool) -> tuple:
    """This CP rank's chunks through ``cp_attention`` and the whole sequences' reference, each
    with its input gradients at those positions."""
    from megatron.core import parallel_state as ps

    from megatron_entropy.models.context_parallel import cp_attention

    init_megatron(context=2)
    group, rank = ps.get_context_parallel_group(), ps.get_context_parallel_rank()
    if packed:
        q, k, v, up = _inputs(sum(LENGTHS), 1)
        starts = [0, 12, 16]
        mine = [s + p for s, n in zip(starts, LENGTHS) for p in _positions(n, rank, 2)]
        cu = torch.tensor([0, 12, 16, 36], dtype=torch.int32)
        fn = lambda q, k, v: cp_attention(q[:, 0], k[:, 0], v[:, 0], group, 0.3, True,  # noqa
                                          cu)[:, None]
        ref = [_with_grads(_reference, q[s:s + n], k[s:s + n], v[s:s + n], up[s:s + n])
               for s, n in zip(starts, LENGTHS)]
        ref_out = torch.cat([r[0] for r in ref])
        ref_grads = [torch.cat([r[1][i] for r in ref]) for i in range(3)]
    else:
        q, k, v, up = _inputs(16, 3)
        mine = _positions(16, rank, 2)
        fn = lambda q, k, v: cp_attention(q, k, v, group, 0.3, True)  # noqa: E731
        ref_out, ref_grads = _with_grads(_reference, q, k, v, up)
    out, grads = _with_grads(fn, q[mine], k[mine], v[mine], up[mine])
    return mine, out, grads, ref_out, ref_grads


@pytest.mark.parametrize("packed", [False, True], ids=["padded rows", "packed"])
def test_context_parallel_attention_equals_whole_sequences(packed):
    results = run_distributed(_cp_worker, 2, packed)
    seen = []
    seq = 20 if packed else 16  # the longest sequence
    for mine, out, grads, ref_out, ref_grads in results:
        seen += mine
        torch.testing.assert_close(out, ref_out[mine], rtol=0,
                                   atol=rounding_tol(ref_out, _terms(seq)))
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r[mine], rtol=0,
                                       atol=rounding_tol(r, grad_terms(_terms(seq), seq)))
    assert sorted(seen) == list(range(len(results[0][3])))


def _model_worker(context: int, initial, packed: bool):
    """The tiny GPTModel's logits at this rank's positions and its parameter gradients of
    sum(logits * weights), on two rows of 16 tokens or three packed sequences."""
    from megatron.core import parallel_state as ps

    from megatron_entropy.models.arch import arch_from_hf_config
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.sharding import full_state_dict, load_full_state_dict
    from megatron_entropy.trainer.packing import thd_params
    from megatron_entropy.trainer.batch import MicroBatch

    init_megatron(context=context)
    model = build_gpt_model(arch_from_hf_config(tiny_hf_config("qwen2")), dtype="fp32",
                            transformer_impl="local", seq_length=64)
    if initial is None:
        initial = full_state_dict(model)
    load_full_state_dict(model, initial)
    rank = ps.get_context_parallel_rank()
    g = torch.Generator().manual_seed(1)
    kwargs = {}
    if packed:
        tokens = torch.randint(3, 1000, (1, sum(LENGTHS)), generator=g)
        positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
        mine = [s + p for s, n in zip([0, 12, 16], LENGTHS) for p in _positions(n, rank,
                                                                                  context)]
        cu = torch.tensor([0, 12, 16, 36], dtype=torch.int32)
        empty = torch.zeros(0, dtype=torch.long)
        kwargs["packed_seq_params"] = thd_params(MicroBatch(
            tokens, positions, empty, empty, empty, empty, torch.zeros(1, 1), torch.zeros(1, 1),
            [], cu_seqlens=cu, cu_seqlens_padded=cu))
    else:
        tokens = torch.randint(3, 1000, (2, 16), generator=g)
        positions = torch.arange(16).expand(2, 16)
        mine = _positions(16, rank, context)
    logits = model(tokens[:, mine], positions[:, mine], None, **kwargs)
    weights = torch.randn(tokens.shape[1], logits.shape[-1], generator=g)[mine]
    (logits * weights).sum().backward()
    return (initial, mine, logits.detach(),
            {n: p.grad.clone() for n, p in model.named_parameters()})


@pytest.mark.parametrize("packed", [False, True], ids=["padded rows", "packed"])
def test_model_at_context_parallel_2_equals_one_rank(packed):
    from megatron_entropy.models.arch import arch_from_hf_config

    ((initial, _, want, grads),) = run_distributed(_model_worker, 1, 1, None, packed)
    results = run_distributed(_model_worker, 2, 2, initial, packed)
    path = transformer_terms(arch_from_hf_config(tiny_hf_config("qwen2")), 20 if packed else 16)
    tokens = sum(LENGTHS) if packed else 32
    for _, mine, logits, _ in results:
        torch.testing.assert_close(logits, want[:, mine], rtol=0, atol=rounding_tol(want, path))
    for name, g in grads.items():
        total = sum(r[3][name] for r in results)
        torch.testing.assert_close(total, g, rtol=0, msg=name,
                                   atol=rounding_tol(g, grad_terms(path, tokens)))
