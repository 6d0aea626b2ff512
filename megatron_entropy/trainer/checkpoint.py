"""Training checkpoints: model + optimizer (Megatron dist_checkpointing) + trainer state, atomic.
A LoRA run's checkpoints hold its adapters and their optimizer only (models/lora.py,
trainer/lora_run.py).

Layout of ``<run_dir>/checkpoints/``::

    step_00000010/           one complete checkpoint
        (dist_checkpointing files)  keys "model" and "optimizer": reshardable to any TP/PP layout
        trainer_state.json   step, data position, engine seed, LR scheduler, metrics so far
        rng_rank_00000.pt    per-rank python/numpy/torch RNG states (restored on the same layout)
        arch.json, hf/       the architecture and HF config/tokenizer (tools/ convert it back)
    latest                   name of the newest complete checkpoint

A checkpoint is written under ``.step_XXXXXXXX.tmp``, verified (every data file as long as its
metadata says, trainer_state.json readable) and renamed when every rank has finished, and ``latest``
is replaced atomically after that, so "latest" never points at a half-written folder. Only the
newest ``keep_last`` are kept. On resume a checkpoint damaged since (a file deleted or truncated) is
skipped with a warning naming the file, for the newest intact one.

dist_checkpointing writes each rank's files from processes it forks; those die with their rank
(``_writers_die_with_rank``) instead of outliving a killed rank, deadlocked on their result queue.
"""

from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, tensor_parallel
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, merge
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megatron_entropy.models.lora import checkpoint_state_dict, load_checkpoint_state
from megatron_entropy.models.megatron_checkpoint import (CheckpointError, check_checkpoint_files,
                                                         read_latest, write_checkpoint_metadata)
from megatron_entropy.models.run_checkpoints import (TRAINER_STATE, checkpoints_folder,
                                                     latest_checkpoint, verify_checkpoint)
from megatron_entropy.models.sharding import unwrap_model
from megatron_entropy.runtime.files import disk_error, write_text_atomic
from megatron_entropy.runtime.processes import die_with_parent
from megatron_entropy.runtime import preemption
from megatron_entropy.trainer.optimizer_chains import (members, rekeyed_to_saved, saved_members,
                                                       with_keys)


# The pid of this process while it saves, else None: processes forked meanwhile are writers.
_saving_pid: Optional[int] = None


def _writer_after_fork() -> None:
    """In a process forked during a save (a dist_checkpointing writer): die with the rank, and
    answer signals by their default action rather than the trainer's record-only handler."""
    global _saving_pid
    parent, _saving_pid = _saving_pid, None
    if parent is None:
        return
    die_with_parent(parent=parent)
    for sig in preemption.SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


os.register_at_fork(after_in_child=_writer_after_fork)


def _results_queue_in_process() -> None:
    """dist_checkpointing passes the writers' results to the saving process through a queue
    that it serves from a spawned Manager process, made for async saves (the results come from
    another process). Our saves are synchronous: the results are put and taken in this process,
    so a plain queue serves, and no Manager is left to outlive a killed rank (it does not notice
    its parent's death, and keeps multiprocessing's resource tracker alive with it)."""
    if getattr(filesystem_async, "_results_queue", False) is None:
        filesystem_async._results_queue = queue.Queue()


@contextmanager
def _writers_die_with_rank():
    global _saving_pid
    _results_queue_in_process()
    _saving_pid = os.getpid()
    try:
        yield
    finally:
        _saving_pid = None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


# The distributed optimizer's state in the canonical per-parameter layout (gathered over DP to
# save, sliced per rank to load): reshardable across TP/PP/DP. megatron-core 0.16's default,
# fully_sharded_model_space, fails to save (flattened ShardedTensors); plain optimizers ignore it.
_OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
_RECHAINED = "optimizer_of_this_chain"  # the load request of optimizer_chains.py


def _is_distributed(optimizer) -> bool:
    """Whether ``optimizer`` is Megatron's distributed optimizer (alone or chained)."""
    return any(isinstance(o, DistributedOptimizer)
               for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _has_optimizer_state(optimizer) -> bool:
    """False until the first optimizer step (Adam creates its moments lazily)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return any(len(state) for opt in inner for state in opt.optimizer.state.values())


def _rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()

    state["megatron_tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

    tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron_tracker"])


def resume_checkpoint(resume: str, manager: "CheckpointManager") -> Optional[Path]:
    """The checkpoint ``trainer.resume`` names: None for 'none', the newest intact one of the
    run for 'auto', else a checkpoint folder, or a checkpoints/ folder or run folder standing
    for its latest (as `convert` takes them); CheckpointError naming the setting if it is not
    one."""
    if resume == "none":
        return None
    if resume == "auto":
        return manager.latest()
    path = Path(resume)
    try:
        for root in (path, path / "checkpoints"):
            if (root / "latest").is_file():
                path = read_latest(root)
                break
        verify_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"trainer.resume={resume!r}: {e}") from None
    return path


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int = 2) -> None:
        self.root = checkpoints_folder(run_dir)
        self.keep_last = keep_last

    def latest(self) -> Optional[Path]:
        """The newest intact checkpoint of the run (models/run_checkpoints.py)."""
        return latest_checkpoint(self.root)

    def save(self, step: int, model_chunks: list, optimizer, trainer_state: dict[str, Any],
             arch, hf_dir: str) -> Path:
        """Collective: every rank calls it. Returns the final checkpoint folder. A write that
        fails leaves nothing of this checkpoint behind; a full or unwritable disk is raised as
        an OSError naming the path and the errno (runtime/files.py)."""
        tmp = self.root / f".step_{step:08d}.tmp"
        try:
            return self._save(step, tmp, model_chunks, optimizer, trainer_state, arch, hf_dir)
        except BaseException as e:  # torch's CheckpointException is a BaseException
            problem = disk_error(e, tmp)  # before the partial files that fill the disk go
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            if problem is None:
                raise
            raise problem from e

    def _save(self, step: int, tmp: Path, model_chunks: list, optimizer,
              trainer_state: dict[str, Any], arch, hf_dir: str) -> Path:

        name = f"step_{step:08d}"
        final = self.root / name
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        _barrier()
        model_sd = checkpoint_state_dict(model_chunks)  # a LoRA model's: its adapters
        sharded = {"model": model_sd}
        # Before the first update there is no optimizer state to keep: a fresh one equals it.
        with_optimizer = _has_optimizer_state(optimizer)
        if with_optimizer:
            sharded["optimizer"] = optimizer.sharded_state_dict(model_sd,
                                                                metadata=_OPTIMIZER_METADATA)
        # Its writer processes and Manager must not die of a signal, but must die with this rank.
        with preemption.held(), _writers_die_with_rank():
            dist_checkpointing.save(sharded, str(tmp))
        torch.save(_rng_state(), tmp / f"rng_rank_{_rank():05d}.pt")
        _barrier()
        if _rank() == 0:
            write_checkpoint_metadata(tmp, arch, hf_dir)
            layout = _layout()
            (tmp / TRAINER_STATE).write_text(json.dumps(
                {**trainer_state, "layout": layout, "optimizer_state": with_optimizer,
                 "distributed_optimizer": _is_distributed(optimizer)}, indent=1))
            verify_checkpoint(tmp)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            write_text_atomic(self.root / "latest", name, self.root / "latest.tmp")
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
        path = Path(path)
        state = verify_checkpoint(path)
        model = unwrap_model(model_chunks)
        model_sd = checkpoint_state_dict(model)
        sharded: dict[str, Any] = {"model": model_sd}
        load_optimizer = load_optimizer and state.get("optimizer_state", True)
        # A checkpoint from before the format was recorded is in this run's format.
        converting = load_optimizer and \
            state.get("distributed_optimizer", _is_distributed(optimizer)) != \
            _is_distributed(optimizer)
        rechained = None
        if load_optimizer:
            request = optimizer.sharded_state_dict(model_sd, is_loading=True,
                                                   metadata=_OPTIMIZER_METADATA)
            sharded["optimizer"] = request
            if converting:
                sharded["optimizer"], model_weights = _in_saved_format(request, optimizer)
            else:
                # Saved by another chain of optimizers (another EP: optimizer_chains.py): its
                # tensors alone, under a key of their own, apart from the saved chain's common
                # state, which dist_checkpointing merges into "optimizer".
                rechained = rekeyed_to_saved(request, set(check_checkpoint_files(path)
                                                          .state_dict_metadata))
                if rechained is not None:
                    del sharded["optimizer"]
                    sharded[_RECHAINED] = rechained
        loaded = dist_checkpointing.load(sharded, str(path))
        load_checkpoint_state(model, loaded["model"])
        if converting:
            if model_weights is not None:
                merge(loaded["optimizer"], dist_checkpointing.load(model_weights, str(path)))
            optimizer.load_state_dict(_converted_optimizer_state(
                request, loaded["optimizer"], optimizer, _saved_adam_step(loaded["optimizer"])))
        elif rechained is not None:
            optimizer.load_state_dict(_converted_optimizer_state(
                request, loaded[_RECHAINED], optimizer, _saved_adam_step(loaded["optimizer"])))
        elif load_optimizer:
            optimizer.load_state_dict(loaded["optimizer"])
        else:
            optimizer.reload_model_params()
        rng_file = path / f"rng_rank_{_rank():05d}.pt"
        # The expert-parallel RNG streams are per EP rank (a layout from before EP or CP was
        # recorded: EP = CP = 1).
        if {"expert": 1, "context": 1, **state.get("layout", {})} == _layout() and \
                rng_file.is_file():
            _set_rng_state(torch.load(rng_file, weights_only=False))
        return state


# The other optimizer's checkpoint: Adam's moments are saved under the same keys by both
# (``optimizer.state.exp_avg.<param>``), the fp32 main weights under
# ``optimizer.state.param.<param>`` by the distributed one, ``optimizer.state.fp32_param.<param>``
# by the plain mixed-precision one; a plain fp32 optimizer's main weights are the model's.
_DISTRIBUTED_MAIN, _PLAIN_MAIN = "optimizer.state.param.", "optimizer.state.fp32_param."


def _inner_optimizers(optimizer) -> list:
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(inner) != 1:
        raise CheckpointError(
            f"the checkpoint's optimizer state is in the other format (trainer."
            f"distributed_optimizer was switched) and this model has {len(inner)} optimizers, "
            "which the conversion does not cover: resume with the setting it was saved with")
    return inner


def _in_saved_format(request: Any, optimizer) -> tuple[Any, Any]:
    """This optimizer's load request with its main weights' keys renamed to those the other
    optimizer saved them under, to load from the checkpoint into this optimizer's layout (the
    request itself is kept), and apart from it (None if none) the main weights that are the
    model's own (a plain fp32 optimizer's): the model's key once more in the same load would
    overlap its shards."""
    config = _inner_optimizers(optimizer)[0].config
    if _is_distributed(optimizer):
        ours, theirs = _DISTRIBUTED_MAIN, _PLAIN_MAIN if config.bf16 or config.fp16 else ""
    else:
        ours, theirs = _PLAIN_MAIN, _DISTRIBUTED_MAIN

    renamed = with_keys(request, lambda key: theirs + key[len(ours):] if key.startswith(ours)
                        else None)
    if theirs:
        return renamed, None
    model_weights, rest = extract_matching_values(  # renamed to the model's keys
        renamed, lambda v: isinstance(v, ShardedBase) and not v.key.startswith("optimizer."))
    return rest, model_weights


def _plain_inner(state: dict) -> dict:
    """The torch optimizer's state inside a plain optimizer's (mixed precision nests it)."""
    return state["optimizer"] if "optimizer" in state else state


def _saved_adam_step(saved: dict) -> float:
    """Adam's step in an optimizer state of either format: the distributed optimizer keeps it
    in its param groups, the plain one as ``state.common_step`` (torch's Adam) or in its param
    groups (apex/TE's fused Adam)."""
    groups = []
    for member in saved_members(saved):  # a chain's members step together
        if "param_state_sharding_type" in member:
            groups += member["optimizer"]["param_groups"]
        else:
            inner = _plain_inner(member)
            groups += [{"step": inner["state"]["common_step"]}] \
                if "common_step" in inner.get("state", {}) else inner["param_groups"]
    steps = {float(g["step"]) for g in groups if "step" in g}
    if len(steps) != 1:
        raise CheckpointError(f"the checkpoint's optimizer records several Adam steps {steps}")
    return steps.pop()


def _converted_optimizer_state(request: dict, loaded: dict, optimizer, step: float) -> dict:
    """The state ``optimizer.load_state_dict`` takes, in its own format: its load request with
    each sharded entry replaced by the tensor loaded from the other format or chain, and the
    saved Adam ``step`` (the rest is this run's: param groups, whose rates the LR schedule sets,
    and an fp16 loss scale, which starts over)."""
    def fill(template: Any, got: Any) -> Any:
        if isinstance(template, ShardedBase):
            return got
        if isinstance(template, LocalNonpersistentObject):
            return template.unwrap()
        if isinstance(template, dict):
            return {k: fill(v, got.get(k) if isinstance(got, dict) else None)
                    for k, v in template.items()}
        if isinstance(template, list):
            return [fill(v, got[i] if isinstance(got, list) and i < len(got) else None)
                    for i, v in enumerate(template)]
        return template

    state = fill(request, loaded)
    for member, part in members(state, optimizer):
        if _is_distributed(member):
            for group in part["optimizer"]["param_groups"]:
                group["step"] = step
        else:
            inner = _plain_inner(part)
            inner["state"]["common_step"] = torch.tensor(step)
            for group in inner["param_groups"]:
                if "step" in group:  # apex/TE's fused Adam counts here
                    group["step"] = int(step)
    return state


def _layout() -> dict[str, int]:

    return {"world": dist.get_world_size() if dist.is_initialized() else 1,
            "tensor": ps.get_tensor_model_parallel_world_size(),
            "pipeline": ps.get_pipeline_model_parallel_world_size(),
            "expert": ps.get_expert_model_parallel_world_size(),
            "context": ps.get_context_parallel_world_size()}
