"""Megatron-Core dist checkpoints (torch_dist) of the policy, shared by the trainer and tools/.

A checkpoint folder holds:

- the dist_checkpointing files (``metadata.json``, ``common.pt``, ``.metadata``, ``*.distcp``) where
  the model's ``sharded_state_dict()`` lives under the top-level key ``"model"`` (the trainer's own
  checkpoints add ``"optimizer"`` etc. beside it in the same save). Tensors are stored by global
  shape, so any TP/PP layout loads them (Megatron reshards on load);
- ``arch.json``: ``ModelArch.to_dict()``, so training and export need no architecture flags;
- ``hf/``: config.json, generation config and tokenizer files of the source HF model.

Conversion from and to HF lives in conversion.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Union

import torch
from torch.distributed.checkpoint import FileSystemReader

from megatron_entropy.models.arch import ModelArch, load_arch
from megatron_entropy.models.hf_io import copy_hf_metadata
from megatron_entropy.models.lora import is_adapter_param
from megatron_entropy.models.sharding import unwrap_model

# Deferred imports: Megatron (~4-5 s) loads inside the functions that use it: the CLI checks
# the model with this module before any rank starts (cli._check_model, read_arch), without
# paying for Megatron's import.
ARCH_FILE = "arch.json"
HF_SUBDIR = "hf"


class CheckpointError(ValueError):
    """A checkpoint or output folder that cannot be used; the message says why."""


# ------------------------------------------------------------------------ metadata and loading


def write_checkpoint_metadata(ckpt_dir: Union[str, Path], arch: ModelArch,
                              hf_dir: Union[str, Path]) -> None:
    """``arch.json`` and ``hf/`` (config, generation config, tokenizer of ``hf_dir``)."""
    ckpt_dir = Path(ckpt_dir)
    (ckpt_dir / ARCH_FILE).write_text(json.dumps(arch.to_dict(), indent=1))
    (ckpt_dir / HF_SUBDIR).mkdir(exist_ok=True)
    copy_hf_metadata(hf_dir, ckpt_dir / HF_SUBDIR)


def read_arch(ckpt_dir: Union[str, Path]) -> ModelArch:
    """The architecture recorded beside a checkpoint (``arch.json``, else ``hf/config.json``)."""
    ckpt_dir = Path(ckpt_dir)
    if (ckpt_dir / ARCH_FILE).is_file():
        return ModelArch.from_dict(json.loads((ckpt_dir / ARCH_FILE).read_text()))
    if (ckpt_dir / HF_SUBDIR / "config.json").is_file():
        return load_arch(ckpt_dir / HF_SUBDIR)
    raise CheckpointError(f"{ckpt_dir} records no architecture (no {ARCH_FILE} or "
                          f"{HF_SUBDIR}/config.json); give the HF model folder it came from "
                          "(--hf-config-from)")


def read_latest(folder: Path) -> Path:
    """The checkpoint that ``folder/latest`` (the trainer's pointer to its newest checkpoint)
    names; CheckpointError naming the file when it names none (empty, not text, several
    lines: damaged on disk)."""
    pointer = folder / "latest"
    try:
        name = pointer.read_bytes().decode().strip()
    except UnicodeDecodeError:
        name = ""
    if not name or "\n" in name or "\0" in name:
        raise CheckpointError(f"{pointer} is damaged: it holds no checkpoint name (it should "
                              "hold one line, e.g. step_00000020)")
    return folder / name


def resolve_checkpoint_dir(path: Union[str, Path]) -> Path:
    """The dist checkpoint folder: ``path`` itself, or the one its ``latest`` file names (the
    trainer's ``checkpoints/`` folder)."""
    path = Path(path)
    if (path / "metadata.json").is_file():
        return path
    if (path / "latest").is_file():
        return resolve_checkpoint_dir(read_latest(path))
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    raise CheckpointError(f"{path} is not a Megatron dist checkpoint (no metadata.json)")


# What shapes a model's tensors: a checkpoint of a model that differs in one cannot be loaded.
SHAPE_FIELDS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                "num_attention_heads", "num_query_groups", "head_dim", "tie_word_embeddings",
                "qkv_bias", "qk_layernorm", "num_experts", "moe_ffn_hidden_size")


def check_same_model(ckpt_dir: Path, arch: ModelArch, model_key: str) -> None:
    """Raise CheckpointError naming the checkpoint and each shape that differs when the model it
    records (arch.json) is not the one ``model_key`` names; one that records none passes."""
    if not (ckpt_dir / ARCH_FILE).is_file():
        return
    saved = read_arch(ckpt_dir)
    differ = [f"{f} {getattr(saved, f)} (the model's {getattr(arch, f)})"
              for f in SHAPE_FIELDS if getattr(saved, f) != getattr(arch, f)]
    if differ:
        raise CheckpointError(f"checkpoint {ckpt_dir} holds another model than {model_key}: "
                              f"{', '.join(differ)}; resume from a checkpoint of this model, or "
                              "set trainer.resume=none to start over")


def check_checkpoint_files(ckpt_dir: Path) -> Any:
    """The checkpoint's torch.distributed.checkpoint metadata, after checking that every data file
    it points into exists and is long enough (missing or partial shards raise)."""
    if not (ckpt_dir / ".metadata").is_file():
        raise CheckpointError(f"{ckpt_dir} has no .metadata file: the checkpoint is incomplete "
                              "(a save that did not finish?)")
    metadata = FileSystemReader(str(ckpt_dir)).read_metadata()
    need: dict[str, int] = {}
    for info in metadata.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        path = ckpt_dir / name
        if not path.is_file():
            raise CheckpointError(f"{ckpt_dir}: data file {name} is missing (partial copy?)")
        if path.stat().st_size < size:
            raise CheckpointError(f"{ckpt_dir}: data file {name} is truncated "
                                  f"({path.stat().st_size} of {size} bytes)")
    return metadata


def model_sharded_state_dict(model) -> dict:
    """``{"model": sharded_state_dict}`` of one model chunk (DDP-wrapped or not), for saving the
    model alone or beside the optimizer in one ``dist_checkpointing.save``."""
    return {"model": unwrap_model(model).sharded_state_dict()}


def load_model_weights(model, ckpt_dir: Union[str, Path]) -> None:
    """Load the model's part of a dist checkpoint (converted or a trainer's), resharded to this
    rank's TP/PP layout. Collective over all ranks. Load before the optimizer is built, or call
    its ``reload_model_params()`` after. A LoRA policy's adapters are not read: the
    checkpoint is its base."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    ckpt_dir = resolve_checkpoint_dir(ckpt_dir)
    stored = set(check_checkpoint_files(ckpt_dir).state_dict_metadata)
    module = unwrap_model(model)
    sharded = {k: v for k, v in module.sharded_state_dict().items() if not is_adapter_param(k)}
    # Transformer Engine layers keep FP8 bookkeeping in ``_extra_state``; checkpoints written with
    # the local spec (CPU, tools/) have none for some modules, and those start empty.
    skipped = {k for k, v in sharded.items()
               if isinstance(v, ShardedObject) and v.unique_key not in stored}
    absent = sorted({v.key for v in sharded.values()
                     if hasattr(v, "key") and not isinstance(v, ShardedObject)
                     and v.key not in stored})
    if absent:
        raise CheckpointError(f"{ckpt_dir} lacks {len(absent)} tensors of this model, e.g. "
                              f"{absent[:3]} (a checkpoint of another architecture?)")
    loaded = dist_checkpointing.load({"model": {k: v for k, v in sharded.items()
                                                if k not in skipped}}, str(ckpt_dir))
    missing, unexpected = module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and not is_adapter_param(k)]
    if missing or unexpected:
        raise CheckpointError(f"{ckpt_dir}: state dict mismatch, missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    bad = next((name for name, p in module.named_parameters()
                if p.is_floating_point() and not torch.isfinite(p).all()), None)
    if bad is not None:
        raise CheckpointError(f"{ckpt_dir}: tensor {bad} holds NaN or inf (the first such "
                              "tensor of the model): the weights are damaged")
