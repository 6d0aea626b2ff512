"""Context parallelism in the RL loop: a CP=2 run's checkpoints resume at CP=1 and back at CP=2
(2 -> 1 -> 2: the weights and the optimizer do not depend on CP), the engine matching the actor
after each; a CP=2 run killed after a step and resumed reproduces an uninterrupted one bit for
bit; and a setting that context parallelism cannot serve stops the start with one line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from harness import (killed_run_resumes_bit_identical, metrics_rows, run_distributed,
                     train_from_dict)
from serving_model import make_tp2_model
from tolerance import rounding_tol, transformer_terms

from megatron_entropy.cli import main as cli_main


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tp2_model(tmp_path_factory.mktemp("model"))


def _config(model_dir: Path, run_dir: Path, name: str, steps: int, context: int) -> dict:
    return {
        "model": {"hf_path": str(model_dir), "dtype": "fp32", "seq_length": 256},
        "parallel": {"context": context},
        "rollout": {"n_samples": 4, "max_new_tokens": 12, "max_prompt_tokens": 96},
        # An entropy bonus: gradients whatever the random model's rewards.
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05, "entropy_coef": 0.01},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 256}},
        "trainer": {"steps": steps, "lr": 1e-3, "micro_batch_tokens": 200, "save_interval": 1,
                    "keep_last": 4, "micro_batch_layout": "packed"},
        "logging": {"name": name, "runs_dir": str(run_dir), "progress_bar": False},
    }


def test_context_parallel_checkpoint_resumes_at_cp1_and_back(model_dir, tmp_path):
    from megatron_entropy.models.arch import load_arch

    arch = load_arch(model_dir)
    for steps, context in ((2, 2), (3, 1), (4, 2)):
        run_distributed(train_from_dict, context, _config(model_dir, tmp_path, "cp", steps,
                                                          context), timeout=300)
        state = json.loads((tmp_path / "cp" / "checkpoints" / f"step_{steps:08d}"
                            / "trainer_state.json").read_text())
        assert state["layout"]["context"] == context
    rows = metrics_rows(tmp_path / "cp")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    # After each resume the engine holds the actor's weights: its log-probs are the actor's
    # up to the rounding of two fp32 forwards.
    drift_tol = rounding_tol(math.log(arch.vocab_size) + 20.0,
                             transformer_terms(arch, 108, log_softmax=True))
    for r in rows:
        assert r["grad_norm"] > 0 and r["rollout/logprob_drift_max"] <= drift_tol, r["step"]


@pytest.mark.slow
def test_killed_context_parallel_run_resumes_bit_identical(model_dir, tmp_path):
    """CP=2 through the CLI (--nproc 2), SIGKILLed after its first step's checkpoint, then run
    again: its later steps equal those of an uninterrupted CP=2 run (forked ranks)."""
    import yaml

    steps = 3
    cfg = _config(model_dir, tmp_path, "ref", steps, 2)
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    killed_run_resumes_bit_identical(cfg_path, cfg, tmp_path, steps)
    assert "(TP=1, PP=1, CP=2, DP=1)" in (tmp_path / "victim.log").read_text()


def test_context_parallelism_refuses_shared_prompt_rows(model_dir, tmp_path, capsys):
    """One line naming the key, exit 2, no run folder."""
    import yaml

    cfg = _config(model_dir, tmp_path, "refused", 1, 2)
    cfg["trainer"]["micro_batch_layout"] = "shared_prompt"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert cli_main(["train", str(path), "--nproc", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trainer.micro_batch_layout=shared_prompt" in err[0] and \
        "parallel.context=2" in err[0], err
    assert not (tmp_path / "refused").exists()
