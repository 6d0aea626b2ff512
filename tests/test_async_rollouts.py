"""Bounded-staleness asynchronous rollouts (trainer/async_rollouts.py, rollout.max_staleness).

The staleness filter and the background producer's ordering on their own; a rollout in flight in
another thread while weights are pushed and a server is killed, against the strict fake SGLang
server (tests/fake_sglang_server.py) serving real transformers models; and the trainer at
max_staleness=1 killed by SIGKILL and resumed (tests/test_async_train.py holds that one).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.rollout.base import Completion, SamplingParams
from megatron_entropy.rollout.sglang import SGLangEngine
from megatron_entropy.trainer.async_rollouts import (RolloutPrefetcher, RolloutProducerError,
                                                     stale_samples, weight_version_of)
from megatron_entropy.trainer.rollouts import Group, LocalStep
from harness import metrics_rows
from serving_model import make_served_model, push_weights
from test_preemption import _kill_marked
from test_rollout_sglang import fake_command, greedy_reference, make_cfg, models  # noqa: F401

REPO = Path(__file__).resolve().parents[1]


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
                       "async/staleness_max": 5.0}
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


def test_max_staleness_needs_a_server_engine_and_inflight_abort_is_not_built():
    with pytest.raises(ConfigError, match=r"rollout.max_staleness=1 needs a server engine.*"
                                          r"rollout.engine=inprocess"):
        load_config(data={"rollout": {"max_staleness": 1}})
    server = {"engine": "sglang", "max_staleness": 1, "server": {"launch": 1}}
    load_config(data={"rollout": server})
    with pytest.raises(ConfigError, match="rollout.inflight_at_sync=abort .* is not built yet"):
        load_config(data={"rollout": {**server, "inflight_at_sync": "abort"}})


@pytest.mark.slow
def test_rollout_in_flight_at_a_push_finishes_on_its_weights_tagged_and_survives_a_kill(
        models, tmp_path):  # noqa: F811
    """A rollout runs in a thread (the pool's background loop) while the main thread pushes new
    weights and then a server is SIGKILLed: the requests in flight at the push finish on the old
    weights and are tagged so, those sent after it are generated and tagged with the new ones,
    the killed server's requests are issued again, it is relaunched (from the new weights), and
    every sample comes back exactly once."""
    cfg = make_cfg(launch=2, max_concurrency=1, launch_command=fake_command(delay=0.1))
    eng = SGLangEngine(cfg, str(models["a"]), str(tmp_path))
    eng.pool.run_in_background()
    try:
        prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
        sampling = SamplingParams(temperature=0.0, max_new_tokens=12)
        result: dict = {}
        rollout = threading.Thread(target=lambda: result.update(out=eng.generate(prompts,
                                                                                  sampling)))
        rollout.start()
        deadline = time.monotonic() + 60
        while eng.pool._inflight_total < 2:  # both servers busy, six requests wait
            assert time.monotonic() < deadline
            time.sleep(0.01)
        push_weights(eng, models["model_b"].state_dict().items(), 1, tmp_path)
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
        old = versions.count("initial")
        assert versions == ["initial"] * old + ["1"] * (len(prompts) - old), versions
        assert 2 <= old < len(prompts), versions
        for prompt, (c,) in zip(prompts, out):
            model = models["model_a"] if c.meta["weight_version"] == "initial" else \
                models["model_b"]
            assert c.token_ids == greedy_reference(model, prompt, 12)[:len(c.token_ids)]
        # Relaunched from the new weights' folder (not waited for: the rollout completed on the
        # other server).
        assert victim.restarts == 1 and victim.process.pid != old_pid
        [relaunch] = [line for line in victim.log_path.read_text().splitlines()
                      if line.startswith("==== ") and "launch (restart 1 " in line]
        assert "weights-v1 " in relaunch and "--weight-version 1 " in relaunch, relaunch
    finally:
        eng.shutdown()
    assert eng.pool._loop is None


def _consumed(state: dict) -> int:
    """Prompts drawn so far by a saved sampler state."""
    return state["epoch"] * state["num_items"] + state["position"]


@pytest.mark.slow
def test_async_run_killed_and_resumed_loses_and_repeats_no_step(tmp_path):
    """max_staleness=1 with the trainer's own (fake) SGLang server, 4 steps, checkpoint every
    step, validation every 2: killed by SIGKILL after step 2 (step 3's rollouts are then being
    generated or done, never trained), then resumed. Each step is logged once; each checkpoint's
    data position is exactly its steps' prompts (the prefetched step is generated again after the
    resume, from the position saved before it was drawn); step 1 and the first resumed step train
    on rollouts of the weights they train (staleness 0), the others on the previous version's
    (their first requests go out before the previous update ends: staleness 1); none is dropped."""
    model = make_served_model(tmp_path / "model")
    prompts_per_step = 4
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 1, "backend": "gloo"},
        "rollout": {"engine": "sglang", "max_staleness": 1, "n_samples": 4,
                    "max_new_tokens": 12, "max_prompt_tokens": 96,
                    "server": {"launch": 1, "base_port": 32450, "startup_timeout_s": 120,
                               "launch_command": fake_command()}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": prompts_per_step, "apply_chat_template": False,
                 "dynamic_sampling": False, "arithmetic": {"num_val": 4}},
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
        _kill_marked(mark)  # its rollout server
        killed_at = len(metrics_rows(run))
        resumed = start(tmp_path / "resumed.log")
        assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    finally:
        _kill_marked(mark)
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
        want = 0.0 if r["step"] in fresh else 1.0
        assert r["async/staleness_max"] == want, (r["step"], r["async/staleness_max"])
        assert 0 <= r["time/trainer_idle"] <= r["time/step"]
        assert 0 <= r["time/engine_idle"] <= r["time/step"]
    assert all("val/acc/mean" in r for r in rows if r["step"] % 2 == 0)
