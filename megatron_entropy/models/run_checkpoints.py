"""A training run's checkpoints found and verified from their files, without Megatron: the
trainer resumes from ``latest_checkpoint`` (trainer/checkpoint.py writes the folders), the study
reads how far a run got (analysis/study.py).

``<run_dir>/checkpoints/step_XXXXXXXX/`` holds one checkpoint (dist_checkpointing's files and
``trainer_state.json``); ``checkpoints/latest`` names the newest complete one."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from megatron_entropy.models.megatron_checkpoint import (CheckpointError, check_checkpoint_files,
                                                         read_latest)

TRAINER_STATE = "trainer_state.json"
COMMON_FILES = ("metadata.json", "common.pt")  # dist_checkpointing's, beside .metadata


def checkpoints_folder(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """The trainer state of checkpoint folder ``path`` after checking its files: every data file
    as long as the metadata says, trainer_state.json readable. Raises CheckpointError naming the
    bad file."""
    state_file = path / TRAINER_STATE
    if not state_file.is_file():
        raise CheckpointError(f"{state_file} is missing")
    try:
        state = json.loads(state_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{state_file} is unreadable ({e})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise CheckpointError(f"{state_file} holds no training state")
    for name in COMMON_FILES:
        if not (path / name).is_file():
            raise CheckpointError(f"{path / name} is missing")
    try:
        check_checkpoint_files(path)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged .metadata fails inside torch's reader
        raise CheckpointError(f"{path / '.metadata'} is unreadable ({type(e).__name__}: {e})") \
            from None
    return state


def latest_checkpoint(root: Path) -> Optional[Path]:
    """The newest intact checkpoint of a ``checkpoints/`` folder: the one ``latest`` names, else
    (it was damaged since it was written: a warning names the bad file) the newest older one
    that verifies. None when there is no checkpoint; CheckpointError when none of them is
    intact. A damaged ``latest`` (no checkpoint name in it) is a warning, as one that names a
    damaged checkpoint."""
    if not (root / "latest").is_file():
        return None
    problems = []
    try:
        named = [read_latest(root)]
    except CheckpointError as e:  # the pointer is damaged: every checkpoint is a candidate
        problems.append(str(e))
        named = []
    candidates = named + sorted((p for p in root.glob("step_*")
                                 if p.is_dir() and (not named or p.name < named[0].name)),
                                reverse=True)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if problems and candidates and rank0:
        print(f"warning: {problems[0]}; resuming from the newest intact checkpoint",
              file=sys.stderr, flush=True)
    for path in candidates:
        try:
            verify_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            if rank0:
                print(f"warning: checkpoint {path} is damaged, not resuming from it: {e}",
                      file=sys.stderr, flush=True)
            continue
        return path
    raise CheckpointError(f"no intact checkpoint in {root} to resume from: "
                          + "; ".join(problems) + " (set trainer.resume=none to start over)")
