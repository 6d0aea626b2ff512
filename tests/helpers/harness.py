"""Multi-process tests on CPU: gloo workers forked from the pytest process, which has already
imported megatron (conftest), and what tests run inside them. The ranks themselves are
megatron_entropy/testing/ranks.py, which the benchmarks share.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import psutil

# Re-exported: the tests import the forked ranks from here, beside the loop helpers.
from megatron_entropy.testing.ranks import free_port, init_megatron, run_distributed  # noqa: F401
from metrics_table import undocumented_metrics


def train_from_dict(cfg: dict) -> dict:
    """Inside a worker: the RL loop on a config given as a dict (as YAML would load it)."""
    from megatron_entropy.config import load_config
    from megatron_entropy.trainer.loop import train

    return train(load_config(data=cfg))


def with_sections(cfg: dict, **sections: dict) -> dict:
    """``cfg`` with each named section updated key by key."""
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def tiny_run_config(model_dir: Path, run_dir: Path, name: str, **sections: dict) -> dict:
    """A few steps of KL-Cov on the arithmetic task, a checkpoint every step, the run in
    ``run_dir / name``; ``sections`` update it (``with_sections``)."""
    return with_sections({
        "model": {"hf_path": str(model_dir), "dtype": "fp32", "seq_length": 256},
        "rollout": {"n_samples": 4, "max_new_tokens": 12, "max_prompt_tokens": 96},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        # 256 training problems, not the default 20000: a few steps draw a few dozen, and
        # building each rank's dataset would cost ~2.3 s (of a ~10 s run)
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 256}},
        "trainer": {"steps": 3, "lr": 1e-3, "micro_batch_tokens": 400, "save_interval": 1},
        "logging": {"name": name, "runs_dir": str(run_dir), "progress_bar": False},
    }, **sections)


def metrics_rows(run_dir) -> list[dict]:
    """Every line of a run's metrics.jsonl, as written (a step logged twice shows twice), after
    checking that docs/metrics.md's table names every key (metrics_table.py): each test
    that reads a run's metrics keeps that table, the one list of metric names, complete."""
    rows = [json.loads(line)
            for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    missing = undocumented_metrics(k for row in rows for k in row)
    assert not missing, f"{run_dir}: metrics missing from the table in docs/metrics.md: {missing}"
    return rows


def kill_marked(mark: str) -> None:
    """Kill every process started under this test (they carry its mark in their environment),
    also those a killed parent left behind."""
    for p in psutil.process_iter():
        try:
            if p.environ().get("ME_TEST_MARK") == mark:
                p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def kill_after_first_step(victim: subprocess.Popen, metrics: Path, log: Path,
                          meanwhile: Callable[[], object], timeout: float = 300) -> int:
    """Run ``meanwhile()`` (the uninterrupted reference) while a thread SIGKILLs ``victim``'s
    process group as soon as its ``metrics.jsonl`` has a line; afterwards the victim is gone.
    Returns the lines the metrics had at the kill; fails, with the victim's ``log``, if it
    exited or the timeout passed first."""
    killed: dict = {}

    def kill() -> None:
        deadline = time.monotonic() + timeout
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 1):
            if victim.poll() is not None or time.monotonic() > deadline:
                return
            time.sleep(0.2)
        os.killpg(victim.pid, signal.SIGKILL)
        killed["at"] = len(metrics.read_text().splitlines())

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    try:
        meanwhile()
    finally:
        thread.join(timeout=timeout)
        if victim.poll() is None:
            os.killpg(victim.pid, signal.SIGKILL)
        victim.wait()
    assert "at" in killed, log.read_text()[-3000:]
    return killed["at"]


REPO = Path(__file__).resolve().parents[2]
# Metric keys that measure time (and what follows from it): they differ between two runs of the
# same numbers.
STABLE = ("time/", "perf/", "weight_sync/seconds", "weight_check/seconds",
          "rollout/tokens_per_s")


def train_cli(config: Path, *overrides: str, log: Path, **env: str) -> subprocess.Popen:
    """``megatron-entropy train CONFIG OVERRIDES`` in its own session, its output in ``log``."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}
    return subprocess.Popen([sys.executable, "-m", "megatron_entropy.cli", "train", str(config),
                             *overrides], cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def study_cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """``megatron-entropy study ARGS`` as a user runs it from the checkout (one OpenMP thread a
    process), its output captured."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "study", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def killed_run_resumes_bit_identical(cfg_path: Path, cfg: dict, run_dir: Path, steps: int,
                                     extra: tuple = ()) -> None:
    """The scheme of the kill-and-resume tests: ``cfg`` (saved at ``cfg_path``, its runs under
    ``run_dir``) as a CLI run of 2 ranks ("victim", ``extra`` overrides) is SIGKILLed after its
    first step while the same config runs uninterrupted in forked ranks ("ref"); run again, the
    victim finishes and its metrics equal the reference's step for step (all but times)."""
    threads = {"OMP_NUM_THREADS": "1"}  # the forked reference's: the same kernels
    victim = train_cli(cfg_path, "logging.name=victim", *extra, "--nproc", "2",
                       log=run_dir / "victim.log", **threads)
    metrics = run_dir / "victim" / "metrics.jsonl"
    assert kill_after_first_step(victim, metrics, run_dir / "victim.log",
                                 lambda: run_distributed(train_from_dict, 2, cfg, timeout=300)
                                 ) < steps
    resumed = train_cli(cfg_path, "logging.name=victim", *extra, "--nproc", "2",
                        log=run_dir / "resumed.log", **threads)
    assert resumed.wait(timeout=300) == 0, (run_dir / "resumed.log").read_text()[-3000:]
    assert "resumed from" in (run_dir / "resumed.log").read_text()
    got, want = metrics_rows(run_dir / "victim"), metrics_rows(run_dir / "ref")
    assert [r["step"] for r in got] == list(range(1, steps + 1))
    assert all(r["grad_norm"] > 0 for r in want)
    for g, w in zip(got, want):
        g = {k: v for k, v in g.items() if not k.startswith(STABLE)}
        w = {k: v for k, v in w.items() if not k.startswith(STABLE)}
        assert g == w, f"step {g['step']} differs"


@contextmanager
def hung_server() -> Iterator[str]:
    """The URL of a server that takes connections and never answers (a hung one)."""
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(64)
        yield f"http://127.0.0.1:{hung.getsockname()[1]}"
