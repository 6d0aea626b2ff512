"""The payoff study's quick preset (examples/study_hinted.yaml --quick) on the shipped two-mode
policy: real training runs logging the mode shares, then ``megatron-entropy eval`` of each run's
last dist checkpoint on the test split, whose numbers the report shows."""

from __future__ import annotations

import json

import pytest

from harness import study_cli
from helpers.metrics_table import undocumented_metrics


@pytest.mark.slow
def test_quick_study_trains_logs_modes_and_evaluates_each_run_on_the_test_split(tmp_path):
    out = tmp_path / "out"
    # The quick preset, shortened further: 2 arms, 2 steps of 8 prompts x 4 samples, 16
    # validation and 8 test problems (x 4 samples).
    done = study_cli("examples/study_hinted.yaml", "--quick", "--out", str(out), "--losses",
                     "grpo,kl_cov", "trainer.steps=2", "trainer.save_interval=2",
                     "trainer.val_interval=2", "data.prompts_per_step=8", "rollout.n_samples=4",
                     "data.hinted.num_val=16", "data.hinted.num_test=8")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "[2/2] kl_cov-seed1: eval in" in done.stdout
    summary = json.loads((out / "summary.json").read_text())
    for name in ("grpo-seed1", "kl_cov-seed1"):
        run = out / "runs" / name
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "modes/direct_frac" in r]
        assert len(train) == 2 and "val/modes/direct_frac" in rows[0]
        for r in train:
            assert r["modes/direct_frac"] + r["modes/worked_frac"] + r["modes/tool_frac"] \
                + r["modes/other_frac"] == pytest.approx(1.0)
        assert not undocumented_metrics({k for r in rows for k in r})
        result = json.loads((run / "eval.json").read_text())
        assert result["converted_from"] and result["split"] == "test" and result["ks"] == [1, 2, 4]
        assert result["overall"]["problems"] == 8
        # pass@k of the whole split is the mean of the per-problem estimates (4 samples each).
        per_source = result["by_source"]
        n = sum(v["problems"] for v in per_source.values())
        assert n == 8
        for k in (1, 2, 4):
            mean = sum(v[f"pass@{k}"] * v["problems"] for v in per_source.values()) / n
            assert result["overall"][f"pass@{k}"] == pytest.approx(mean)
        assert 0 <= result["overall"]["pass@1"] <= result["overall"]["pass@4"] <= 1
        assert summary["runs"][name]["test"]["pass@1"] == result["overall"]["pass@1"]
    report = (out / "report.md").read_text()
    assert "## Test split" in report and "| grpo | 1 |" in report
