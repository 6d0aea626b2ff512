"""Step metrics: ``metrics.jsonl`` (one JSON object per step), console progress, optional
TensorBoard / wandb. Only global rank 0 writes."""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

from tqdm import tqdm

from megatron_entropy.config import LoggingConfig

# Shown in the progress bar, in this order, when present.
PROGRESS_KEYS = (("acc/mean", "acc"), ("reward/mean", "R"), ("entropy/seq_mean", "H"),
                 ("val/acc/mean", "val"), ("loss/selected_frac", "sel"), ("grad_norm", "gn"))


class PhaseTimer:
    """Wall-clock seconds per phase of a step: ``with timer("rollout"): ...``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def as_metrics(self) -> dict[str, float]:
        return {f"time/{k}": v for k, v in self.seconds.items()}


def _clean(value: Any) -> Any:
    """JSON-safe: floats stay floats, NaN/inf become null (never silently 0)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    """metrics.jsonl of ``run_dir`` and the backends that ``settings``, the ``logging`` section,
    turns on (progress bar, tensorboard, wandb); only where ``enabled`` (rank 0)."""

    def __init__(self, run_dir: Path, total_steps: int, enabled: bool,
                 settings: Optional[LoggingConfig] = None, config: Optional[dict] = None,
                 start_step: int = 0) -> None:
        settings = settings or LoggingConfig()
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._bar = None
        self._shown: dict[str, str] = {}  # the bar's numbers: the latest of each (val persists)
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_after(start_step)
        # Deferred imports: tensorboard and wandb are optional packages, loaded when asked for.
        if settings.progress_bar:
            self._bar = tqdm(total=total_steps, initial=start_step, desc="RL steps",
                             dynamic_ncols=True)
        if settings.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
        if settings.wandb:
            import wandb as wandb_lib

            self._wandb = wandb_lib.init(project=settings.wandb_project,
                                         name=Path(run_dir).name,
                                         config=config, dir=str(run_dir), resume="allow")

    def _truncate_after(self, step: int) -> None:
        # A resumed run replays steps after its checkpoint: drop their old lines so each step
        # appears once. A run that starts at step 0 (no checkpoint yet) replays everything,
        # the validation before training included. A line a kill or a full disk cut short is
        # dropped with a warning.
        if not self.path.is_file():
            return
        if step == 0:
            self.path.write_text("")
            return
        kept = []
        for number, line in enumerate(self.path.read_text(errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            if not isinstance(record, dict):
                print(f"warning: {self.path}:{number}: dropped an incomplete line (the run was "
                      "killed while writing it?)", file=sys.stderr, flush=True)
                continue
            if record.get("step", 0) <= step:
                kept.append(line)
        self.path.write_text("".join(line + "\n" for line in kept))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _clean(v) for k, v in sorted(metrics.items())}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(record, step=step)
        if self._bar is not None:
            self._shown.update({short: f"{record[k]:.3g}" for k, short in PROGRESS_KEYS
                                if isinstance(record.get(k), (int, float))})
            self._bar.set_postfix({short: self._shown[short] for _, short in PROGRESS_KEYS
                                   if short in self._shown}, refresh=False)
            # The bar counts training steps: a validation before the first (step 0) only
            # refreshes the numbers shown.
            self._bar.update(max(step - self._bar.n, 0))

    def write(self, message: str) -> None:
        """A line on the console that does not break the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
