"""The study's selection rule: the hyper-parameter of an arm that has one to choose
(``study.losses[].tune_key`` with its candidates ``tune_values``) is chosen on the validation
split only, by a stated rule within a stated budget:

- budget: one run per candidate, at ``study.tuning_seed`` (a seed none of the reported runs
  uses), of the same length and settings as the reported runs;
- rule: the candidate with the highest ``study.tuning_metric`` (validation accuracy) averaged
  over the run's last ``study.window`` logged values; ties go to the candidate listed first
  (the arm's default: list the paper's value first).

The chosen value then runs at every seed of the study as the arm's own runs; the test split is
read only by ``eval`` of those runs. The runner adds an arm's runs once its tuning runs have
finished (``add_tuned_runs``), so a resumed study makes the same choice from the same runs.
"""

from __future__ import annotations

from typing import Any, Collection

from megatron_entropy.analysis.plots import read_metrics, series
from megatron_entropy.analysis.study import StudyError, StudyPlan, StudyRun, add_runs
from megatron_entropy.config.study import StudyLoss


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


def _choose(plan: StudyPlan, arm: StudyLoss) -> dict[str, Any]:
    """One tuned arm's key, each candidate's score and the chosen value."""
    scores = {value: tuning_score(plan, _tuning_run(plan, arm.name, value))
              for value in arm.tune_values}
    best = max(scores.values())
    chosen = next(v for v in arm.tune_values if scores[v] == best)
    return {"key": arm.tune_key, "scores": scores, "chosen": chosen,
            "runs": [_tuning_run(plan, arm.name, v).name for v in arm.tune_values]}


def choices(plan: StudyPlan) -> dict[str, dict[str, Any]]:
    """Per tuned arm of the plan: its key, each candidate's score and the chosen value."""
    if not plan.study.tune:  # each arm ran its first candidate
        return {}
    arms = {arm.name: arm for arm in plan.study.losses}
    return {name: _choose(plan, arms[name]) for name in plan.arms if arms[name].tune_values}


def add_tuned_runs(plan: StudyPlan, finished: Collection[str]) -> list[StudyRun]:
    """The runs at every seed, with its chosen value, of each pending arm whose tuning runs
    are all ``finished`` (run names): checked and added to the plan in the arms' order, the
    arm no longer pending; returns them. An arm's runs never start before its choice."""
    arms = {arm.name: arm for arm in plan.study.losses}
    ready = [name for name in plan.pending
             if all(_tuning_run(plan, name, value).name in finished
                    for value in arms[name].tune_values)]
    if not ready:
        return []
    entries = []
    for name in ready:
        arm = arms[name]
        value = _choose(plan, arm)["chosen"]
        entries += [(f"{name}-seed{seed}", [*arm.overrides, f"{arm.tune_key}={value!r}"], seed,
                     ("loss", name)) for seed in plan.seeds]
    plan.pending = [name for name in plan.pending if name not in ready]
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
