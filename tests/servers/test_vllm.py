"""VLLMEngine against a real vLLM CPU server (.venv-vllm from .ci/setup-vllm.sh), bf16 serving.

One server for the module (start-up ~30 s). Checks: completions and log-probs against an fp32
transformers reference; a weight sync with inflight_at_sync=abort aborts the rollout in flight
and resumes it on the new weights (old greedy prefix + new greedy continuation, each within
bf16 drift of its own weights); after it the greedy output and the log-probs follow the new
weights (drift <= 1e-2); the server killed by its PID mid-rollout is restarted from the newest
weights and every sample comes back once; the trainer's weight check catches a checkpoint
reloaded behind the engine's back; RL steps log the weight check's drift and cost. (The
shipped vLLM quickstart example runs with a real vLLM server as a Slurm job:
tests/slurm/test_slurm_jobs.py.)
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.server.vllm import VLLMEngine
from serving_model import make_served_model, push_weights, reference_logprobs

VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
PLUGINS = Path(__file__).resolve().parents[1] / "helpers" / "vllm_plugins"
PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 7, 3, 9, 12]]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(not VENV_PYTHON.exists(),
                       reason="no .venv-vllm: run .ci/setup-vllm.sh (tests/run.sh does)"),
]


def drift(engine_logprobs: list[float], reference: list[float]) -> float:
    return sum(abs(a - b) for a, b in zip(engine_logprobs, reference)) / len(reference)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("vllm_models")
    paths = {"a": make_served_model(root / "a", seed=0), "b": make_served_model(root / "b", seed=1)}
    loaded = {k: transformers.AutoModelForCausalLM.from_pretrained(
        p, local_files_only=True, dtype=torch.float32).eval() for k, p in paths.items()}
    return {**paths, "model_a": loaded["a"], "model_b": loaded["b"]}


@pytest.fixture(scope="module")
def slow_gate(tmp_path_factory) -> Path:
    """While this file exists the module's server slows its steps down after the first few
    (tests/helpers/vllm_plugins/slow_steps.py), so a rollout stays in flight until the test
    has acted on it."""
    return tmp_path_factory.mktemp("vllm_gate") / "slow"


@pytest.fixture(scope="module")
def engine(models, slow_gate, tmp_path_factory):
    cfg = ServerConfig(
        launch=1, server_python=str(VENV_PYTHON), base_port=32500, max_model_len=256,
        extra_args=["--enforce-eager", "--logits-processors", "slow_steps:SlowSteps"],
        max_concurrency=16, startup_timeout_s=600,
        request_timeout_s=120, health_check_interval_s=1.0, health_timeout_s=10,
        extra_env=["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind",
                   "HF_HUB_OFFLINE=1", f"PYTHONPATH={PLUGINS}", f"SLOW_STEPS_GATE={slow_gate}"])
    eng = VLLMEngine(cfg, str(models["a"]), str(tmp_path_factory.mktemp("vllm_run")))
    yield eng
    eng.shutdown()


def test_generate_logprobs_match_reference(engine, models):
    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=12, seed=7,
                              stop_token_ids=(2,))
    out = engine.generate(PROMPTS, sampling)
    assert [len(row) for row in out] == [3, 3, 3]
    drifts = []
    for prompt, row in zip(PROMPTS, out):
        for c in row:
            assert 1 <= len(c.token_ids) == len(c.logprobs) <= 12
            assert c.finish_reason == ("stop" if c.token_ids[-1] == 2 else "length")
            drifts.append(drift(c.logprobs, reference_logprobs(models["model_a"], prompt,
                                                               c.token_ids)))
    print(f"vLLM bf16 vs fp32 reference, T=1: mean |dlogp| {sum(drifts) / len(drifts):.2e}")
    assert sum(drifts) / len(drifts) <= 1e-2
    # Per-sample seeds reproduce the samples; another seed gives others.
    again = engine.generate(PROMPTS, sampling)
    assert [[c.token_ids for c in r] for r in again] == [[c.token_ids for c in r] for r in out]
    other = engine.generate(PROMPTS, SamplingParams(n=3, temperature=1.0, max_new_tokens=12,
                                                    seed=8, stop_token_ids=(2,)))
    assert [[c.token_ids for c in r] for r in other] != [[c.token_ids for c in r] for r in out]
    assert engine.metrics()["rollout/tokens_per_s"] > 0


def greedy_sample_drift(model, prompt: list[int], token_ids: list[int],
                        logprobs: list[float]) -> float:
    """Greedy tokens are the model's argmax at every step (up to a bf16 near-tie of 0.05
    nats); returns their mean |log-prob - reference|."""
    ids = torch.tensor([prompt + token_ids])
    with torch.no_grad():
        lp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), -1)
    chosen = lp.gather(1, torch.tensor(token_ids)[:, None])[:, 0]
    assert bool((chosen >= lp.max(-1).values - 0.05).all()), "not the greedy tokens"
    return drift(logprobs, chosen.tolist())


def greedy_drift(engine, model) -> float:
    """Greedy completions' mean `greedy_sample_drift`."""
    out = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=8))
    drifts = [greedy_sample_drift(model, prompt, c.token_ids, c.logprobs)
              for prompt, (c,) in zip(PROMPTS, out)]
    return sum(drifts) / len(drifts)


def post(engine, path: str) -> None:
    urllib.request.urlopen(urllib.request.Request(engine.pool.servers[0].url + path, data=b"",
                                                  method="POST"), timeout=60).read()


def push_aborting_a_rollout(engine, models, slow_gate: Path, max_new: int = 240):
    """inflight_at_sync=abort: a greedy rollout (model a does not stop within 240 tokens; b's
    continuation of a's prefix may end on EOS, as vLLM's finish reason `stop` says) runs in a
    thread while model b is pushed as version 1. The push must find it in flight on any
    machine: with the slow gate set, the server makes its first 8 steps at full speed, then
    signals and makes each step last 0.05 s (240 steps: 12 s; unslowed they take ~1 s on a fast
    machine, where a test that polled the server's progress saw the rollout end before it
    acted). The test then freezes the server (`/pause?mode=keep`, as another client may), lifts
    the gate and pushes; the push's own pause and resume replace the freeze. Our requests in
    flight are aborted (/abort_requests by id), vLLM answers them with the tokens and log-probs
    they had, and they resume on the new weights: each sample is a's greedy prefix (tagged with
    the launch version, None) then b's greedy continuation of it (tagged 1), each token's
    log-prob within bf16 drift of its own weights'. Returns the push's stats."""
    engine.pool.run_in_background()
    engine.pool.inflight_at_sync = "abort"
    result: dict = {}
    rollout = threading.Thread(target=lambda: result.update(out=engine.generate(
        PROMPTS, SamplingParams(temperature=0.0, max_new_tokens=max_new))))
    reached = slow_gate.with_name(slow_gate.name + ".reached")
    reached.unlink(missing_ok=True)
    frozen = pushed = False
    try:
        slow_gate.touch()
        rollout.start()
        deadline = time.monotonic() + 120
        while not reached.exists():  # each request has its first tokens
            assert time.monotonic() < deadline and rollout.is_alive()
            time.sleep(0.01)
        post(engine, "/pause?mode=keep")
        frozen = True
        slow_gate.unlink()
        assert rollout.is_alive()
        stats = push_weights(engine, models["model_b"].state_dict().items(), 1,
                             engine.pool.dir.parent)
        pushed = True
        rollout.join(timeout=300)
        assert not rollout.is_alive()
        resumed = engine.metrics()["rollout/aborted_resumed"]
    finally:
        slow_gate.unlink(missing_ok=True)
        if frozen and not pushed:
            post(engine, "/resume")  # the tests after this one need a server that generates
        engine.pool.inflight_at_sync = "finish"
        engine.pool.runner.stop_loop()  # the other tests run on the default dispatch
    partial = 0
    for prompt, (c,) in zip(PROMPTS, result["out"]):
        n = len(c.token_ids)
        assert n == len(c.logprobs)
        assert (n == max_new and c.finish_reason == "length") or (
            n < max_new and c.finish_reason == "stop"), (n, c.finish_reason)
        runs = c.meta.get("version_runs", [(c.meta["weight_version"], n)])
        assert [v for v, _ in runs] in ([None, 1], [None], [1]), runs
        assert sum(k for _, k in runs) == n, runs
        head = runs[0][1] if runs[0][0] is None else 0
        partial += 0 < head < n
        for model, before, part in (("model_a", prompt, slice(0, head)),
                                    ("model_b", prompt + c.token_ids[:head],
                                     slice(head, n))):
            if c.token_ids[part]:
                assert greedy_sample_drift(models[model], before, c.token_ids[part],
                                           c.logprobs[part]) <= 1e-2, model
    print(f"vLLM abort at a push: {partial} of {len(PROMPTS)} samples resumed, version runs "
          f"{[c.meta.get('version_runs') for (c,) in result['out']]}")
    assert partial >= 1 and resumed == partial
    return stats


def test_weight_sync_follows_new_weights(engine, models, slow_gate):
    assert greedy_drift(engine, models["model_a"]) <= 1e-2
    stats = push_aborting_a_rollout(engine, models, slow_gate)
    assert stats["weight_sync/bytes"] == sum(t.numel() * 4 for t in
                                             models["model_b"].state_dict().values())
    after = greedy_drift(engine, models["model_b"])
    print(f"vLLM after weight sync: greedy mean |dlogp| vs new weights {after:.2e} "
          f"({stats['weight_sync/seconds']:.2f} s)")
    assert after <= 1e-2
    # ... and the old weights' log-probs are far from what the server now returns.
    out = engine.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_new_tokens=8))
    c = out[0][0]
    assert drift(c.logprobs, reference_logprobs(models["model_a"], PROMPTS[0], c.token_ids)) > 0.1
    assert c.meta["weight_version"] == 1


def test_server_killed_mid_rollout_restarts_from_newest_weights(engine, models):
    server = engine.pool.servers[0]
    old_pid = server.process.pid
    done_before = server.requests

    def kill_mid_rollout():
        # After 8 of the 64 requests came back: at most 16 are in flight, so 40+ are left.
        deadline = time.monotonic() + 300
        while server.requests < done_before + 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(old_pid, signal.SIGKILL)
    killer = threading.Thread(target=kill_mid_rollout, daemon=True)
    killer.start()
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(16)]
    out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=64,
                                                  seed=11))
    killer.join()
    assert [len(row) for row in out] == [4] * 16
    assert all(len(c.token_ids) == len(c.logprobs) >= 1 for row in out for c in row)
    metrics = engine.metrics()
    assert metrics["rollout/retries"] >= 1 and metrics["rollout/server_restarts"] == 1
    assert server.process.pid != old_pid and server.state == "up"
    # The restarted server loaded the synced weights (version 1 = model b), not the original.
    assert greedy_drift(engine, models["model_b"]) <= 1e-2


def test_weight_check_catches_weights_reloaded_behind_its_back(engine, models, tmp_path):
    """The trainer's weight check (a Megatron actor scoring the probe) against the real server:
    it passes on the weights the server holds (model b, bf16 serving vs the fp32 actor), and
    after another checkpoint is loaded behind the engine's back with the server's own reload
    endpoint, it fails with an error naming the server."""
    from harness import run_distributed
    from serving_model import probe_served_weights

    def reload(eng, folder) -> None:
        eng.pool.call_all("/collective_rpc", {"method": "reload_weights",
                                              "kwargs": {"weights_path": str(folder)}})
        eng.pool.call_all("/reset_prefix_cache")

    try:
        first, error = run_distributed(probe_served_weights, 1, "vllm", str(models["b"]),
                                       [engine.pool.servers[0].url], str(tmp_path),
                                       lambda eng: reload(eng, models["a"]), timeout=300)[0]
    finally:
        reload(engine, models["b"])
    print(f"probe on correct weights: {first}\n{error}")
    assert first["weight_check/replicas"] == 1 and first["weight_check/drift_mean"] <= 1e-2
    assert error.startswith("weight check after a sync: the rollout engine's log-probs disagree")
    assert f"server 0 ({engine.pool.servers[0].url}" in error
    assert greedy_drift(engine, models["model_b"]) <= 1e-2  # restored for the next tests


def test_rl_steps_with_vllm_engine(engine, models, tmp_path):
    """A few RL steps (real Megatron actor, gloo) rolling out on the module's vLLM server: the
    trainer connects to it by URL, syncs its weights after every step, and the server's
    log-probs stay within 1e-2 of the actor's recompute."""
    from harness import metrics_rows, run_distributed, train_from_dict

    # The server holds model b now (synced, then restarted from it): train from that folder.
    cfg = {
        "model": {"hf_path": str(models["b"]), "dtype": "fp32", "seq_length": 256},
        "rollout": {"engine": "vllm", "n_samples": 4, "max_new_tokens": 12,
                    "max_prompt_tokens": 96,
                    "server": {"urls": [engine.pool.servers[0].url], "request_timeout_s": 120,
                               "startup_timeout_s": 60}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05, "entropy_coef": 0.01},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 64}},
        "trainer": {"steps": 3, "lr": 1e-3, "micro_batch_tokens": 400},
        "logging": {"name": "vllm_rl", "runs_dir": str(tmp_path), "progress_bar": False},
    }

    run_distributed(train_from_dict, 1, cfg, timeout=600)
    rows = metrics_rows(tmp_path / "vllm_rl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        print(f"step {r['step']}: drift {r['rollout/logprob_drift']:.2e} "
              f"(max {r['rollout/logprob_drift_max']:.2e}), "
              f"{r['rollout/tokens_per_s']:.0f} tokens/s, sync {r['weight_sync/seconds']:.2f} s, "
              f"weight check {r['weight_check/seconds']:.2f} s of a {r['time/step']:.2f} s step "
              f"(probe drift {r['weight_check/drift_mean']:.2e})")
        assert r["rollout/logprob_drift"] <= 1e-2
        assert r["rollout/tokens_per_s"] > 0 and r["weight_sync/seconds"] > 0
        assert r["weight_check/drift_mean"] <= 1e-2 and r["weight_check/seconds"] > 0
