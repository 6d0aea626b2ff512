"""Wire the fused log-prob/entropy op to a Megatron GPTModel's output layer.

``hidden_states_instead_of_logits(model)`` makes the last pipeline stage return the final hidden
states (after the final norm) instead of logits, prepared for ``fused_linear_logprob_entropy``
with ``output_layer_weight(model)``: the hidden states go through the same TP region the output
layer's column-parallel GEMM would have used, so their gradient is reduced over TP exactly as in
Megatron (all-reduce; reduce-scatter with sequence parallelism, where the sequence-sharded hidden
states are first all-gathered).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                    gather_from_sequence_parallel_region)
from torch import Tensor

from megatron_entropy.models.sharding import unwrap_model


def output_layer_weight(model: torch.nn.Module) -> Tensor:
    """This rank's output-layer shard [V_local, H] (the word embedding if tied); last stage only."""
    gpt = unwrap_model(model)
    if not getattr(gpt, "post_process", False):
        raise ValueError("output_layer_weight: this pipeline stage has no output layer "
                         "(only the last stage does)")
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    GPTModel transposes its output to [B, S, ...], so the gradient arriving here is a transposed
    view; Megatron's TP all-reduce (``_reduce``) reduces ``grad.contiguous()`` in place and would
    silently drop the reduction on such a view. (Its own output layer never sees one: the GEMM's
    input gradient is contiguous.)
    """

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        return grad.contiguous()


def _to_output_region(layer: torch.nn.Module, hidden: Tensor) -> Tensor:
    group = getattr(layer, "tp_group", None)
    if getattr(layer, "sequence_parallel", False):
        out = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True,
                                                   group=group)
    else:
        out = copy_to_tensor_model_parallel_region(hidden, group=group)
    return _ContiguousGrad.apply(out)


@contextmanager
def hidden_states_instead_of_logits(model: torch.nn.Module) -> Iterator[None]:
    """Inside, ``model(tokens, position_ids, None)`` on the last stage returns [B, S, H] final
    hidden states (after the final norm; full sequence even with sequence parallelism), in the
    output weight's dtype. Other stages are unaffected."""
    gpt = unwrap_model(model)
    layer = getattr(gpt, "output_layer", None) if getattr(gpt, "post_process", False) else None
    if layer is None:
        yield
        return
    dtype = output_layer_weight(model).dtype

    def hidden_out(hidden_states, weight=None, runtime_gather_output=None):
        # GPTModel turns [S, B, H] into [B, S, H] for us, as it does for logits.
        return _to_output_region(layer, hidden_states.to(dtype)), None

    layer.forward = hidden_out
    try:
        yield
    finally:
        del layer.forward  # back to the class's forward
