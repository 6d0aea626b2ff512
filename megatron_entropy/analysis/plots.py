"""Read a run's ``metrics.jsonl`` and draw it: entropy, reward/accuracy and covariance over steps,
training health, and reward against entropy with the fitted entropy law.

Missing keys are skipped (a figure with nothing to show is not written), so a run of any
algorithm, or one still in progress, plots what it has.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

from megatron_entropy.analysis.entropy_law import EntropyLawFit, fit_entropy_law

# Deferred import: matplotlib (~1 s) loads when a figure is drawn: the CLI imports this module
# for `--help` and `fit`, which draw none.

METRICS_FILE = "metrics.jsonl"
# Preference order of the law's axes: the paper plots validation accuracy against the mean of
# per-sequence entropies of the training rollouts.
ENTROPY_KEYS = ("entropy/seq_mean", "entropy/token_mean")
PERFORMANCE_KEYS = ("val/acc/mean", "acc/mean", "reward/mean")


def read_metrics(run_dir: Union[str, Path]) -> list[dict]:
    """One dict per step, sorted by step; a step logged twice (a resumed run) keeps its last
    record; an unreadable line (e.g. one being written) is skipped."""
    run_dir = Path(run_dir)
    path = run_dir / METRICS_FILE if run_dir.is_dir() else run_dir
    if not path.is_file():
        raise FileNotFoundError(f"no {METRICS_FILE} in {str(run_dir)!r}: pass a run folder "
                                "(runs/<name>) or its metrics file")
    by_step: dict[float, dict] = {}
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                by_step[record.get("step", i)] = record
    return [by_step[s] for s in sorted(by_step)]


def series(records: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) of the records that have a finite number under ``key``."""
    steps, values = [], []
    for i, r in enumerate(records):
        v = r.get(key)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            steps.append(r.get("step", i))
            values.append(float(v))
    return steps, values


def _keys(records: Sequence[dict]) -> set[str]:
    return {k for r in records for k in r}


def paired_series(records: Sequence[dict], x_key: str, y_key: str
                  ) -> tuple[list[float], list[float], list[float]]:
    """(steps, x values, y values) of the records with a finite number under both keys."""
    steps, xs, ys = [], [], []
    for i, r in enumerate(records):
        x, y = r.get(x_key), r.get(y_key)
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
               for v in (x, y)):
            steps.append(r.get("step", i))
            xs.append(float(x))
            ys.append(float(y))
    return steps, xs, ys


def law_points(records: Sequence[dict], entropy_key: Optional[str] = None,
               performance_key: Optional[str] = None,
               min_points: int = 3) -> tuple[list[float], list[float], str, str]:
    """(entropy, performance, entropy_key, performance_key) at the steps that have both. Without
    explicit keys, the first of ENTROPY_KEYS / PERFORMANCE_KEYS with ``min_points`` pairs."""
    keys = _keys(records)
    h_opts = [entropy_key] if entropy_key else [k for k in ENTROPY_KEYS if k in keys]
    r_opts = [performance_key] if performance_key else [k for k in PERFORMANCE_KEYS if k in keys]
    best: tuple[list[float], list[float], str, str] = ([], [], "", "")
    for rk in r_opts:
        for hk in h_opts:
            _, h, r = paired_series(records, hk, rk)
            if len(h) >= min_points:
                return h, r, hk, rk
            if len(h) > len(best[0]):
                best = (h, r, hk, rk)
    return best


def _plot_lines(ax, records, keys: Sequence[str], marker_keys: Sequence[str] = ()) -> int:
    drawn = 0
    for key in keys:
        steps, values = series(records, key)
        if steps:
            ax.plot(steps, values, marker="o" if key in marker_keys else None,
                    markersize=3, label=key)
            drawn += 1
    if drawn:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return drawn


def _draw_entropy_law(ax, records: list[dict], name: str) -> None:
    """The run's (entropy, reward) points, early to late, with the fitted law and its ceiling
    (when it fits)."""
    h, r, hk, rk = law_points(records)
    ax.scatter(h, r, s=14, c=range(len(h)), cmap="viridis", label="steps (dark = early)")
    try:
        fit: Optional[EntropyLawFit] = fit_entropy_law(h, r)
    except ValueError:
        fit = None
    if fit is not None:
        grid = np.linspace(0.0, max(h) * 1.05, 200)
        ax.plot(grid, fit.predict(grid), "r-",
                label=f"R = -{fit.a:.3g} exp(H) + {fit.b:.3g}  (R² {fit.r2:.3f})")
        ax.axhline(fit.ceiling, color="gray", ls="--", lw=1,
                   label=f"ceiling b - a = {fit.ceiling:.3f}")
    ax.set_xlabel(hk)
    ax.set_ylabel(rk)
    ax.set_title(f"{name}: {rk} vs {hk}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_run(run_dir: Union[str, Path], out_dir: Optional[Union[str, Path]] = None) -> list[Path]:
    """Write PNGs of a run (default ``<run_dir>/plots``); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else (
        run_dir if run_dir.is_dir() else run_dir.parent) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    keys = _keys(records)
    name = run_dir.name if run_dir.is_dir() else run_dir.parent.name
    written: list[Path] = []

    def save(fig, filename: str, drawn: int) -> None:
        if drawn:
            fig.tight_layout()
            fig.savefig(out / filename, dpi=110)
            written.append(out / filename)
        plt.close(fig)

    # Entropy over steps, overall and per data source.
    fig, ax = plt.subplots(figsize=(7, 4))
    per_source = sorted(k for k in keys if k.startswith("entropy/") and k.endswith("/seq_mean")
                        and k.count("/") == 2)
    drawn = _plot_lines(ax, records, ["entropy/token_mean", "entropy/seq_mean", *per_source])
    ax.set_title(f"{name}: policy entropy")
    save(fig, "entropy.png", drawn)

    # Reward and accuracy: training rollouts as lines, validation as markers.
    fig, ax = plt.subplots(figsize=(7, 4))
    train_acc = sorted(k for k in keys if k.startswith("acc/"))
    val_acc = sorted(k for k in keys if k.startswith("val/acc/"))
    drawn = _plot_lines(ax, records, ["reward/mean", *train_acc, *val_acc], marker_keys=val_acc)
    ax.set_title(f"{name}: reward and accuracy")
    save(fig, "reward.png", drawn)

    # Covariance of log-prob and advantage, and what the loss did with it.
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    drawn = _plot_lines(ax1, records, ["cov/mean", "cov/selected_mean"])
    ax1.set_title(f"{name}: covariance (log-prob, advantage)")
    drawn += _plot_lines(ax2, records, ["loss/selected_frac", "loss/clip_frac"])
    ax2.set_title("fraction of tokens selected / clipped")
    save(fig, "covariance.png", drawn)

    # Training health.
    health = ["grad_norm", "loss/ppo_kl", "response/length_mean", "rollout/logprob_drift"]
    fig, axes = plt.subplots(2, 2, figsize=(9, 6))
    drawn = 0
    for ax, key in zip(axes.flat, health):
        n = _plot_lines(ax, records, [key])
        ax.set_title(key, fontsize=9)
        if not n:
            ax.set_visible(False)
        drawn += n
    save(fig, "training.png", drawn)

    # The lemma per token (analysis.entropy_lemma): agreement of the measured entropy change
    # with the first-order prediction and with the policy-gradient form, per step.
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    drawn = _plot_lines(ax1, records, ["lemma/corr", "lemma/pg_corr"], ["lemma/corr"])
    ax1.set_title(f"{name}: per-token entropy change vs prediction, corr", fontsize=10)
    drawn += _plot_lines(ax2, records, ["lemma/slope"], ["lemma/slope"])
    ax2.set_title("slope of the change on -Cov(log pi, dz) (1: the lemma exactly)", fontsize=10)
    save(fig, "lemma.png", drawn)

    # Performance against entropy, with the fitted law R = -a exp(H) + b.
    if law_points(records)[0]:
        fig, ax = plt.subplots(figsize=(6, 4.5))
        _draw_entropy_law(ax, records, name)
        save(fig, "entropy_law.png", 1)
    return written
