"""`megatron-entropy train` against a connected rollout server that is not there, or that never
answers: start-up ends with one line, in bounded time, and SIGTERM stops it wherever it waits
(rollout/server/supervisor.py, trainer/preemption.py)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from harness import free_port, kill_marked
from serving_model import make_served_model

REPO = Path(__file__).resolve().parents[2]


def _start_trainer(tmp_path: Path, url: str, **server) -> tuple[subprocess.Popen, Path]:
    """Rank 0 of a one-rank torchrun-style launch of a run whose engine connects to ``url``."""
    model = make_served_model(tmp_path / "model")
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 1, "backend": "gloo"},
        "rollout": {"engine": "sglang", "n_samples": 2, "max_new_tokens": 8,
                    "max_prompt_tokens": 96, "server": {"urls": [url], **server}},
        "data": {"prompts_per_step": 2, "apply_chat_template": False,
                 "arithmetic": {"num_train": 16}},
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
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
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
