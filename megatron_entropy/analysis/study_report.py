"""The numbers of a finished study and the text of its report (``OUT/report.md``; study_runner.py
writes it with ``OUT/summary.json`` and the figures of ``study_plots``).

Definitions (also stated in the report):
- a run's start / end value of a metric: the mean over its first / last ``study.window`` steps
  (entropy = ``entropy/seq_mean``, the paper's mean of per-sequence means; reward =
  ``reward/mean``; response length = ``response/length_mean``);
- a run's initial / final validation accuracy: its first / last ``val/acc/mean`` point;
- an arm's value: the mean over its seeds, with the spread (standard deviation, min, max);
- the entropy law of an arm: R = -a exp(H) + b fitted by least squares to the validation points
  of all its seeds together (R = ``val/acc/mean`` at a step, H = that step's
  ``entropy/seq_mean``; training accuracy when no run validates), with a seeded bootstrap
  interval of the ceiling b - a; per-seed fits are listed too;
- early prediction (a run): the law fitted to its points at steps <= ``early_fraction`` x steps
  predicts its later validation accuracy from their entropy; the error at the last point is the
  one the target judges (mean of |error| over seeds);
- dH against Cov: the Pearson correlation of ``entropy/delta`` with ``-cov/step`` over every
  step of every seed of the arm;
- a plateau (an arm): over the last third of the steps, the rise of a least-squares line through
  each seed's validation points, averaged over seeds, within 2 standard errors of zero or under
  2 points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import numpy as np

from megatron_entropy.analysis.entropy_law import (ceiling_interval, fit_and_predict,
                                                   fit_entropy_law)
from megatron_entropy.analysis.plots import paired_series, read_metrics, series
from megatron_entropy.analysis.study import (StudyPlan, StudyRun, config_value,
                                             elapsed_seconds, read_run_state,
                                             run_wall_seconds)
from megatron_entropy.analysis.study_tuning import choices, render_tuning
from megatron_entropy.analysis.study_eval import (arm_test, render_comparison,
                                                  render_test_section, run_test_numbers,
                                                  eval_targets)

ENTROPY = "entropy/seq_mean"
VAL = "val/acc/mean"
TRAIN_ACC = "acc/mean"
DIRECT_SHARE = "modes/direct_frac"  # tasks with solution modes (data/hinted.py)
WORKED_ACC = "modes/worked_acc"
TOOL_SHARE = "modes/tool_frac"  # tasks with a tool mode (examples/tool_study.yaml)
TOOL_ACC = "modes/tool_acc"
AFTER_TOOL = "entropy/after_tool"
REWARD = "reward/mean"
LENGTH = "response/length_mean"
DELTA = "entropy/delta"
COV = "cov/step"
COV_LOSSES = ("clip_cov", "kl_cov")
MIN_SEEDS = 3  # the targets compare means over at least 3 seeds
PLATEAU_PART = 1 / 3  # a plateau is judged over the last third of the steps
# A rise under 2 points is flat even when it is measurable: one validation point of a few hundred
# responses has a sampling noise of about 2 points, and a nearly deterministic policy's points
# scatter far less, which makes a negligible drift "significant".
PLATEAU_MIN_RISE = 0.02
MAX_CEILING = 0.9  # the baseline's fitted ceiling b - a below this: entropy limits it


@dataclass
class RunResult:
    run: StudyRun
    records: list[dict]
    wall_s: float

    @property
    def steps(self) -> int:
        return self.run.config.trainer.steps


def load_results(plan: StudyPlan) -> list[RunResult]:
    return [RunResult(run, read_metrics(run.run_dir), run_wall_seconds(read_run_state(run)))
            for run in plan.runs]


def _window(records: Sequence[dict], key: str, window: int, last: bool) -> Optional[float]:
    _, values = series(records, key)
    if not values:
        return None
    part = values[-window:] if last else values[:window]
    return sum(part) / len(part)


def _first_last(records: Sequence[dict], key: str) -> tuple[Optional[float], Optional[float]]:
    _, values = series(records, key)
    return (values[0], values[-1]) if values else (None, None)


def performance_key(results: Sequence[RunResult]) -> str:
    """Validation accuracy when the runs validate during training, else training accuracy."""
    has_val = any(len(paired_series(r.records, ENTROPY, VAL)[0]) >= 2 for r in results)
    return VAL if has_val else TRAIN_ACC


def _law_undetermined(h: Sequence[float], r: Sequence[float], min_points: int = 3) -> str:
    """Why the law cannot be fitted to these points, or '' when it can."""
    if len(h) < min_points:
        return f"{len(h)} point(s)"
    if np.ptp(np.exp(h)) == 0:
        return "entropy did not vary"
    if np.ptp(r) == 0:
        return "performance did not vary"
    return ""


def run_numbers(result: RunResult, window: int, early_fraction: float, perf: str) -> dict:
    rec = result.records
    out: dict[str, Any] = {"name": result.run.name, "seed": result.run.seed,
                           "wall_s": result.wall_s, "steps": result.steps}
    for key, name in ((ENTROPY, "entropy"), (REWARD, "reward"), (LENGTH, "length")):
        out[f"{name}_start"] = _window(rec, key, window, last=False)
        out[f"{name}_end"] = _window(rec, key, window, last=True)
    out["val_start"], out["val_end"] = _first_last(rec, VAL)
    out["test"] = run_test_numbers(result.run.run_dir)
    steps, h, r = paired_series(rec, ENTROPY, perf)
    out["law_r2"] = None if _law_undetermined(h, r) else fit_entropy_law(h, r).r2
    cut = early_fraction * result.steps
    k = sum(s <= cut for s in steps)
    out["early"] = None
    if k and len(h) > k:  # points on both sides of the cut
        why = _law_undetermined(h[:k], r[:k], min_points=2)
        e = None if why else fit_and_predict(h, r, k)
        out["early"] = {"seed": result.run.seed, "k": k, "cut_step": cut, "undetermined": why,
                        "final_error": e.final_error if e else None, "mae": e.mae if e else None,
                        "steps": steps, "actual": r,
                        "predicted": e.fit.predict(h).tolist() if e else None}
    return out


def spread(values: Sequence[Optional[float]]) -> Optional[dict]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return None
    arr = np.asarray(vals)
    return {"mean": float(arr.mean()), "std": float(arr.std(ddof=1)) if len(arr) > 1 else 0.0,
            "min": float(arr.min()), "max": float(arr.max()), "n": len(vals)}


def pooled_law(results: Sequence[RunResult], perf: str, resamples: int, seed: int
               ) -> Optional[dict]:
    """The law fitted to every seed's points together: {h, r, fit, interval, undetermined}."""
    h, r = [], []
    for res in results:
        _, hh, rr = paired_series(res.records, ENTROPY, perf)
        h += hh
        r += rr
    if not h:
        return None
    out: dict[str, Any] = {"h": h, "r": r, "fit": None, "interval": None,
                           "undetermined": _law_undetermined(h, r)}
    if not out["undetermined"]:
        out["fit"] = fit_entropy_law(h, r).to_dict()
        if resamples:
            try:
                out["interval"] = ceiling_interval(h, r, resamples, 0.95, seed).to_dict()
            except ValueError:
                pass
    return out


def plateau(results: Sequence[RunResult], part: float = PLATEAU_PART) -> Optional[dict]:
    """Whether validation accuracy has stopped rising over the last ``part`` of the steps: per
    seed, a least-squares line through its points there gives the rise across the window and
    that rise's standard error; the arm's rise is the seeds' mean, its standard error theirs
    combined. Flat: |rise| within 2 standard errors of zero or under PLATEAU_MIN_RISE. None with
    fewer than 3 points a seed."""
    rises, variances, levels, first = [], [], [], []
    for res in results:
        steps, vals = series(res.records, VAL)
        cut = res.steps - part * res.steps  # (1 - part) * steps rounds 40 up to 40.000001
        pts = [(s, v) for s, v in zip(steps, vals) if s >= cut]
        if len(pts) < 3:
            return None
        x, y = np.array(pts, dtype=float).T
        slope, intercept = np.polyfit(x, y, 1)
        resid = y - (slope * x + intercept)
        sxx = float(((x - x.mean()) ** 2).sum())
        sd = math.sqrt(float((resid ** 2).sum()) / (len(x) - 2))  # 3 points at least
        span = float(x[-1] - x[0])
        rises.append(slope * span)
        variances.append((sd / math.sqrt(sxx) * span) ** 2 if sxx else 0.0)
        levels.append(float(y.mean()))
        first.append(float(x[0]))
    rise = float(np.mean(rises))
    se = math.sqrt(sum(variances)) / len(variances)
    return {"rise": rise, "se": se, "level": float(np.mean(levels)), "from_step": min(first),
            "flat": abs(rise) <= max(2 * se, PLATEAU_MIN_RISE)}


def correlation(x: Sequence[float], y: Sequence[float]) -> Optional[float]:
    if len(x) < 3 or np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.corrcoef(x, y)[0, 1])


def delta_vs_cov(results: Sequence[RunResult]) -> dict:
    cov, delta = [], []
    for res in results:
        _, c, d = paired_series(res.records, COV, DELTA)
        cov += c
        delta += d
    return {"cov": cov, "delta": delta,
            "corr_delta_minus_cov": correlation(delta, [-c for c in cov]), "n": len(cov)}


def _sweep_groups(results: Sequence[RunResult], base: str, key: str, part: str,
                  seeds: Sequence[int]) -> dict[float, list[RunResult]]:
    """The sweep's runs and its base arm's runs at the sweep seeds, by the key's value."""
    groups: dict[float, list[RunResult]] = {}
    for res in results:
        in_sweep = any(role == part for role, _ in res.run.roles)
        is_base = res.run.arm() == base and res.run.seed in seeds
        if in_sweep or is_base:
            groups.setdefault(float(config_value(res.run.config, key)), []).append(res)
    return dict(sorted(groups.items()))


def summarize(plan: StudyPlan, results: Sequence[RunResult]) -> dict:
    st = plan.study
    perf = performance_key(results)
    per_run = {r.run.name: run_numbers(r, st.window, st.early_fraction, perf) for r in results}
    arms: dict[str, dict] = {}
    for arm in plan.arms:
        members = [r for r in results if r.run.arm() == arm]
        if not members:
            continue
        nums = [per_run[r.run.name] for r in members]
        early = [n["early"]["final_error"] for n in nums
                 if n["early"] is not None and n["early"]["final_error"] is not None]
        arms[arm] = {
            "loss": members[0].run.config.algorithm.loss,
            "runs": [r.run.name for r in members], "seeds": [r.run.seed for r in members],
            **{f: spread([n[f] for n in nums]) for f in (
                "entropy_start", "entropy_end", "reward_start", "reward_end", "length_start",
                "length_end", "val_start", "val_end")},
            "law": pooled_law(members, perf, st.bootstrap, st.bootstrap_seed),
            "law_r2_per_seed": [n["law_r2"] for n in nums],
            "early_abs_final_error": spread([abs(e) for e in early]),
            "early_final_errors": early,
            "delta_vs_cov": delta_vs_cov(members),
            "plateau": plateau(members),
            "test": arm_test([n["test"] for n in nums], spread),
            "wall_s": spread([n["wall_s"] for n in nums]),
        }
    sweeps = {}
    sweep_seeds = plan.seeds[:st.sweep_seeds]
    for part in ("entropy_bonus", "threshold_sweep"):
        sw = getattr(st, part)
        if not sw.values:
            continue
        groups = _sweep_groups(results, sw.base, sw.key, part, sweep_seeds)
        sweeps[part] = {"base": sw.base, "key": sw.key, "values": {
            value: {"runs": [r.run.name for r in members],
                    "entropy_end": spread([per_run[r.run.name]["entropy_end"] for r in members]),
                    "val_end": spread([per_run[r.run.name]["val_end"] for r in members])}
            for value, members in groups.items()}}
    summary = {"config": plan.config_path, "out": str(plan.out), "quick": plan.quick,
               "window": st.window, "early_fraction": st.early_fraction,
               "performance_key": perf, "baseline": st.baseline, "arms": arms,
               "sweeps": sweeps, "runs": per_run, "tuning": choices(plan),
               "wall_s": elapsed_seconds([read_run_state(r.run) for r in results]),
               "run_s": sum(r.wall_s for r in results), "n_runs": len(results)}
    summary["targets"] = targets(summary, plan)
    summary["notes"] = study_notes(plan)
    return summary


def study_notes(plan: StudyPlan) -> list[str]:
    """What keeps the comparison from meaning what it seems to: arms whose runs update fully
    on-policy, where the Cov losses cannot act."""
    on_policy = sorted({run.arm() for run in plan.runs if run.arm() is not None
                        and run.config.trainer.mini_batches_per_step
                        * run.config.trainer.ppo_epochs == 1})
    if not on_policy:
        return []
    return [f"{', '.join(on_policy)}: one update per rollout batch (trainer.mini_batches_per_step"
            "=1, trainer.ppo_epochs=1), so every update is on-policy: log p equals the old log p "
            "where the loss is taken, KL-Cov's |log p - old log p| penalty has zero gradient and "
            "the PPO clip never acts; KL-Cov trains exactly as GRPO does and Clip-Cov differs "
            "only by the tokens it detaches. Set trainer.mini_batches_per_step >= 2 to compare "
            "them."]


# ------------------------------------------------------------------------------ targets


def _status(ok: Optional[bool]) -> str:
    return "not measured" if ok is None else ("hit" if ok else "missed")


def _mean(d: Optional[dict]) -> Optional[float]:
    return None if d is None else d["mean"]


def _fmt(v: Optional[float], digits: int = 3) -> str:
    return "n/a" if v is None else f"{v:.{digits}f}"


def _baseline_targets(add: Callable[..., None], summary: dict, plan: StudyPlan,
                      base: dict) -> None:
    """The baseline's targets: collapse, length, law fit, early prediction, plateau, ceiling,
    dH-vs-Cov correlation."""
    st, arms, base_name = plan.study, summary["arms"], plan.study.baseline
    h0, h1 = _mean(base["entropy_start"]), _mean(base["entropy_end"])
    r0, r1 = _mean(base["reward_start"]), _mean(base["reward_end"])
    ok = None if None in (h0, h1, r0, r1) else (h1 <= h0 / 3 and r1 > r0)
    ratio = f" = {h1 / h0:.2f}x" if h0 and h1 is not None else ""
    add(f"{base_name}: final entropy <= 1/3 of its start while reward rises",
        f"entropy {_fmt(h0)} -> {_fmt(h1)}{ratio}, reward {_fmt(r0)} -> {_fmt(r1)}", ok)
    l0, l1 = _mean(base["length_start"]), _mean(base["length_end"])
    ok = None if not l0 or l1 is None else 0.5 <= l1 / l0 <= 1.5
    add(f"{base_name}: response length within +-50% of its start",
        f"{_fmt(l0, 1)} -> {_fmt(l1, 1)} tokens", ok)
    law = base["law"] or {"fit": None, "undetermined": "no points"}
    per_seed = ", ".join(_fmt(v) for v in base["law_r2_per_seed"])
    fit = law["fit"]
    add(f"{base_name}: the entropy law fits with R^2 >= 0.9",
        f"not fitted: {law['undetermined']}" if fit is None else
        f"R^2 = {fit['r2']:.3f} (all seeds' points; per seed: {per_seed})",
        None if fit is None else fit["r2"] >= 0.9)
    early = base["early_abs_final_error"]
    whys = sorted({(summary["runs"][n]["early"] or {}).get("undetermined")
                   or "no points after the first steps" for n in base["runs"]})
    add(f"{base_name}: the law fitted on the first {st.early_fraction:.0%} of the steps "
        "predicts the final validation accuracy within 3 points",
        f"not fitted: {'; '.join(whys)}" if early is None else
        f"|error| {early['mean']:.3f} (mean over {early['n']} seed(s))",
        None if early is None else early["mean"] <= 0.03)
    flat = base["plateau"]
    best = max(((_mean(a["val_end"]), n) for n, a in arms.items()
                if _mean(a["val_end"]) is not None), default=None)
    add(f"{base_name}: on a plateau over the last {PLATEAU_PART:.0%} of its steps "
        f"(validation accuracy's fitted rise there within 2 standard errors of zero or under "
        f"{PLATEAU_MIN_RISE * 100:g} points)",
        "fewer than 3 validation points a seed there" if flat is None else
        f"level {flat['level']:.3f} from step {flat['from_step']:.0f}, rise "
        f"{flat['rise'] * 100:+.1f} points (2 SE {2 * flat['se'] * 100:.1f}); the best "
        f"arm's final validation accuracy {best[0]:.3f} ({best[1]})",
        None if flat is None else flat["flat"])
    add(f"{base_name}: the fitted ceiling b - a < {MAX_CEILING:g}",
        "not fitted" if fit is None else f"{fit['ceiling']:.3f}",
        None if fit is None else fit["ceiling"] < MAX_CEILING)
    corr = base["delta_vs_cov"]["corr_delta_minus_cov"]
    add(f"{base_name}: correlation of per-step entropy/delta with -cov/step >= 0.7",
        "n/a" if corr is None else f"{corr:.3f} over {base['delta_vs_cov']['n']} steps",
        None if corr is None else corr >= 0.7)


def _cov_arm_targets(add: Callable[..., None], arms: dict, base_name: str, base: dict
                     ) -> None:
    """Each Cov arm's final entropy and accuracy against the baseline's."""
    for name, arm in arms.items():
        if name == base_name or arm["loss"] not in COV_LOSSES:
            continue
        n = min(len(arm["seeds"]), len(base["seeds"]))
        few = f"not judged: {n} seed(s), the target needs >= {MIN_SEEDS}" \
            if n < MIN_SEEDS else ""
        for field, what, rule in (("entropy_end", "final entropy >= 2x", lambda a, b: a >= 2 * b),
                                  ("val_end", "final validation accuracy >=",
                                   lambda a, b: a >= b)):
            a, b = arm[field], base[field]
            ok = None if a is None or b is None else rule(a["mean"], b["mean"])
            measured = "n/a" if a is None or b is None else (
                f"{a['mean']:.3f} (sd {a['std']:.3f}, {a['min']:.3f}-{a['max']:.3f}) vs "
                f"{b['mean']:.3f} (sd {b['std']:.3f}, {b['min']:.3f}-{b['max']:.3f})")
            add(f"{name}: {what} {base_name}'s, mean over >= {MIN_SEEDS} seeds", measured,
                None if few else ok, few)


def targets(summary: dict, plan: StudyPlan) -> list[dict]:
    """Each target of the study (the baseline's collapse, length, law fit, early prediction,
    plateau, ceiling and dH-vs-Cov correlation; each Cov arm's entropy and accuracy against the
    baseline; the threshold sweep's order; the time budget): what it asks, the measured value,
    hit / missed / not judged."""
    st, arms = plan.study, summary["arms"]
    base_name = st.baseline
    base = arms.get(base_name)
    rows: list[dict] = []

    def add(target: str, measured: str, ok: Optional[bool], note: str = "") -> None:
        status = _status(ok)
        if note:
            status = f"{status} ({note})" if ok is not None else note
        rows.append({"target": target, "measured": measured, "status": status,
                     "hit": ok})

    if base is None:
        add(f"{base_name} (the baseline) in the study", "not run", None)
    else:
        _baseline_targets(add, summary, plan, base)
        _cov_arm_targets(add, arms, base_name, base)
    eval_targets(arms, base_name, add, MIN_SEEDS)
    sweep = summary["sweeps"].get("threshold_sweep")
    if sweep:
        ends = [(v, _mean(d["entropy_end"])) for v, d in sweep["values"].items()]
        known = [e for _, e in ends if e is not None]
        ok = None if len(known) < 2 or len(known) < len(ends) else all(
            x < y for x, y in zip(known, known[1:]))
        add(f"threshold sweep: final entropy increases with {sweep['key']}",
            ", ".join(f"{v:g}: {_fmt(e)}" for v, e in ends), ok)
    minutes = summary["wall_s"] / 60
    add(f"the study finishes in <= {st.time_budget_minutes:g} minutes",
        f"{minutes:.1f} minutes for {summary['n_runs']} runs (recorded attempts)",
        None if plan.quick else minutes <= st.time_budget_minutes,
        "not judged: --quick" if plan.quick else "")
    return rows


# ------------------------------------------------------------------------------ report


def _spread_cell(d: Optional[dict]) -> str:
    if d is None:
        return "n/a"
    return f"{d['mean']:.3f} ± {d['std']:.3f}" if d["n"] > 1 else f"{d['mean']:.3f}"


def render_report(summary: dict, figures: dict[str, Path]) -> str:
    arms = summary["arms"]
    lines = [
        "# Entropy study", "",
        f"Config `{summary['config']}`{' with --quick (toy length)' if summary['quick'] else ''}"
        f"; {summary['n_runs']} runs, {summary['wall_s'] / 60:.1f} minutes of recorded run "
        f"time ({summary['run_s'] / 60:.1f} summed over the runs, which overlap when "
        "study.jobs > 1). Made by `megatron-entropy study`; each run's metrics are in `runs/NAME/`.", "",
        f"Start / end: mean over a run's first / last {summary['window']} steps; entropy is the "
        "mean of per-sequence mean token entropies (`entropy/seq_mean`); initial / final "
        "validation accuracy: a run's first / last validation point; ± is the standard "
        "deviation over seeds. A plateau: over the last third of the steps, the fitted rise "
        "of each seed's validation points (mean over seeds) within 2 standard errors of zero or "
        "under 2 points. "
        "The law uses "
        f"`{summary['performance_key']}` against `entropy/seq_mean` at the same steps.", "",
        "## Targets", "", "| target | measured | status |", "| --- | --- | --- |"]
    lines += [f"| {t['target']} | {t['measured']} | {t['status']} |" for t in summary["targets"]]
    if summary.get("notes"):
        lines += ["", "## Notes", "", *(f"- {note}" for note in summary["notes"])]
    lines += ["", "## Losses", "",
              "| arm | loss | seeds | entropy start | entropy end | reward start | reward end | "
              "val start | val end | R^2 | ceiling b - a [95% interval] | early |error| | "
              "corr(dH, -Cov) |", "|" + " --- |" * 13]
    for name, arm in arms.items():
        fit = (arm["law"] or {}).get("fit")
        ceiling = "n/a"
        if fit is not None:
            ci = arm["law"]["interval"]
            ceiling = f"{fit['ceiling']:.3f}" + (
                f" [{ci['low']:.3f}, {ci['high']:.3f}]" if ci else "")
        corr = arm["delta_vs_cov"]["corr_delta_minus_cov"]
        cells = [name, arm["loss"], str(len(arm["seeds"])),
                 *(_spread_cell(arm[f]) for f in ("entropy_start", "entropy_end", "reward_start",
                                                  "reward_end", "val_start", "val_end")),
                 "n/a" if fit is None else f"{fit['r2']:.3f}", ceiling,
                 _spread_cell(arm["early_abs_final_error"]), _fmt(corr)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += render_comparison(arms) + render_tuning(summary["tuning"])
    lines += render_test_section(arms)
    for part, title in (("entropy_bonus", "Entropy bonus"), ("threshold_sweep",
                                                              "Threshold sweep")):
        sweep = summary["sweeps"].get(part)
        if not sweep:
            continue
        lines += ["", f"## {title}: {sweep['base']} with `{sweep['key']}`", "",
                  "| value | runs | entropy end | val end |", "| --- | --- | --- | --- |"]
        for value, d in sweep["values"].items():
            lines.append(f"| {value:g} | {', '.join(d['runs'])} | "
                         f"{_spread_cell(d['entropy_end'])} | {_spread_cell(d['val_end'])} |")
    lines += ["", "## Figures", ""]
    for name, path in figures.items():
        lines += [f"### {FIGURE_TITLES[name]}", "", f"![{name}]({path.name})", ""]
    missing = [n for n in FIGURE_TITLES if n not in figures]
    if missing:
        lines += [f"Not drawn (no data in these runs): {', '.join(missing)}.", ""]
    lines += ["## Runs", "", "| run | seed | steps | wall s | entropy start -> end | "
              "val start -> end |", "| --- | --- | --- | --- | --- | --- |"]
    for name, n in summary["runs"].items():
        lines.append(f"| {name} | {n['seed']} | {n['steps']} | {n['wall_s']:.0f} | "
                     f"{_fmt(n['entropy_start'])} -> {_fmt(n['entropy_end'])} | "
                     f"{_fmt(n['val_start'])} -> {_fmt(n['val_end'])} |")
    return "\n".join(lines) + "\n"


FIGURE_TITLES = {
    "entropy": "Entropy against step per loss (paper Figs. 1, 8)",
    "val_accuracy": "Validation accuracy against step per loss",
    "mode_share": "Share of the direct mode against step per loss",
    "worked_accuracy": "Accuracy of the worked mode against step per loss",
    "tool_share": "Share of responses that call the tool against step per loss",
    "tool_accuracy": "Accuracy of the responses that call the tool against step per loss",
    "entropy_after_tool": "Entropy of the first tokens after a tool result against step",
    "pass_at_k": "Test pass@k at the end per loss",
    "entropy_law": "Performance against entropy with the fitted law (Figs. 1, 2)",
    "early_prediction": "Early prediction: the law fitted on the first steps predicts the rest "
                        "(Fig. 3)",
    "covariance": "Cov and the exact entropy change against step (Fig. 5)",
    "delta_vs_cov": "Entropy change against Cov per step (Fig. 5)",
    "entropy_bonus": "The entropy bonus at several coefficients (Fig. 6)",
    "threshold_sweep": "Threshold sweep (Fig. 7)",
}
