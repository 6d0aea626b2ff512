"""Disk: the engine's servers reload an HF folder the trainer writes, one folder per version.

Each stage's leader writes its own stage's tensors (``model-stage{s}-0000i.safetensors``, one
tensor held at a time) into ``.weights-v{N}.partial`` beside the final folder; nothing crosses
stages. The first stage's leader then learns what every stage wrote (one small gather), checks
the whole set against the architecture (names and shapes, from the files' headers), adds the
index, config and tokenizer, and renames the folder to ``weights-v{N}``: a reader sees a
complete folder or none. Only then is the engine told to reload it; the previous version's
folder is removed once the engine holds the new one.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Union

import torch.distributed as dist

from megatron_entropy.models.arch import load_arch
from megatron_entropy.models.hf_io import copy_hf_metadata, write_weight_files, write_weight_index
from megatron_entropy.models.hf_names import check_hf_checkpoint
from megatron_entropy.rollout.base import ReloadsFolders
from megatron_entropy.weight_sync.base import VersionFolders, WeightSync
from megatron_entropy.weight_sync.stream import StageStream


class DiskSync(WeightSync):
    ENDPOINTS = ReloadsFolders

    def __init__(self, engine, sync_root: Union[str, Path], hf_dir: Union[str, Path]):
        super().__init__(engine)
        self.folders = VersionFolders(sync_root, "weights")
        self.hf_dir = Path(hf_dir)
        self.arch = load_arch(hf_dir)

    def sync_stream(self, stream: StageStream, version: int) -> dict[str, float]:
        engine = self._engine_here(stream)
        if not stream.leader:
            stream.drain()
            return {}
        start = time.monotonic()
        # The first stage empties the partial folder that every stage writes into.
        folder, partial = (self.folders.fresh if stream.first else self.folders.paths)(version)
        if stream.group is not None and stream.stages > 1:
            dist.barrier(group=stream.group)
        written: tuple = ({}, 0, None)
        try:
            written = (*self._write_stage(stream, partial), None)
        except Exception as e:  # reported by the first stage, with every stage's outcome
            stream.drain()
            written = ({}, 0, f"{type(e).__name__}: {e}")
        stages = [written]
        if stream.group is not None and stream.stages > 1:
            stages = [None] * stream.stages if stream.first else None
            dist.gather_object(written, stages, dst=stream.leader_ranks[0], group=stream.group)
        if not stream.first:
            if written[2]:
                raise RuntimeError(f"weight sync v{version}: stage {stream.stage} could not "
                                   f"write its weights: {written[2]}")
            return {}
        failed = {s: err for s, (_, _, err) in enumerate(stages) if err}
        try:
            if failed:
                raise RuntimeError(f"weight sync v{version}: stages {sorted(failed)} could not "
                                   f"write their weights into {partial}: {failed}")
            weight_map = {name: f for wm, _, _ in stages for name, f in wm.items()}
            total = sum(nbytes for _, nbytes, _ in stages)
            check_hf_checkpoint({n: partial / f for n, f in weight_map.items()}, self.arch,
                                partial)
            write_weight_index(partial, weight_map, total)
            copy_hf_metadata(self.hf_dir, partial)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return {**self.folders.deliver(partial, folder, version, engine.reload_from_folder, start),
                "weight_sync/bytes": float(total)}

    def _write_stage(self, stream: StageStream, partial: Path) -> tuple[dict[str, str], int]:
        """This stage's files; a tied model's ``lm_head.weight`` (HF's state dict lists it, the
        folder holds the embedding once) is left out."""
        tied = self.arch.tie_word_embeddings
        specs = [s for s in stream.specs if not (tied and s[0] == "lm_head.weight")]
        tensors = ((n, t) for n, t in stream.tensors if not (tied and n == "lm_head.weight"))
        return write_weight_files(tensors, partial, f"model-stage{stream.stage:03d}", specs)
