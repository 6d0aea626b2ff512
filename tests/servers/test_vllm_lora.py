"""A LoRA policy against a real vLLM CPU server (.venv-vllm) that serves its adapters: the
weight sync sends the adapters alone (``rollout.weight_sync.strategy=adapters``), the server
loads them in place on its base and answers with them, the trainer's weight check passes after
every sync, and what the server answers equals ``peft`` on the HF base with the run's exported
adapters; a merged sync of the same policy (``disk``) moves the whole model instead."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.server.vllm import LORA_NAME, VLLMEngine, lora_serving
from megatron_entropy.trainer.weight_check import tolerances
from serving_model import (check_adapter_syncs, exported_peft, make_served_model,
                           reference_logprobs)

VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
PROMPT = [5, 6, 7, 8]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not VENV_PYTHON.exists(),
                       reason="no .venv-vllm: run .ci/setup-vllm.sh (tests/run.sh does)"),
]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(the base model's folder, a vLLM server that serves it with LoRA serving on)."""
    base = make_served_model(tmp_path_factory.mktemp("vllm_lora_base") / "base", seed=0)
    cfg = lora_serving(ServerConfig(
        launch=1, server_python=str(VENV_PYTHON), base_port=32700, max_model_len=256,
        extra_args=["--enforce-eager"], max_concurrency=16, startup_timeout_s=600,
        request_timeout_s=120, extra_env=["VLLM_CPU_KVCACHE_SPACE=1",
                                          "VLLM_CPU_OMP_THREADS_BIND=nobind", "HF_HUB_OFFLINE=1"]),
        rank=4)
    engine = VLLMEngine(cfg, str(base), str(tmp_path_factory.mktemp("vllm_lora_run")))
    yield base, engine.pool.servers[0].url
    engine.shutdown()


def _config(base: Path, url: str, run_dir: Path, name: str, strategy: str) -> dict:
    return {
        "model": {"hf_path": str(base), "dtype": "fp32", "seq_length": 256,
                  "lora": {"rank": 4, "alpha": 8}},
        "rollout": {"engine": "vllm", "n_samples": 4, "max_new_tokens": 12,
                    "max_prompt_tokens": 96,
                    "server": {"urls": [url], "request_timeout_s": 120, "startup_timeout_s": 60},
                    "weight_sync": {"strategy": strategy}},
        # The entropy bonus moves the adapters though the random model earns no reward.
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05, "entropy_coef": 0.5},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 64}},
        "trainer": {"steps": 2, "lr": 5e-2, "micro_batch_tokens": 400, "save_interval": 2},
        "logging": {"name": name, "runs_dir": str(run_dir), "progress_bar": False},
    }


def _complete(url: str, model: str) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0,
            "logprobs": 0, "return_token_ids": True}
    req = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    choice = json.loads(urllib.request.urlopen(req, timeout=120).read())["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _drift(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(b)


def test_adapter_sync_serves_the_trainers_adapters(served, tmp_path):
    from harness import run_distributed, train_from_dict

    base, url = served
    run_distributed(train_from_dict, 1, _config(base, url, tmp_path, "adapters", "adapters"),
                    timeout=900)
    limit = tolerances("bf16", "fp32")[0]  # the weight check's: bf16 serving, fp32 actor
    check_adapter_syncs(tmp_path / "adapters", base, limit)

    # The server's answers with the adapters are peft's on the HF base with the run's adapters.
    trained = exported_peft(tmp_path / "adapters", base, tmp_path / "peft")
    ids, served_logprobs = _complete(url, LORA_NAME)
    assert _drift(served_logprobs, reference_logprobs(trained, PROMPT, ids)) <= limit
    # ... and the adapters matter: the base's log-probs of the same tokens are far from them.
    with trained.disable_adapter():
        assert _drift(served_logprobs, reference_logprobs(trained, PROMPT, ids)) > 3 * limit


def test_merged_sync_moves_the_whole_model(served, tmp_path):
    from harness import metrics_rows, run_distributed, train_from_dict

    base, url = served
    run_distributed(train_from_dict, 1, _config(base, url, tmp_path, "merged", "disk"),
                    timeout=900)
    rows = metrics_rows(tmp_path / "merged")
    for r in rows:
        print(f"step {r['step']}: merged sync {r['weight_sync/bytes'] / 2**10:.0f} KiB in "
              f"{r['weight_sync/seconds']:.2f} s; weight check drift "
              f"{r['weight_check/drift_mean']:.2e}")
        assert r["weight_check/drift_mean"] <= tolerances("bf16", "fp32")[0]
