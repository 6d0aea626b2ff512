"""The one Hugging Face <-> Megatron-Core weight mapping (its names and shapes: hf_names.py).

Used by the checkpoint tools (tools/), by the trainer to start from HF weights and by the rollout
weight sync. Megatron names are *global* (``decoder.layers.{i}`` counts layers over all pipeline
stages, see models/sharding.py). Both layer specs are covered: the local spec keeps a layer's two
norms as modules (``input_layernorm``, ``pre_mlp_layernorm``); Transformer Engine fuses them into
the linear that follows (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``), and
Megatron's dist checkpoints always use the Transformer-Engine names.

Layout facts:
- ``linear_qkv`` holds, for each query group g, the rows [q heads of g; k_g; v_g]; HF keeps
  ``q_proj``, ``k_proj``, ``v_proj`` apart (same for the biases of Qwen2);
- ``linear_fc1`` holds [gate; up] (HF ``gate_proj``, ``up_proj``);
- the embedding and output layer have ``arch.padded_vocab_size`` rows: the rows past the real
  vocabulary are zero on import and dropped on export;
- tied embeddings: HF stores only ``model.embed_tokens.weight``; with PP > 1 Megatron's last stage
  keeps a copy of it as ``output_layer.weight``;
- mixture of experts (Qwen3-MoE): the router ``mlp.router.weight`` is HF ``mlp.gate.weight``;
  expert e's ``mlp.experts.local_experts.{e}.linear_fc1`` is [gate; up] of HF
  ``mlp.experts.{e}.gate_proj`` / ``up_proj`` and its ``linear_fc2`` HF's ``down_proj`` (the
  per-expert tensors of Qwen's checkpoints, which transformers' ``save_pretrained`` writes too).
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import torch
import torch.distributed as dist

from megatron_entropy.models.arch import ModelArch, load_arch
from megatron_entropy.models.hf_io import TensorSpec, open_hf_slices, save_hf_weights
from megatron_entropy.models.hf_names import (WeightMap, check_hf_checkpoint, check_shape,
                                              hf_shape, hf_weight_files, local_spec_name,
                                              megatron_param_names, weight_map)
from megatron_entropy.models.lora import is_adapter_param, merged_weight
from megatron_entropy.models.sharding import (ep_gather_experts, expert_offset,
                                              is_expert_param, layer_offset, tp_gather,
                                              to_global_name, unwrap_model)

# Deferred imports: Megatron (~4-5 s), and runtime/roles.py which imports it, load inside the
# functions that use them: importing this module costs torch only. The names and shapes of the
# mapping are in hf_names.py (torch-free).


class NonFiniteWeightError(ValueError):
    """Initial weights with a NaN or an infinity; the message names the first such tensor."""


def hf_tensor_specs(arch: ModelArch, dtype: torch.dtype) -> list[TensorSpec]:
    """(name, shape, dtype) of every HF tensor, in the order ``megatron_to_hf`` produces them when
    the Megatron parameters are visited in ``megatron_param_names`` order."""
    return [(n, hf_shape(n, arch), dtype)
            for name in megatron_param_names(arch) for n in weight_map(name, arch).hf]


def save_exported_weights(named_tensors: Iterable[tuple[str, torch.Tensor]],
                          out_dir: Union[str, Path], hf_dir: Union[str, Path]) -> dict[str, float]:
    """Write a stream of full HF-named tensors (``export_hf_weights``, or any order) as an HF folder
    with config and tokenizer from ``hf_dir``, holding one tensor in memory at a time: the shards
    are planned from the architecture and the first tensor's dtype."""
    arch = load_arch(hf_dir)
    # A tied model's lm_head is its embedding (HF's state_dict lists both; the file holds one).
    it = ((n, t) for n, t in named_tensors
          if not (arch.tie_word_embeddings and n == "lm_head.weight"))
    first = next(it)
    return save_hf_weights(itertools.chain([first], it), out_dir, metadata_from=hf_dir,
                           specs=hf_tensor_specs(arch, first[1].dtype))


# ------------------------------------------------------------------------------- tensor layouts


def _shape(src) -> tuple[int, ...]:
    return tuple(src.get_shape()) if hasattr(src, "get_shape") else tuple(src.shape)


def _rows(src, dim: int, start: int, stop: int) -> torch.Tensor:
    """``src[..., start:stop, ...]`` along ``dim``; reads only that part of a safetensors slice."""
    return src[(slice(None),) * dim + (slice(start, stop),)]


def _part(src, dim: int, rank: int, parts: int) -> torch.Tensor:
    size = _shape(src)[dim] // parts
    return _rows(src, dim, rank * size, (rank + 1) * size)


def hf_to_megatron(wm: WeightMap, sources: Sequence, arch: ModelArch, tp_rank: int = 0,
                   tp_size: int = 1, partition_dim: Optional[int] = None) -> torch.Tensor:
    """The Megatron tensor of ``wm`` (TP rank ``tp_rank``'s shard along ``partition_dim``, or the
    whole tensor when ``partition_dim`` is None) from its HF tensors.

    ``sources`` are torch tensors or safetensors slices (``open_hf_slices``); of a slice only the
    rows this shard needs are read.
    """
    for name, src in zip(wm.hf, sources, strict=True):
        check_shape(name, _shape(src), arch)
    if partition_dim is None:
        tp_rank, tp_size, partition_dim = 0, 1, 0
    if wm.kind == "copy":
        return _part(sources[0], partition_dim, tp_rank, tp_size)
    if wm.kind == "glu":
        gate, up = sources
        return torch.cat([_part(gate, 0, tp_rank, tp_size), _part(up, 0, tp_rank, tp_size)])
    if wm.kind == "vocab":
        rows = arch.padded_vocab_size // tp_size
        start, stop = tp_rank * rows, min((tp_rank + 1) * rows, arch.vocab_size)
        real = _rows(sources[0], 0, start, max(start, stop))
        if real.shape[0] == rows:  # no padding rows in this shard: no copy
            return real
        out = real.new_zeros((rows, arch.hidden_size))
        out[: real.shape[0]] = real
        return out
    # qkv: this rank holds whole query groups [g0, g0 + groups).
    groups = arch.num_query_groups // tp_size
    hd, per_group = arch.head_dim, arch.num_attention_heads // arch.num_query_groups
    g0 = tp_rank * groups
    q = _rows(sources[0], 0, g0 * per_group * hd, (g0 + groups) * per_group * hd)
    k, v = (_rows(s, 0, g0 * hd, (g0 + groups) * hd) for s in sources[1:])
    rest = q.shape[1:]
    return torch.cat([q.reshape(groups, per_group * hd, *rest), k.reshape(groups, hd, *rest),
                      v.reshape(groups, hd, *rest)], dim=1).reshape(-1, *rest)


def megatron_to_hf(wm: WeightMap, full: torch.Tensor, arch: ModelArch
                   ) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of one whole (TP-gathered) Megatron tensor; padded vocab rows dropped."""
    if wm.kind == "copy":
        return [(wm.hf[0], full)]
    if wm.kind == "vocab":
        return [(wm.hf[0], full[: arch.vocab_size])]
    if wm.kind == "glu":
        return list(zip(wm.hf, full.chunk(2, dim=0)))
    hd, per_group = arch.head_dim, arch.num_attention_heads // arch.num_query_groups
    rest = full.shape[1:]
    grouped = full.reshape(arch.num_query_groups, (per_group + 2) * hd, *rest)
    q, k, v = grouped.split([per_group * hd, hd, hd], dim=1)
    return [(name, t.reshape(-1, *rest)) for name, t in zip(wm.hf, (q, k, v))]


# -------------------------------------------------------------------------------- model level


@torch.no_grad()
def load_hf_weights(model, hf_dir: Union[str, Path], arch: ModelArch) -> None:
    """Read this rank's TP/PP shard of every parameter of a built GPTModel (DDP-wrapped or not)
    from an HF safetensors folder. Each rank reads only the rows/columns it holds, one tensor at a
    time. Load before the optimizer is built (it copies fp32 master weights when built)."""
    from megatron.core import parallel_state as ps

    files = hf_weight_files(hf_dir)
    check_hf_checkpoint(files, arch, hf_dir)
    module = unwrap_model(model)
    offset, experts = layer_offset(module), expert_offset(module)
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    for name, param in module.named_parameters():
        if is_adapter_param(name):  # LoRA adapters start from their own initialisation
            continue
        wm = weight_map(to_global_name(name, offset, experts), arch)
        dim = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        with open_hf_slices(files, wm.hf) as sources:
            shard = hf_to_megatron(wm, sources, arch, tp_rank, tp_size, dim)
        if shard.shape != param.shape:
            raise ValueError(f"{wm.megatron}: the HF tensors give a shard of shape "
                             f"{tuple(shard.shape)}, but the parameter is {tuple(param.shape)}")
        if shard.is_floating_point() and not torch.isfinite(shard).all():
            raise NonFiniteWeightError(
                f"model.hf_path: {files[wm.hf[0]]}: tensor {' + '.join(wm.hf)} holds NaN or "
                "inf (the first such tensor of the model): the weights are damaged")
        param.copy_(shard)


@torch.no_grad()
def export_hf_weights(model, arch: ModelArch
                      ) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
    """HF-named full tensors of the model, one Megatron parameter at a time.

    Collective over this DP replica's model-parallel group: every TP and PP rank of it must iterate
    to the end in lockstep. On the group's leader (TP rank 0 of the first PP stage) each item is a
    whole tensor named as in HF's state dict, padded vocab rows removed, on the model's device and
    in its dtype; on every other rank the same names come with None. Tied embeddings are exported
    once (``model.embed_tokens.weight``), as ``save_pretrained`` stores them. The order is that of
    ``hf_tensor_specs(arch, dtype)`` whatever the layer spec, so ``hf_io.save_hf_weights(...,
    specs=hf_tensor_specs(arch, dtype))`` can write the stream holding one tensor at a time.
    """
    from megatron.core import parallel_state as ps

    from megatron_entropy.runtime.roles import is_replica_leader

    module = unwrap_model(model)
    if arch.is_moe and ps.get_expert_model_parallel_world_size() > 1:
        raise NotImplementedError("export_hf_weights gathers over TP and PP only; with "
                                  "parallel.expert > 1 use export_stage_hf_weights per stage")
    params = _stage_params(module, arch)
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp_rank = ps.get_tensor_model_parallel_rank()
    # Every stage learns every stage's parameters: (global name, full shape, dtype).
    mine = []
    for gname, (name, param) in params.items():
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= ps.get_tensor_model_parallel_world_size()
        mine.append((gname, tuple(shape), param.dtype))
    stages: list = [None] * ps.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(stages, mine, group=pp_group)
    stage_ranks = dist.get_process_group_ranks(pp_group)
    leader = is_replica_leader()
    device = next(module.parameters()).device
    for stage, entries in enumerate(stages):
        for gname, shape, dtype in entries:
            full = None
            if stage == pp_rank:
                name, param = params[gname]
                full = tp_gather(name, merged_weight(module, name, param), param)
            if stage != 0 and tp_rank == 0:
                # The owning stage hands the tensor to the first stage's TP rank 0.
                if pp_rank == stage:
                    dist.send(full.contiguous(), dst=stage_ranks[0])
                elif pp_rank == 0:
                    full = torch.empty(shape, dtype=dtype, device=device)
                    dist.recv(full, src=stage_ranks[stage])
            yield from _hf_items(gname, full, arch, leader)
            del full


def _hf_items(gname: str, full: Optional[torch.Tensor], arch: ModelArch, leader: bool
              ) -> Iterator[tuple[str, Optional[torch.Tensor]]]:
    """One Megatron parameter's HF tensors on the exporting rank; its HF names with None on the
    others (they take part in the gathers only)."""
    wm = weight_map(gname, arch)
    return megatron_to_hf(wm, full, arch) if leader else ((n, None) for n in wm.hf)


def _stage_params(module, arch: ModelArch) -> dict[str, tuple[str, torch.nn.Parameter]]:
    """This stage's parameters, global name -> (local name, parameter), in global order; a tied
    output layer (the last stage's copy of the embedding) left out: it is exported once, and
    LoRA adapters too: the export merges them into their layers' weights."""
    offset, experts = layer_offset(module), expert_offset(module)
    order = {name: i for i, name in enumerate(megatron_param_names(arch))}
    params = {}
    for name, param in module.named_parameters():
        gname = to_global_name(name, offset, experts)
        if is_adapter_param(name):
            continue
        if not (gname == "output_layer.weight" and arch.tie_word_embeddings):
            params[gname] = (name, param)
    # Stages hold consecutive layers, so sorting each stage's parameters gives the global order.
    return dict(sorted(params.items(), key=lambda kv: order[local_spec_name(kv[0])]))


def export_stage_hf_weights(model, arch: ModelArch
                            ) -> tuple[list[TensorSpec],
                                       Iterator[tuple[str, Optional[torch.Tensor]]]]:
    """This pipeline stage's own HF tensors: (their specs, the stream of them).

    The specs (HF name, full shape, dtype; in stream order) are known on every rank at once.
    The stream is collective over this stage's TP group only (each tensor is TP-gathered): every
    TP rank of the stage iterates it to the end in lockstep; on TP rank 0 each item is a whole
    HF-named tensor (padded vocab rows removed, on the model's device and in its dtype), on the
    others the same names come with None. Nothing crosses stages. Over all stages, in stage
    order, the streams are ``export_hf_weights``'s stream; tied embeddings come once, from the
    first stage. With expert parallelism every stage streams all experts: the stream is then
    collective over the EP group too (every EP rank of the stage iterates it in lockstep).
    """
    from megatron.core import parallel_state as ps

    module = unwrap_model(model)
    params = _stage_params(module, arch)
    ep = ps.get_expert_model_parallel_world_size() if arch.is_moe else 1
    names = _with_all_experts(list(params), arch) if ep > 1 else list(params)
    dtype = next(iter(params.values()))[1].dtype
    specs = [(n, hf_shape(n, arch), params[g][1].dtype if g in params else dtype)
             for g in names for n in weight_map(g, arch).hf]
    leader = ps.get_tensor_model_parallel_rank() == 0

    # The decorator (not a ``with`` inside the generator) turns grad off only while the generator
    # runs: a consumer that stops after the last tensor must not leave it off for the caller.
    @torch.no_grad()
    def stream() -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        gathered: dict[str, torch.Tensor] = {}
        for gname in names:
            if ep > 1 and is_expert_param(gname) and gname not in gathered:
                # A layer's first expert: every EP rank's experts of the layer, at once.
                layer = gname.split(".mlp.")[0]
                gathered = ep_gather_experts(
                    [(g, tp_gather(n, merged_weight(module, n, p), p))
                     for g, (n, p) in params.items()
                     if is_expert_param(g) and g.split(".mlp.")[0] == layer],
                    arch.num_experts // ep)
            if gname in gathered:
                full = gathered.pop(gname)
            else:
                name, param = params[gname]
                full = tp_gather(name, merged_weight(module, name, param), param)
            yield from _hf_items(gname, full, arch, leader)
            del full

    return specs, stream()


def _with_all_experts(names: list[str], arch: ModelArch) -> list[str]:
    """A stage's global names (this EP rank's experts) with every expert of each layer instead,
    in global order."""
    out: list[str] = []
    for name in names:
        if not is_expert_param(name):
            out.append(name)
            continue
        layer = name.split(".mlp.")[0]
        if not any(is_expert_param(n) and n.startswith(layer + ".") for n in out):
            out += [f"{layer}.mlp.experts.local_experts.{e}.{fc}.weight"
                    for e in range(arch.num_experts) for fc in ("linear_fc1", "linear_fc2")]
    return out
