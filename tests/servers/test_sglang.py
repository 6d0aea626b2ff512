"""SGLangEngine against the strict fake SGLang 0.5.x server (tests/helpers/fake_sglang_server.py).

The fake serves the checkpoint in fp32 (Qwen2's forward), so completions and their log-probs are
checked against a transformers fp32 reference here, weight syncs (from disk, and by a real gloo
broadcast) against the new weights, and faults with real processes killed or stopped by PID.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import sys
import threading
import time
import urllib.error
from pathlib import Path

import psutil
import pytest
import torch

from megatron_entropy.config import WeightSyncConfig
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.server import supervisor
from megatron_entropy.rollout.server.errors import RequestRejected, ServerError
from megatron_entropy.rollout.server.partial import version_runs
from megatron_entropy.rollout.server.sglang import SGLangEngine, weight_sync_address
from megatron_entropy.runtime.seeds import sample_seed
from fake_sglang import fake_command, greedy_reference, make_cfg, post, requests_of, start_fake
from serving_model import push_weights, reference

PROMPTS = [[5, 6, 7, 8], [40, 41], [100, 7, 3, 9, 12]]


def assert_follows(engine, model, prompts=PROMPTS, n_new=8) -> None:
    """Greedy completions equal the reference model's; their log-probs match it up to rounding."""
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=n_new))
    for prompt, (c,) in zip(prompts, out):
        assert c.token_ids == greedy_reference(model, prompt, n_new)[:len(c.token_ids)]
        ref, tol = reference(model, prompt, c.token_ids)
        assert max(abs(x - y) for x, y in zip(c.logprobs, ref)) <= tol


@pytest.fixture(scope="module")
def engine(models, tmp_path_factory):
    run = tmp_path_factory.mktemp("sglang_run")
    log = run / "requests.jsonl"
    eng = SGLangEngine(make_cfg(launch=2, launch_command=fake_command(log=str(log))),
                       str(models["a"]), str(run))
    eng.request_log = log
    yield eng
    eng.shutdown()


def test_generate_matches_reference_and_sends_valid_requests(engine, models):
    sampling = SamplingParams(n=3, temperature=0.7, max_new_tokens=12, seed=5,
                              stop_token_ids=(2,))
    out = engine.generate(PROMPTS, sampling)
    assert [len(row) for row in out] == [3, 3, 3]
    for prompt, row in zip(PROMPTS, out):
        for c in row:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            ref, tol = reference(models["model_a"], prompt, c.token_ids, temperature=0.7)
            assert max(abs(x - y) for x, y in zip(c.logprobs, ref)) <= tol
            assert c.finish_reason == ("stop" if c.token_ids[-1] == 2 else "length")
            if c.finish_reason == "length":
                assert len(c.token_ids) == 12
    # Per-sample seeds: sample j of prompt i carries sample_seed(5, i, j); reruns reproduce.
    sent = requests_of(engine.request_log, "/generate")[-9:]
    assert sorted(r["sampling_params"]["sampling_seed"] for r in sent) == sorted(
        sample_seed(5, i, j) for i in range(3) for j in range(3))
    assert all(r["return_logprob"] is True and r["sampling_params"]["n"] == 1 for r in sent)
    again = engine.generate(PROMPTS, sampling)
    assert [[c.token_ids for c in row] for row in again] == [[c.token_ids for c in row]
                                                             for row in out]
    # Both servers took requests (least-loaded dispatch).
    metrics = engine.metrics()
    assert metrics["rollout/server0/requests"] > 0 and metrics["rollout/server1/requests"] > 0
    assert metrics["rollout/tokens_per_s"] > 0


def test_greedy_and_invalid_request(engine, models):
    assert_follows(engine, models["model_a"])
    with pytest.raises(RequestRejected, match="top_k must be -1 .disable. or at least 1"):
        engine.generate([[5, 6]], SamplingParams(top_k=0, max_new_tokens=2))
    # Never sent (an SGLang server dies of one): the engine says which prompt and ids.
    before = len(requests_of(engine.request_log, "/generate"))
    with pytest.raises(RequestRejected, match=r"prompt 1 holds token ids \[100000, -1\] outside "
                                              r"the model's vocabulary \[0, 512\): not sent"):
        engine.generate([[5, 6], [5, 100000, -1]], SamplingParams(max_new_tokens=2))
    assert len(requests_of(engine.request_log, "/generate")) == before


def test_fake_is_strict(engine):
    """The fake refuses what SGLang refuses, so passing tests mean valid requests."""
    import urllib.request

    url = engine.pool.servers[0].url
    # As a real 0.5.15 server: an unknown sampling key is a 500 with a plain-text body (a
    # TypeError inside SGLang), a bad pause mode a 400...
    status, body = post(url + "/generate", {"input_ids": [5, 6], "sampling_params": {
        "max_new_tokens": 2, "max_tokens": 2}})
    assert (status, body) == (500, "Internal Server Error")
    status, body = post(url + "/pause_generation", {"mode": "halt"})
    assert status == 400 and body["type"] == "BadRequestError"
    # ...its meta_info has the tokenizer manager's fields in their order, input_token_logprobs
    # is [] with logprob_start_len -1...
    status, body = post(url + "/generate", {"input_ids": [5, 6], "return_logprob": True,
                                            "logprob_start_len": -1,
                                            "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and list(body["meta_info"]) == [
        "id", "finish_reason", "prompt_tokens", "weight_version", "total_retractions",
        "input_token_logprobs", "output_token_logprobs", "output_token_logprobs_length",
        "completion_tokens", "cached_tokens", "e2e_latency"]
    assert body["meta_info"]["input_token_logprobs"] == []
    # ...and the weight version is in /model_info, /weight_version is 404.
    with urllib.request.urlopen(url + "/model_info", timeout=30) as r:
        assert "weight_version" in json.loads(r.read())
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(url + "/weight_version", timeout=30)
    status, _ = post(url + "/generate", {"sampling_params": {"max_new_tokens": 2}})
    assert status == 400
    status, body = post(url + "/update_weights_from_disk", {"load_format": "auto"})
    assert status == 422 and body["detail"][0]["loc"] == ["body", "model_path"]
    status, body = post(url + "/update_weights_from_distributed", {
        "names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "nope"})
    assert status == 400 and body["success"] is False


def test_an_idle_server_refusing_a_cache_flush_once_is_asked_again(engine, models, tmp_path,
                                                                  caplog):
    """A real server answered /flush_cache 400 "Flush cache failed." once on an idle server
    right after a request returned: the sync asks again, and nothing is left unflushed."""
    for server in engine.pool.servers:
        post(server.url + "/fake/flush_fails", {"count": 1})
    before = len(requests_of(engine.request_log, "/flush_cache"))
    push_weights(engine, models["model_a"].state_dict().items(), 7, tmp_path)
    assert "prefix cache not flushed" not in caplog.text
    assert len(requests_of(engine.request_log, "/flush_cache")) == before + 4  # 2 per server
    assert_follows(engine, models["model_a"])


def test_a_slow_weight_update_says_what_it_waits_for(engine, models, tmp_path, caplog,
                                                     monkeypatch):
    """A control call (here /update_weights_from_disk, 1.5 s late on each server: a large
    model's reload takes minutes) logs what it waits for every PROGRESS_S (30 s; 0.2 s here),
    as generation does; it used to wait up to request_timeout_s in silence."""
    monkeypatch.setattr(supervisor, "PROGRESS_S", 0.2)
    for server in engine.pool.servers:
        post(server.url + "/fake/update_delay", {"seconds": 1.5})
    try:
        with caplog.at_level(logging.WARNING):
            push_weights(engine, models["model_a"].state_dict().items(), 70, tmp_path)
    finally:
        for server in engine.pool.servers:
            post(server.url + "/fake/update_delay", {"seconds": 0.0})
    said = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("waiting for POST /update_weights_from_disk on ")]
    assert len(said) >= 3, caplog.text
    assert said[0].startswith("waiting for POST /update_weights_from_disk on 2 of 2 sglang "
                              "servers"), said[0]
    assert all(s.describe() in said[0] for s in engine.pool.servers), said[0]
    assert_follows(engine, models["model_a"])


def test_a_weight_probe_with_no_server_holding_the_current_weights_fails(engine, models,
                                                                        tmp_path):
    """After a sync, every server that is up came back after a fault with unknown weights (kept
    from requests until the next sync): the probe has no replica to check and says so, where it
    used to return nothing and the check passed with weight_check/replicas = 0."""
    push_weights(engine, models["model_a"].state_dict().items(), 71, tmp_path)
    held = {s.index: s.weight_version for s in engine.pool.servers}
    for server in engine.pool.servers:
        server.weight_version = None  # as ensure_up marks a connected server that came back
    try:
        with pytest.raises(ServerError) as failed:
            engine.generate_on_each_replica(PROMPTS, SamplingParams(max_new_tokens=2))
    finally:
        for server in engine.pool.servers:
            server.weight_version = held[server.index]
    message = str(failed.value)
    assert message.startswith("no sglang server to check: none that is up holds weight "
                              "version 71"), message
    assert all(f"{s.describe()}: up, weights None" in message for s in engine.pool.servers)


def test_an_out_of_vocabulary_id_kills_the_server(models):
    """As a real server's scheduler crashes on one (the engine never sends it: above)."""
    proc, url = start_fake(models["a"], 32450)
    try:
        with pytest.raises(OSError):
            post(url + "/generate", {"input_ids": [5, 512], "sampling_params": {}})
        assert proc.wait(timeout=30) == 1
    finally:
        proc.kill()
        proc.wait()


def test_an_abort_the_server_does_not_honour_is_sent_again_once_the_request_runs(
        models, tmp_path):
    """Another client paused the server in place; our request waits there when a weight push
    (inflight_at_sync=abort) aborts it. A real server does not abort a waiting request paused in
    place, so the push waits, sending the abort again each second; once the other client
    continues, the request runs, the next abort stops it after a token or more, and it is
    resumed on the new weights: a's greedy prefix, then b's continuation, each token tagged
    with its version. Our rids are prefix-free (SGLang aborts by prefix)."""
    log = tmp_path / "requests.jsonl"
    proc, url = start_fake(models["a"], 32460, delay=0.2, log=str(log))
    eng = SGLangEngine(make_cfg(launch=0, urls=[url]), str(models["a"]), str(tmp_path))
    try:
        eng.pool.run_in_background()
        eng.pool.inflight_at_sync = "abort"
        post(url + "/pause_generation", {"mode": "in_place"})  # the other client
        prompt, result = [5, 6, 7], {}
        rollout = threading.Thread(target=lambda: result.update(out=eng.generate(
            [prompt], SamplingParams(temperature=0.0, max_new_tokens=12))))
        rollout.start()
        deadline = time.monotonic() + 60
        while fake_state(url)["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        push = threading.Thread(target=push_weights, args=(
            eng, models["model_b"].state_dict().items(), 1, tmp_path))
        push.start()
        while len(requests_of(log, "/abort_request")) < 2:  # aborted, and again
            assert time.monotonic() < deadline and push.is_alive()
            time.sleep(0.05)
        assert fake_state(url)["waiting"] == 1 and push.is_alive() and rollout.is_alive()
        post(url + "/continue_generation", {})  # the other client
        push.join(timeout=120)
        rollout.join(timeout=120)
        assert not push.is_alive() and not rollout.is_alive()
    finally:
        eng.shutdown()
        proc.kill()
        proc.wait()
    (c,) = result["out"][0]
    runs = version_runs(c)
    assert [v for v, _ in runs] == ["v0", "1"] and runs[0][1] >= 1, runs
    head = runs[0][1]
    assert c.token_ids[:head] == greedy_reference(models["model_a"], prompt, 12)[:head]
    assert c.token_ids[head:] == greedy_reference(models["model_b"], prompt + c.token_ids[:head],
                                                  12 - head)
    rids = [g["rid"] for g in requests_of(log, "/generate")]
    assert len(rids) == 2 and not any(a != b and b.startswith(a) for a in rids for b in rids)
    assert all(r.endswith(".") for r in rids)


def test_disk_sync_follows_new_weights_and_checks_version(engine, models, tmp_path,
                                                         monkeypatch):
    start = len(requests_of(engine.request_log, "/pause_generation"))
    resumed = len(requests_of(engine.request_log, "/continue_generation"))
    stats = push_weights(engine, models["model_b"].state_dict().items(), 1, tmp_path)
    assert stats["weight_sync/bytes"] == sum(t.numel() * 4 for t in
                                             models["model_b"].state_dict().values())
    assert len(requests_of(engine.request_log, "/pause_generation")) == start + 2
    assert len(requests_of(engine.request_log, "/continue_generation")) == resumed + 2
    assert [r.get("weight_version") for r in
            requests_of(engine.request_log, "/update_weights_from_disk")][-2:] == ["1", "1"]
    assert_follows(engine, models["model_b"])
    out = engine.generate([[5, 6]], SamplingParams(max_new_tokens=3))
    assert out[0][0].meta["weight_version"] == "1"
    # A server that silently kept other weights is caught by the version check.
    post(engine.pool.servers[0].url + "/update_weights_from_disk",
         {"model_path": str(models["b"]), "weight_version": "7"})
    with pytest.raises(ServerError, match="weight version '7', expected 1"):
        engine.generate([[5, 6]] * 4, SamplingParams(max_new_tokens=2))
    # A tensor of the wrong shape is refused before anything reaches the servers...
    bad = {**models["model_b"].state_dict(), "model.embed_tokens.weight": torch.zeros(3, 3)}
    with pytest.raises(ValueError, match=r"model.embed_tokens.weight has shape \(3, 3\)"):
        push_weights(engine, bad.items(), 2, tmp_path)
    # ...and a folder a server cannot load (written here without that check) fails loudly.
    import megatron_entropy.weight_sync.disk as disk_sync

    monkeypatch.setattr(disk_sync, "check_hf_checkpoint", lambda files, arch, where: None)
    with pytest.raises(ServerError, match="update_weights_from_disk"):
        push_weights(engine, bad.items(), 2, tmp_path)
    monkeypatch.undo()
    push_weights(engine, models["model_a"].state_dict().items(), 3, tmp_path)
    assert_follows(engine, models["model_a"])


def test_aborted_completions_are_issued_again(engine, models):
    """A completion answered as aborted is truncated: it never comes back from generate (so no
    training batch can hold one); its request is issued again and counted."""
    for server in engine.pool.servers:
        post(server.url + "/fake/abort_next", {"count": 2})  # of 6+ requests each
    engine.metrics()
    out = engine.generate(PROMPTS, SamplingParams(n=4, temperature=0.0, max_new_tokens=6))
    assert engine.metrics()["rollout/aborted_reissued"] == 4
    for prompt, row in zip(PROMPTS, out):
        for c in row:
            assert c.finish_reason == "length"
            assert c.token_ids == greedy_reference(models["model_a"], prompt, 6)


def test_weight_check_catches_a_silently_wrong_sync(engine, models, tmp_path):
    """The trainer's weight check (a Megatron actor scoring the probe) against both servers:
    it passes on the weights they hold, and after a sync they answer with success but apply
    with noise (as SGLang's CPU build did), it fails with an error naming each server."""
    from harness import run_distributed
    from serving_model import probe_served_weights

    urls = [s.url for s in engine.pool.servers]
    state = {k: v.clone() for k, v in models["model_a"].state_dict().items()}

    def wrong_sync(eng):
        for url in urls:
            post(url + "/fake/corrupt_syncs", {"noise": 0.05})
        push_weights(eng, state.items(), 5, tmp_path)

    try:
        first, error = run_distributed(probe_served_weights, 1, "sglang", str(models["a"]), urls,
                                       str(tmp_path), wrong_sync, timeout=300)[0]
    finally:
        for url in urls:
            post(url + "/fake/corrupt_syncs", {"noise": 0.0})
    print(f"probe on correct weights: {first}\n{error}")
    assert first["weight_check/replicas"] == 2
    assert first["weight_check/drift_mean"] <= 1e-4  # fp32 fake, fp32 actor
    assert error.startswith("weight check after a sync: the rollout engine's log-probs disagree")
    for url in urls:
        assert f"({url}" in error


def test_the_weight_probe_catches_a_copy_perturbed_by_a_tenth_of_each_tensors_std(tmp_path):
    """The first-contact probe (the default 8 prompts x 32 tokens, bf16 tolerances) against a
    server holding the quickstart model with noise of 0.1 x std on every tensor: caught, by
    its 0.99 quantile (0.39 nats, bench/bench_weight_check_power.py), where the 4 x 8 probe
    measured a mean of 3.4e-3 against its tolerance of 0.098. The trainer's first 8 prompts."""
    from harness import run_distributed
    from serving_model import probe_served_weights

    from megatron_entropy.config import DataConfig
    from megatron_entropy.data.dataset import load_prompt_dataset, load_tokenizer

    quick = Path(__file__).resolve().parents[2] / "examples" / "quickstart_model"
    data = load_prompt_dataset(DataConfig(), load_tokenizer(quick), 128, "train")
    proc, url = start_fake(quick, 32750)
    try:
        first, error = run_distributed(
            probe_served_weights, 1, "sglang", str(quick), [url], str(tmp_path),
            lambda eng: post(url + "/fake/perturb", {"scale": 0.1}),
            [data[i].prompt_ids for i in range(8)], timeout=300)[0]
    finally:
        proc.kill()
        proc.wait()
    print(f"probe on correct weights: {first}\n{error}")
    assert first["weight_check/drift_mean"] <= 1e-4  # fp32 fake, fp32 actor
    assert error.startswith("weight check after a sync: the rollout engine's log-probs disagree")
    assert f"server 0 ({url}" in error and "p99" in error


def test_router_takes_generation_workers_take_updates(engine, models, tmp_path):
    """With router_url, requests go to the router; weight updates to each worker in urls. (The
    first fake stands in for the router here.)"""
    urls = [s.url for s in engine.pool.servers]
    routed = SGLangEngine(make_cfg(launch=0, urls=urls, router_url=urls[0]), str(models["a"]),
                          str(tmp_path))
    before = len(requests_of(engine.request_log, "/update_weights_from_disk"))
    push_weights(routed, models["model_b"].state_dict().items(), 4, tmp_path)
    updates = requests_of(engine.request_log, "/update_weights_from_disk")[before:]
    assert [r["weight_version"] for r in updates] == ["4", "4"]
    out = routed.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, seed=1))
    assert all(c.meta["server"] == -1 and c.meta["weight_version"] == "4"
               for row in out for c in row)
    assert "sampling_seed" in requests_of(engine.request_log, "/generate")[-1]["sampling_params"]
    assert_follows(routed, models["model_b"])


def test_a_server_that_dies_under_a_sync_is_left_out_then_restarted_from_the_new_weights(
        engine, models, tmp_path, caplog):
    """One of two servers dies under /update_weights_from_disk (a node lost mid-sync): the sync
    goes on with the other, as a rollout would, instead of failing the run; the next rollout
    restarts the dead one from the weights just pushed, and both serve them. (With no server
    left the call's error is raised: test_connected_server_pause_shutdown_death_and_refusal.)"""
    victim = engine.pool.servers[1]
    old_pid = victim.process.pid
    post(victim.url + "/fake/die_on_next_sync", {})
    push_weights(engine, models["model_b"].state_dict().items(), 6, tmp_path)
    assert victim.state == "dead" and victim.process.poll() == 1
    assert f"{victim.describe()} died under POST /update_weights_from_disk" in caplog.text
    assert engine.pool.servers[0].weight_version == "6"
    assert_follows(engine, models["model_b"])  # restarted by this rollout's ensure_up
    assert victim.restarts == 1 and victim.process.pid != old_pid
    assert victim.state == "up" and victim.weight_version == "6"
    out = engine.generate(PROMPTS * 2, SamplingParams(max_new_tokens=2))
    assert {c.meta["server"] for row in out for c in row} == {0, 1}
    assert {c.meta["weight_version"] for row in out for c in row} == {"6"}


@pytest.mark.slow
def test_distributed_sync_by_gloo_broadcast(models, tmp_path):
    log = tmp_path / "requests.jsonl"
    cfg = make_cfg(launch=2, launch_command=fake_command(log=str(log)))
    eng = SGLangEngine(cfg, str(models["a"]), str(tmp_path),
                       WeightSyncConfig(strategy="broadcast", backend="gloo"))
    try:
        state = models["model_b"].state_dict()
        stats = push_weights(eng, state.items(), 1, tmp_path, bucket_mb=1)
        assert stats["weight_sync/bytes"] == sum(t.numel() * 4 for t in state.values())
        assert_follows(eng, models["model_b"])
        inits = requests_of(log, "/init_weights_update_group")
        assert sorted(r["rank_offset"] for r in inits) == [1, 2]
        assert {r["world_size"] for r in inits} == {3}
        updates = requests_of(log, "/update_weights_from_distributed")
        per_server = len(updates) // 2
        assert per_server > 1  # several 1 MB buckets
        names = [n for r in updates[::2] for n in r["names"]]
        assert sorted(set(names)) == sorted(state) and len(names) == len(state)
        assert [r.get("weight_version") for r in updates].count("1") == 2
        # A restarted server holds stale weights: it gets no requests until the next sync
        # re-forms the group with it.
        victim = eng.pool.servers[1]
        os.kill(victim.process.pid, signal.SIGKILL)
        victim.process.wait()
        out = eng.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=4, temperature=1.0))
        assert all(c.meta["server"] == 0 for row in out for c in row)
        assert victim.restarts == 1 and victim.weight_version == "initial"
        push_weights(eng, models["model_a"].state_dict().items(), 2, tmp_path)
        assert len(requests_of(log, "/init_weights_update_group")) == 4
        assert_follows(eng, models["model_a"])
        out = eng.generate(PROMPTS * 3, SamplingParams(max_new_tokens=2))
        assert {c.meta["server"] for row in out for c in row} == {0, 1}
    finally:
        eng.shutdown()


def _kill_mid_rollout(eng, sig: int, index: int, after: int = 2) -> threading.Thread:
    """Signal server ``index`` once ``after`` of its requests came back (more are queued)."""
    server = eng.pool.servers[index]
    done_before = server.requests

    def go():
        deadline = time.monotonic() + 120
        while server.requests < done_before + after and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(server.process.pid, sig)
    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_server_fault_mid_rollout(models, tmp_path, sig):
    """A server killed (or stopped: it hangs) mid-rollout is noticed, restarted, and its
    requests re-issued: every sample comes back exactly once."""
    cfg = make_cfg(launch=2, launch_command=fake_command(delay=0.05))
    eng = SGLangEngine(cfg, str(models["a"]), str(tmp_path))
    try:
        victim = eng.pool.servers[1]
        old_pid = victim.process.pid
        killer = _kill_mid_rollout(eng, sig, 1)
        prompts = [[10 + i, 20 + i] for i in range(8)]
        out = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=10, temperature=1.0,
                                                   seed=3, stop_token_ids=(2,)))
        killer.join()
        assert [len(row) for row in out] == [2] * 8
        for prompt, row in zip(prompts, out):
            for c in row:
                ref, tol = reference(models["model_a"], prompt, c.token_ids)
                assert max(abs(x - y) for x, y in zip(c.logprobs, ref)) <= tol
        metrics = eng.metrics()
        assert metrics["rollout/retries"] >= 1
        eng.pool.ensure_up()
        assert victim.restarts == 1 and victim.process.pid != old_pid
        assert victim.state == "up" and "restart 1" in victim.log_path.read_text()
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_a_slow_server_that_makes_progress_is_not_restarted(models, tmp_path):
    """What a busy machine does to a (re)started server: before its first answer it may take
    long (warming up), and then its health probe goes unanswered for longer than
    health_timeout_s while it decodes (busy). Neither is a hang: one that has not completed a
    request since it came up is governed by startup_timeout_s, and a server completing requests
    is alive. So no restart, and every sample comes back once (before the pool judged liveness
    by progress, the unanswered probes alone killed and restarted it). One run has both phases:
    the busy one follows the warm-up (a run without the warm-up, once a second case, had only
    the busy phase)."""
    # Probes get 6 s and are answered only after 12 s while the server decodes. Requests take
    # ~0.8 s (40 tokens at 0.02 s), 4 at a time; they may all finish together, so a sign of life
    # comes every ~0.8 s: a 7x margin for a busy machine (with 3 s against 2 s requests, the
    # suite on a loaded machine once went 3 s without one). The 48 requests take ~10 s, so
    # probes do go unanswered for longer than 6 s; the warm-up holds the first answer 8 s.
    cfg = make_cfg(launch=1, health_check_interval_s=0.5, health_timeout_s=6.0,
                   launch_command=fake_command(delay=0.02, busy_health_delay=12.0,
                                               warmup=8.0))
    eng = SGLangEngine(cfg, str(models["a"]), str(tmp_path))
    try:
        server = eng.pool.servers[0]
        pid = server.process.pid
        prompts = [[10 + i, 20 + i] for i in range(24)]
        out = eng.generate(prompts, SamplingParams(n=2, max_new_tokens=40, temperature=1.0,
                                                   seed=3))
        assert [len(row) for row in out] == [2] * 24
        metrics = eng.metrics()
        assert metrics["rollout/server_restarts"] == 0 and metrics["rollout/retries"] == 0
        assert server.restarts == 0 and server.process.pid == pid and server.state == "up"
        assert metrics["rollout/server0/requests"] == 48
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_connected_servers_drop_dead_and_old_versions(models, tmp_path):
    """Servers we did not launch: a dead one is dropped and its requests go elsewhere; an
    0.5.2 server gets no sampling_seed (it would reject the key)."""
    log = tmp_path / "requests.jsonl"
    started = [start_fake(models["a"], 32300 + k, version="0.5.2", delay=0.05, log=str(log))
               for k in range(2)]
    procs, urls = [p for p, _ in started], [u for _, u in started]
    try:
        eng = SGLangEngine(make_cfg(launch=0, urls=urls), str(models["a"]), str(tmp_path))

        def kill_mid_rollout():
            deadline = time.monotonic() + 120
            while eng.pool.servers[0].requests < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            procs[0].kill()
        killer = threading.Thread(target=kill_mid_rollout, daemon=True)
        killer.start()
        out = eng.generate([[10 + i] for i in range(8)],
                           SamplingParams(n=2, max_new_tokens=10, seed=1, temperature=1.0))
        killer.join()
        assert [len(row) for row in out] == [2] * 8
        assert all("sampling_seed" not in r["sampling_params"]
                   for r in requests_of(log, "/generate"))
        assert eng.pool.servers[0].state == "dead" and eng.pool.servers[0].restarts == 0
        procs[1].kill()
        with pytest.raises(ServerError, match="no sglang server is up"):
            eng.generate([[5]], SamplingParams(max_new_tokens=2))
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_server_that_dies_under_the_weight_probe_is_left_out(models, tmp_path, caplog):
    """The weight check's probe runs on each server in turn. One that dies meanwhile (a node
    lost during the check after a sync) is left out while another answered, as a rollout drops
    it, instead of failing the run (a four-node Slurm job under load failed so: the probe of
    the dead server raised "no server left"); when the last one dies under its probe, its
    error is raised."""
    started = [start_fake(models["a"], 32350 + k, delay=0.1) for k in range(2)]
    procs, urls = [p for p, _ in started], [u for _, u in started]
    probe = SamplingParams(temperature=0.0, max_new_tokens=8)

    def kill_under_the_probe_of(server, proc) -> threading.Thread:
        def kill() -> None:
            deadline = time.monotonic() + 60
            while server.inflight == 0 and time.monotonic() < deadline:
                time.sleep(0.005)
            proc.kill()
            proc.wait()
        killer = threading.Thread(target=kill, daemon=True)
        killer.start()
        return killer

    try:
        eng = SGLangEngine(make_cfg(launch=0, urls=urls), str(models["a"]), str(tmp_path))
        first, second = eng.pool.servers
        # Server 1 dies while server 0 answers its probe (0.8 s): it is probed next.
        killer = kill_under_the_probe_of(first, procs[1])
        out = eng.generate_on_each_replica(PROMPTS, probe)
        killer.join()
        assert list(out) == [first.describe()] and second.state == "dead"
        assert f"{second.describe()} died under the weight check's probe and is left out" in \
            caplog.text
        assert [[len(c.token_ids) for c in row] for row in out[first.describe()]] == [[8]] * 3
        # The last server dies under its own probe: nothing answered, so the check cannot pass.
        killer = kill_under_the_probe_of(first, procs[0])
        with pytest.raises(ServerError, match="no sglang server"):
            eng.generate_on_each_replica(PROMPTS, probe)
        killer.join()
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_server_that_never_comes_up_names_its_log(models, tmp_path, caplog):
    """One line naming the server, its exit code and its log; the log's last lines go to the
    trainer's log, not into the error."""
    cmd = [sys.executable, "-c", "import sys; print('model folder is broken'); sys.exit(3)"]
    with pytest.raises(ServerError) as failed:
        SGLangEngine(make_cfg(launch_command=cmd), str(models["a"]), str(tmp_path))
    message = str(failed.value)
    assert "\n" not in message and "exited with code 3 while starting" in message
    assert f"log {tmp_path / 'servers' / 'sglang-0.log'}" in message
    assert "model folder is broken" in caplog.text


def test_a_pool_that_fails_to_start_stops_the_servers_that_came_up(models, tmp_path):
    """No launched server outlives the engine that could not start: of two launched servers one
    exits while starting, and the one that came up is stopped with it."""
    first, pid_file = tmp_path / "first", tmp_path / "first.pid"
    # mkdir is atomic: one server wins and serves (exec keeps its pid), the other exits.
    gate = (f'if mkdir {first} 2>/dev/null; then echo $$ > {pid_file}; exec "$0" "$@"; fi; '
            'exit 3')
    cmd = ["/bin/sh", "-c", gate, *fake_command()]
    with pytest.raises(ServerError, match=r"(?s)1 of 2 sglang servers did not come up.*"
                                          r"exited with code 3"):
        SGLangEngine(make_cfg(launch=2, launch_command=cmd), str(models["a"]), str(tmp_path))
    pid = int(pid_file.read_text())
    try:
        gone = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        gone = True
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone, f"server pid {pid} outlived the engine that failed to start"


def test_weight_sync_address():
    """The weight-sync group's master: loopback for servers on this host; for a remote one the
    address of the interface that routes there (not the hostname's, 127.0.1.1 on Debian)."""
    import ipaddress

    assert weight_sync_address(["http://127.0.0.1:30000", "http://localhost:30001"]) == \
        "127.0.0.1"
    try:
        address = weight_sync_address(["http://127.0.0.1:30000", "http://192.0.2.77:30000"])
    except ServerError as e:  # a host without any route off it
        assert "rollout.server.weight_sync_master_addr" in str(e)
    else:
        assert not ipaddress.ip_address(address).is_loopback


def fake_state(url: str) -> dict:
    import urllib.request

    with urllib.request.urlopen(url + "/fake/state", timeout=30) as r:
        return json.loads(r.read())


def wait_decoding(url: str, tokens: int = 2) -> None:
    """Until a request on the server has decoded ``tokens`` more tokens (it is in flight)."""
    start = fake_state(url)["decoded"]
    deadline = time.monotonic() + 120
    while fake_state(url)["decoded"] < start + tokens:
        assert time.monotonic() < deadline, "the request never started decoding"
        time.sleep(0.05)


@pytest.mark.slow
def test_connected_server_pause_shutdown_death_and_refusal(models, tmp_path, caplog):
    """One server we did not launch, decoding at 0.05 s a token, and another client's request
    (80 tokens: in flight for 4 s, long enough for the sync to start on a busy machine):
    - SGLang's default pause mode (abort) cuts it off; our sync pauses in retract mode, so the
      request is held and finishes whole after the sync (the refused cache flush only warns);
    - the server dying under /update_weights_from_disk: the error is that call's (it was the
      only server: nothing to go on with), says the server no longer answers, and no
      /continue_generation goes to the server it found dead;
    - connecting again: "connection refused", said as such."""
    proc, url = start_fake(models["a"], 32400, delay=0.05)
    try:
        eng = SGLangEngine(make_cfg(launch=0, urls=[url]), str(models["a"]), str(tmp_path))
        answers: dict = {}

        def other_client(key: str) -> threading.Thread:
            t = threading.Thread(target=lambda: answers.__setitem__(key, post(
                url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": {
                    "max_new_tokens": 80, "temperature": 0.0, "ignore_eos": True}})))
            t.start()
            wait_decoding(url)
            return t

        t = other_client("abort")
        post(url + "/pause_generation", {})
        post(url + "/continue_generation", {})
        t.join()
        status, body = answers["abort"]
        assert status == 200 and body["meta_info"]["finish_reason"]["type"] == "abort"
        assert 2 <= len(body["output_ids"]) < 80

        t = other_client("kept")
        push_weights(eng, models["model_b"].state_dict().items(), 1, tmp_path)
        t.join()
        status, body = answers["kept"]
        assert body["meta_info"]["finish_reason"]["type"] == "length"
        assert len(body["output_ids"]) == 80
        assert "prefix cache not flushed" in caplog.text
        assert_follows(eng, models["model_b"])

        post(url + "/fake/die_on_next_sync", {})
        with pytest.raises(ServerError) as failed:
            push_weights(eng, models["model_a"].state_dict().items(), 2, tmp_path)
        message = str(failed.value)
        assert message.startswith("/update_weights_from_disk failed")
        # Refused, or reset when the probe's connect met the dying server's socket (a busy
        # machine): either way the error names the server and says nothing listens.
        assert re.search(f"connection (refused|reset) at {re.escape(url)}: nothing listens",
                         message), message
        assert "/continue_generation" not in message
        assert eng.pool.servers[0].state == "dead"
        assert not getattr(failed.value, "__notes__", None)  # no /continue_generation failed
        assert proc.wait(timeout=30) == 1

        with pytest.raises(ServerError, match=f"connection refused at {url}: nothing listens"):
            SGLangEngine(make_cfg(launch=0, urls=[url], startup_timeout_s=2), str(models["a"]),
                         str(tmp_path))
    finally:
        proc.kill()
        proc.wait()
