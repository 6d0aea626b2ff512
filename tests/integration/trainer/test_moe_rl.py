"""KL-Cov RL on the tiny Qwen3-MoE at EP=2 with routing replay (R2, R3), end to end through the
CLI: the in-process engines get every expert at each sync (the weight check passes), and a run
killed with SIGKILL resumes bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import (killed_run_resumes_bit_identical, metrics_rows, run_distributed,
                     train_from_dict)

from megatron_entropy.testing.toy_models import save_tiny_hf_model, save_tokenizer


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> Path:
    out = save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("moe_rl"), seed=3,
                             vocab_size=512, max_position_embeddings=512)
    save_tokenizer(out, 512)
    return out


def _config(model: Path, run_dir: Path, name: str, replay: str = "recompute",
            steps: int = 3) -> dict:
    return {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"expert": 2},
        "rollout": {"n_samples": 4, "max_new_tokens": 12, "max_prompt_tokens": 96,
                    "routing_replay": replay},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 256}},
        # Two mini-batches: the second one's forward runs on updated weights.
        "trainer": {"steps": steps, "lr": 1e-2, "micro_batch_tokens": 400, "save_interval": 1,
                    "keep_last": steps, "mini_batches_per_step": 2},
        "logging": {"name": name, "runs_dir": str(run_dir), "progress_bar": False},
    }


def test_ep2_run_syncs_every_expert_and_replay_removes_the_mismatch(moe_model, tmp_path):
    """Replay none, recompute (R2) and rollout (R3: the engines' routing travels with their
    completions to the rank that trains on them)."""
    runs = {"free": "none", "replay": "recompute", "engine": "rollout"}
    for name, replay in runs.items():
        run_distributed(train_from_dict, 2, _config(moe_model, tmp_path, name, replay, 2),
                        timeout=300)
    free, replay, engine = (metrics_rows(tmp_path / name) for name in runs)
    for rows in (free, replay, engine):
        assert [r["step"] for r in rows] == [1, 2]
        # The engines hold the trained experts: the check after each sync passes on both replicas.
        assert all(r["weight_check/replicas"] == 2 for r in rows)
        assert all(r["moe/aux_loss"] > 0 and r["moe/load_imbalance"] >= 1 for r in rows)
        assert all(0 <= r["moe/rollout_routing_mismatch"] <= 1 for r in rows)
    assert max(r["moe/routing_mismatch"] for r in free) > 0
    assert all(r["moe/routing_mismatch"] == 0 for r in replay + engine)
    assert all(r["moe/rollout_routing_mismatch"] == 0 for r in engine)


@pytest.mark.parametrize("pipeline", [1, 2], ids=["pp1", "pp2"])
def test_ep2_cp2_run_replays_the_engines_routing_chunk_by_chunk(moe_model, tmp_path, pipeline):
    """EP=2 x CP=2 (x PP=2: 4 ranks) with R3, packed rows (auto); the EP group is each stage's
    CP pair: CP rank 0's engine routing travels with its samples to both CP ranks, the recompute
    replays each rank's chunks of it and records what its routers chose, gathered whole, and
    every update replays that: no (token, layer) pair routes elsewhere than the engine, and the
    engines hold every trained expert (the weight check passes)."""
    cfg = _config(moe_model, tmp_path, "cp", "rollout", 2)
    cfg["parallel"].update(context=2, pipeline=pipeline)
    run_distributed(train_from_dict, 2 * pipeline, cfg, timeout=300)
    rows = metrics_rows(tmp_path / "cp")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["weight_check/replicas"] == 1 for r in rows)
    assert all(r["moe/routing_mismatch"] == 0 and r["moe/rollout_routing_mismatch"] == 0
               for r in rows)
    assert all(r["moe/aux_loss"] > 0 for r in rows)


@pytest.mark.slow
def test_killed_ep2_run_resumes_bit_identical(moe_model, tmp_path):
    """The dense test_killed_run_resumes_bit_identical's scheme: a CLI run at EP=2 (its
    checkpoints hold each EP rank's experts) killed after its first step and resumed equals an
    uninterrupted run in forked ranks, metric for metric."""
    import yaml

    steps = 3
    cfg = _config(moe_model, tmp_path, "ref")
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    killed_run_resumes_bit_identical(cfg_path, cfg, tmp_path, steps)


@pytest.mark.parametrize("section,key,value,error", [
    # the updates replay the routing the recompute records; the engine's log-probs skip it
    ("algorithm", "old_logprobs", "engine",
     r"algorithm\.old_logprobs=engine: a mixture-of-experts policy's updates replay"),
    # the routing is recorded and replayed a sample at a time, and a shared-prompt row's prompt
    # tokens are several samples' (auto, which every other MoE test here runs, resolves to
    # packed rows)
    ("trainer", "micro_batch_layout", "shared_prompt",
     r"trainer\.micro_batch_layout=shared_prompt: a mixture-of-experts policy"),
], ids=["engine_old_logprobs", "shared_prompt_rows"])
def test_a_moe_policy_refuses_what_skips_its_routing_record(moe_model, tmp_path, section, key,
                                                            value, error):
    """An MoE policy's updates replay the routing its recompute records, a sample at a time: a
    setting that skips the record or shares prompt tokens between samples stops the start-up
    with one error naming the key, and no checkpoint is written."""
    cfg = _config(moe_model, tmp_path, key, replay="none", steps=1)
    cfg["parallel"]["expert"] = 1
    cfg[section][key] = value
    with pytest.raises(AssertionError, match=rf"ConfigError: {error}"):
        run_distributed(train_from_dict, 1, cfg, timeout=120)
    assert not (tmp_path / key / "checkpoints").exists()
