"""Conversion between HF folders and Megatron-Core dist checkpoints (megatron_checkpoint.py),
streamed: ``convert_hf_to_checkpoint`` describes the checkpoint with a model built on the meta
device (no memory) and hands ``torch.distributed.checkpoint`` a planner that computes each tensor
from the HF files only when the writer asks for it; ``convert_checkpoint_to_hf`` reads one layer
at a time through ``dist_checkpointing.load`` and writes safetensors whose headers are planned up
front. Peak memory follows the largest tensor (the embedding), not the model.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter, save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                  WriteItemType)
from tqdm import tqdm

from megatron_entropy.models.arch import ModelArch, load_arch
from megatron_entropy.models.bridge import hf_tensor_specs, hf_to_megatron, megatron_to_hf
from megatron_entropy.models.builder import DTYPES, build_gpt_model
from megatron_entropy.models.hf_io import open_hf_slices, save_hf_weights, temp_sibling
from megatron_entropy.models.hf_names import (check_hf_checkpoint, hf_weight_files,
                                              layer_param_names, weight_map)
from megatron_entropy.models.megatron_checkpoint import (ARCH_FILE, HF_SUBDIR, CheckpointError,
                                                         check_checkpoint_files, read_arch,
                                                         resolve_checkpoint_dir,
                                                         write_checkpoint_metadata)
from megatron_entropy.runtime.dtypes import long_name, name_of_long

_LAYERS = "decoder.layers."
# Dist checkpoints stack each expert tensor of all layers and experts: [layers, experts, ...].
_EXPERTS = "mlp.experts.experts."
_LOCAL_EXPERTS = "mlp.experts.local_experts."

# Deferred imports: Megatron (~4-5 s) loads inside the functions that use it: the CLI checks
# the model with this module before any rank starts (cli._check_model, read_arch), without
# paying for Megatron's import.
# ------------------------------------------------------------------------- conversion helpers


@contextlib.contextmanager
def single_process_megatron() -> Iterator[None]:
    """Megatron's parallel state for one process (TP=1, PP=1), unless the caller has one.

    Conversion builds the model on the meta device and reads and writes CPU tensors: it needs no
    RNG tracker and no CUDA, so it runs without the CPU compatibility layer and with any
    megatron-core the package accepts."""
    from megatron.core import parallel_state as ps

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("checkpoint conversion runs in a single process")
    own_state = not ps.model_parallel_is_initialized()
    if own_state:
        ps.initialize_model_parallel(1, 1)
    try:
        yield
    finally:
        if own_state:
            ps.destroy_model_parallel()
        if own_group:
            dist.destroy_process_group()


def prepare_output(out_dir: Path, overwrite: bool) -> Path:
    """A fresh temporary sibling of ``out_dir``; refuses a non-empty ``out_dir``."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        if not overwrite:
            raise CheckpointError(f"{out_dir} already exists and is not empty (it holds a "
                                  "checkpoint?); pass --overwrite to replace it")
    return temp_sibling(out_dir)


def replace_output(tmp: Path, out_dir: Path) -> None:
    if out_dir.is_dir():
        shutil.rmtree(out_dir)
    elif out_dir.exists():
        out_dir.unlink()
    os.replace(tmp, out_dir)


def peak_rss_bytes() -> int:
    """This process's peak resident memory. VmHWM belongs to the process's own address space;
    ru_maxrss would also count the parent's memory at the fork that started this process."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _config_dtype(cfg: dict) -> Optional[str]:
    return name_of_long(cfg.get("dtype") or cfg.get("torch_dtype"))


def cast_checked(t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
    out = t.to(dtype)
    if out.dtype != t.dtype and out.is_floating_point() and not torch.isfinite(out).all() \
            and torch.isfinite(t).all():
        biggest = float(t.abs().max())
        raise CheckpointError(f"{what}: values up to {biggest:.4g} do not fit in {dtype} (largest "
                              f"{torch.finfo(dtype).max:.4g}); choose a wider --dtype")
    return out


def _progress(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, unit="tensor", disable=not enabled, dynamic_ncols=True)


def run_conversion(convert: Callable[[], dict[str, float]],
                   summary: Callable[[dict[str, float]], str]) -> int:
    """A conversion tool's exit code: 0 and ``summary`` of the stats; 2 and one line for bad
    input; 130 on Ctrl-C or SIGTERM, after the conversion removed its partial output."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # clean up as on Ctrl-C
    try:
        stats = convert()
    except (OSError, KeyError, ValueError) as e:
        print(f"megatron-entropy convert: error: {e.args[0] if isinstance(e, KeyError) else e}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megatron-entropy convert: interrupted: the partial output was removed",
              file=sys.stderr)
        return 130
    print(summary(stats))
    return 0


# ---------------------------------------------------------------------------------- HF -> mcore


class _LazySavePlanner(DefaultSavePlanner):
    """A torch.distributed.checkpoint save planner whose tensors exist only when the writer asks
    for them (the writer resolves one item at a time when it runs in one thread)."""

    def __init__(self, items: list, resolve: Callable) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._resolve = items, resolve

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item):
        return self._resolve(write_item)


def stacked_global_name(key: str, offset: tuple[int, ...], prepended: int) -> str:
    """``decoder.layers.mlp.linear_fc1.weight`` at layer offset 3 -> ``decoder.layers.3.mlp...``;
    ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` at (3, 5) ->
    ``decoder.layers.3.mlp.experts.local_experts.5.linear_fc1.weight``."""
    if prepended == 2:
        rel = key.removeprefix(_LAYERS).removeprefix(_EXPERTS)
        return f"{_LAYERS}{offset[0]}.{_LOCAL_EXPERTS}{offset[1]}.{rel}"
    if prepended:
        return f"{_LAYERS}{offset[0]}.{key.removeprefix(_LAYERS)}"
    return key


def _described_model(arch: ModelArch, dtype: str):
    """The model on the meta device, which only describes the checkpoint's layout. megatron-core's
    MoE all-to-all dispatcher makes a CUDA stream when it is built, which fails without CUDA (a
    CPU node; conversion hides the GPUs too); a model that never runs needs none, so a
    placeholder stands in while it is built."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    dispatcher = MoEAlltoAllTokenDispatcher
    stand_in = not torch.cuda.is_available() and \
        getattr(dispatcher, "cuda_dtoh_stream", False) is None
    if stand_in:
        dispatcher.cuda_dtoh_stream = object()
    try:
        with torch.device("meta"):
            return build_gpt_model(arch, 1, 1, dtype, "local", seq_length=16,
                                   use_cpu_initialization=True)
    finally:
        if stand_in:
            dispatcher.cuda_dtoh_stream = None


def _checked_source(hf_dir: Path, dtype: str, tensor: int, pipeline: int
                    ) -> tuple[ModelArch, str, list[Path]]:
    """An HF folder to convert, checked: (its architecture, split as ``tensor`` x
    ``pipeline`` allows; the dtype to write, "auto" resolved; its weight files, every tensor
    against config.json)."""
    try:
        arch = load_arch(hf_dir)
    except FileNotFoundError as e:
        raise CheckpointError(f"--hf-dir: {e}") from None
    try:
        arch.check_parallel(tensor, pipeline)
    except ValueError as e:
        raise CheckpointError(f"--tp {tensor} --pp {pipeline}: {e}") from None
    if dtype == "auto":
        dtype = _config_dtype(json.loads((hf_dir / "config.json").read_text())) or "bf16"
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    files = hf_weight_files(hf_dir)
    check_hf_checkpoint(files, arch, hf_dir)
    return arch, dtype, files


def _write_items(sharded) -> tuple[list, dict, dict]:
    """The torch_dist write items of a sharded state dict's main replicas, with what they
    write: (items, objects by key, sharded tensors by (key, global offset))."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, is_main_replica

    items, objects, tensors = [], {}, {}
    for sh in nested_values(sharded):
        if not is_main_replica(sh.replica_id):
            continue
        if isinstance(sh, ShardedObject):
            items.append(WriteItem(index=MetadataIndex(sh.unique_key),
                                   type=WriteItemType.BYTE_IO))
            objects[sh.unique_key] = sh.data
            continue
        offset = torch.Size(sh.global_offset)
        # Stacked layers: the layer axis is prepended to the parameter's own shape.
        sizes = torch.Size((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
        items.append(WriteItem(
            index=MetadataIndex(sh.key, offset), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=offset, sizes=sizes),
                properties=TensorProperties(dtype=sh.dtype),
                size=torch.Size(sh.global_shape))))
        tensors[(sh.key, offset)] = sh
    return items, objects, tensors


def convert_hf_to_checkpoint(hf_dir: Union[str, Path], out_dir: Union[str, Path],
                             dtype: str = "auto", tensor: int = 1, pipeline: int = 1,
                             overwrite: bool = False, progress: bool = False) -> dict[str, float]:
    """Write a dist checkpoint (+ arch.json, hf/) of an HF safetensors model, streaming.

    The checkpoint stores global tensors and loads at any TP/PP layout; ``tensor``/``pipeline``
    only check that the model can be split that way. ``dtype`` "auto" keeps config.json's dtype
    (bf16 if it names none). Returns {"tensors", "bytes", "seconds", "peak_rss_bytes"}.
    """
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess

    start = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    arch, dtype, files = _checked_source(hf_dir, dtype, tensor, pipeline)
    tmp = prepare_output(out_dir, overwrite)
    try:
        with single_process_megatron():
            # The model Megatron would save, described without memory: its sharded state dict
            # gives every key, global shape, chunk and dtype of the torch_dist layout.
            model = _described_model(arch, dtype)
            sharded, common = save_preprocess({"model": model.sharded_state_dict()}, True)
            torch.save(common, tmp / "common.pt")
            items, objects, tensors = _write_items(sharded)
            del model
            bar = _progress(len(tensors), f"HF -> mcore {out_dir.name}", progress)
            cache: dict[str, torch.Tensor] = {}
            failure: list[BaseException] = []
            written = [0]

            def resolve(item):
                if item.type == WriteItemType.BYTE_IO:
                    buf = io.BytesIO()
                    torch.save([objects[item.index.fqn]], buf)  # as Megatron stores ShardedObjects
                    return buf
                sh = tensors[(item.index.fqn, item.index.offset)]
                try:
                    name = stacked_global_name(sh.key, sh.global_offset, sh.prepend_axis_num)
                    if name not in cache:
                        # One Megatron tensor at a time (linear_fc1 is written as two chunks).
                        cache.clear()
                        wm = weight_map(name, arch)
                        with open_hf_slices(files, wm.hf) as sources:
                            full = hf_to_megatron(wm, sources, arch)
                        cache[name] = cast_checked(full, sh.dtype, " + ".join(wm.hf))
                    chunk = cache[name]
                    for dim, (off, size) in enumerate(zip(sh.global_offset[sh.prepend_axis_num:],
                                                          sh.local_shape)):
                        chunk = chunk.narrow(dim, off, size)
                except BaseException as e:
                    failure.append(e)
                    raise
                bar.update(1)
                written[0] += chunk.numel() * chunk.element_size()
                return chunk.reshape(item.tensor_data.chunk.sizes)

            try:
                dcp_save({}, storage_writer=FileSystemWriter(str(tmp), thread_count=1),
                         planner=_LazySavePlanner(items, resolve), no_dist=True)
            except CheckpointException:
                if failure:
                    raise failure[0] from None
                raise
            finally:
                bar.close()
            save_config(CheckpointingConfig("torch_dist", 1), str(tmp))
        write_checkpoint_metadata(tmp, arch, hf_dir)
        replace_output(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"tensors": float(len(tensors)), "bytes": float(written[0]),
            "seconds": time.perf_counter() - start, "peak_rss_bytes": float(peak_rss_bytes())}


# ---------------------------------------------------------------------------------- mcore -> HF


def _model_keys(arch: ModelArch) -> tuple[list[str], list[str]]:
    """The checkpoint keys of the model: (top-level, stacked per layer) in Megatron's order."""
    top = ["embedding.word_embeddings.weight", "decoder.final_layernorm.weight"]
    if not arch.tie_word_embeddings:
        top.append("output_layer.weight")
    stacked = [_LAYERS + n for n in layer_param_names(arch, te_names=True)
               if not n.startswith(_LOCAL_EXPERTS)]
    if arch.is_moe:
        stacked += [f"{_LAYERS}{_EXPERTS}{fc}.weight" for fc in ("linear_fc1", "linear_fc2")]
    return top, stacked


def iter_checkpoint_tensors(ckpt_dir: Union[str, Path], arch: ModelArch
                            ) -> Iterator[tuple[str, torch.Tensor]]:
    """(global Megatron name, full tensor) of every model parameter in a dist checkpoint, in
    ``megatron_param_names(arch, te_names=True)`` order, reading one layer at a time. Needs
    torch.distributed and Megatron's parallel state (one process is enough)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    stored = check_checkpoint_files(ckpt_dir).state_dict_metadata
    top, stacked = _model_keys(arch)
    absent = [k for k in top + stacked if k not in stored]
    if absent:
        raise CheckpointError(f"{ckpt_dir} lacks {len(absent)} tensors of a {arch.architecture} "
                              f"model, e.g. {absent[:3]} (another architecture?)")
    for key in stacked:
        if stored[key].size[0] != arch.num_layers:
            raise CheckpointError(f"{ckpt_dir}: {key} has {stored[key].size[0]} layers, the "
                                  f"architecture {arch.num_layers}")
        if _EXPERTS in key and stored[key].size[1] != arch.num_experts:
            raise CheckpointError(f"{ckpt_dir}: {key} has {stored[key].size[1]} experts, the "
                                  f"architecture {arch.num_experts}")

    def load(request: dict[str, ShardedTensor]) -> dict[str, torch.Tensor]:
        return dist_checkpointing.load(request, str(ckpt_dir), validate_access_integrity=False)

    def whole(key: str) -> ShardedTensor:
        md = stored[key]
        return ShardedTensor.from_rank_offsets(
            key, torch.empty(tuple(md.size), dtype=md.properties.dtype), replica_id=0)

    first, last = top[0], top[1:]
    yield first, load({first: whole(first)})[first]
    for layer in range(arch.num_layers):
        request = {}
        for key in stacked:
            # Row ``layer`` of the stacked tensor, as a plain chunk [1, ...] (a partial read).
            md = stored[key]
            request[key] = ShardedTensor.from_rank_offsets(
                key, torch.empty((1, *md.size[1:]), dtype=md.properties.dtype),
                (0, layer, arch.num_layers), replica_id=0)
        loaded = load(request)
        # Megatron's order within a layer: its own tensors, then expert by expert fc1, fc2.
        experts = [k for k in stacked if _EXPERTS in k]
        for key in stacked:
            if key not in experts:
                yield stacked_global_name(key, (layer,), 1), loaded.pop(key)[0]
        for e in range(arch.num_experts if experts else 0):
            for key in experts:
                yield stacked_global_name(key, (layer, e), 2), loaded[key][0, e]
    for key in last:
        yield key, load({key: whole(key)})[key]


def convert_checkpoint_to_hf(ckpt_dir: Union[str, Path], out_dir: Union[str, Path],
                             hf_config_from: Optional[Union[str, Path]] = None,
                             dtype: Optional[str] = None, max_shard_bytes: int = 5 * 1024**3,
                             overwrite: bool = False, progress: bool = False) -> dict[str, float]:
    """Write HF safetensors (+ index when sharded), config and tokenizer from a dist checkpoint
    (a converted one or a trainer's), layer by layer; padded vocab rows are dropped.

    Config and tokenizer come from ``hf_config_from`` or else the checkpoint's ``hf/``. ``dtype``
    defaults to the dtype of the checkpoint's weight matrices (config.json's dtype field is set to
    match). Returns {"tensors", "bytes",
    "shards", "seconds", "peak_rss_bytes"}.
    """
    start = time.perf_counter()
    ckpt_dir, out_dir = resolve_checkpoint_dir(ckpt_dir), Path(out_dir)
    meta_dir = Path(hf_config_from) if hf_config_from else ckpt_dir / HF_SUBDIR
    if not (meta_dir / "config.json").is_file():
        raise CheckpointError(f"no config.json in {meta_dir}: give the source HF folder with "
                              "--hf-config-from")
    arch = read_arch(ckpt_dir) if (ckpt_dir / ARCH_FILE).is_file() else load_arch(meta_dir)
    cfg = json.loads((meta_dir / "config.json").read_text())
    top, stacked = _model_keys(arch)
    if dtype is None:
        # The dtype the weight matrices are stored in (norms may be kept in fp32).
        stored = check_checkpoint_files(ckpt_dir).state_dict_metadata
        key = _LAYERS + "self_attention.linear_qkv.weight"
        dtype = {v: k for k, v in DTYPES.items()}.get(stored[key].properties.dtype) \
            if key in stored else None
        dtype = dtype or _config_dtype(cfg) or "fp32"
    if dtype not in DTYPES:
        raise CheckpointError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    torch_dtype = DTYPES[dtype]
    specs = hf_tensor_specs(arch, torch_dtype)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise CheckpointError(f"{out_dir} already exists and is not empty (it holds a "
                              "checkpoint?); pass --overwrite to replace it")

    def hf_tensors(bar) -> Iterator[tuple[str, torch.Tensor]]:
        for name, full in iter_checkpoint_tensors(ckpt_dir, arch):
            for hf_name, t in megatron_to_hf(weight_map(name, arch), full, arch):
                bar.update(1)
                yield hf_name, cast_checked(t, torch_dtype, hf_name)

    with single_process_megatron(), _progress(len(specs), f"mcore -> HF {out_dir.name}",
                                               progress) as bar:
        stats = save_hf_weights(hf_tensors(bar), out_dir, metadata_from=meta_dir,
                                max_shard_bytes=max_shard_bytes, specs=specs)
    if _config_dtype(cfg) not in (None, dtype):
        # The weights' dtype changed: say so in config.json, as save_pretrained would.
        cfg.update({k: long_name(dtype) for k in ("dtype", "torch_dtype") if k in cfg})
        (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    return {**stats, "seconds": time.perf_counter() - start,
            "peak_rss_bytes": float(peak_rss_bytes())}
