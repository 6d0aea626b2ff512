"""The run folder's own files beside the checkpoints: the resolved config of the run."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from megatron_entropy.config import Config
from megatron_entropy.runtime.files import write_text_atomic


def save_run_config(cfg: Config, run_dir: Path) -> Path:
    """``run_dir/config.yaml`` := ``cfg``, for a run that has started. A different config.yaml
    already there (an earlier start of this run folder) is kept as ``config.<n>.yaml``, the next
    free ``n`` from 1."""
    path = run_dir / "config.yaml"
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False)

    def keep_earlier() -> None:
        if path.is_file() and path.read_text() != text:
            n = 1
            while (run_dir / f"config.{n}.yaml").exists():
                n += 1
            os.replace(path, run_dir / f"config.{n}.yaml")

    # Once the new text is on disk: a write that fails (a full disk) leaves the earlier
    # config.yaml where it was, and no .config.yaml.tmp.
    return write_text_atomic(path, text, before_replace=keep_earlier)
