"""The local spec's core attention through torch's SDPA (models/attention.py) against
Megatron-Core's own DotProductAttention: the same outputs and gradients up to rounding, causal
and with an explicit boolean mask (the shared-prompt rows' kind)."""

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
    scaling divides by 2); outputs and input gradients, causal and with a mask."""
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
        # An explicit mask, not a causal one: causal, and the first key hidden from every
        # query after it (SDPA's own causal mask would give another result).
        mask = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), 1)
        mask[1:, 0] = True
        for case, attention_mask in (("causal", None), ("masked", mask[None, None])):
            out[f"{name}_takes_sdpa_{case}"] = (isinstance(module, SdpaDotProductAttention)
                                                and module._sdpa_applies(attention_mask, None,
                                                                         None))
            inputs = [t.clone().requires_grad_() for t in (q, k, v)]
            result = module(*inputs, attention_mask=attention_mask)
            (result * upstream).sum().backward()
            out[f"{name}_{case}"] = (result.detach(), [t.grad for t in inputs])
    model = build_gpt_model(arch, transformer_impl="local", seq_length=64)
    out["built"] = type(model.decoder.layers[0].self_attention.core_attention).__name__
    out["dim"] = dim
    return out


@pytest.mark.parametrize("query_groups,layer_scaling", [(2, False), (4, True)])
def test_sdpa_attention_equals_megatrons(query_groups, layer_scaling):
    (r,) = run_distributed(_attention_worker, 1, query_groups, layer_scaling)
    # Along one output: the scores' dot product (dim terms), the softmax normaliser and the
    # weighted sum over the keys (SEQ each); a gradient goes back along the same sums.
    terms = r["dim"] + 2 * SEQ
    for case in ("causal", "masked"):
        (ref, ref_grads), (ours, grads) = r[f"megatron_{case}"], r[f"sdpa_{case}"]
        torch.testing.assert_close(ours, ref, rtol=0, atol=rounding_tol(ref, terms), msg=case)
        for name, a, b in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(a, b, rtol=0, atol=rounding_tol(b, 2 * terms),
                                       msg=f"{case} {name}")
        assert r[f"sdpa_takes_sdpa_{case}"]
    # The mask matters: hiding the first key moves the outputs far beyond rounding.
    assert (r["megatron_masked"][0] - r["megatron_causal"][0]).abs().max() > 0.1
    assert r["built"] == "SdpaDotProductAttention"
