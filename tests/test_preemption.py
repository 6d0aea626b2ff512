"""Preemption requests (SIGUSR1/SIGTERM): one that arrives while `megatron-entropy train` is
still starting up is held until the loop looks at it (the run checkpoints after its first step and
exits 75 instead of dying by the signal's default action); helper processes started during a
checkpoint (dist_checkpointing's writers and Manager) do not die of one sent to the whole process
tree, as Slurm's proctrack/linuxproc delivers it."""

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

from harness import metrics_rows
from serving_model import make_served_model

from megatron_entropy.trainer import preemption

REPO = Path(__file__).resolve().parents[1]
FAKE_SGLANG = Path(__file__).with_name("fake_sglang_server.py")


def _kill_marked(mark: str) -> None:
    """Kill every process started under this test (they carry its mark in their environment),
    also those a killed parent left behind."""
    for p in psutil.process_iter():
        try:
            if p.environ().get("ME_TEST_MARK") == mark:
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


@pytest.mark.slow
def test_usr1_during_start_up_checkpoints_after_the_first_step(tmp_path):
    model = make_served_model(tmp_path / "model")
    started, go = tmp_path / "server-started", tmp_path / "go"
    # The rollout server the trainer launches during its start-up waits for the test: the
    # signal comes while the trainer is building its engine, long after torch and Megatron load.
    gate = f'touch {started}; while [ ! -e {go} ]; do sleep 0.1; done; exec "$0" "$@"'
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 1, "backend": "gloo"},
        "rollout": {"engine": "sglang", "n_samples": 4, "max_new_tokens": 12,
                    "max_prompt_tokens": 96,
                    "server": {"launch": 1, "base_port": 32300, "startup_timeout_s": 120,
                               "launch_command": ["/bin/sh", "-c", gate, sys.executable,
                                                  str(FAKE_SGLANG), "--model-path", "{model}",
                                                  "--host", "{host}", "--port", "{port}",
                                                  "--weight-version", "{weight_version}"]}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False},
        "trainer": {"steps": 3, "lr": 1e-3, "micro_batch_tokens": 400, "save_interval": 0},
        "logging": {"name": "early", "runs_dir": str(tmp_path / "runs"), "progress_bar": False},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    mark = str(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "ME_TEST_MARK": mark}
    log = tmp_path / "train.log"
    proc = subprocess.Popen([sys.executable, "-m", "megatron_entropy.cli", "train",
                             str(tmp_path / "c.yaml")], env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 180
        while not started.exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        proc.send_signal(signal.SIGUSR1)
        time.sleep(1.0)  # a rank that the signal kills is gone by now
        go.touch()
        rc = proc.wait(timeout=300)
    finally:
        _kill_marked(mark)
    out = log.read_text()
    assert rc == 75, f"exit {rc}\n{out[-3000:]}"
    assert "signal received: checkpointed step 1" in out
    run = tmp_path / "runs" / "early"
    assert [r["step"] for r in metrics_rows(run)] == [1]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000001"


def test_processes_started_while_held_do_not_die_of_the_signals():
    """As in a checkpoint: a spawned multiprocessing Manager (it also starts the resource
    tracker, which unblocks SIGTERM behind our back) and a plain child."""
    import multiprocessing

    with preemption.held():
        manager = multiprocessing.get_context("spawn").Manager()
        queue = manager.Queue()
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    free = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    helpers = psutil.Process().children(recursive=True)
    try:
        for p in helpers:
            if p.pid != free.pid:
                for sig in (signal.SIGUSR1, signal.SIGTERM):
                    os.kill(p.pid, sig)
        os.kill(free.pid, signal.SIGTERM)
        assert free.wait(timeout=30) == -signal.SIGTERM  # outside the hold: the default action
        time.sleep(0.5)
        assert child.poll() is None
        queue.put("still served")
        assert queue.get(timeout=10) == "still served"
    finally:
        child.kill()
        child.wait()
        manager.shutdown()


def test_a_signal_during_the_hold_is_not_lost(monkeypatch):
    monkeypatch.setattr(preemption, "_received", [])
    previous = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    try:
        preemption.install()
        with preemption.held():
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.1)
        time.sleep(0.1)
        assert preemption.requested()
        assert preemption._received == [signal.SIGUSR1]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
