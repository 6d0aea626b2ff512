"""`megatron-entropy train` against a connected rollout server that is not there, that never
answers, or that dies before or under the first contact's weight check: start-up ends with one
line, in bounded time, and SIGTERM stops it wherever it waits (rollout/server/supervisor.py,
runtime/preemption.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Callable, Optional

import pytest
import yaml

from fake_sglang import start_fake
from harness import free_port, hung_server, kill_marked
from serving_model import make_served_model

REPO = Path(__file__).resolve().parents[2]


def _start_trainer(tmp_path: Path, url: str, model: Optional[Path] = None,
                   rollout: Optional[dict] = None, data: Optional[dict] = None,
                   **server) -> tuple[subprocess.Popen, Path]:
    """Rank 0 of a one-rank torchrun-style launch of a run whose engine connects to ``url``
    (serving ``model``, made here if None), with ``rollout`` and ``data`` added to its
    settings."""
    model = model or make_served_model(tmp_path / "model")
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 1, "backend": "gloo"},
        "rollout": {"engine": "sglang", "n_samples": 2, "max_new_tokens": 8,
                    "max_prompt_tokens": 96, "server": {"urls": [url], **server},
                    **(rollout or {})},
        "data": {"prompts_per_step": 2, "apply_chat_template": False,
                 "arithmetic": {"num_train": 16}, **(data or {})},
        "trainer": {"steps": 1, "micro_batch_tokens": 400, "save_interval": 0},
        "logging": {"name": "run", "runs_dir": str(tmp_path / "runs"), "progress_bar": False},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "ME_TEST_MARK": str(tmp_path), "RANK": "0",
           "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port())}
    log = tmp_path / "train.log"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_entropy.cli", "train",
                             str(tmp_path / "c.yaml")], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    return proc, log


def _last_line(log: Path) -> str:
    return log.read_text().strip().splitlines()[-1]


@pytest.mark.slow
def test_a_connected_url_where_nothing_listens_fails_start_up_with_one_line(tmp_path):
    """Nothing listens: after health_timeout_s (1 s) of refused connections the start fails
    (it used to wait startup_timeout_s, 600 s, saying nothing)."""
    url = f"http://127.0.0.1:{free_port()}"
    proc, log = _start_trainer(tmp_path, url, health_timeout_s=1.0)
    try:
        rc = proc.wait(timeout=180)
    finally:
        kill_marked(str(tmp_path))
    out = log.read_text()
    assert rc == 2, out[-3000:]
    assert _last_line(log) == (
        f"megatron-entropy train: error: 1 of 1 sglang servers did not come up: server 0 "
        f"({url}) is not serving: connection refused at {url}: nothing listens there for 1 s "
        "(rollout.server.health_timeout_s)"), out[-3000:]
    assert "Traceback" not in out


@pytest.mark.slow
def test_sigterm_stops_a_start_up_that_waits_for_a_server_that_never_answers(tmp_path):
    """A socket that takes connections but never answers (a hung server): the trainer says what
    it waits for, and SIGTERM ends the wait with one line and exit 75 (it used to be recorded
    for the loop, which the start-up never reached)."""
    with hung_server() as url:
        proc, log = _start_trainer(tmp_path, url, health_timeout_s=1.0, startup_timeout_s=600)
        try:
            deadline = time.monotonic() + 180
            while f"waiting for server 0 ({url}) to answer /health" not in log.read_text():
                assert proc.poll() is None, log.read_text()[-3000:]
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)
            rc = proc.wait(timeout=60)
        finally:
            kill_marked(str(tmp_path))
    out = log.read_text()
    assert rc == 75, out[-3000:]
    assert _last_line(log) == "megatron-entropy train: stopped by SIGTERM during start-up"
    assert "Traceback" not in out


def _run_past_its_servers_death(tmp_path: Path, model: Path, fake: subprocess.Popen, url: str,
                                kill: Callable[[subprocess.Popen, Path], None]
                                ) -> tuple[str, str]:
    """A run against the fake server at ``url``; ``kill(trainer, its log)`` returns once the
    fake is dead (it exited itself, or was killed). The run then ends with exit 2, within 60 s,
    without a traceback: its output and its last line."""
    try:
        proc, log = _start_trainer(tmp_path, url, model=model)
        kill(proc, log)
        died = time.monotonic()
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run went on 120 s after its server died:\n{log.read_text()[-3000:]}")
        after = time.monotonic() - died
    finally:
        fake.kill()
        fake.wait()
        kill_marked(str(tmp_path))
    out = log.read_text()
    print(f"the run ended {after:.1f} s after its server died")
    assert rc == 2, out[-3000:]
    assert after < 60 and "Traceback" not in out, out[-3000:]
    return out, _last_line(log)


@pytest.mark.slow
def test_a_connected_server_that_dies_before_the_first_probe_ends_the_run_with_one_line(tmp_path):
    """The server answers /health and the engine's first call (/get_server_info), then exits
    before the weight check's first probe: the probe finds nothing listening there and the run
    ends at once with one line that says so (it used to put each server's state on a line of
    its own, under "no sglang server is up:")."""
    model = make_served_model(tmp_path / "model")
    fake, url = start_fake(model, 32800, exit_after="/get_server_info")
    out, last = _run_past_its_servers_death(tmp_path, model, fake, url,
                                            lambda proc, log: fake.wait(timeout=180))
    assert last == (
        f"megatron-entropy train: error: no sglang server is up: server 0 ({url}): dead, "
        f"weights None (failed its health probe (connection refused at {url}: nothing listens "
        "there))"), out[-3000:]


@pytest.mark.slow
def test_a_connected_server_killed_under_the_first_probe_ends_the_run_with_one_line(tmp_path):
    """The server is killed (SIGKILL) while it decodes the weight check's first probe (0.5 s a
    token): its requests fail, it is found dead, and with no server left the run ends with one
    line naming it and what its last probe saw (it used to be several lines)."""
    model = make_served_model(tmp_path / "model")
    requests = tmp_path / "requests.jsonl"
    fake, url = start_fake(model, 32810, delay=0.5, log=str(requests))

    def kill_under_the_probe(proc: subprocess.Popen, log: Path) -> None:
        deadline = time.monotonic() + 180
        while not (requests.is_file() and '"/generate"' in requests.read_text()):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        fake.kill()
        fake.wait()

    out, last = _run_past_its_servers_death(tmp_path, model, fake, url, kill_under_the_probe)
    assert last.startswith(f"megatron-entropy train: error: no sglang server left to send "
                           f"requests to: server 0 ({url}): dead, weights None ("), out[-3000:]
    assert "nothing listens there" in last, last
    assert "died under the weight check's probe" in out


@pytest.mark.slow
def test_a_run_whose_server_changes_weights_after_the_probe_stops_before_the_sync(tmp_path):
    """The connected server answers the first-contact probe (2 prompts x 4 tokens) with the
    trainer's weights, then holds the model with noise of 0.05 x each tensor's std (another
    client of a shared server loaded other weights): the run starts, and step 1's check of its
    rollout tokens (the actor's old log-probs against the engine's) stops it with one line
    naming the server and the numbers, before the weights trained on them reach the server or a
    checkpoint: no metrics row, no checkpoint. Without that check the step trains on them (and
    the sync after it hides the fault: the server then loads the trained weights)."""
    model = make_served_model(tmp_path / "model")
    fake, url = start_fake(model, 32820)
    try:
        urllib.request.urlopen(urllib.request.Request(
            url + "/fake/perturb", data=json.dumps({"scale": 0.05, "after_requests": 2}).encode(),
            headers={"Content-Type": "application/json"}), timeout=60).read()
        # Every group is trained on (the tiny model's rewards are all 0: none would be kept).
        proc, log = _start_trainer(tmp_path, url, model=model,
                                   rollout={"weight_check": {"prompts": 2, "tokens": 4}},
                                   data={"dynamic_sampling": False})
        rc = proc.wait(timeout=300)
    finally:
        fake.kill()
        fake.wait()
        kill_marked(str(tmp_path))
    out = log.read_text()
    assert "weight check at the first contact: mean |engine - trainer|" in out, out[-3000:]
    assert rc == 2, out[-3000:]
    last = _last_line(log)
    print(last)
    assert last.startswith(
        "megatron-entropy train: error: weight check at step 1: the rollout engine's log-probs "
        "disagree with the trainer's on this step's rollout tokens, scored by the actor "
        "before its update (version any), so it does not hold the trained weights: server 0: "
        "|engine - trainer| "), last
    assert re.search(r"(mean|p99) [0-9.e-]+ nats > [0-9.e-]+ .*over \d+ tokens", last), last
    assert "Traceback" not in out
    run = tmp_path / "runs" / "run"
    metrics = run / "metrics.jsonl"
    assert not metrics.is_file() or not any(
        json.loads(line).get("step") == 1 for line in metrics.read_text().splitlines())
    assert not (run / "checkpoints").exists() or not any((run / "checkpoints").iterdir())
