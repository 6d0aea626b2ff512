"""The ops on a real Megatron GPTModel (in Megatron's DDP) at TP=2: the fused path (final hidden
states x output-layer shard) equals the logits path equals torch's log_softmax on the gathered
logits, and both paths give the model the same parameter gradients."""

from __future__ import annotations

import pytest
import torch

from harness import init_megatron, run_distributed
from tiny_models import tiny_hf_config
from tolerance import grad_terms, logprob_tol, rounding_tol, transformer_terms

from megatron_entropy.models.arch import arch_from_hf_config

B, S = 2, 12


def _worker(tp: int, tied: bool):
    from megatron.core import parallel_state as ps

    from megatron_entropy.config import ModelConfig, ParallelConfig
    from megatron_entropy.models.arch import arch_from_hf_config
    from megatron_entropy.models.output_head import (hidden_states_instead_of_logits,
                                                     output_layer_weight)
    from megatron_entropy.models.sharding import unwrap_model
    from megatron_entropy.ops.logprob_entropy import (fused_linear_logprob_entropy,
                                                      vocab_parallel_logprob_entropy)
    from megatron_entropy.trainer.model_setup import build_trainable_model

    init_megatron(tensor=tp)
    arch = arch_from_hf_config(tiny_hf_config("qwen2", tie_word_embeddings=tied))
    (model,) = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64),
        ParallelConfig(tensor=tp))
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (B, S), generator=g)
    targets = torch.roll(tokens, -1, dims=1).reshape(-1)
    pos = torch.arange(S).expand(B, S)
    up_logp, up_ent = torch.randn(B * S, generator=g), torch.randn(B * S, generator=g)
    group = ps.get_tensor_model_parallel_group()
    kw = dict(vocab_size=arch.vocab_size, group=group, chunk_tokens=7)

    def grads():
        out = {n: p.main_grad.clone() for n, p in model.named_parameters()}
        model.zero_grad_buffer()
        return out

    logits = model(tokens, pos, None)
    assert logits.shape == (B, S, arch.padded_vocab_size // tp)
    parts = [torch.empty_like(logits) for _ in range(tp)]
    torch.distributed.all_gather(parts, logits.detach().contiguous(), group=group)
    full = torch.cat(parts, dim=-1)[..., :arch.vocab_size].reshape(B * S, -1)
    logsm = torch.log_softmax(full.double(), dim=-1)
    ref = (logsm.gather(1, targets[:, None]).squeeze(1), -(logsm.exp() * logsm).sum(-1))

    lp1, ent1 = vocab_parallel_logprob_entropy(logits.reshape(B * S, -1), targets, **kw)
    (lp1 * up_logp + ent1 * up_ent).sum().backward()
    grads_logits = grads()

    with hidden_states_instead_of_logits(model):
        hidden = model(tokens, pos, None)
    assert hidden.shape == (B, S, arch.hidden_size)
    weight = output_layer_weight(model)
    gpt = unwrap_model(model)
    assert weight is (gpt.embedding.word_embeddings.weight if tied else gpt.output_layer.weight)
    lp2, ent2 = fused_linear_logprob_entropy(hidden.reshape(B * S, -1), weight, targets, **kw)
    (lp2 * up_logp + ent2 * up_ent).sum().backward()
    grads_fused = grads()

    # Leaving the context restores the logits.
    assert model(tokens, pos, None).shape == logits.shape
    return full.abs().max(), ref, (lp1.detach(), ent1.detach()), (lp2.detach(), ent2.detach()), \
        grads_logits, grads_fused


@pytest.mark.parametrize("tied", [False, True])
def test_fused_equals_logits_path_equals_log_softmax_tp2(tied):
    arch = arch_from_hf_config(tiny_hf_config("qwen2", tie_word_embeddings=tied))
    # The op's fp32 sums run over the vocabulary; the fused path also recomputes the logits
    # (hidden @ weight.T: another GEMM, hidden_size terms, than the output layer's).
    op_terms, fused_terms = arch.vocab_size, arch.vocab_size + arch.hidden_size
    # Both paths backpropagate through the same model; they differ in the output layer's GEMMs.
    grad_path = grad_terms(transformer_terms(arch, S, log_softmax=True), B * S)
    for max_logit, ref, chunked, fused, g_logits, g_fused in run_distributed(_worker, 2, 2, tied):
        scale = max(max_logit, ref[0].abs().max())  # as logprob_tol: |z| and |log p|
        for ours, terms in ((chunked, op_terms), (fused, fused_terms)):
            for got, want in zip(ours, ref):
                torch.testing.assert_close(got.double(), want, rtol=0,
                                           atol=logprob_tol(scale, want, terms))
        for got, want in zip(fused, chunked):
            torch.testing.assert_close(got, want, rtol=0, atol=logprob_tol(scale, want,
                                                                           fused_terms))
        assert g_logits.keys() == g_fused.keys()
        for name, g in g_logits.items():
            torch.testing.assert_close(g_fused[name], g, rtol=0, msg=name,
                                       atol=rounding_tol(g, grad_path))
        # Real gradients reached every layer, including the output/embedding weight.
        assert all(g.abs().max() > 0 for g in g_logits.values())
