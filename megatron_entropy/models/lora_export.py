"""A LoRA policy's adapters out of Megatron: a checkpoint's as a PEFT adapter folder, or merged
into its base as an HF folder (``megatron-entropy convert mcore-to-peft | mcore-to-hf``), and a
live model's as the PEFT-named tensors that a weight sync sends an engine serving LoRA.

PEFT's names and shapes, from ours (models/lora.py: A [r, in], B [out, r], output scaled by
alpha / r as PEFT scales it): a Megatron linear that stands for several HF ones (linear_qkv: q,
k, v; linear_fc1: gate, up) gives each of them the adapter's A and its rows of B, so
``base_model.model.<hf module>.lora_A.weight`` = A and ``.lora_B.weight`` = B's rows of that
module; the product B A is the Megatron adapter's, row for row.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import torch

from megatron_entropy.models.arch import ModelArch, UnsupportedModelError
from megatron_entropy.models.bridge import hf_tensor_specs, hf_to_megatron, megatron_to_hf
from megatron_entropy.models.builder import DTYPES
from megatron_entropy.models.conversion import (cast_checked, iter_checkpoint_tensors,
                                                peak_rss_bytes, prepare_output, replace_output,
                                                single_process_megatron, stacked_global_name)
from megatron_entropy.models.hf_io import TensorSpec, open_hf_slices, save_hf_weights
from megatron_entropy.models.hf_names import (check_hf_checkpoint, hf_weight_files,
                                              local_spec_name, megatron_param_names, weight_map)
from megatron_entropy.models.lora import (SUFFIX, LoraAdapter, fingerprint_difference,
                                          is_adapter_param)
from megatron_entropy.models.lora_settings import TARGETS
from megatron_entropy.models.megatron_checkpoint import (CheckpointError, check_checkpoint_files,
                                                         resolve_checkpoint_dir)
from megatron_entropy.models.sharding import (expert_offset, layer_offset, to_global_name,
                                              tp_gather, unwrap_model)

PEFT_PREFIX = "base_model.model."
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_EXPERTS = ".mlp.experts.experts."


def peft_config(rank: int, alpha: float, targets: Iterable[str], base: str) -> dict:
    """adapter_config.json of a PEFT LoRA adapter with our adapters' shape and scale."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
            "target_modules": sorted(m for t in targets for m in TARGETS[t]),
            "base_model_name_or_path": base, "inference_mode": True}


def peft_tensors(adapter: str, a: torch.Tensor, b: torch.Tensor, arch: ModelArch
                 ) -> list[tuple[str, torch.Tensor]]:
    """PEFT's tensors of one whole adapter (``adapter``: its global module name,
    ``decoder.layers.3.self_attention.linear_qkv_lora``)."""
    if ".local_experts." in adapter:
        raise UnsupportedModelError(
            f"{adapter}: transformers keeps a mixture-of-experts model's experts as fused 3-D "
            "tensors, which PEFT's LoRA layers (per linear module) do not reach; export the "
            "adapters merged (megatron-entropy convert mcore-to-hf)")
    out = []
    for hf_name, rows in megatron_to_hf(weight_map(adapter.removesuffix(SUFFIX) + ".weight",
                                                   arch), b, arch):
        stem = PEFT_PREFIX + hf_name.removesuffix(".weight")
        out += [(f"{stem}.lora_A.weight", a), (f"{stem}.lora_B.weight", rows)]
    return out


def checkpoint_adapters(ckpt_dir: Union[str, Path]) -> dict[str, torch.Tensor]:
    """Every adapter tensor of a LoRA training checkpoint, whole, by global parameter name
    (``decoder.layers.3.self_attention.linear_qkv_lora.a``). Needs Megatron's parallel state
    (one process is enough)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    stored = check_checkpoint_files(ckpt_dir).state_dict_metadata
    keys = [k for k in stored if is_adapter_param(k) and not k.startswith("optimizer")]
    if not keys:
        raise CheckpointError(f"{ckpt_dir} holds no LoRA adapters (a checkpoint of every "
                              "weight: convert it with mcore-to-hf)")
    request = {k: ShardedTensor.from_rank_offsets(
        k, torch.empty(tuple(stored[k].size), dtype=stored[k].properties.dtype), replica_id=0)
        for k in keys}
    loaded = dist_checkpointing.load(request, str(ckpt_dir), validate_access_integrity=False)
    out = {}
    for key in keys:  # the load adds the checkpoint's common state beside them
        stacked = loaded[key]
        if _EXPERTS in key:  # [layers, experts, ...]
            for layer in range(stacked.shape[0]):
                for e in range(stacked.shape[1]):
                    out[stacked_global_name(key, (layer, e), 2)] = stacked[layer, e]
        else:
            for layer in range(stacked.shape[0]):
                out[stacked_global_name(key, (layer,), 1)] = stacked[layer]
    return out


def _whole_adapters(adapters: dict[str, torch.Tensor]
                    ) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """(module name, A, B) of each adapter."""
    for name in adapters:
        if name.endswith(".a"):
            module = name.removesuffix(".a")
            yield module, adapters[name], adapters[f"{module}.b"]


def write_peft_adapter(folder: Path, tensors: dict[str, torch.Tensor], config: dict) -> int:
    """A PEFT adapter folder: ``adapter_model.safetensors`` of ``tensors`` (PEFT names) and
    ``adapter_config.json``; returns the bytes of the tensors."""
    from safetensors.torch import save_file

    # A is shared by the HF modules of one Megatron linear: a copy each (safetensors).
    save_file({k: v.detach().cpu().clone() for k, v in tensors.items()},
              str(folder / PEFT_WEIGHTS), metadata={"format": "pt"})
    (folder / PEFT_CONFIG).write_text(json.dumps(config, indent=2))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def export_peft(ckpt_dir: Union[str, Path], out_dir: Union[str, Path], identity: dict,
                arch: ModelArch, overwrite: bool = False) -> dict[str, float]:
    """Write a LoRA checkpoint's adapters as a PEFT adapter folder (adapter_config.json,
    adapter_model.safetensors) for the base ``identity`` names (trainer/lora_run.py)."""
    start = time.perf_counter()
    out_dir = Path(out_dir)
    tmp = prepare_output(out_dir, overwrite)
    try:
        with single_process_megatron():
            adapters = checkpoint_adapters(ckpt_dir)
        tensors = dict(t for module, a, b in _whole_adapters(adapters)
                       for t in peft_tensors(module, a, b, arch))
        nbytes = write_peft_adapter(tmp, tensors, peft_config(
            identity["rank"], identity["alpha"], identity["targets"], identity["base"]))
        replace_output(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tensors": float(len(tensors)), "bytes": float(nbytes),
            "seconds": time.perf_counter() - start, "peak_rss_bytes": float(peak_rss_bytes())}


def export_stage_adapters(model, arch: ModelArch
                          ) -> tuple[list[TensorSpec],
                                     Iterator[tuple[str, Optional[torch.Tensor]]]]:
    """This pipeline stage's adapters as PEFT-named whole tensors: (their specs, the stream of
    them), as ``bridge.export_stage_hf_weights`` gives the stage's weights (collective over
    the stage's TP group: each tensor is TP-gathered; None on the other TP ranks)."""
    from megatron.core import parallel_state as ps

    module = unwrap_model(model)
    offset, experts = layer_offset(module), expert_offset(module)
    held = [(to_global_name(name, offset, experts), m) for name, m in module.named_modules()
            if isinstance(m, LoraAdapter)]
    tp = ps.get_tensor_model_parallel_world_size()

    def meta(p: torch.Tensor) -> torch.Tensor:
        shape = list(p.shape)
        if getattr(p, "tensor_model_parallel", False):
            shape[p.partition_dim] *= tp
        return torch.empty(shape, dtype=p.dtype, device="meta")

    specs = [(n, tuple(t.shape), t.dtype) for gname, m in held
             for n, t in peft_tensors(gname, meta(m.a), meta(m.b), arch)]
    leader = ps.get_tensor_model_parallel_rank() == 0

    @torch.no_grad()
    def stream() -> Iterator[tuple[str, Optional[torch.Tensor]]]:
        for gname, m in held:
            a = tp_gather(f"{gname}.a", m.a.detach(), m.a)
            b = tp_gather(f"{gname}.b", m.b.detach(), m.b)
            for name, t in peft_tensors(gname, a, b, arch):
                yield name, t if leader else None

    return specs, stream()


def base_tensors(base: Union[str, Path], arch: ModelArch
                 ) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, full tensor) of the base model: an HF folder, or a Megatron dist
    checkpoint (a folder with metadata.json); one tensor at a time."""
    base = Path(base)
    if (base / "metadata.json").is_file() or (base / "latest").is_file():
        yield from iter_checkpoint_tensors(base, arch)
        return
    files = hf_weight_files(base)
    check_hf_checkpoint(files, arch, base)
    for name in megatron_param_names(arch):
        wm = weight_map(name, arch)
        with open_hf_slices(files, wm.hf) as sources:
            yield name, hf_to_megatron(wm, sources, arch)


def merged_tensors(base: Iterable[tuple[str, torch.Tensor]], adapters: dict[str, torch.Tensor],
                   scale: float, arch: ModelArch, dtype: torch.dtype,
                   fingerprint: Optional[dict] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors of the base with each adapter merged in (``W + scale B A`` in fp32, rounded
    once to ``dtype``); with ``fingerprint`` (the run's, trainer/lora_run.py) each base tensor,
    in ``dtype`` as the run held it, is checked against it first."""
    for name, full in base:
        full = full.to(dtype)
        if fingerprint is not None:
            _check_base(local_spec_name(name), full, fingerprint)
        module = name.removesuffix(".weight") + SUFFIX
        if name.endswith(".weight") and f"{module}.a" in adapters:
            delta = adapters[f"{module}.b"].float() @ adapters[f"{module}.a"].float() * scale
            full = (full.float() + delta).to(dtype)
        for hf_name, t in megatron_to_hf(weight_map(name, arch), full, arch):
            yield hf_name, cast_checked(t, dtype, hf_name)


def _check_base(name: str, full: torch.Tensor, fingerprint: dict) -> None:
    if name not in fingerprint:
        return
    v = full.double()
    diff = fingerprint_difference({name: fingerprint[name]},
                                  {name: [float(v.sum()), float((v * v).sum())]})
    if diff:
        raise CheckpointError(f"--base: not the base the adapters were trained on: {diff}")


def export_merged(ckpt_dir: Union[str, Path], out_dir: Union[str, Path], identity: dict,
                  arch: ModelArch, meta_dir: Union[str, Path], base: Optional[Path] = None,
                  dtype: Optional[str] = None, max_shard_bytes: int = 5 * 1024**3,
                  overwrite: bool = False) -> dict[str, float]:
    """Write the base of a LoRA checkpoint (``base``, else the one its ``identity`` names) with
    the adapters merged in, as an HF folder in ``dtype`` (default: the run's); config and
    tokenizer from ``meta_dir``. The base is checked against the run's fingerprint as it
    streams: another base stops the export and leaves nothing."""
    start = time.perf_counter()
    dtype = dtype or identity["dtype"]
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    if Path(out_dir).exists() and any(Path(out_dir).iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir} already exists and is not empty; pass --overwrite to "
                              "replace it")
    with single_process_megatron():
        adapters = checkpoint_adapters(ckpt_dir)
        # The fingerprint holds the base as the run held it: in the run's dtype.
        check = identity["fingerprint"] if dtype == identity["dtype"] else None
        stats = save_hf_weights(
            merged_tensors(base_tensors(base or identity["base"], arch), adapters,
                           identity["alpha"] / identity["rank"], arch, torch_dtype, check),
            out_dir, metadata_from=meta_dir, max_shard_bytes=max_shard_bytes,
            specs=hf_tensor_specs(arch, torch_dtype))
    return {**stats, "seconds": time.perf_counter() - start,
            "peak_rss_bytes": float(peak_rss_bytes())}
