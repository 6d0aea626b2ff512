"""The local layer spec's core attention through torch's fused scaled_dot_product_attention.

Megatron-Core's local ``DotProductAttention`` materialises the [b, heads, s, s] scores (baddbmm),
masks them with a causal mask it builds, softmaxes and multiplies by V (bmm), and keeps the
probabilities for the backward. torch's SDPA computes the same causal attention in one kernel
(flash-style on CPU, flash or memory-efficient on GPU), without the s x s tensors: on the
quickstart model's update (fp32, one CPU thread) a layer's attention forward and backward take
~0.7x the time. The result equals Megatron's up to rounding (another order of the same sums).

The causal case goes through SDPA, and so does an explicit boolean mask (True where a query may
not see a key, Megatron's convention; the shared-prompt micro-batches' rows, trainer/batch.py),
packed sequences (Megatron's ``PackedSeqParams`` in the THD format; trainer/packing.py) and
context parallelism (models/context_parallel.py), which Megatron's local attention refuses:
window attention, a softmax offset (off-by-one / learnable), attention dropout while training, an
attention bias or a mask of another dtype take Megatron's own path, unchanged (and refuse CP).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_entropy.models.context_parallel import cp_attention, packed_attention


class SdpaDotProductAttention(DotProductAttention):
    """``DotProductAttention`` whose causal or boolean-masked case is one call of torch's SDPA;
    tensors in Megatron's layout, query [s, b, heads, d], key/value [s, b, groups, d] -> [s, b,
    heads x d], a mask [b, 1, s, s]; packed (THD): [t, heads, d] -> [t, heads x d]."""

    def __init__(self, config, *args, **kwargs) -> None:
        # Megatron's class asserts CP = 1 (it has no CP path); this one has, so its parent is
        # built as at CP = 1 and the config keeps its CP size.
        cp = config.context_parallel_size
        config.context_parallel_size = 1
        try:
            super().__init__(config, *args, **kwargs)
        finally:
            config.context_parallel_size = cp

    def _sdpa_applies(self, attention_mask: Optional[torch.Tensor], attention_bias,
                      packed_seq_params) -> bool:
        applies = ((attention_mask is None or attention_mask.dtype == torch.bool)
                   and attention_bias is None and self.softmax_offset is None
                   and self.scale_mask_softmax.window_size is None
                   and not (self.training and self.attention_dropout.p > 0)
                   and (packed_seq_params is None or packed_seq_params.qkv_format == "thd"))
        if not applies and self.config.context_parallel_size > 1:
            raise NotImplementedError(
                "context parallelism on the local layer spec takes causal attention without "
                "window, bias, softmax offset or attention dropout")
        return applies

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type=None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params=None
                ) -> torch.Tensor:
        if not self._sdpa_applies(attention_mask, attention_bias, packed_seq_params):
            return super().forward(query, key, value, attention_mask, attn_mask_type,
                                   attention_bias, packed_seq_params)
        # With query-key layer scaling Megatron divides the scores by the layer number and the
        # softmax multiplies them back: the net scale is softmax_scale x that coefficient.
        scale = self.softmax_scale * (self.scale_mask_softmax.scale or 1.0)
        gqa = self.num_attention_heads_per_partition != self.num_query_groups_per_partition
        cp = self.config.context_parallel_size
        if packed_seq_params is not None or cp > 1:
            if attention_mask is not None:
                raise NotImplementedError("packed sequences and context parallelism take no "
                                          "explicit attention mask")
            cu = None
            if packed_seq_params is not None:
                cu = (packed_seq_params.cu_seqlens_q_padded
                      if packed_seq_params.cu_seqlens_q_padded is not None
                      else packed_seq_params.cu_seqlens_q)
            if cp > 1:
                out = cp_attention(query, key, value, parallel_state.get_context_parallel_group(),
                                   scale, gqa, cu)
            else:
                out = packed_attention(query, key, value, cu, scale, gqa)
            return out.reshape(*out.shape[:-2], self.hidden_size_per_partition)
        s, b = query.shape[0], query.shape[1]
        out = F.scaled_dot_product_attention(
            query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3), value.permute(1, 2, 0, 3),
            attn_mask=None if attention_mask is None else ~attention_mask,
            is_causal=attention_mask is None, scale=scale, enable_gqa=gqa)
        # [b, heads, s, d] -> [s, b, heads x d]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.hidden_size_per_partition)


def takes_explicit_masks(model_chunks: list) -> bool:
    """Whether every chunk's core attention is the local spec's (ours or Megatron's
    ``DotProductAttention``), which applies an explicit mask; Transformer Engine's causal
    kernels would not."""
    return all(any(isinstance(m, DotProductAttention) for m in chunk.modules())
               for chunk in model_chunks)


def takes_packed_sequences(model_chunks: list) -> bool:
    """Whether every chunk's core attention takes packed sequences and context parallelism: this
    module's, or Transformer Engine's (named, not imported: it exists on GPU machines only)."""
    return all(any(isinstance(m, SdpaDotProductAttention)
                   or type(m).__name__ == "TEDotProductAttention" for m in chunk.modules())
               for chunk in model_chunks)
