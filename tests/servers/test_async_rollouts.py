"""Bounded-staleness asynchronous rollouts (trainer/async_rollouts.py, rollout.max_staleness).

The staleness filter, partial rollouts' joins and the background producer's ordering on their
own; rollouts in flight in another thread while weights are pushed (aborted and resumed, then
finished) and a server is killed, against the strict fake SGLang server
(tests/helpers/fake_sglang_server.py) serving the checkpoints in fp32; and the trainer at
max_staleness=1 killed by SIGKILL and resumed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.rollout.base import Completion, SamplingParams
from megatron_entropy.rollout.server.partial import (finished_before_resume, join_completions,
                                                     version_runs)
from megatron_entropy.rollout.server.sglang import SGLangEngine
from megatron_entropy.trainer.async_rollouts import (RolloutPrefetcher, RolloutProducerError,
                                                     stale_samples, version_number,
                                                     weight_version_of)
from megatron_entropy.trainer.rollouts import Group, LocalStep
from harness import kill_marked, metrics_rows
from serving_model import make_served_model, push_weights, reference
from fake_sglang import fake_command, greedy_reference, make_cfg

REPO = Path(__file__).resolve().parents[2]


def _token_versions(completion: Completion) -> list[int]:
    """The weight version that generated each response token."""
    return [version_number(tag) for tag, n in version_runs(completion) for _ in range(n)]


def _completion(version) -> Completion:
    return Completion([1], [-0.5], "x", "stop", meta={"weight_version": version})


def test_version_tags_and_the_staleness_filter():
    assert [weight_version_of(_completion(v)) for v in (None, "initial", "3", 4)] == [0, 0, 3, 4]
    groups = [Group(None, [_completion("5"), _completion("3")], [1.0, 0.0]),
              Group(None, [_completion("2"), _completion(None)], [0.0, 1.0])]
    # Trained weights are version 5: ages 0, 2 | 3, 5.
    dropped, metrics = stale_samples(groups, trained_version=5, max_staleness=2)
    assert dropped == {(1, 0), (1, 1)}
    assert metrics == {"async/dropped_samples": 2.0, "async/staleness_mean": 2.5,
                       "async/staleness_max": 5.0, "async/partial_samples": 0.0,
                       "async/resumed_tokens": 0.0}
    dropped, metrics = stale_samples(groups, trained_version=5, max_staleness=5)
    assert dropped == frozenset() and metrics["async/dropped_samples"] == 0.0


def _local(step: int) -> LocalStep:
    return LocalStep({}, [], {}, [], {"step": float(step)})


def test_prefetcher_runs_at_most_depth_steps_ahead_in_order_and_surfaces_its_error():
    started: list[tuple[int, int]] = []  # (step, last step taken when it started)
    built = threading.Event()
    holder: dict = {}

    def produce(step, between_rounds):
        built.wait(10)
        started.append((step, holder["prefetcher"]._taken))
        if step == 5:
            raise ValueError("server exploded")
        return _local(step)
    prefetcher = holder["prefetcher"] = RolloutPrefetcher(produce, first=1, last=6, depth=2)
    built.set()
    try:
        for step in (1, 2, 3, 4):
            got = None
            while got is None:
                got = prefetcher.take(step, timeout=5)
            assert got.metrics["step"] == step
        with pytest.raises(RolloutProducerError, match="step 5: ValueError: server exploded"):
            while prefetcher.take(5, timeout=5) is None:
                pass
    finally:
        prefetcher.stop()
        prefetcher.join(10)
    assert [s for s, _ in started] == [1, 2, 3, 4, 5]
    assert all(step - taken <= 2 for step, taken in started), started
    assert not prefetcher._thread.is_alive()


def test_prefetcher_is_held_while_the_engine_is_used_elsewhere():
    gate = threading.Event()
    running = threading.Event()

    def produce(step, between_rounds):
        running.set()
        gate.wait(10)
        return _local(step)
    prefetcher = RolloutPrefetcher(produce, first=1, last=3, depth=1)
    try:
        assert running.wait(10)
        holder_in = threading.Event()

        def hold():
            with prefetcher.held():
                holder_in.set()
                time.sleep(0.3)
        holder = threading.Thread(target=hold)
        holder.start()
        assert not holder_in.wait(0.3)  # waits for the step in production
        gate.set()
        assert holder_in.wait(10)
        running.clear()
        assert prefetcher.take(1, timeout=10).metrics["step"] == 1
        assert not running.wait(0.1)  # step 2 waits for the hold to end
        holder.join()
        assert running.wait(10)
        assert prefetcher.take(2, timeout=10).metrics["step"] == 2
    finally:
        prefetcher.stop()
        prefetcher.join(10)


def test_max_staleness_needs_a_server_engine_and_inflight_abort_no_router():
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=1 needs a server engine.*"
                                          r"rollout.engine=inprocess"):
        load_config(data={"rollout": {"max_staleness": 1}})
    server = {"engine": "sglang", "max_staleness": 1, "server": {"launch": 1}}
    load_config(data={"rollout": server})
    load_config(data={"rollout": {**server, "inflight_at_sync": "abort"}})
    routed = {**server, "inflight_at_sync": "abort",
              "server": {"urls": ["http://127.0.0.1:1"], "router_url": "http://127.0.0.1:2"}}
    with pytest.raises(ConfigError, match="inflight_at_sync=abort .* rollout.server.router_url"):
        load_config(data={"rollout": routed})


def _part(ids, version, text="", reason="abort") -> Completion:
    return Completion(list(ids), [-0.1 * t for t in ids], text, reason,
                      meta={"server": 0, "weight_version": version})


def test_partial_rollouts_join_with_per_token_versions_and_count_as_their_oldest_token():
    # Aborted after 2 tokens on the starting weights, again after 1 on version 1 (a second
    # push), finished on version 2; a sample of another group was never aborted.
    joined = join_completions(join_completions(_part([7, 8], "initial", "ab"),
                                               _part([9], "1", "c")),
                              _part([10, 11], "2", "de", "length"))
    assert joined.token_ids == [7, 8, 9, 10, 11] and joined.text == "abcde"
    assert joined.logprobs == [-0.1 * t for t in (7, 8, 9, 10, 11)]
    assert joined.finish_reason == "length" and joined.meta["resumed"] == 2
    assert version_runs(joined) == [("initial", 2), ("1", 1), ("2", 2)]
    assert _token_versions(joined) == [0, 0, 1, 2, 2]
    # An abort that found the request still waiting left no token: no run of its own.
    assert version_runs(join_completions(_part([], "1"), _part([5], "2", reason="stop"))) \
        == [("2", 1)]
    whole = _part([3, 4], "2", reason="stop")
    assert version_runs(whole) == [("2", 2)] and _token_versions(whole) == [2, 2]
    # Staleness counts the oldest token: trained weights v2 -> ages 2 and 0.
    dropped, metrics = stale_samples([Group(None, [joined], [1.0]), Group(None, [whole], [0.0])],
                                     trained_version=2, max_staleness=1)
    assert dropped == {(0, 0)}
    assert metrics == {"async/dropped_samples": 1.0, "async/partial_samples": 1.0,
                       "async/resumed_tokens": 3.0, "async/staleness_mean": 1.0,
                       "async/staleness_max": 2.0}


def test_an_aborted_prefix_is_resumed_only_while_it_has_budget_and_no_stop():
    stops = {2}
    assert finished_before_resume(_part([5, 6], 0), 4, stops, []) is None
    assert finished_before_resume(_part([5, 6, 7, 8], 0), 4, stops, []) == "length"
    # SGLang aborts a running request after one more decode step, which may sample EOS.
    assert finished_before_resume(_part([5, 2], 0), 4, stops, []) == "stop"
    assert finished_before_resume(_part([5, 6], 0, "x = 4\n"), 4, stops, ["\n"]) == "stop"
    assert finished_before_resume(_part([], 0), 4, stops, ["\n"]) is None


def _wait_decoded(eng, tokens: int, rollout: threading.Thread) -> None:
    """Until the fake servers decoded ``tokens`` tokens since they started, in all."""
    deadline = time.monotonic() + 60
    while sum(json.load(urllib.request.urlopen(f"{s.url}/fake/state"))["decoded"]
              for s in eng.pool.servers) < tokens:
        assert time.monotonic() < deadline and rollout.is_alive()
        time.sleep(0.02)


def _check_aborted_and_resumed(eng, models, log: Path) -> None:
    """inflight_at_sync=abort, the engine on model a ("initial"): a rollout runs in a thread
    while the main thread pushes model b as version 1. Our requests in flight are aborted by
    their rid (only those: no abort_all), answered with the tokens they had, and resumed on the
    new weights with prompt + those tokens for the rest of their budget: each such sample is a's
    greedy prefix, then b's greedy continuation of it, each token's log-prob the one its own
    weights give (fp32 rounding), each token tagged with its version, the sample's staleness
    its oldest token's. The others (done before the push, or sent after it) are one version's
    whole. Every sample comes back once, none over max_new_tokens."""
    eng.pool.inflight_at_sync = "abort"
    max_new = 12
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(6)]
    result: dict = {}
    rollout = threading.Thread(target=lambda: result.update(out=eng.generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=max_new))))
    rollout.start()
    _wait_decoded(eng, 4, rollout)  # both servers busy, ~2 tokens each
    push_weights(eng, models["model_b"].state_dict().items(), 1, log.parent)
    rollout.join(timeout=120)
    assert not rollout.is_alive()
    metrics = eng.metrics()
    out = result["out"]
    assert [len(row) for row in out] == [1] * len(prompts)
    partial = 0
    for prompt, (c,) in zip(prompts, out):
        runs = version_runs(c)
        assert runs in ([("initial", len(c.token_ids))], [("1", len(c.token_ids))]) or \
            [v for v, _ in runs] == ["initial", "1"], runs
        head = runs[0][1] if runs[0][0] == "initial" else 0
        old, rest = c.token_ids[:head], c.token_ids[head:]
        partial += bool(old and rest)
        assert 1 <= len(c.token_ids) == len(c.logprobs) <= max_new
        assert c.finish_reason in ("stop", "length")
        assert old == greedy_reference(models["model_a"], prompt, max_new)[:head]
        assert rest == greedy_reference(models["model_b"], prompt + old,
                                        max_new - head)[:len(rest)]
        for model, before, tokens, logprobs in (("model_a", prompt, old, c.logprobs[:head]),
                                                ("model_b", prompt + old, rest,
                                                 c.logprobs[head:])):
            if tokens:
                ref, tol = reference(models[model], before, tokens)
                assert max(abs(x - y) for x, y in zip(logprobs, ref)) <= tol, model
        assert _token_versions(c) == [0] * head + [1] * len(rest)
        assert weight_version_of(c) == (0 if head else 1)
    assert partial >= 1
    # On the wire: an abort by rid for each request that ran at the push; each resumed
    # request is prompt + the kept tokens, with the rest of the budget.
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    generates = [e["body"] for e in sent if e["path"] == "/generate"]
    aborts = [e["body"] for e in sent if e["path"] == "/abort_request"]
    assert {a["rid"] for a in aborts} <= {g["rid"] for g in generates}
    assert len({a["rid"] for a in aborts}) >= partial and not any(a.get("abort_all")
                                                                 for a in aborts)
    for prompt, (c,) in zip(prompts, out):
        head = version_runs(c)[0][1]
        if len(version_runs(c)) == 2:
            [resumed] = [g for g in generates if g["input_ids"] == prompt + c.token_ids[:head]]
            assert resumed["sampling_params"]["max_new_tokens"] == max_new - head
    assert metrics["rollout/aborted_resumed"] == partial == len(generates) - len(prompts)
    assert metrics["rollout/aborted_reissued"] == 0



def test_a_request_aborted_before_its_first_token_is_sent_again_whole(models, tmp_path):
    """inflight_at_sync=abort with requests still waiting in the server at the push (here it
    is paused, as a busy vLLM or SGLang scheduler holds requests before their first token):
    they are aborted with no tokens. Each is sent again whole on the new weights, one version
    and its full budget, and is not counted as resumed (a real vLLM server answered one so)."""
    log = tmp_path / "requests.jsonl"
    cfg = make_cfg(launch=1, max_concurrency=4,
                   launch_command=fake_command(delay=0.05, log=str(log)))
    eng = SGLangEngine(cfg, str(models["a"]), str(tmp_path))
    eng.pool.run_in_background()
    eng.pool.inflight_at_sync = "abort"
    [server] = eng.pool.servers
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(3)]
    try:
        urllib.request.urlopen(urllib.request.Request(
            f"{server.url}/pause_generation", data=json.dumps({"mode": "abort"}).encode(),
            headers={"Content-Type": "application/json"}))
        result: dict = {}
        rollout = threading.Thread(target=lambda: result.update(out=eng.generate(
            prompts, SamplingParams(temperature=0.0, max_new_tokens=6))))
        rollout.start()
        deadline = time.monotonic() + 60
        while json.load(urllib.request.urlopen(f"{server.url}/fake/state"))["waiting"] < 3:
            assert time.monotonic() < deadline and rollout.is_alive()
            time.sleep(0.01)
        push_weights(eng, models["model_b"].state_dict().items(), 1, tmp_path)
        rollout.join(timeout=120)
        assert not rollout.is_alive()
        metrics = eng.metrics()
    finally:
        eng.shutdown()
    for prompt, (c,) in zip(prompts, result["out"]):
        assert version_runs(c) == [("1", 6)] and "resumed" not in c.meta, c.meta
        assert c.token_ids == greedy_reference(models["model_b"], prompt, 6)
    sent = [json.loads(line) for line in log.read_text().splitlines()]
    generates = [e["body"]["input_ids"] for e in sent if e["path"] == "/generate"]
    assert sorted(generates) == sorted(prompts * 2)  # each sent twice, whole
    assert metrics["rollout/aborted_resumed"] == 0 and metrics["rollout/aborted_reissued"] == 0


@pytest.mark.slow
def test_rollouts_in_flight_at_pushes_resume_or_finish_tagged_and_survive_a_kill(
        models, tmp_path):  # noqa: F811
    """Two fake servers, one request each at a time. First inflight_at_sync=abort
    (`_check_aborted_and_resumed`). Then finish: a rollout runs in a thread while the main
    thread pushes model a back (version 2) and then a server is SIGKILLed: the requests in
    flight at the push finish on the old weights and are tagged so, those sent after it are
    generated and tagged with the new ones, the killed server's requests are issued again, it
    is relaunched (from the new weights), and every sample comes back exactly once."""
    log = tmp_path / "requests.jsonl"
    cfg = make_cfg(launch=2, max_concurrency=1,
                   launch_command=fake_command(delay=0.1, log=str(log)))
    eng = SGLangEngine(cfg, str(models["a"]), str(tmp_path))
    eng.pool.run_in_background()
    try:
        _check_aborted_and_resumed(eng, models, log)
        eng.pool.inflight_at_sync = "finish"
        prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
        result: dict = {}
        rollout = threading.Thread(target=lambda: result.update(out=eng.generate(prompts,
                                                                                  sampling)))
        rollout.start()
        deadline = time.monotonic() + 60
        while eng.pool.dispatch.inflight_total < 2:  # both servers busy, six requests wait
            assert time.monotonic() < deadline
            time.sleep(0.01)
        push_weights(eng, models["model_a"].state_dict().items(), 2, tmp_path)
        victim = eng.pool.servers[1]
        old_pid = victim.process.pid
        os.kill(old_pid, signal.SIGKILL)
        rollout.join(timeout=180)
        assert not rollout.is_alive()
        out = result["out"]
        assert [len(row) for row in out] == [1] * len(prompts)
        versions = [c.meta["weight_version"] for (c,) in out]
        # Requests are sent in order: those sent before the push (the two in flight when it
        # began at least) have the old weights, those after it the new ones.
        old = versions.count("1")
        assert versions == ["1"] * old + ["2"] * (len(prompts) - old), versions
        assert 2 <= old < len(prompts), versions
        for prompt, (c,) in zip(prompts, out):
            model = models["model_b"] if c.meta["weight_version"] == "1" else \
                models["model_a"]
            assert c.token_ids == greedy_reference(model, prompt, 12)[:len(c.token_ids)]
            assert "version_runs" not in c.meta  # finish: nothing was aborted
        # Relaunched from the new weights' folder (not waited for: the rollout completed on the
        # other server).
        assert victim.restarts == 1 and victim.process.pid != old_pid
        [relaunch] = [line for line in victim.log_path.read_text().splitlines()
                      if line.startswith("==== ") and "launch (restart 1 " in line]
        assert "weights-v2 " in relaunch and "--weight-version 2 " in relaunch, relaunch
    finally:
        eng.shutdown()
    assert eng.pool.runner.loop is None


def _consumed(state: dict) -> int:
    """Prompts drawn so far by a saved sampler state."""
    return state["epoch"] * state["num_items"] + state["position"]


@pytest.mark.slow
def test_async_run_killed_and_resumed_loses_and_repeats_no_step(tmp_path):
    """max_staleness=1 (requests in flight at a push aborted and resumed: the riskier mode;
    the pool test above covers both) with the trainer's own (fake) SGLang server, 4 steps,
    checkpoint every step, validation every 2: killed by SIGKILL after step 2 (step 3's rollouts are then being
    generated or done, never trained), then resumed. Each step is logged once; each checkpoint's
    data position is exactly its steps' prompts (the prefetched step is generated again after the
    resume, from the position saved before it was drawn); step 1 and the first resumed step train
    on rollouts of the weights they train (staleness 0), the others on the previous version's
    (their first requests go out before the previous update ends: staleness 1, a partial
    sample counting as its oldest token); none is dropped."""
    model = make_served_model(tmp_path / "model")
    prompts_per_step = 4
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 1, "backend": "gloo"},
        "rollout": {"engine": "sglang", "max_staleness": 1, "inflight_at_sync": "abort",
                    "n_samples": 4,
                    "max_new_tokens": 12, "max_prompt_tokens": 96,
                    "server": {"launch": 1, "base_port": 32450, "startup_timeout_s": 120,
                               "launch_command": fake_command()}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": prompts_per_step, "apply_chat_template": False,
                 "dynamic_sampling": False, "arithmetic": {"num_train": 64, "num_val": 4}},
        "trainer": {"steps": 4, "lr": 1e-3, "micro_batch_tokens": 400, "save_interval": 1,
                    "keep_last": 4, "val_interval": 2},
        "logging": {"name": "async", "runs_dir": str(tmp_path / "runs"), "progress_bar": False},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    mark = str(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "ME_TEST_MARK": mark}
    run = tmp_path / "runs" / "async"

    def start(log: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "megatron_entropy.cli", "train",
                                 str(tmp_path / "c.yaml")], env=env, stdout=log.open("w"),
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        victim = start(tmp_path / "victim.log")
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").is_file() and len(metrics_rows(run)) >= 2):
            assert victim.poll() is None, (tmp_path / "victim.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the async run made no progress"
            time.sleep(0.1)
        os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
        kill_marked(mark)  # its rollout server
        killed_at = len(metrics_rows(run))
        resumed = start(tmp_path / "resumed.log")
        assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    finally:
        kill_marked(mark)
    assert killed_at < 4 and "resumed from" in (tmp_path / "resumed.log").read_text()
    rows = [r for r in metrics_rows(run) if r["step"] > 0]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for step in range(1, 5):
        state = json.loads((run / "checkpoints" / f"step_{step:08d}" /
                            "trainer_state.json").read_text())
        assert _consumed(state["sampler"]) == step * prompts_per_step, (step, state)
    fresh = {1, killed_at + 1}
    for r in rows:
        assert r["async/dropped_samples"] == 0
        assert 0 <= r["async/partial_samples"] <= 16 and r["async/resumed_tokens"] >= 0
        want = 0.0 if r["step"] in fresh else 1.0
        assert r["async/staleness_max"] == want, (r["step"], r["async/staleness_max"])
        assert 0 <= r["time/trainer_idle"] <= r["time/step"]
        assert 0 <= r["time/engine_idle"] <= r["time/step"]
    assert all("val/acc/mean" in r for r in rows if r["step"] % 2 == 0)
