"""Megatron parameters <-> full (unsharded, TP=1/PP=1) tensors, by global name.

The "full" form of a Megatron model names its layers globally (``decoder.layers.{global_i}``) and
holds every TP-sharded parameter whole. It is the one layout-independent form: the HF bridge maps
HF tensors to it, and any TP x PP layout can be loaded from it or gathered into it.

Layout facts handled here:
- a TP-sharded parameter carries ``tensor_model_parallel=True`` and ``partition_dim``;
- SwiGLU's ``linear_fc1`` stores ``[gate; up]`` per TP shard, so the full tensor is not the
  concatenation of the shards but ``[gate_0..gate_n; up_0..up_n]``;
- ``linear_qkv`` shards hold whole query groups, so plain concatenation is right;
- QK-norm weights are replicated across TP;
- a LoRA adapter's A and B (models/lora.py) carry the same attributes; fc1's B is [gate; up];
- mixture of experts: with expert parallelism (EP) each EP rank holds ``num_experts / EP``
  consecutive experts as ``mlp.experts.local_experts.{j}``; the global name counts experts over
  all EP ranks (``local_experts.{global_e}``). An expert's fc1 is a SwiGLU [gate; up] like a dense
  fc1, TP-sharded the same way (expert TP = TP).
"""

from __future__ import annotations

import re
from typing import Iterator, Optional

import torch

# Deferred imports: Megatron (~4-5 s) loads inside the functions that use it, because
# models/bridge.py, which the CLI uses before any rank starts, imports this module.
_LAYER_RE = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.")


def unwrap_model(model) -> torch.nn.Module:
    """The GPTModel inside a chunk's wrappers (DDP, Float16Module); a list of chunks must hold
    one (no virtual pipeline), which is taken."""
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ValueError(f"expected one model chunk (no virtual pipeline), got {len(model)}")
        model = model[0]
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module):
        model = model.module
    return model


def layer_offset(model) -> int:
    """Global index of this pipeline stage's first transformer layer."""
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    return get_transformer_layer_offset(unwrap_model(model).config)


def expert_offset(model) -> int:
    """Global index of this expert-parallel rank's first expert (0 for a dense model)."""
    from megatron.core import parallel_state as ps

    config = unwrap_model(model).config
    if not config.num_moe_experts:
        return 0
    return ps.get_expert_model_parallel_rank() * (
        config.num_moe_experts // ps.get_expert_model_parallel_world_size())


def to_global_name(local_name: str, offset: int, experts: int = 0) -> str:
    """``decoder.layers.1.x`` on a stage starting at layer 4 -> ``decoder.layers.5.x``; with
    ``experts`` (``expert_offset``) local expert j becomes expert ``experts + j``."""
    local_name = local_name.removeprefix("module.")
    name = _LAYER_RE.sub(lambda m: f"{m.group(1)}decoder.layers.{int(m.group(2)) + offset}.",
                         local_name, count=1)
    if experts:
        name = _EXPERT_RE.sub(
            lambda m: f".mlp.experts.local_experts.{int(m.group(1)) + experts}.", name, count=1)
    return name


def is_expert_param(name: str) -> bool:
    return ".mlp.experts.local_experts." in name


def ep_gather_experts(local: list[tuple[str, torch.Tensor]], experts_per_rank: int
                      ) -> dict[str, torch.Tensor]:
    """Every expert-parallel rank's expert tensors from this rank's (global name, full tensor)
    list, which lists the same local experts in the same order on every EP rank (one layer's,
    say): global name -> tensor. A collective over the EP group."""
    from megatron.core import parallel_state as ps

    group = ps.get_expert_model_parallel_group()
    size, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    out = {}
    for name, t in local:
        parts = [torch.empty_like(t) for _ in range(size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        j = int(_EXPERT_RE.search(name).group(1)) - rank * experts_per_rank
        for r, part in enumerate(parts):
            out[_EXPERT_RE.sub(f".mlp.experts.local_experts.{r * experts_per_rank + j}.", name,
                               count=1)] = part
    return out


def is_glu_fc1(name: str) -> bool:
    """SwiGLU's fc1 weight or bias, or its LoRA adapter's B (models/lora.py): [gate; up] rows."""
    return name.endswith(("linear_fc1.weight", "linear_fc1.bias", "linear_fc1_lora.b"))


def tp_shard(name: str, full: torch.Tensor, param: torch.nn.Parameter, tp_rank: int,
             tp_size: int) -> torch.Tensor:
    """This TP rank's part of a full tensor, laid out as the local parameter expects."""
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return full
    dim = param.partition_dim
    if is_glu_fc1(name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim=dim)[tp_rank],
                          up.chunk(tp_size, dim=dim)[tp_rank]], dim=dim)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def tp_gather(name: str, local: torch.Tensor, param: torch.nn.Parameter,
              group: Optional[torch.distributed.ProcessGroup] = None) -> torch.Tensor:
    """The full tensor from every TP rank's shard (a collective over the TP group)."""
    from megatron.core import parallel_state as ps

    group = group or ps.get_tensor_model_parallel_group()
    tp_size = torch.distributed.get_world_size(group)
    if not getattr(param, "tensor_model_parallel", False) or tp_size == 1:
        return local

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(t) for _ in range(tp_size)]
        torch.distributed.all_gather(parts, t.contiguous(), group=group)
        return parts

    dim = param.partition_dim
    if is_glu_fc1(name):
        gate, up = local.chunk(2, dim=dim)
        return torch.cat(gather(gate) + gather(up), dim=dim)
    return torch.cat(gather(local), dim=dim)


def iter_full_params(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(global name, full tensor) for each parameter of this PP stage (of the experts, this EP
    rank's); collective over TP."""
    offset, experts = layer_offset(model), expert_offset(model)
    for name, param in unwrap_model(model).named_parameters():
        yield to_global_name(name, offset, experts), tp_gather(name, param.detach(), param)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in iter_full_params(model)}


@torch.no_grad()
def load_full_state_dict(model, full: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy each local parameter's shard out of full tensors keyed by global name.

    Load before building the optimizer (or call its ``reload_model_params``): bf16 training keeps
    fp32 master copies that are taken when the optimizer is built.
    """
    from megatron.core import parallel_state as ps

    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    offset, experts = layer_offset(model), expert_offset(model)
    missing = []
    for name, param in unwrap_model(model).named_parameters():
        gname = to_global_name(name, offset, experts)
        if gname == "output_layer.weight" and gname not in full:
            # Tied embeddings: with PP > 1 the last stage keeps its own copy of the embedding.
            gname = "embedding.word_embeddings.weight"
        if gname not in full:
            missing.append(gname)
            continue
        shard = tp_shard(name, full[gname], param, tp_rank, tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"{gname}: a full tensor of shape {tuple(full[gname].shape)} gives a "
                             f"shard of {tuple(shard.shape)}, but the parameter is "
                             f"{tuple(param.shape)}")
        param.copy_(shard)
    if strict and missing:
        raise KeyError(f"no full tensor for {len(missing)} parameters, e.g. {missing[:3]}")
