"""The run folder's own files beside the checkpoints: the resolved config of the run."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from megatron_entropy.config import Config


def save_run_config(cfg: Config, run_dir: Path) -> Path:
    """``run_dir/config.yaml`` := ``cfg``, for a run that has started. A different config.yaml
    already there (an earlier start of this run folder) is kept as ``config.<n>.yaml``, the next
    free ``n`` from 1."""
    path = run_dir / "config.yaml"
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)
    if path.is_file() and path.read_text() != text:
        n = 1
        while (run_dir / f"config.{n}.yaml").exists():
            n += 1
        os.replace(path, run_dir / f"config.{n}.yaml")
    tmp = run_dir / ".config.yaml.tmp"
    tmp.write_text(text)
    os.replace(tmp, path)
    return path
