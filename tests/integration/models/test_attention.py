"""The local spec's core attention through torch's SDPA (models/attention.py) against
Megatron-Core's own DotProductAttention: the same outputs and gradients up to rounding, and
Megatron's path itself wherever SDPA does not apply."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness import init_megatron, run_distributed
from tiny_models import tiny_hf_config
from tolerance import rounding_tol

SEQ, BATCH = 11, 3


def _attention_worker(query_groups: int, layer_scaling: bool) -> dict:
    """Inside a rank: both modules on the same random q, k, v (layer 2, so that query-key layer
    scaling divides by 2); outputs, input gradients, and Megatron's vs ours with a mask."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_entropy.models.arch import arch_from_hf_config
    from megatron_entropy.models.attention import SdpaDotProductAttention
    from megatron_entropy.models.builder import build_gpt_model, transformer_config

    init_megatron()
    arch = arch_from_hf_config(tiny_hf_config("qwen2", num_key_value_heads=query_groups))
    config = dataclasses.replace(transformer_config(arch),
                                 apply_query_key_layer_scaling=layer_scaling)
    heads, dim = config.num_attention_heads, config.kv_channels
    g = torch.Generator().manual_seed(0)
    q = torch.randn(SEQ, BATCH, heads, dim, generator=g) * 2
    k = torch.randn(SEQ, BATCH, query_groups, dim, generator=g) * 2
    v = torch.randn(SEQ, BATCH, query_groups, dim, generator=g)
    upstream = torch.randn(SEQ, BATCH, heads * dim, generator=g)
    out = {}
    for name, cls in (("megatron", DotProductAttention), ("sdpa", SdpaDotProductAttention)):
        module = cls(config, layer_number=2, attn_mask_type=AttnMaskType.causal,
                     attention_type="self")
        out[f"{name}_takes_sdpa"] = (isinstance(module, SdpaDotProductAttention)
                                     and module._sdpa_applies(None, None, None))
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        result = module(*inputs, attention_mask=None)
        (result * upstream).sum().backward()
        # An explicit mask (here: causal, and the first key hidden from every query) is not
        # the plain causal case: ours must be Megatron's own path.
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)
        mask[1:, 0] = True
        masked = module(q, k, v, attention_mask=mask[None, None])
        out[name] = (result.detach(), [t.grad for t in inputs], masked)
    model = build_gpt_model(arch, transformer_impl="local", seq_length=64)
    out["built"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
    out["dim"] = dim
    return out


@pytest.mark.parametrize("query_groups,layer_scaling", [(2, False), (4, True)])
def test_sdpa_attention_equals_megatrons(query_groups, layer_scaling):
    (r,) = run_distributed(_attention_worker, 1, query_groups, layer_scaling)
    (ref, ref_grads, ref_masked), (ours, grads, masked) = r["megatron"], r["sdpa"]
    # Along one output: the scores' dot product (dim terms), the softmax normaliser and the
    # weighted sum over the keys (SEQ each); a gradient goes back along the same sums.
    terms = r["dim"] + 2 * SEQ
    torch.testing.assert_close(ours, ref, rtol=0, atol=rounding_tol(ref, terms))
    for name, a, b in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=rounding_tol(b, 2 * terms), msg=name)
    assert torch.equal(masked, ref_masked)
    assert r["sdpa_takes_sdpa"] and r["built"] == "SdpaDotProductAttention"
