"""The thread defaults of `megatron-entropy train` (runtime/threads.py): what the launcher sets
for the ranks it starts, seen in the ranks' own environment and by OpenMP itself, and that a
value the user set wins."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from serving_model import make_tp2_model

from megatron_entropy.runtime.threads import apply_thread_defaults, thread_defaults

REPO = Path(__file__).resolve().parents[3]
CPUS = len(os.sched_getaffinity(0))
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    return {**env, "PYTHONPATH": str(REPO), **extra}


def _config(tmp_path: Path, hf_path: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"hf_path": hf_path, "dtype": "fp32", "seq_length": 128},
        "parallel": {"tensor": 1},
        "rollout": {"max_prompt_tokens": 64, "max_new_tokens": 16},
        "data": {"apply_chat_template": False, "arithmetic": {"num_train": 16, "num_val": 4}},
        "trainer": {"steps": 1},
        "logging": {"runs_dir": str(tmp_path / "runs"), "name": "threads",
                    "progress_bar": False}}))
    return path


@pytest.mark.parametrize("ranks,cpus,threads", [(1, 2, 2), (2, 2, 1), (3, 2, 1), (2, 16, 8)])
def test_defaults_split_the_cores_among_the_ranks_and_idle_threads_sleep(ranks, cpus, threads):
    assert thread_defaults(ranks, cpus) == {"OMP_NUM_THREADS": str(threads),
                                           "OMP_WAIT_POLICY": "PASSIVE"}


def test_a_variable_the_user_set_wins():
    env = {"OMP_NUM_THREADS": "3"}
    assert apply_thread_defaults(1, env) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}
    assert apply_thread_defaults(4, env) == {}
    assert env == {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}


def _openmp_settings(output: str) -> dict[str, str]:
    """OpenMP's own account of its settings (OMP_DISPLAY_ENV), printed when it loads."""
    lines = output.split("OPENMP DISPLAY ENVIRONMENT BEGIN", 1)[1].split("END", 1)[0]
    pairs = (line.strip().split(" = ", 1) for line in lines.splitlines() if " = " in line)
    return {k: v.strip("'") for k, v in pairs}


@pytest.mark.parametrize("user", [{}, {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}])
def test_one_process_run_loads_openmp_with_the_defaults(tmp_path, user):
    """At one process the run is this process: the defaults must be in place before torch
    loads OpenMP. The model is a dist checkpoint, an empty folder, so the command stops (exit
    2) right after loading torch to read it (an HF model folder is checked without torch)."""
    config = _config(tmp_path, str(tmp_path / "no_model"))
    (tmp_path / "no_checkpoint").mkdir()
    out = subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "train", str(config),
                          "model.hf_path=", f"model.megatron_ckpt={tmp_path / 'no_checkpoint'}"],
                         env=_env(OMP_DISPLAY_ENV="VERBOSE", **user), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "no_checkpoint records no architecture" in out.stderr, out.stderr
    seen = _openmp_settings(out.stdout + out.stderr)
    if user:
        assert {k: seen[k] for k in THREAD_VARS} == user
    else:
        # OpenMP shows an unset wait policy as PASSIVE too; what tells them apart is that an
        # idle thread spins 300000 times first unless the policy was set (GOMP_SPINCOUNT 0).
        assert (seen["OMP_NUM_THREADS"], seen["GOMP_SPINCOUNT"]) == (str(CPUS), "0")


def test_eval_loads_openmp_with_the_one_process_defaults(tmp_path):
    """Every command but train computes in its own process (eval generates, convert reshards)
    and loads OpenMP with the defaults of a one-process run: a study's eval of each run spun
    its threads without them. The checkpoint is an empty folder, so eval stops (exit 2) after
    loading torch, to read it."""
    config = _config(tmp_path, str(tmp_path / "no_model"))
    (tmp_path / "no_checkpoint").mkdir()
    out = subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "eval", str(config),
                          "--checkpoint", str(tmp_path / "no_checkpoint"), "eval.split=val"],
                         env=_env(OMP_DISPLAY_ENV="VERBOSE"), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "no_checkpoint" in out.stderr
    seen = _openmp_settings(out.stdout + out.stderr)
    assert (seen["OMP_NUM_THREADS"], seen["GOMP_SPINCOUNT"]) == (str(CPUS), "0")


def _ranks_environment(cmd: list[str], env: dict, cwd: Path, count: int) -> list[dict]:
    """The environment of the ``count`` ranks ``cmd`` starts, read from the running ranks; then
    the command and its ranks are stopped."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            children = psutil.Process(proc.pid).children()
            # A rank between fork and exec still shows the launcher's own first environment
            # (the launcher starts its ranks with a preexec function): wait for its own (RANK).
            envs = [child.environ() for child in children]
            if len(envs) == count and all("RANK" in env for env in envs):
                return envs
            assert proc.poll() is None, f"the launcher exited with {proc.returncode}"
            time.sleep(0.05)
        raise AssertionError(f"{count} ranks did not start in 120 s")
    finally:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("user", [{}, {"OMP_NUM_THREADS": "3", "OMP_WAIT_POLICY": "ACTIVE"}])
def test_nproc_ranks_get_the_defaults(tmp_path, user):
    model = make_tp2_model(tmp_path / "model")
    config = _config(tmp_path, str(model))
    ranks = _ranks_environment([sys.executable, "-m", "megatron_entropy.cli", "train",
                                str(config), "--nproc", "2"], _env(**user), tmp_path, 2)
    expected = user or {"OMP_NUM_THREADS": str(max(1, CPUS // 2)), "OMP_WAIT_POLICY": "PASSIVE"}
    for rank_env in ranks:
        assert {k: rank_env.get(k) for k in THREAD_VARS} == expected
