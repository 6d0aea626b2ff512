"""Training checkpoints: model + optimizer (Megatron dist_checkpointing) + trainer state, atomic.

Layout of ``<run_dir>/checkpoints/``::

    step_00000010/           one complete checkpoint
        (dist_checkpointing files)  keys "model" and "optimizer": reshardable to any TP/PP layout
        trainer_state.json   step, data position, engine seed, LR scheduler, metrics so far
        rng_rank_00000.pt    per-rank python/numpy/torch RNG states (restored on the same layout)
        arch.json, hf/       the architecture and HF config/tokenizer (tools/ convert it back)
    latest                   name of the newest complete checkpoint

A checkpoint is written under ``.step_XXXXXXXX.tmp`` and renamed when every rank has finished, and
``latest`` is replaced atomically after that, so "latest" never points at a half-written folder. Only
the newest ``keep_last`` are kept.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_entropy.models.megatron_checkpoint import write_checkpoint_metadata
from megatron_entropy.trainer import preemption


def _unwrap(chunk):
    return chunk.module if hasattr(chunk, "module") else chunk


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# The distributed optimizer's state in the canonical per-parameter layout (gathered over DP to
# save, sliced per rank to load): reshardable across TP/PP/DP. megatron-core 0.16's default,
# fully_sharded_model_space, fails to save (flattened ShardedTensors); plain optimizers ignore it.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}


def _has_optimizer_state(optimizer) -> bool:
    """False until the first optimizer step (Adam creates its moments lazily)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(state) for opt in inner for state in opt.optimizer.state.values())


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    from megatron.core import tensor_parallel

    state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    from megatron.core import tensor_parallel

    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int = 2) -> None:
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def latest(self) -> Optional[Path]:
        pointer = self.root / "latest"
        if not pointer.is_file():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / "trainer_state.json").is_file():
            raise RuntimeError(f"{pointer} names {path}, which is not a complete checkpoint")
        return path

    def save(self, step: int, model_chunks: list, optimizer, trainer_state: dict[str, Any],
             arch, hf_dir: str) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint folder."""
        from megatron.core import dist_checkpointing

        name = f"step_{step:08d}"
        final = self.root / name
        tmp = self.root / f".{name}.tmp"
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd = _unwrap(model_chunks[0]).sharded_state_dict()
        sharded = {"model": model_sd}
        # Before the first update there is no optimizer state to keep: a fresh one equals it.
        with_optimizer = _has_optimizer_state(optimizer)
        if with_optimizer:
            sharded["optimizer"] = optimizer.sharded_state_dict(model_sd,
                                                                metadata=_OPTIMIZER_METADATA)
        with preemption.held():  # its writer processes and Manager must not die of a signal
            dist_checkpointing.save(sharded, str(tmp))
        torch.save(_rng_state(), tmp / f"rng_rank_{_rank():05d}.pt")
        _barrier()
        if _rank() == 0:
            write_checkpoint_metadata(tmp, arch, hf_dir)
            layout = _layout()
            (tmp / "trainer_state.json").write_text(json.dumps(
                {**trainer_state, "layout": layout, "optimizer_state": with_optimizer}, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer_tmp = self.root / "latest.tmp"
            pointer_tmp.write_text(name)
            os.replace(pointer_tmp, self.root / "latest")
            self._prune()
        _barrier()
        return final

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in done[:-self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    def load(self, path: Path, model_chunks: list, optimizer, load_optimizer: bool = True
             ) -> dict[str, Any]:
        """Collective. Loads model (+ optimizer) resharded to this layout; restores RNG states
        when the layout is the one that was saved. Returns the trainer state."""
        from megatron.core import dist_checkpointing

        path = Path(path)
        state_file = path / "trainer_state.json"
        if not state_file.is_file():
            raise FileNotFoundError(f"{path} is not a training checkpoint (no trainer_state.json)")
        state = json.loads(state_file.read_text())
        model = _unwrap(model_chunks[0])
        model_sd = model.sharded_state_dict()
        sharded: dict[str, Any] = {"model": model_sd}
        load_optimizer = load_optimizer and state.get("optimizer_state", True)
        if load_optimizer:
            sharded["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                                metadata=_OPTIMIZER_METADATA)
        loaded = dist_checkpointing.load(sharded, str(path))
        model.load_state_dict(loaded["model"])
        if load_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
        else:
            optimizer.reload_model_params()
        rng_file = path / f"rng_rank_{_rank():05d}.pt"
        if state.get("layout") == _layout() and rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return state


def _layout() -> dict[str, int]:
    from megatron.core import parallel_state as ps

    return {"world": dist.get_world_size() if dist.is_initialized() else 1,
            "tensor": ps.get_tensor_model_parallel_world_size(),
            "pipeline": ps.get_pipeline_model_parallel_world_size()}
