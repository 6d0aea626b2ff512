"""`megatron-entropy slurm serve` on this machine (no cluster): the one server of a Slurm task,
started, signalled and stopped through rollout/server/process.py as the engines' servers are.
It publishes its URL once the server answers /health, ignores SIGTERM (preemption is the
trainer's), and on SIGUSR2 stops the server's whole process group and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from harness import free_port, kill_marked
from serving_model import make_served_model

from megatron_entropy.runtime.launch_env import healthy

REPO = Path(__file__).resolve().parents[2]
FAKE = REPO / "tests" / "helpers" / "fake_sglang_server.py"


@pytest.mark.slow
def test_serve_publishes_ignores_sigterm_and_stops_its_group_on_sigusr2(tmp_path):
    model = make_served_model(tmp_path / "model")
    port = free_port()
    cfg = {"model": {"hf_path": str(model)},
           "rollout": {"engine": "sglang", "server": {
               "urls_file": str(tmp_path / "urls"), "base_port": port,
               "startup_timeout_s": 120, "launch_command": [
                   sys.executable, str(FAKE), "--model-path", "{model}", "--host", "{host}",
                   "--port", "{port}", "--weight-version", "{weight_version}"]}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    urls = tmp_path / "urls.d"
    env = {**os.environ, "PYTHONPATH": str(REPO), "ME_TEST_MARK": str(tmp_path)}
    for key in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_JOB_NUM_NODES", "SLURM_NNODES"):
        env.pop(key, None)
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_entropy.cli", "slurm", "serve",
                             str(tmp_path / "c.yaml"), "--urls-dir", str(urls)], env=env,
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while not (urls / "0").exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        url = (urls / "0").read_text().strip()
        assert url == f"http://127.0.0.1:{port}" and healthy(url)
        [server] = psutil.Process(proc.pid).children()
        assert os.getpgid(server.pid) == server.pid != os.getpgid(proc.pid)  # its own group
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None and healthy(url)  # ignored, the server still serves
        proc.send_signal(signal.SIGUSR2)
        assert proc.wait(timeout=60) == 0, log.read_text()
        assert not psutil.pid_exists(server.pid) or server.status() == psutil.STATUS_ZOMBIE
    finally:
        kill_marked(str(tmp_path))
    out = log.read_text()
    assert f"[serve 0] ready at {url}" in out and "SIGTERM ignored" in out
