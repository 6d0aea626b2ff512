"""LoRA adapters on Megatron-Core's tensor-parallel linear layers (the local layer spec).

An adapter adds ``(alpha / rank) * B A x`` to its linear layer's output; the layer's own weights
are frozen. It sits beside the layer as ``<linear>_lora`` (``self_attention.linear_qkv_lora.a``,
``.b``) and joins the layer's forward through a forward hook, so the base layer, its parameter
names, its checkpoint keys and the HF mapping stay as they are.

Sharding follows the base layer, and no weight is ever gathered:
- column-parallel (linear_qkv, linear_fc1; W's output rows sharded): A [r, in] whole on every
  TP rank, B [out/tp, r] sharded as W is. The [T, r] activation ``A x`` enters the TP region as
  the layer's input does: its gradient is all-reduced over TP in the backward.
- row-parallel (linear_proj, linear_fc2; W's input columns sharded): A [r, in/tp] sharded as W
  is, B [out, r] whole. Each rank's partial ``A x`` is summed over TP in the forward (an
  all-reduce of [T, r] beside the layer's own of [T, out]).
- experts: each local expert's linears get their own adapters, placed by expert parallelism as
  the experts are; like the experts' weights they are reduced over the expert-data-parallel
  group (``allreduce=False``).
SwiGLU's linear_fc1 keeps [gate; up] per TP shard, and its B does too, so ``W + s B A`` is the
merged weight shard by shard; checkpoints store B in the unsharded [gate; up] order, as W.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from typing import Iterator, Optional

import torch
import torch.nn.functional as F

from megatron_entropy.models.arch import UnsupportedModelError
from megatron_entropy.models.lora_settings import LoraSettings
from megatron_entropy.models.sharding import (expert_offset, layer_offset, to_global_name,
                                              tp_shard, unwrap_model)

# Deferred imports: Megatron (~4-5 s) loads inside the functions that use it (models/bridge.py
# imports this module, and the CLI imports the bridge before any rank starts).
SUFFIX = "_lora"  # an adapter's module name: its linear's name + SUFFIX


def is_adapter_param(name: str) -> bool:
    """Whether a (local or global) parameter or state-dict name is an adapter's."""
    return f"{SUFFIX}." in name


class LoraAdapter(torch.nn.Module):
    """The adapter of one parallel linear layer ``base``: A [r, in], B [out, r], each this
    rank's shard as the module docstring says; B starts at zero."""

    def __init__(self, base: torch.nn.Module, column: bool, settings: LoraSettings,
                 glu: bool) -> None:
        from megatron.core.tensor_parallel.layers import (
            set_defaults_if_not_set_tensor_model_parallel_attributes,
            set_tensor_model_parallel_attributes)

        super().__init__()
        out_local, in_local = base.weight.shape
        like = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.a = torch.nn.Parameter(torch.zeros(settings.rank, in_local, **like))
        self.b = torch.nn.Parameter(torch.zeros(out_local, settings.rank, **like))
        sharded, whole = (self.b, self.a) if column else (self.a, self.b)
        set_tensor_model_parallel_attributes(sharded, True, 0 if column else 1, 1)
        set_defaults_if_not_set_tensor_model_parallel_attributes(whole)
        for p in (self.a, self.b):
            p.allreduce = getattr(base.weight, "allreduce", True)
        self.column, self.glu = column, glu
        self.scale, self.dropout = settings.scale, settings.dropout
        self.tp_group = base.tp_group
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core import tensor_parallel

        if self.dropout and self.training:
            # x is whole on every TP rank before a column-parallel layer (the same mask
            # everywhere: the default stream) and sharded before a row-parallel one.
            fork = (contextlib.nullcontext() if self.column
                    else tensor_parallel.get_cuda_rng_tracker().fork())
            with fork:
                x = F.dropout(x, self.dropout)
        h = F.linear(x, self.a)
        if self.column:
            h = tensor_parallel.copy_to_tensor_model_parallel_region(h, group=self.tp_group)
        else:
            h = tensor_parallel.reduce_from_tensor_model_parallel_region(h, group=self.tp_group)
        return F.linear(h, self.b) * self.scale

    def delta(self) -> torch.Tensor:
        """``s B A`` of this rank's shard, in fp32: what merging adds to the base weight."""
        return (self.b.detach().float() @ self.a.detach().float()) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (),
                           metadata: Optional[dict] = None) -> dict:
        """A and B as dist-checkpoint tensors, sharded as the module docstring says (the
        parents' offsets, layers and experts, prepended)."""
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import (ensure_metadata_has_dp_cp_group,
                                                     make_sharded_tensors_for_checkpoint)

        metadata = ensure_metadata_has_dp_cp_group(metadata)
        out = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix,
            {"b": 0} if self.column else {"a": 1}, sharded_offsets, tp_group=self.tp_group,
            dp_cp_group=metadata["dp_cp_group"])
        if self.glu:
            out[f"{prefix}b"] = apply_swiglu_sharded_factory(
                out[f"{prefix}b"], sharded_offsets, metadata.get("singleton_local_shards", False))
        return out


def _add_output(adapter: LoraAdapter, module: torch.nn.Module, args: tuple, kwargs: dict,
                output: tuple) -> tuple:
    """Forward hook of a linear with an adapter: its (output, bias) with the adapter's added."""
    if not adapter.enabled:
        return output
    out, bias = output
    return out + adapter(args[0] if args else kwargs["input_"]), bias


def add_adapters(model, settings: LoraSettings, seed: int = 0) -> int:
    """Put an adapter on every ``settings.targets`` linear of a built model (this rank's part),
    freeze everything else and initialise the adapters (``init_adapters``). Returns how many
    adapters this rank holds. Before the model is wrapped in DDP: DDP and the optimizer then
    hold the adapters only."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    module = unwrap_model(model)
    count = 0
    for parent_name, parent in list(module.named_modules()):
        for target in settings.targets:
            base = parent._modules.get(target)
            if base is None:
                continue
            where = f"{parent_name}.{target}"
            if not isinstance(base, (ColumnParallelLinear, RowParallelLinear)):
                raise UnsupportedModelError(
                    f"model.lora: {where} is a {type(base).__name__}; adapters sit on the local "
                    "layer spec's parallel linear layers (set model.transformer_impl=local)")
            column = isinstance(base, ColumnParallelLinear)
            tp = torch.distributed.get_world_size(base.tp_group)
            if base.config.sequence_parallel or (base.is_expert and tp > 1):
                raise UnsupportedModelError(
                    f"model.lora: {where}: adapters under sequence parallelism or on experts "
                    "with tensor parallelism are not supported; use parallel.sequence_parallel="
                    "false and parallel.expert for the experts")
            adapter = LoraAdapter(base, column, settings,
                                  glu=target == "linear_fc1" and base.config.gated_linear_unit)
            parent.add_module(target + SUFFIX, adapter)
            base.register_forward_hook(functools.partial(_add_output, adapter), with_kwargs=True)
            count += 1
    if not count:
        raise UnsupportedModelError(f"model.lora.targets={settings.targets}: the model has none "
                                    "of these layers on this pipeline stage")
    for name, param in module.named_parameters():
        param.requires_grad_(is_adapter_param(name))
    init_adapters(module, seed)
    return count


@torch.no_grad()
def init_adapters(model, seed: int = 0) -> None:
    """A uniform in +-1/sqrt(in) (PEFT's default, kaiming-uniform with a = sqrt(5)) and B zero:
    the adapters change no output. A is drawn whole from a generator seeded by ``seed`` and its
    global name, then sharded: every layout starts from the same adapters."""
    from megatron.core import parallel_state as ps

    module = unwrap_model(model)
    offset, experts = layer_offset(module), expert_offset(module)
    tp_rank = ps.get_tensor_model_parallel_rank()
    tp_size = ps.get_tensor_model_parallel_world_size()
    for name, param in module.named_parameters():
        if not is_adapter_param(name):
            continue
        if name.endswith(".b"):
            param.zero_()
            continue
        gname = to_global_name(name, offset, experts)
        shape = list(param.shape)
        if getattr(param, "tensor_model_parallel", False):
            shape[param.partition_dim] *= tp_size
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(gname.encode()))
        bound = shape[1] ** -0.5
        full = (torch.rand(shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
        param.copy_(tp_shard(name, full, param, tp_rank, tp_size))


def adapters(model) -> Iterator[LoraAdapter]:
    return (m for m in unwrap_model(model).modules() if isinstance(m, LoraAdapter))


def has_adapters(model) -> bool:
    return next(adapters(model), None) is not None


@contextlib.contextmanager
def adapters_disabled(model) -> Iterator[None]:
    """The base model alone (every adapter off) inside the block: the reference policy of a
    LoRA run, with no second model in memory. A model without adapters is unchanged."""
    held = list(adapters(model))
    for a in held:
        a.enabled = False
    try:
        yield
    finally:
        for a in held:
            a.enabled = True


def adapter_of(module: torch.nn.Module, name: str) -> Optional[LoraAdapter]:
    """The adapter beside the linear whose weight is the local parameter ``name``, or None."""
    if not name.endswith(".weight"):
        return None
    try:
        found = module.get_submodule(name.removesuffix(".weight") + SUFFIX)
    except AttributeError:
        return None
    return found if isinstance(found, LoraAdapter) else None


def merged_weight(module: torch.nn.Module, name: str, param: torch.Tensor) -> torch.Tensor:
    """This rank's shard of local parameter ``name`` with its adapter merged in (``W + s B A``,
    summed in fp32 and rounded once to W's dtype), or the parameter itself."""
    adapter = adapter_of(module, name)
    if adapter is None or not adapter.enabled:
        return param.detach()
    return (param.detach().float() + adapter.delta()).to(param.dtype)


def checkpoint_state_dict(model) -> dict:
    """The model's sharded state dict for a training checkpoint: with adapters, theirs alone
    (the base is frozen, and named by the run's base identity)."""
    sharded = unwrap_model(model).sharded_state_dict()
    if not has_adapters(model):
        return sharded
    return {k: v for k, v in sharded.items() if is_adapter_param(k)}


def load_checkpoint_state(model, state: dict) -> None:
    """Load what ``checkpoint_state_dict`` saved (strict: every tensor saved is one of the
    model's, and every trainable tensor of the model is saved)."""
    module = unwrap_model(model)
    if not has_adapters(module):
        module.load_state_dict(state)
        return
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if is_adapter_param(k)]
    if missing or unexpected:
        raise KeyError(f"the checkpoint's adapters do not match the model's: missing "
                       f"{missing[:3]}, unexpected {unexpected[:3]}")


@torch.no_grad()
def base_fingerprint(model) -> dict[str, list[float]]:
    """Every frozen base parameter's (sum, sum of squares) in float64, by global name, over its
    whole tensor: the same numbers, up to float64 rounding, at every TP/PP/EP layout, and
    different ones for any other weights. A collective over the whole job (every rank's shards
    are gathered as objects: two numbers per tensor)."""
    from megatron.core import parallel_state as ps

    module = unwrap_model(model)
    offset, experts = layer_offset(module), expert_offset(module)
    tied = getattr(module, "share_embeddings_and_output_weights", False)
    mine = {}
    for name, param in module.named_parameters():
        gname = to_global_name(name, offset, experts)
        if is_adapter_param(name) or (tied and gname == "output_layer.weight"):
            continue  # a tied output layer is the embedding's copy on the last stage
        shard = 0
        if getattr(param, "tensor_model_parallel", False):
            shard = (ps.get_expert_tensor_parallel_rank() if ".local_experts." in name
                     else ps.get_tensor_model_parallel_rank())
        v = param.detach().double()
        mine[(gname, shard)] = (float(v.sum()), float((v * v).sum()))
    everyone: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    shards = {key: sums for part in everyone for key, sums in part.items()}
    out: dict[str, list[float]] = {}
    for (gname, _), (total, squares) in sorted(shards.items()):
        acc = out.setdefault(gname, [0.0, 0.0])
        acc[0] += total
        acc[1] += squares
    return out


def fingerprint_difference(saved: dict, now: dict, rtol: float = 1e-9) -> Optional[str]:
    """What differs between two ``base_fingerprint``s beyond float64 rounding (a sum of n
    values is off by ~sqrt(n) 1e-16 of sqrt(sum of squares)), or None."""
    if saved.keys() != now.keys():
        other = sorted(saved.keys() ^ now.keys())
        return f"other tensors ({len(other)} differ, e.g. {other[:2]})"
    for name, (total, squares) in saved.items():
        t, q = now[name]
        if abs(q - squares) > rtol * squares or abs(t - total) > rtol * squares ** 0.5:
            return f"tensor {name} differs (sum of squares {squares:.9g} saved, {q:.9g} now)"
    return None
