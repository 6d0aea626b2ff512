"""Multi-turn rollouts with tools on server engines, with the scripted tool-calling model
(megatron_entropy/testing/tool_script.py): a real vLLM server runs the three-turn trajectory
with the calculator and the code tool, and the RL loop trains on it; the fake SGLang server is
sent the calls a real one gets (token ids in, the turn's stop, its budget) and gives the
in-process engine's trajectories; a trajectory aborted at a weight push resumes with the same
prefix."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import transformers

from fake_sglang import fake_command, make_cfg
from harness import metrics_rows, run_distributed, train_from_dict
from serving_model import push_weights

from megatron_entropy.config import ServerConfig, load_config
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.server.partial import version_runs
from megatron_entropy.testing import tool_script
from megatron_entropy.tool_use.engine import build_rollout_engine
from megatron_entropy.tool_use.metrics import turn_runs

VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
TOOLS = {"names": ["calculator", "python"], "format": "plain", "workers": 2}
GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=48)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model():
    return tool_script.hf_dir()


@pytest.fixture(scope="module")
def prompts(model):
    tok = transformers.AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    return [tok.encode(tool_script.question(a, b), add_special_tokens=False)
            for a, b in tool_script.PROMPTS[:3]]


@pytest.fixture(scope="module")
def reference(model, prompts, tmp_path_factory):
    """The in-process engine's greedy trajectories."""
    cfg = load_config(data={"rollout": {"tools": TOOLS}})
    engine = build_rollout_engine(cfg.rollout, model, tmp_path_factory.mktemp("inprocess"))
    try:
        return [c for (c,) in engine.generate(prompts, GREEDY)]
    finally:
        engine.shutdown()


def _server_engine(kind: str, server: ServerConfig, model: Path, run_dir: Path):
    cfg = load_config(data={"rollout": {"engine": kind, "server": dataclasses.asdict(server),
                                        "tools": TOOLS}})
    return build_rollout_engine(cfg.rollout, model, run_dir)


# ------------------------------------------------------------------ vLLM


@pytest.mark.vllm
@pytest.mark.skipif(not VENV_PYTHON.exists(),
                    reason="no .venv-vllm: run .ci/setup-vllm.sh (tests/run.sh does)")
def test_vllm_runs_a_three_turn_trajectory_and_trains_on_it(model, prompts, reference,
                                                            tmp_path):
    server = ServerConfig(
        launch=1, server_python=str(VENV_PYTHON), base_port=32700, max_model_len=256,
        extra_args=["--enforce-eager"], startup_timeout_s=600, request_timeout_s=120,
        extra_env=["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind",
                   "HF_HUB_OFFLINE=1"])
    engine = _server_engine("vllm", server, model, tmp_path / "engine")
    try:
        out = [c for (c,) in engine.generate(prompts, GREEDY)]
        # bf16 serving, the same greedy trajectories: 3 turns, the tools' results inserted.
        for c, ref in zip(out, reference):
            assert (c.token_ids, c.loss_mask) == (ref.token_ids, ref.loss_mask)
            assert c.meta["trajectory"].turns == 3 and c.meta["trajectory"].errors == 0
            assert len(turn_runs(c.loss_mask)) == 3 and c.meta["server"] == 0
        cfg = {
            "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 96},
            "rollout": {"engine": "vllm", "n_samples": 2, "max_new_tokens": 48,
                        "max_prompt_tokens": 32, "tools": TOOLS,
                        "server": {"urls": [engine.pool.servers[0].url],
                                   "request_timeout_s": 120, "startup_timeout_s": 60}},
            "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.1},
            "data": {"train_files": [str(model / "prompts.jsonl")], "apply_chat_template": False,
                     "prompt_suffix": "", "prompts_per_step": 5, "dynamic_sampling": False},
            "trainer": {"steps": 2, "lr": 1e-4, "micro_batch_tokens": 1024},
            "logging": {"name": "vllm_tools", "runs_dir": str(tmp_path), "progress_bar": False},
        }
        run_distributed(train_from_dict, 1, cfg, timeout=600)
    finally:
        engine.shutdown()
    rows = metrics_rows(tmp_path / "vllm_tools")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        # Sampled at T = 1: now and then a call goes wrong (the scripted model is sure, not
        # certain); most responses run the script's three turns and two calls.
        assert r["tools/turns_mean"] > 2.5 and r["tools/calls_mean"] > 1.5
        assert r["tools/errors"] <= 4 and r["tools/token_frac"] > 0
        # The generated tokens only: bf16 serving against the fp32 actor.
        assert r["rollout/logprob_drift"] < 2e-2 and r["weight_sync/seconds"] > 0
        assert r["weight_check/rollout_drift_mean"] < 2e-2


# ------------------------------------------------------------------ SGLang (the fake)


def test_the_fake_sglang_server_speaks_the_multi_turn_calls(model, prompts, reference,
                                                            tmp_path):
    log = tmp_path / "requests.jsonl"
    engine = _server_engine("sglang", make_cfg(base_port=32800,
                                               launch_command=fake_command(log=str(log))),
                            model, tmp_path)
    try:
        out = [c for (c,) in engine.generate(prompts, GREEDY)]
    finally:
        engine.shutdown()
    for c, ref in zip(out, reference):
        assert (c.token_ids, c.loss_mask, c.text) == (ref.token_ids, ref.loss_mask, ref.text)
    # Each turn one /generate: token ids in (the prompt and the trajectory so far), the format's
    # stop, the budget left; as SGLang 0.5's API takes them.
    bodies = [e["body"] for e in map(json.loads, log.read_text().splitlines())
              if e["path"] == "/generate"]
    for prompt, c in zip(prompts, out):
        starts = [start for start, _ in turn_runs(c.loss_mask)]
        sent = [b for b in bodies if b["input_ids"][:len(prompt)] == prompt]
        assert [b["input_ids"] for b in sent] == [prompt + c.token_ids[:s] for s in starts]
        assert [b["sampling_params"]["max_new_tokens"] for b in sent] == [48 - s for s in starts]
        assert all(b["sampling_params"]["stop"] == ["</call>"] and b["return_logprob"]
                   for b in sent)


def test_a_trajectory_aborted_at_a_sync_resumes_with_the_same_prefix(model, prompts,
                                                                      reference, tmp_path):
    """Token by token slowly, with inflight_at_sync=abort: the same weights pushed as version 1
    while turns are in flight. Aborted turns are resumed from the tokens they had (prompt,
    trajectory so far, kept tokens), so every trajectory is the one never aborted; some carry
    tokens of both versions."""
    log = tmp_path / "requests.jsonl"
    server = make_cfg(base_port=32900, launch_command=fake_command(delay=0.05, log=str(log)))
    engine = _server_engine("sglang", server, model, tmp_path)
    try:
        engine.pool.inflight_at_sync = "abort"
        result: dict = {}
        rollout = threading.Thread(target=lambda: result.update(
            out=engine.generate(prompts, GREEDY)))
        rollout.start()
        deadline = time.monotonic() + 120
        # Past the first turns (about 7 tokens each): the second turns run, after a result.
        while json.load(urllib.request.urlopen(
                f"{engine.pool.servers[0].url}/fake/state"))["decoded"] < 30:
            assert rollout.is_alive() and time.monotonic() < deadline
            time.sleep(0.02)
        from safetensors.torch import load_file
        push_weights(engine.inner, load_file(str(model / "model.safetensors")).items(), 1,
                     tmp_path)
        rollout.join(timeout=120)
        assert not rollout.is_alive()
    finally:
        engine.shutdown()
    out = [c for (c,) in result["out"]]
    for c, ref in zip(out, reference):
        assert (c.token_ids, c.loss_mask) == (ref.token_ids, ref.loss_mask)
    resumed = [c for c in out if len({v for v, _ in version_runs(c)}) == 2]
    assert resumed
    bodies = [e["body"] for e in map(json.loads, log.read_text().splitlines())
              if e["path"] == "/generate"]
    for c in resumed:
        # A resumed turn's request: the prompt, then the trajectory up to where it was aborted.
        prompt = next(p for p in prompts if c.token_ids and p == prompts[out.index(c)])
        starts = {s for s, _ in turn_runs(c.loss_mask)}
        cut = [b for b in bodies if b["input_ids"][:len(prompt)] == prompt
               and len(b["input_ids"]) - len(prompt) not in starts]
        assert cut and all(b["input_ids"] == prompt + c.token_ids[:len(b["input_ids"])
                                                                  - len(prompt)] for b in cut)


def test_async_rollouts_run_the_tool_loop_ahead_and_train_on_generated_tokens(model, tmp_path):
    """rollout.max_staleness=1 with tools: the next step's multi-turn rollouts are generated in
    the background while the current step trains (staleness 1 from step 2 on), their tool
    results still inserted and masked: the drift between the server's and the trainer's
    log-probs, over generated tokens only, stays at one update's size (the inserted tokens
    have no engine log-prob; counted in, they would dominate it)."""
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 96},
        "rollout": {"engine": "sglang", "max_staleness": 1, "inflight_at_sync": "abort",
                    "n_samples": 2, "temperature": 1.0, "max_new_tokens": 48,
                    "max_prompt_tokens": 32, "tools": TOOLS,
                    "server": {"launch": 1, "base_port": 33000, "startup_timeout_s": 120,
                               "launch_command": fake_command()}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.1},
        "data": {"train_files": [str(model / "prompts.jsonl")], "apply_chat_template": False,
                 "prompt_suffix": "", "prompts_per_step": 5, "dynamic_sampling": False},
        "trainer": {"steps": 3, "lr": 1e-4, "micro_batch_tokens": 1024, "save_interval": 0},
        "logging": {"name": "async_tools", "runs_dir": str(tmp_path), "progress_bar": False},
    }
    run_distributed(train_from_dict, 1, cfg, timeout=600)
    rows = metrics_rows(tmp_path / "async_tools")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["tools/turns_mean"] > 2.5 and r["tools/calls_mean"] > 1.5
        assert r["tools/token_frac"] > 0
        assert r["rollout/logprob_drift"] < 2e-2
    # Step 1's rollouts come from the weights it trains (measured 2e-7; one update later 6e-4).
    assert rows[0]["async/staleness_max"] == 0 and rows[0]["rollout/logprob_drift"] < 1e-3
    assert max(r["async/staleness_max"] for r in rows[1:]) == 1
