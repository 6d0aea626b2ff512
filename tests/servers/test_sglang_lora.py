"""A LoRA policy against the strict fake SGLang server with SGLang's LoRA serving
(tests/helpers/fake_sglang_server.py): the fake holds SGLang's adapter API to its real behaviour
(what it refuses, and the adapter applied as peft applies it); the weight sync sends the
adapters alone (``rollout.weight_sync.strategy=adapters``), each version loaded under its own
name beside the base and the previous one unloaded, every request names it, the trainer's
weight check holds after every sync at fp32 rounding, and the run's exported adapters served by
the fake give peft's log-probs."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from megatron_entropy.models.lora_settings import LoraSettings
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.server.partial import version_runs
from megatron_entropy.rollout.server.sglang import SGLangEngine, lora_serving
from megatron_entropy.trainer.weight_check import tolerances
from fake_sglang import fake_command, make_cfg, post, requests_of, start_fake
from serving_model import check_adapter_syncs, exported_peft, make_served_model, reference

PROMPT = [5, 6, 7, 8]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_served_model(tmp_path_factory.mktemp("sglang_lora") / "base", seed=0)


def _peft_adapter(base: Path, out: Path, rank: int, modules: list[str], seed: int = 0):
    """A PEFT adapter with random A and B on ``base`` saved in ``out``; the peft model."""
    import transformers
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules,
                                          init_lora_weights=False)).eval()
    model.save_pretrained(out)
    return model


def _generate(url: str, lora: str = None, n_new: int = 8) -> tuple[int, object]:
    body = {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": n_new, "temperature": 0.0}}
    return post(f"{url}/generate", {**body, **({"lora_path": lora} if lora else {})})


def _served(url: str, lora: str = None) -> tuple[list[int], list[float]]:
    status, answer = _generate(url, lora)
    assert status == 200, answer
    return answer["output_ids"], [e[0] for e in answer["meta_info"]["output_token_logprobs"]]


def _drift(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b)) / len(b)


def test_the_fake_serves_adapters_as_sglang_does(base, tmp_path):
    attention = _peft_adapter(base, tmp_path / "attn", 4, ["q_proj", "v_proj", "o_proj"])
    _peft_adapter(base, tmp_path / "rank8", 8, ["q_proj"])
    _peft_adapter(base, tmp_path / "mlp", 4, ["down_proj"])
    proc, url = start_fake(base, 32800, extra=(
        "--enable-lora", "--max-lora-rank", "4", "--lora-target-modules", "q_proj", "k_proj",
        "v_proj", "o_proj", "--max-loras-per-batch", "1", "--max-loaded-loras", "2"))
    plain, plain_url = start_fake(base, 32820)
    try:
        status, answer = _generate(url, "a")
        assert status == 400 and answer["error"]["message"].startswith(
            "The following requested LoRA adapters are not loaded: a")
        status, answer = post(f"{url}/load_lora_adapter",
                              {"lora_name": "a", "lora_path": str(tmp_path / "attn")})
        assert status == 200 and answer["success"] and answer["loaded_adapters"] == {
            "a": str(tmp_path / "attn")}
        # The adapter is applied as peft applies it; the base without one.
        ids, served = _served(url, "a")
        expected, tol = reference(attention, PROMPT, ids)
        assert _drift(served, expected) <= tol
        with attention.disable_adapter():
            base_ids, base_served = _served(url)
            base_expected, tol = reference(attention, PROMPT, base_ids)
            assert _drift(base_served, base_expected) <= tol
            assert _drift(served, reference(attention, PROMPT, ids)[0]) > 10 * tol
        # A name that is loaded, a rank above --max-lora-rank, a module outside
        # --lora-target-modules: 400, nothing loaded.
        for name, folder, why in [
                ("a", "attn", "Failed to load LoRA adapter a because it is already loaded"),
                ("b", "rank8", "LoRA adapter b with rank 8 is incompatible"),
                ("c", "mlp", "LoRA adapter c with rank 4 is incompatible")]:
            status, answer = post(f"{url}/load_lora_adapter",
                                  {"lora_name": name, "lora_path": str(tmp_path / folder)})
            assert status == 400 and not answer["success"] \
                and answer["error_message"].startswith(why), answer
        assert post(f"{url}/load_lora_adapter", {"lora_name": "a"})[0] == 422
        # Unloaded: requests naming it are refused, a second unload too.
        assert post(f"{url}/unload_lora_adapter", {"lora_name": "a"})[0] == 200
        assert _generate(url, "a")[0] == 400
        status, answer = post(f"{url}/unload_lora_adapter", {"lora_name": "a"})
        assert status == 400 and answer["error_message"].startswith("LoRA with name a does not")
        # A server without --enable-lora loads nothing (and ignores lora_path, as SGLang).
        status, answer = post(f"{plain_url}/load_lora_adapter",
                              {"lora_name": "a", "lora_path": str(tmp_path / "attn")})
        assert status == 400 and "Please set `--enable-lora`" in answer["error_message"]
        assert _served(plain_url, "a") == (base_ids, base_served)
    finally:
        for p in (proc, plain):
            p.terminate()
            p.wait(30)


ATTENTION = ["k_proj", "o_proj", "q_proj", "v_proj"]  # linear_qkv and linear_proj in HF names


def _assert_each_server_serves(engine: SGLangEngine, model) -> None:
    """Each server's sampled tokens have ``model``'s log-probs (a peft model), at fp32
    rounding."""
    sampling = SamplingParams(max_new_tokens=8, seed=0)
    for replica, rows in engine.generate_on_each_replica([PROMPT], sampling).items():
        completion = rows[0][0]
        expected, tol = reference(model, PROMPT, completion.token_ids)
        assert _drift(completion.logprobs, expected) <= tol, replica


def test_each_version_loads_under_its_name_and_a_restarted_server_loads_the_newest(base,
                                                                                   tmp_path):
    log = tmp_path / "requests.jsonl"
    v1 = _peft_adapter(base, tmp_path / "v1", 4, ATTENTION, seed=1)
    v2 = _peft_adapter(base, tmp_path / "v2", 4, ATTENTION, seed=2)
    cfg = lora_serving(make_cfg(launch=2, base_port=32880,
                                launch_command=fake_command(log=str(log))),
                       LoraSettings(rank=4, targets=["linear_qkv", "linear_proj"]))
    engine = SGLangEngine(cfg, str(base), str(tmp_path))
    try:
        engine.load_adapter(tmp_path / "v1", 1)
        _assert_each_server_serves(engine, v1)
        victim = engine.pool.servers[1]
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.wait()
        engine.generate([PROMPT], SamplingParams(max_new_tokens=2))  # restarts it
        assert victim.restarts == 1 and victim.weight_version == "1"
        _assert_each_server_serves(engine, v1)  # it started with --lora-paths
        engine.load_adapter(tmp_path / "v2", 2)
        _assert_each_server_serves(engine, v2)
        assert [b["lora_name"] for b in requests_of(log, "/load_lora_adapter")] == \
            ["policy-lora-v1"] * 2 + ["policy-lora-v2"] * 2
        assert [b["lora_name"] for b in requests_of(log, "/unload_lora_adapter")] == \
            ["policy-lora-v1"] * 2
    finally:
        engine.shutdown()


def test_requests_aborted_at_a_sync_resume_on_the_new_version_s_adapters(base, tmp_path):
    """rollout.inflight_at_sync=abort: our requests in flight at an adapter sync are aborted
    and resumed after it, naming the new version's adapters (the previous ones are unloaded
    by then, and SGLang refuses a name that is not loaded)."""
    log = tmp_path / "requests.jsonl"
    _peft_adapter(base, tmp_path / "v1", 4, ATTENTION, seed=1)
    v2 = _peft_adapter(base, tmp_path / "v2", 4, ATTENTION, seed=2)
    cfg = lora_serving(make_cfg(launch=1, base_port=32900,
                                launch_command=fake_command(delay=0.05, log=str(log))),
                       LoraSettings(rank=4, targets=["linear_qkv", "linear_proj"]))
    engine = SGLangEngine(cfg, str(base), str(tmp_path))
    try:
        engine.load_adapter(tmp_path / "v1", 1)
        engine.pool.inflight_at_sync = "abort"
        result: dict = {}
        rollout = threading.Thread(target=lambda: result.update(out=engine.generate(
            [PROMPT, [9, 8, 7]], SamplingParams(temperature=0.0, max_new_tokens=12))))
        rollout.start()
        while engine.pool.dispatch.inflight_total < 2 and rollout.is_alive():
            time.sleep(0.02)
        time.sleep(0.2)  # a few tokens each
        engine.load_adapter(tmp_path / "v2", 2)
        rollout.join(timeout=120)
        assert "out" in result  # the rollout did not fail
        runs = [version_runs(c) for row in result["out"] for c in row]
        assert any([v for v, _ in r] == ["1", "2"] for r in runs), runs
        resumed = [b for b in requests_of(log, "/generate")
                   if b["input_ids"] not in (PROMPT, [9, 8, 7])]
        assert resumed and {b["lora_path"] for b in resumed} == {"policy-lora-v2"}
        for row in result["out"]:  # the tokens after the sync are v2's
            c = row[0]
            head = version_runs(c)[0][1] if version_runs(c)[0][0] == "1" else 0
            prompt = PROMPT if c is result["out"][0][0] else [9, 8, 7]
            if head < len(c.token_ids):
                expected, tol = reference(v2, prompt + c.token_ids[:head], c.token_ids[head:])
                assert _drift(c.logprobs[head:], expected) <= tol
    finally:
        engine.shutdown()


def _config(base: Path, run_dir: Path, log: Path) -> dict:
    return {
        "model": {"hf_path": str(base), "dtype": "fp32", "seq_length": 256,
                  "lora": {"rank": 4, "alpha": 8}},
        "rollout": {"engine": "sglang", "n_samples": 4, "max_new_tokens": 12,
                    "max_prompt_tokens": 96,
                    "server": {"launch": 1, "base_port": 32840, "startup_timeout_s": 120,
                               "request_timeout_s": 120,
                               "launch_command": fake_command(log=str(log))},
                    "weight_sync": {"strategy": "adapters"}},
        # The entropy bonus moves the adapters though the random model earns no reward.
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05, "entropy_coef": 0.5},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 64}},
        "trainer": {"steps": 2, "lr": 5e-2, "micro_batch_tokens": 400, "save_interval": 2},
        "logging": {"name": "adapters", "runs_dir": str(run_dir), "progress_bar": False},
    }


def test_adapter_sync_serves_the_trainers_adapters(base, tmp_path):
    from harness import run_distributed, train_from_dict

    log = tmp_path / "requests.jsonl"
    run_distributed(train_from_dict, 1, _config(base, tmp_path, log), timeout=900)
    # fp32 actor, fp32 fake: rounding only
    check_adapter_syncs(tmp_path / "adapters", base, tolerances("fp32", "fp32")[0])
    # Each version under its own name, the previous one unloaded once the new one serves;
    # every request after the first load names the version loaded last.
    loads = [b["lora_name"] for b in requests_of(log, "/load_lora_adapter")]
    assert loads == [f"policy-lora-v{i}" for i in range(1, len(loads) + 1)] and loads
    assert [b["lora_name"] for b in requests_of(log, "/unload_lora_adapter")] == loads[:-1]
    current = None
    for row in map(json.loads, log.read_text().splitlines()):
        if row["path"] == "/load_lora_adapter":
            current = row["body"]["lora_name"]
        elif row["path"] == "/generate":
            assert row["body"].get("lora_path") == current

    # The run's exported adapters, served by the fake, give peft's log-probs on the HF base.
    peft_dir = tmp_path / "peft"
    trained = exported_peft(tmp_path / "adapters", base, peft_dir)
    proc, url = start_fake(base, 32860, extra=("--lora-paths", f"trained={peft_dir}"))
    try:
        ids, served = _served(url, "trained")
    finally:
        proc.terminate()
        proc.wait(30)
    expected, tol = reference(trained, PROMPT, ids)
    assert _drift(served, expected) <= tol
    # ... and the adapters matter: the base's log-probs of the same tokens are far from them.
    with trained.disable_adapter():
        assert _drift(served, reference(trained, PROMPT, ids)[0]) > 10 * tol
