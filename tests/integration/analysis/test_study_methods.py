"""The methods study (examples/study_methods.yaml) from its one config, as a user runs it: the
quick preset shortened to two arms and two steps, with the selection rule on: the tuned arm's
candidates run first at the tuning seed, the one with the best validation accuracy over the last
validation points runs at the study's seed, the report shows the choice and the comparison
table, and no tuning run is evaluated on the test split."""

from __future__ import annotations

import json

import pytest

from harness import study_cli
from helpers.metrics_table import undocumented_metrics

from megatron_entropy.analysis.plots import read_metrics, series


@pytest.mark.slow
def test_methods_study_tunes_on_validation_then_runs_the_choice(tmp_path):
    out = tmp_path / "out"
    done = study_cli("examples/study_methods.yaml", "--quick", "--out", str(out), "--losses",
                     "grpo_80_20,siren", "study.tune=true", "study.tuning_seed=7",
                     "study.window=2",
                     "study.eval_runs=false", "trainer.steps=2", "trainer.save_interval=2",
                     "trainer.val_interval=1", "data.prompts_per_step=4", "rollout.n_samples=4",
                     "data.hinted.num_val=8", "rollout.val_n_samples=4")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    tuning = summary["tuning"]["siren"]
    assert tuning["key"] == "algorithm.siren.coef"
    assert tuning["runs"] == ["siren-tune0.005", "siren-tune0.05"]
    # The rule: the mean of each tuning run's last 2 validation accuracies (of 3: before
    # training and after each step), the best wins (the first listed on a tie), from the runs'
    # own metrics.
    scores = {}
    for value, name in zip((0.005, 0.05), tuning["runs"]):
        _, val = series(read_metrics(out / "runs" / name), "val/acc/mean")
        assert len(val) == 3
        scores[value] = sum(val[-2:]) / 2
        assert tuning["scores"][str(value)] == pytest.approx(scores[value])
    best = max(scores.values())
    chosen = next(v for v in (0.005, 0.05) if scores[v] == best)
    assert tuning["chosen"] == chosen
    config = (out / "runs" / "siren-seed1" / "config.yaml").read_text()
    assert f"coef: {chosen}" in config
    assert done.stdout.index("siren-tune0.05: done") < done.stdout.index("siren-seed1: training")
    assert set(summary["arms"]) == {"grpo_80_20", "siren"}
    assert summary["arms"]["siren"]["runs"] == ["siren-seed1"]
    for name in ("grpo_80_20-seed1", "siren-tune0.005", "siren-tune0.05", "siren-seed1"):
        rows = read_metrics(out / "runs" / name)
        assert not undocumented_metrics({k for r in rows for k in r})
        assert not (out / "runs" / name / "eval.json").exists()
    # SIREN's anchor is its first step's masked entropy, kept for the run.
    anchors = [r["siren/anchor"] for r in read_metrics(out / "runs" / "siren-seed1")
               if "siren/anchor" in r]
    assert len(anchors) == 2 and len(set(anchors)) == 1
    report = (out / "report.md").read_text()
    assert "## Hyper-parameters chosen on the validation split" in report
    assert "## Comparison" in report and "| siren | 1 |" in report
