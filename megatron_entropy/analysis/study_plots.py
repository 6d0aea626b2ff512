"""The study's figures, each the toy-scale counterpart of one of the paper's (see
``study_report.FIGURE_TITLES``). Curves over seeds are the mean at each step with a band from
the minimum to the maximum over seeds. A figure with nothing to draw is not written."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure

from megatron_entropy.analysis.plots import series
from megatron_entropy.analysis.study import StudyPlan
from megatron_entropy.analysis.study_report import (AFTER_TOOL, COV, DELTA, DIRECT_SHARE,
                                                    ENTROPY, TOOL_ACC, TOOL_SHARE, VAL,
                                                    WORKED_ACC, RunResult, delta_vs_cov)


def _aligned(records: Sequence[Sequence[dict]], key: str
             ) -> tuple[list[float], np.ndarray, np.ndarray, np.ndarray]:
    """(steps, mean, min, max) over the runs that have ``key`` at each step."""
    per_step: dict[float, list[float]] = {}
    for rec in records:
        for step, value in zip(*series(rec, key)):
            per_step.setdefault(step, []).append(value)
    steps = sorted(per_step)
    vals = [per_step[s] for s in steps]
    return (steps, np.array([np.mean(v) for v in vals]), np.array([min(v) for v in vals]),
            np.array([max(v) for v in vals]))


def _band(ax, records: Sequence[Sequence[dict]], key: str, label: str, color,
          marker: bool = False) -> bool:
    steps, mean, lo, hi = _aligned(records, key)
    if not steps:
        return False
    ax.plot(steps, mean, color=color, label=f"{label} ({len(records)} seeds)"
            if len(records) > 1 else label, marker="o" if marker else None, markersize=3)
    if len(records) > 1:
        ax.fill_between(steps, lo, hi, color=color, alpha=0.2, lw=0)
    return True


def _finish(ax, ylabel: str, title: str) -> None:
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _subplots(*grid: int, figsize: tuple[float, float], **kwargs):
    """pyplot.subplots without pyplot: a figure of no backend (savefig draws it with Agg), so
    drawing changes no global matplotlib state and needs no close."""
    fig = Figure(figsize=figsize)
    return fig, fig.subplots(*grid, **kwargs)


# The figures of each arm's seeds as bands over steps: (metric, figure, y label, title, marker).
ARM_BANDS = (
    (ENTROPY, "entropy", "entropy (nats / token)",
     "policy entropy, mean of per-sequence means; band: min-max over seeds", False),
    (VAL, "val_accuracy", "validation accuracy", "validation accuracy", True),
    (DIRECT_SHARE, "mode_share", "share of direct answers",
     "share of the direct mode among the sampled responses; band: min-max over seeds", False),
    (WORKED_ACC, "worked_accuracy", "accuracy of worked answers",
     "accuracy of the worked mode's sampled responses (while it is sampled); band: "
     "min-max over seeds", False),
    (TOOL_SHARE, "tool_share", "share of tool calls",
     "share of sampled responses that call the tool; band: min-max over seeds", False),
    (TOOL_ACC, "tool_accuracy", "accuracy of tool answers",
     "accuracy of the sampled responses that call the tool; band: min-max over seeds", False),
    (AFTER_TOOL, "entropy_after_tool", "entropy (nats / token)",
     "entropy of the first generated tokens after each tool result; band: min-max over seeds",
     False))


def plot_study(plan: StudyPlan, results: Sequence[RunResult], summary: dict, out: Path
               ) -> dict[str, Path]:
    """Write the study's PNGs into ``out``; returns figure name -> file, in report order."""
    colors = colormaps["tab10"]
    by_name = {r.run.name: r for r in results}
    arms = summary["arms"]
    arm_records = {a: [by_name[n].records for n in arm["runs"]] for a, arm in arms.items()}
    written: dict[str, Path] = {}

    def save(name: str, fig, drawn: bool) -> None:
        if drawn:
            fig.tight_layout()
            fig.savefig(out / f"{name}.png", dpi=110)
            written[name] = out / f"{name}.png"

    for key, name, ylabel, title, marker in ARM_BANDS:
        save(name, *_arm_bands(arm_records, key, ylabel, title, marker, colors))
    save("pass_at_k", *_pass_at_k(arms, colors))
    save("entropy_law", *_laws(arms, summary["performance_key"], colors))
    save("early_prediction", *_early_prediction(arms, summary, colors))
    save("covariance", *_covariance(arm_records, colors))
    save("delta_vs_cov", *_delta_vs_cov(arms, by_name, colors))
    for part in ("entropy_bonus", "threshold_sweep"):
        sweep = summary["sweeps"].get(part)
        if sweep:
            save(part, *_sweep(sweep, by_name, colors))
    return written


def _arm_bands(arm_records: dict[str, list], key: str, ylabel: str, title: str, marker: bool,
               colors) -> tuple[Figure, bool]:
    fig, ax = _subplots(figsize=(7, 4.2))
    drawn = [_band(ax, recs, key, a, colors(i), marker)
             for i, (a, recs) in enumerate(arm_records.items())]
    if any(drawn):
        _finish(ax, ylabel, title)
    return fig, any(drawn)


def _pass_at_k(arms: dict, colors) -> tuple[Figure, bool]:
    """pass@k of each arm on the test split (eval of each run's last checkpoint), mean of
    seeds."""
    fig, ax = _subplots(figsize=(7, 4.2))
    tested = {a: arm["test"] for a, arm in arms.items() if arm.get("test")}
    for i, (a, test) in enumerate(tested.items()):
        ks = sorted(int(key.split("@")[1]) for key in test if key.startswith("pass@")
                    and key != "pass@1_greedy")
        ax.plot(ks, [test[f"pass@{k}"]["mean"] for k in ks], marker="o", color=colors(i),
                label=a)
    if tested:
        ax.set_xscale("log", base=2)
        _finish(ax, "test pass@k", "pass@k on the test split (unbiased estimator), mean over "
                                   "seeds")
        ax.set_xlabel("k")
    return fig, bool(tested)


def _laws(arms: dict, performance_key: str, colors) -> tuple[Figure, bool]:
    """The law per arm: all seeds' points, the fit, its ceiling and interval."""
    fig, ax = _subplots(figsize=(7, 4.8))
    laws = {a: arm["law"] for a, arm in arms.items() if arm["law"]}
    top = max((max(law["h"]) for law in laws.values()), default=1.0)
    grid = np.linspace(0.0, top * 1.05, 200)
    for i, (a, law) in enumerate(laws.items()):
        fit, ci = law["fit"], law["interval"]
        if fit is None:
            ax.scatter(law["h"], law["r"], s=12, color=colors(i),
                       label=f"{a}: law not fitted ({law['undetermined']})")
            continue
        ax.scatter(law["h"], law["r"], s=12, color=colors(i), alpha=0.7)
        interval = f" [{ci['low']:.2f}, {ci['high']:.2f}]" if ci else ""
        ax.plot(grid, -fit["a"] * np.exp(grid) + fit["b"], color=colors(i),
                label=f"{a}: a={fit['a']:.3g} b={fit['b']:.3g} R²={fit['r2']:.2f} "
                      f"ceiling {fit['ceiling']:.2f}{interval}")
    if laws:
        ax.set_xlabel("entropy (entropy/seq_mean)")
        ax.set_ylabel(performance_key)
        ax.set_title("R = -a exp(H) + b per loss (ceiling b - a at H = 0, 95% bootstrap "
                     "interval)", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig, bool(laws)


def _early_prediction(arms: dict, summary: dict, colors) -> tuple[Figure, bool]:
    """Each run's own early fit against its later points."""
    with_early = {a: [summary["runs"][n]["early"] for n in arm["runs"]
                      if summary["runs"][n]["early"] is not None] for a, arm in arms.items()}
    with_early = {a: e for a, e in with_early.items() if e}
    fig, axes = _subplots(1, max(len(with_early), 1), figsize=(4.2 * max(len(with_early), 1),
                                                                  3.8), squeeze=False)
    for ax, (a, runs) in zip(axes[0], with_early.items()):
        for j, e in enumerate(runs):
            if e["predicted"] is None:
                ax.plot(e["steps"], e["actual"], "o", color=colors(j), markersize=3,
                        label=f"seed {e['seed']}: not fitted ({e['undetermined']})")
                continue
            ax.plot(e["steps"], e["actual"], "o", color=colors(j), markersize=3)
            ax.plot(e["steps"], e["predicted"], "--", color=colors(j),
                    label=f"seed {e['seed']}: final error {e['final_error']:+.3f}")
        ax.axvline(runs[0]["cut_step"], color="gray", lw=1)
        _finish(ax, summary["performance_key"],
                f"{a}: law fitted on steps <= {runs[0]['cut_step']:.0f}\n"
                "dots: measured, dashed: predicted from entropy")
    return fig, bool(with_early)


def _covariance(arm_records: dict[str, list], colors) -> tuple[Figure, bool]:
    """Cov and dH over steps."""
    fig, (ax1, ax2) = _subplots(2, 1, figsize=(7, 6), sharex=True)
    d1 = [_band(ax1, recs, COV, a, colors(i)) for i, (a, recs) in enumerate(arm_records.items())]
    d2 = [_band(ax2, recs, DELTA, a, colors(i)) for i, (a, recs) in enumerate(arm_records.items())]
    if any(d1):
        _finish(ax1, "cov/step", "Cov(logp, A) over the step's tokens")
    if any(d2):
        _finish(ax2, "entropy/delta", "exact entropy change of the step (H_after - H_before)")
    return fig, any(d1) or any(d2)


def _delta_vs_cov(arms: dict, by_name: dict[str, RunResult], colors) -> tuple[Figure, bool]:
    """dH against Cov, per step, each arm's seeds together."""
    fig, ax = _subplots(figsize=(6, 4.8))
    drawn = False
    for i, a in enumerate(arms):
        dc = delta_vs_cov([by_name[n] for n in arms[a]["runs"]])
        if not dc["n"]:
            continue
        corr = dc["corr_delta_minus_cov"]
        ax.scatter(dc["cov"], dc["delta"], s=12, color=colors(i),
                   label=f"{a}: corr(dH, -Cov) = {'n/a' if corr is None else f'{corr:.2f}'}")
        drawn = True
    if drawn:
        ax.axhline(0, color="gray", lw=0.8)
        ax.axvline(0, color="gray", lw=0.8)
        ax.set_xlabel("cov/step")
        ax.set_ylabel("entropy/delta")
        ax.set_title("per step: entropy change against Cov (the paper: dH ~ -eta Cov)",
                     fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig, drawn


def _sweep(sweep: dict, by_name: dict[str, RunResult], colors) -> tuple[Figure, bool]:
    """A sweep: entropy and validation accuracy per value."""
    leaf = sweep["key"].rsplit(".", 1)[-1]
    fig, (ax1, ax2) = _subplots(1, 2, figsize=(11, 4.2))
    drawn = False
    for i, (value, d) in enumerate(sweep["values"].items()):
        recs = [by_name[n].records for n in d["runs"]]
        drawn |= _band(ax1, recs, ENTROPY, f"{leaf}={value:g}", colors(i))
        _band(ax2, recs, VAL, f"{leaf}={value:g}", colors(i), marker=True)
    if drawn:
        _finish(ax1, "entropy (nats / token)", f"{sweep['base']}: entropy by {leaf}")
        _finish(ax2, "validation accuracy", f"{sweep['base']}: validation by {leaf}")
    return fig, drawn
