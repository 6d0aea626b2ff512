"""A LoRA run's identity: what its checkpoints need beside the adapters they hold.

A checkpoint of a LoRA run holds the adapters and their optimizer (trainer/checkpoint.py saves
``models.lora.checkpoint_state_dict``); the base model is read again from ``model.hf_path`` (or
``model.megatron_ckpt``) on resume. So the trainer state records the base's identity, its path,
dtype and a fingerprint of its weights (``models.lora.base_fingerprint``), with the adapters'
shape, and a resume checks them before it loads anything: adapters trained on other weights
would load without a complaint and be wrong.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from megatron_entropy.config import ModelConfig
from megatron_entropy.models.conversion import convert_checkpoint_to_hf
from megatron_entropy.models.lora import base_fingerprint, fingerprint_difference
from megatron_entropy.models.lora_export import export_merged, export_peft
from megatron_entropy.models.megatron_checkpoint import (CheckpointError, HF_SUBDIR, read_arch,
                                                         resolve_checkpoint_dir)
from megatron_entropy.models.run_checkpoints import TRAINER_STATE

STATE_KEY = "lora"  # the identity's key in trainer_state.json


def base_identity(model, model_cfg: ModelConfig, hf_dir: str) -> Optional[dict[str, Any]]:
    """The identity of a LoRA policy (None without adapters). A collective: every rank calls
    it, once, after the base weights are loaded (they never change)."""
    lora = model_cfg.lora
    if not lora.enabled:
        return None
    key = "model.megatron_ckpt" if model_cfg.megatron_ckpt else "model.hf_path"
    return {"rank": lora.rank, "alpha": lora.alpha, "targets": list(lora.targets),
            "base_key": key, "base": str(Path(model_cfg.megatron_ckpt or hf_dir).resolve()),
            "dtype": model_cfg.dtype, "fingerprint": base_fingerprint(model)}


def check_resume(state: dict[str, Any], identity: Optional[dict[str, Any]], path: Path) -> None:
    """Raise CheckpointError, naming the key, when the checkpoint at ``path`` (its trainer
    ``state``) cannot resume this run: LoRA against full weights either way, adapters of
    another shape or scale, or adapters trained on another base."""
    saved = state.get(STATE_KEY)
    if identity is None and saved is None:
        return
    if identity is None:
        raise CheckpointError(f"trainer.resume: {path} holds LoRA adapters (rank "
                              f"{saved['rank']}) on the base {saved['base']}, not every weight: "
                              f"set model.lora.rank={saved['rank']} to resume it")
    if saved is None:
        raise CheckpointError(f"model.lora.rank={identity['rank']}: {path} holds every weight "
                              "of a run without adapters; resume it with model.lora.rank=0")
    for key in ("rank", "alpha", "targets"):
        if saved[key] != identity[key]:
            raise CheckpointError(f"model.lora.{key}={identity[key]!r}, but {path} holds "
                                  f"adapters with {key} {saved[key]!r}")
    diff = fingerprint_difference(saved["fingerprint"], identity["fingerprint"])
    if diff:
        raise CheckpointError(
            f"{identity['base_key']}: the base model ({identity['base']}, {identity['dtype']}) "
            f"is not the one the adapters of {path} were trained on ({saved['base']}, "
            f"{saved['dtype']}): {diff}")


def recorded_identity(ckpt_dir: Path) -> Optional[dict[str, Any]]:
    """The LoRA identity the dist checkpoint ``ckpt_dir`` records in its trainer state; None
    for one that holds every weight (a full run's, or a converted model)."""
    state = Path(ckpt_dir) / TRAINER_STATE
    return json.loads(state.read_text()).get(STATE_KEY) if state.is_file() else None


def export_hf(ckpt: Union[str, Path], out: Union[str, Path],
              hf_config_from: Optional[Path] = None, base: Optional[Path] = None,
              dtype: Optional[str] = None, max_shard_bytes: int = 5 * 1024**3,
              overwrite: bool = False, progress: bool = False) -> dict[str, float]:
    """A checkpoint (a step folder, or a run's ``checkpoints/``) as an HF folder at ``out``: a
    LoRA run's adapters merged into its base (``base``, else the one the run recorded, checked
    against the run's fingerprint), any other checkpoint converted. Stats as the conversions'."""
    ckpt_dir = resolve_checkpoint_dir(ckpt)
    identity = recorded_identity(ckpt_dir)
    if identity is None:
        return convert_checkpoint_to_hf(ckpt_dir, out, hf_config_from=hf_config_from,
                                        dtype=dtype, max_shard_bytes=max_shard_bytes,
                                        overwrite=overwrite, progress=progress)
    return export_merged(ckpt_dir, out, identity, read_arch(ckpt_dir),
                         hf_config_from or ckpt_dir / HF_SUBDIR, base, dtype, max_shard_bytes,
                         overwrite)


def export_adapters(ckpt: Union[str, Path], out: Union[str, Path],
                    overwrite: bool = False) -> dict[str, float]:
    """A LoRA run's checkpoint's adapters as a PEFT adapter folder at ``out``; CheckpointError
    for a checkpoint that holds every weight."""
    ckpt_dir = resolve_checkpoint_dir(ckpt)
    identity = recorded_identity(ckpt_dir)
    if identity is None:
        raise CheckpointError(f"--ckpt {ckpt}: not a LoRA run's checkpoint (it holds every "
                              "weight: use mcore-to-hf)")
    return export_peft(ckpt_dir, out, identity, read_arch(ckpt_dir), overwrite)
