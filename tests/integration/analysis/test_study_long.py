"""The long-task study's quick preset (examples/study_long.yaml --quick) on the shipped policy:
real training runs at the paper's exact fractions, whose Cov selection takes r x N and k x N of
each update's N response tokens, and whose responses are classified into the direct and worked
modes."""

from __future__ import annotations

import json

import pytest

from harness import study_cli
from megatron_entropy.config import load_config
from megatron_entropy.ops.covariance import kl_cov_count


@pytest.mark.slow
def test_quick_study_selects_the_paper_fractions_of_each_update_and_logs_modes(tmp_path):
    out = tmp_path / "out"
    done = study_cli("examples/study_long.yaml", "--quick", "--out", str(out), "--losses",
                     "clip_cov_paper,kl_cov_paper", "study.eval_runs=false")
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    cfg = load_config("examples/study_long.yaml")
    arms = {a.name: a.overrides for a in cfg.study.losses}
    assert "algorithm.clip_cov_ratio=0.0002" in arms["clip_cov_paper"]
    assert "algorithm.kl_cov_ratio=0.002" in arms["kl_cov_paper"]
    samples = 4 * 4  # the quick preset: 4 prompts x 4 samples, one update a step
    worked = 0.0
    for name, ratio in (("clip_cov_paper-seed1", 2e-4), ("kl_cov_paper-seed1", 2e-3)):
        rows = [json.loads(x) for x in
                (out / "runs" / name / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "loss/selected_frac" in r]
        assert len(train) == 2
        for r in train:
            tokens = round(r["response/length_mean"] * samples)
            selected = r["loss/selected_frac"] * tokens
            assert selected == pytest.approx(round(selected), abs=1e-6)
            if name.startswith("kl_cov"):  # the k x N tokens of highest Cov, at least one
                assert round(selected) == kl_cov_count(ratio, tokens)
            else:  # r x N (at least one) drawn among the candidates, when there are as many
                assert round(selected) <= max(1, int(ratio * tokens))
            assert r["modes/direct_frac"] + r["modes/worked_frac"] + r["modes/tool_frac"] \
                + r["modes/other_frac"] == pytest.approx(1.0)
            worked += r["modes/worked_frac"]
    assert worked > 0  # the long chains are classified as worked
