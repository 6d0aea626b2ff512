"""``megatron-entropy study CONFIG``: the paper's comparison at toy scale, one training run at a
time (or ``study.jobs`` at once), then a report with the counterpart of each of the paper's
figures.

The run matrix comes from the config's ``study`` section (config/study.py):

- every arm of ``study.losses`` (a name and its overrides) at every seed of ``study.seeds``;
- the entropy bonus (``study.entropy_bonus``: arm ``base`` with ``key`` at each value) and the
  threshold sweep (``study.threshold_sweep``), each at the first ``study.sweep_seeds`` seeds.

A seed sets every key of ``study.seed_keys``. Each run is a normal ``train`` run of CONFIG with,
in this order: the ``study.quick`` overrides (with ``--quick``), the command line's overrides,
the arm's, the swept value, the seed, then the study's own (its folder ``OUT/runs/NAME``,
``analysis.entropy_change=true`` for the dH-vs-Cov figure, ``trainer.resume=auto``, no progress
bar). Two entries that resolve to the same settings (a sweep value equal to its arm's own) are
one run. Every run's config is resolved and checked before the first one starts.

Resumable: ``OUT/runs/NAME/study_run.json`` records a run's settings and attempts. A finished
run is not run again; an interrupted one is started again and resumes from its last checkpoint
through the trainer's own resume (so it loses at most ``trainer.save_interval`` steps); a run
folder made with other settings is an error naming the keys that differ. One study at a time
holds ``OUT/study.lock``; the lock is shared with the running ``train`` process, so a study
started again while a killed study's run is still finishing its step waits for it. A run whose
study dies gets SIGTERM (Linux), checkpoints at the end of its step and exits. Each attempt
records its OpenMP thread count, which a run that resumes keeps (study_runner.py).

This module plans the study and keeps each run's record; study_runner.py runs the plan and
writes the report.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_entropy.analysis.plots import read_metrics
from megatron_entropy.config.study import StudyConfig
from megatron_entropy.config import Config, ConfigError, load_config
from megatron_entropy.runtime.files import write_text_atomic
from megatron_entropy.models.run_checkpoints import (TRAINER_STATE, checkpoints_folder,
                                                     latest_checkpoint)

RUN_STATE_FILE = "study_run.json"
RUN_LOG_FILE = "train.log"
RUN_EVAL_FILE = "eval.json"  # megatron-entropy eval of the run's last checkpoint


class StudyError(RuntimeError):
    """A study that cannot go on (a run failed, a run folder holds another run's settings)."""


@dataclass
class StudyRun:
    name: str
    seed: int
    overrides: list[str]  # after CONFIG on the train command line
    own: list[str]  # the part that makes this run: the arm's, the swept value, the seed
    config: Config  # resolved
    # What the run stands for: ("loss", arm name) and/or ("entropy_bonus" | "threshold_sweep",
    # value); one run may serve several (deduplicated).
    roles: list[tuple[str, Any]] = field(default_factory=list)

    @property
    def run_dir(self) -> Path:
        return self.config.run_dir

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(json.dumps(settings_of(self.config), sort_keys=True,
                                         default=str).encode()).hexdigest()

    def arm(self) -> Optional[str]:
        return next((value for role, value in self.roles if role == "loss"), None)


@dataclass
class StudyPlan:
    config_path: str
    out: Path
    quick: bool
    study: StudyConfig
    runs: list[StudyRun]
    arms: list[str]  # the study.losses names in the comparison (after --losses)
    seeds: list[int]
    base: list[str] = field(default_factory=list)  # every run's overrides before its own
    # Arms whose tune_key the tuning runs choose: their runs at every seed come after
    # (analysis/study_tuning.py, ``add_tuned_runs``).
    pending: list[str] = field(default_factory=list)


def settings_of(cfg: Config) -> dict:
    """The settings that decide a run's numbers: all but where it logs and the study section."""
    d = cfg.to_dict()
    d.pop("study")
    d.pop("logging")
    return d


def _flat(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_value(cfg: Config, key: str) -> Any:
    """The value of a dotted key in a resolved config."""
    return _flat(cfg.to_dict())[key]


def _default_out(cfg: Config, quick: bool) -> Path:
    return Path(cfg.logging.runs_dir) / f"{cfg.logging.name}_study{'_quick' if quick else ''}"


def plan_study(config_path: str, overrides: list[str], out: Optional[str] = None,
               quick: bool = False, losses: Optional[list[str]] = None,
               seeds: Optional[list[int]] = None) -> StudyPlan:
    """Every run of the study, resolved and checked (ConfigError names the run and the key)."""
    first = load_config(config_path, overrides)
    base = [*(first.study.quick if quick else []), *overrides]
    resolved = load_config(config_path, base)
    st = resolved.study
    out_dir = Path(out) if out else _default_out(resolved, quick)
    out_dir = out_dir.resolve()
    arms = {arm.name: arm for arm in st.losses}
    chosen = losses if losses is not None else list(arms)
    unknown = [name for name in chosen if name not in arms]
    if unknown:
        raise ConfigError(f"--losses: {', '.join(unknown)} not in study.losses "
                          f"({', '.join(arms) or 'empty'})")
    seeds = seeds if seeds is not None else list(st.seeds)
    if not seeds:
        raise ConfigError("study.seeds is empty: the study has no run")

    entries: list[Entry] = []
    pending = [name for name in chosen if arms[name].tune_values and st.tune]
    for name in chosen:
        arm = arms[name]
        for value in arm.tune_values if name in pending else []:
            # The tuning runs; the arm's own runs wait for their choice (study_tuning.py).
            entries.append((f"{name}-tune{value:g}", [*arm.overrides, f"{arm.tune_key}={value!r}"],
                            st.tuning_seed, ("tune", f"{name}={value!r}")))
        fixed = [f"{arm.tune_key}={arm.tune_values[0]!r}"] if arm.tune_values else []
        for seed in [] if name in pending else seeds:
            entries.append((f"{name}-seed{seed}", [*arm.overrides, *fixed], seed,
                            ("loss", name)))
    for part in ("entropy_bonus", "threshold_sweep"):
        sweep = getattr(st, part)
        leaf = sweep.key.rsplit(".", 1)[-1]
        for value in sweep.values:
            for seed in seeds[:st.sweep_seeds]:
                entries.append((f"{sweep.base}-{leaf}{value:g}-seed{seed}",
                                [*arms[sweep.base].overrides, f"{sweep.key}={value!r}"], seed,
                                (part, value)))
    plan = StudyPlan(config_path, out_dir, quick, st, [], chosen, seeds, base, pending)
    add_runs(plan, entries)
    if not plan.runs:
        raise ConfigError("the study has no run: study.losses (or --losses) and the sweeps' "
                          "values are all empty")
    return plan


Entry = tuple[str, list[str], int, tuple[str, Any]]  # name, the arm's overrides, seed, role


def add_runs(plan: StudyPlan, entries: list[Entry]) -> list[StudyRun]:
    """Resolve and check ``entries`` into the plan's runs (ConfigError names the run and the
    key); an entry whose settings equal a planned run's only adds its role to it. Returns the
    runs added."""
    by_settings = {run.fingerprint: run for run in plan.runs}
    added = []
    for name, arm_overrides, seed, role in entries:
        own = [*arm_overrides, *(f"{k}={seed}" for k in plan.study.seed_keys)]
        run_overrides = [*plan.base, *own,
                         f"logging.runs_dir={plan.out / 'runs'}", f"logging.name={name}",
                         "logging.progress_bar=false", "analysis.entropy_change=true",
                         "trainer.resume=auto"]
        try:
            cfg = load_config(plan.config_path, run_overrides)
        except ConfigError as e:
            raise ConfigError(f"study run {name}: {e}") from None
        run = StudyRun(name, seed, run_overrides, own, cfg, [role])
        same = by_settings.get(run.fingerprint)
        if same is not None:
            same.roles.append(role)
            continue
        by_settings[run.fingerprint] = run
        plan.runs.append(run)
        added.append(run)
    return added


# ------------------------------------------------------------------------------ run records


def read_run_state(run: StudyRun) -> Optional[dict]:
    path = run.run_dir / RUN_STATE_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StudyError(f"{path} is not valid JSON ({e}); remove it to run {run.name} again "
                         "from its checkpoints") from None


def write_run_state(run: StudyRun, state: dict) -> None:
    """Record ``state`` as the run's study_run.json, atomically."""
    write_text_atomic(run.run_dir / RUN_STATE_FILE, json.dumps(state, indent=1, default=str),
                      (run.run_dir / RUN_STATE_FILE).with_suffix(".tmp"))


def _differences(old: dict, new: dict) -> str:
    a, b = _flat(old), _flat(new)
    # A key added to the config after the run was recorded, at its default, is the behaviour
    # the run had: a newer version of the package reads an older study folder.
    defaults = _flat(json.loads(json.dumps(settings_of(Config()), default=str)))
    keys = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)
                  and not (k not in a and k in defaults and b[k] == defaults[k]))
    shown = ", ".join(f"{k} ({a.get(k)!r} -> {b.get(k)!r})" for k in keys[:5])
    return shown + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def check_same_run(run: StudyRun, state: dict) -> None:
    """Raise StudyError, naming the keys that differ, when ``state`` (the run folder's record)
    was made with other settings than ``run``."""
    if state.get("fingerprint") == run.fingerprint:
        return
    diff = _differences(state.get("settings", {}), json.loads(json.dumps(
        settings_of(run.config), default=str)))
    if not diff:
        return
    raise StudyError(f"{run.run_dir} holds a run made with other settings: {diff}; "
                     "remove that folder (or choose another --out) to run it with these")


def run_wall_seconds(state: Optional[dict]) -> float:
    """Wall time of a run's recorded attempts (an attempt killed with its study is not)."""
    return sum(a.get("wall_s") or 0.0 for a in (state or {}).get("attempts", []))


def elapsed_seconds(states: list[Optional[dict]]) -> float:
    """The study's run time: the union of its runs' recorded attempts (runs trained at once,
    ``study.jobs``, count once); an attempt recorded without its start time counts whole."""
    spans, loose = [], 0.0
    for state in states:
        for a in (state or {}).get("attempts", []):
            if a.get("start_unix") is None:
                loose += a.get("wall_s") or 0.0
            elif a.get("wall_s"):
                spans.append((a["start_unix"], a["start_unix"] + a["wall_s"]))
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        total += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    return total + loose


def checkpoint_step(run_dir: Path) -> int:
    """The step of the checkpoint the trainer would resume from (0: none)."""
    latest = latest_checkpoint(checkpoints_folder(run_dir))
    return int(json.loads((latest / TRAINER_STATE).read_text())["step"]) if latest else 0


def last_step(run_dir: Path) -> int:
    try:
        records = read_metrics(run_dir)
    except FileNotFoundError:
        return 0
    return max((int(r.get("step", 0)) for r in records), default=0)
