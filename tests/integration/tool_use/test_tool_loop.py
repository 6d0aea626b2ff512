"""The RL loop with tools on the in-process engine: the scripted model (testing/tool_script.py)
calls the calculator and a code tool whose code hangs, opens a socket, prints 10 MB or forks and
crashes; every call is contained and counted (tools/errors, tools/timeouts), the step trains on
the trajectories and its metrics are the documented ones; ``megatron-entropy eval`` runs the
same multi-turn loop."""

from __future__ import annotations

import json
import subprocess

import pytest

from harness import metrics_rows, run_distributed, train_from_dict

from megatron_entropy.testing import tool_script


def _cfg(model, run_dir, steps: int = 1) -> dict:
    prompts = str(model / "prompts.jsonl")
    return {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 96},
        "rollout": {"n_samples": 2, "temperature": 1.0, "max_new_tokens": 48,
                    "max_prompt_tokens": 32, "val_n_samples": 1,
                    "tools": {"names": ["calculator", "tools_under_test:HostilePython"],
                              "format": "plain", "timeout_s": 2.0, "workers": 4}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.1},
        "data": {"train_files": [prompts], "val_files": [prompts], "apply_chat_template": False,
                 "prompt_suffix": "", "prompts_per_step": 5, "dynamic_sampling": False,
                 "shuffle": False},
        "trainer": {"steps": steps, "lr": 1e-4, "micro_batch_tokens": 1024, "save_interval": 0},
        "logging": {"name": "tools", "runs_dir": str(run_dir), "progress_bar": False},
    }


@pytest.fixture(scope="module")
def model():
    return tool_script.hf_dir()


def test_hostile_tool_calls_are_contained_and_the_run_goes_on(model, tmp_path):
    run_distributed(train_from_dict, 1, _cfg(model, tmp_path), timeout=600)
    (row,) = metrics_rows(tmp_path / "tools")
    # 5 prompts x 2 samples: every trajectory calls the calculator, then the code tool, whose
    # snippet fails: 4 samples hang (sum 5), the other 6 error out (socket, 10 MB, fork+crash).
    assert row["tools/calls_mean"] == pytest.approx(2.0, abs=0.3)
    assert row["tools/timeouts"] >= 3 and row["tools/errors"] >= 4
    assert row["tools/token_frac"] > 0 and row["tools/turns_mean"] > 2
    assert row["time/tools"] < 30  # the hung calls were cut at 2 s, in parallel
    for key in ("entropy/turn_1", "entropy/turn_2", "entropy/after_tool",
                "entropy/not_after_tool", "reward/by_tool_calls/2", "rollout/logprob_drift"):
        assert key in row, key
    assert row["rollout/logprob_drift"] < 1e-3  # the generated tokens only: engine = actor
    assert row["loss/selected_frac"] > 0


def test_eval_runs_the_multi_turn_loop(model, tmp_path):
    cfg = _cfg(model, tmp_path)
    cfg["rollout"]["tools"]["names"] = ["calculator", "python"]
    cfg["eval"] = {"split": "val", "n_samples": 2, "temperature": 1.0}
    config = tmp_path / "tools.yaml"
    config.write_text(json.dumps(cfg))
    out = tmp_path / "eval.json"
    done = subprocess.run(["megatron-entropy", "eval", str(config), "--checkpoint", str(model),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    # The scripted model calls the tools on every problem and gets every answer right.
    assert result["tools"]["call_frac"] == 1.0
    assert result["tools"]["accuracy_with_calls"] >= 0.8
    assert result["overall"]["pass@1"] >= 0.8 and result["overall"]["pass@1_greedy"] == 1.0
