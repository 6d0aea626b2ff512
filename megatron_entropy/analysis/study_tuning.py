"""The study's selection rule: the hyper-parameter of an arm that has one to choose
(``study.losses[].tune_key`` with its candidates ``tune_values``) is chosen on the validation
split only, by a stated rule within a stated budget:

- budget: one run per candidate, at ``study.tuning_seed`` (a seed none of the reported runs
  uses), of the same length and settings as the reported runs;
- rule: the candidate with the highest ``study.tuning_metric`` (validation accuracy) averaged
  over the run's last ``study.window`` logged values; ties go to the candidate listed first
  (the arm's default: list the paper's value first).

The chosen value then runs at every seed of the study as the arm's own runs; the test split is
read only by ``eval`` of those runs. The runner adds them once the tuning runs have finished
(``add_tuned_runs``), so a resumed study makes the same choice from the same runs.
"""

from __future__ import annotations

from typing import Any

from megatron_entropy.analysis.plots import read_metrics, series
from megatron_entropy.analysis.study import StudyError, StudyPlan, StudyRun, add_runs


def _tuning_run(plan: StudyPlan, arm: str, value: float) -> StudyRun:
    role = ("tune", f"{arm}={value!r}")
    return next(run for run in plan.runs if role in run.roles)


def tuning_score(plan: StudyPlan, run: StudyRun) -> float:
    """The rule's score of one tuning run: its last ``window`` values of the metric, averaged."""
    st = plan.study
    try:
        _, values = series(read_metrics(run.run_dir), st.tuning_metric)
    except FileNotFoundError:
        values = []
    if not values:
        raise StudyError(f"tuning run {run.name} logged no {st.tuning_metric} (set "
                         "trainer.val_interval, or study.tuning_metric to a metric it logs)")
    last = values[-st.window:]
    return sum(last) / len(last)


def choices(plan: StudyPlan) -> dict[str, dict[str, Any]]:
    """Per tuned arm of the plan: its key, each candidate's score and the chosen value."""
    out: dict[str, dict[str, Any]] = {}
    if not plan.study.tune:  # each arm ran its first candidate
        return out
    arms = {arm.name: arm for arm in plan.study.losses}
    for name in plan.arms:
        arm = arms[name]
        if not arm.tune_values:
            continue
        scores = {value: tuning_score(plan, _tuning_run(plan, name, value))
                  for value in arm.tune_values}
        best = max(scores.values())
        chosen = next(v for v in arm.tune_values if scores[v] == best)
        out[name] = {"key": arm.tune_key, "scores": scores, "chosen": chosen,
                     "runs": [_tuning_run(plan, name, v).name for v in arm.tune_values]}
    return out


def add_tuned_runs(plan: StudyPlan) -> list[StudyRun]:
    """After the tuning runs: the pending arms' runs at every seed with their chosen value
    (checked and added to the plan); returns them."""
    if not plan.pending:
        return []
    chosen = choices(plan)
    arms = {arm.name: arm for arm in plan.study.losses}
    entries = [(f"{name}-seed{seed}",
                [*arms[name].overrides, f"{arms[name].tune_key}={chosen[name]['chosen']!r}"],
                seed, ("loss", name))
               for name in plan.pending for seed in plan.seeds]
    plan.pending = []
    return add_runs(plan, entries)


def render_tuning(tuning: dict[str, dict[str, Any]]) -> list[str]:
    """The report's section of the choices (nothing when no arm tunes)."""
    if not tuning:
        return []
    lines = ["", "## Hyper-parameters chosen on the validation split", "",
             "One run per candidate at the tuning seed; the highest mean of the last validation "
             "points wins (ties: the first listed).", "",
             "| arm | key | candidate | validation score | chosen |",
             "| --- | --- | --- | --- | --- |"]
    for name, t in tuning.items():
        for value, score in t["scores"].items():
            mark = "yes" if value == t["chosen"] else ""
            lines.append(f"| {name} | `{t['key']}` | {value:g} | {score:.3f} | {mark} |")
    return lines
