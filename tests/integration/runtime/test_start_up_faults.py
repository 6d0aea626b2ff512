"""Start-up faults of `megatron-entropy train`: a rank that dies while the job starts ends the
whole run within seconds with one line naming the rank and the cause, and nothing is left
running; a signal that comes before a rank has installed its handler is held for it, not fatal."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from safetensors.torch import load_file, save_file

from harness import hung_server, kill_marked
from serving_model import make_served_model

from megatron_entropy.runtime.processes import start_held, stop_all

REPO = Path(__file__).resolve().parents[3]


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_stop_all_escalates_to_sigkill_for_a_process_that_only_records_sigterm():
    stubborn = subprocess.Popen(_python(
        "import signal, time; signal.signal(signal.SIGTERM, lambda *a: None); print('ready', "
        "flush=True); time.sleep(120)"), stdout=subprocess.PIPE, text=True)
    done = subprocess.Popen(_python("pass"))
    done.wait()
    assert stubborn.stdout.readline() == "ready\n"
    started = time.monotonic()
    assert stop_all([done, stubborn], grace_s=0.5) == [1]
    assert stubborn.returncode == -signal.SIGKILL
    assert time.monotonic() - started < 10


def _started(start, code: str, before: str = "") -> subprocess.Popen:
    """A Python child started by ``start`` (start_held or Popen) running ``before``, then (once
    it has said so) ``code``."""
    child = start(_python(f"import time\n{before}\nprint('started', flush=True)\n{code}"),
                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                  env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.stdout.readline() == "started\n"
    return child


def test_a_signal_before_the_handler_is_installed_is_held_for_it():
    """A rank started by the launcher sleeps (as if importing torch) before it installs the
    preemption handler; SIGTERM and SIGINT sent meanwhile reach the handler once it is there."""
    child = _started(start_held, "time.sleep(1.0)\nfrom megatron_entropy.runtime import "
                     "preemption\npreemption.install(); time.sleep(0.2); "
                     "print(sorted(preemption._received), flush=True)")
    child.send_signal(signal.SIGTERM)
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err
    assert out.strip() == str(sorted([int(signal.SIGTERM), int(signal.SIGINT)]))
    assert "stopping after this step" not in err  # no step runs yet: no such promise


def test_second_ctrl_c_stops_at_once():
    child = _started(subprocess.Popen, "time.sleep(60)",
                     before="from megatron_entropy.runtime import preemption\n"
                            "preemption.install()")
    child.send_signal(signal.SIGINT)
    time.sleep(0.3)
    assert child.poll() is None  # the first one only asks for a checkpoint
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=30)
    assert child.returncode == -signal.SIGINT
    assert "Traceback" not in err


def _ranks(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    ranks = {}
    for p in psutil.Process(launcher.pid).children():
        try:
            ranks[int(p.environ()["RANK"])] = p
        except (psutil.NoSuchProcess, KeyError):
            pass
    return ranks


def test_rank_0_killed_during_start_up_ends_the_run_within_seconds(tmp_path):
    """kill -9 of rank 0 while the ranks import: rank 1 would wait for it in the c10d store for
    parallel.timeout_minutes, recording the launcher's SIGTERM; the launcher kills it."""
    cfg = {"model": {"hf_path": str(REPO / "examples" / "quickstart_model")},
           "parallel": {"tensor": 1, "timeout_minutes": 30},
           "logging": {"runs_dir": str(tmp_path / "runs"), "name": "r", "progress_bar": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    mark = str(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO), "ME_TEST_MARK": mark, "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    launcher = subprocess.Popen(
        [sys.executable, "-m", "megatron_entropy.cli", "train", str(tmp_path / "c.yaml"),
         "--nproc", "2"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while len(ranks := _ranks(launcher)) < 2:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(1.0)  # both are importing (torch, megatron)
        ranks[0].kill()
        killed = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        took = time.monotonic() - killed
        left = [p.pid for p in ranks.values() if p.is_running() and p.status() != "zombie"]
    finally:
        launcher.kill()
        kill_marked(mark)
    assert launcher.returncode == 128 + signal.SIGKILL
    lines = err.strip().splitlines()
    assert lines[-1].startswith("megatron-entropy train: rank 0 failed first (killed by "
                                "SIGKILL); stopped rank 1;"), err
    assert took < 30, took  # the grace periods (2 x 5 s), on a loaded machine
    assert not left


def _config(tmp_path: Path, **sections) -> Path:
    cfg = {"model": {"hf_path": str(REPO / "examples" / "quickstart_model")},
           "logging": {"runs_dir": str(tmp_path / "runs"), "name": "r", "progress_bar": False},
           **sections}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    return tmp_path / "c.yaml"


def test_second_trainer_on_a_run_folder_is_refused_naming_the_holder(tmp_path, capsys):
    from megatron_entropy.cli import main

    config = _config(tmp_path, parallel={"tensor": 1})
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    holder = subprocess.Popen(_python(
        "import sys, time; from pathlib import Path\n"
        "from megatron_entropy.runtime import run_lock\n"
        "run_lock.acquire(Path(sys.argv[1]), 'run folder'); print('held', flush=True); "
        "time.sleep(120)") + [str(run / "train.lock")], stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert holder.stdout.readline() == "held\n"
        handlers = [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)]
        assert main(["train", str(config)]) == 2
        # The command's signal handlers were this process's for the command only.
        assert [signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)] == handlers
    finally:
        holder.kill()
        holder.wait()
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith(f"megatron-entropy train: error: run folder {run} is in use by host "
                             f"{socket.gethostname()}, pid {holder.pid} (since "), err


def test_lock_of_a_dead_holder_is_taken_over_and_said(tmp_path, capsys):
    from megatron_entropy.runtime import run_lock

    lock = tmp_path / "train.lock"
    lock.write_text("node07 4242 2026-12-01T10:00:00+0000\n")  # its holder was killed
    fd = run_lock.acquire(lock, "run folder")
    assert capsys.readouterr().err.strip() == (
        f"run folder {tmp_path}: taking over the lock of host node07, pid 4242 (since "
        "2026-12-01T10:00:00+0000), which ended without releasing it")
    assert lock.read_text().split()[1] == str(os.getpid())
    with pytest.raises(run_lock.RunLockError, match=f"pid {os.getpid()} "):
        run_lock.acquire(lock, "run folder")  # another open of the file: refused while held
    run_lock.release(fd)
    run_lock.release(run_lock.acquire(lock, "run folder"))  # released cleanly: nothing to say
    assert capsys.readouterr().err == ""



def _launch(tmp_path: Path, nproc: int, cfg: dict) -> tuple[subprocess.Popen, Path]:
    """``train`` as a terminal starts it: the leader of its own process group (what Ctrl-C
    signals), its output in a file; ``--nproc 2`` for ``nproc`` 2."""
    cfg = {"model": {"hf_path": str(REPO / "examples" / "quickstart_model")},
           "logging": {"runs_dir": str(tmp_path / "runs"), "name": "r", "progress_bar": False},
           **cfg}
    cfg["parallel"] = {"tensor": 1, "timeout_minutes": 30}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PYTHONPATH": str(REPO), "ME_TEST_MARK": str(tmp_path),
           "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID"):
        env.pop(key, None)
    log = tmp_path / "train.log"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "megatron_entropy.cli", "train", str(tmp_path / "c.yaml"),
         *(["--nproc", str(nproc)] if nproc > 1 else [])], env=env, stdout=log.open("w"),
        stderr=subprocess.STDOUT, start_new_session=True)
    return launcher, log


def _wait_for(launcher: subprocess.Popen, ready, what: str, log: Path, within_s: float = 180):
    deadline = time.monotonic() + within_s
    while not (found := ready()):
        assert launcher.poll() is None, log.read_text()[-3000:]
        assert time.monotonic() < deadline, f"no {what}: {log.read_text()[-3000:]}"
        time.sleep(0.05)
    return found


def _catches_sigterm(pid: int) -> bool:
    """Whether ``pid`` has a handler for SIGTERM (the trainer's is installed)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line for line in status.splitlines() if line.startswith("SigCgt:"))
                 .split()[1], 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _processes(launcher: subprocess.Popen, nproc: int, log: Path) -> list[psutil.Process]:
    """The run's processes: the launcher and, with ``--nproc``, its ranks once both exist."""
    if nproc == 1:
        return [psutil.Process(launcher.pid)]
    ranks = _wait_for(launcher, lambda: r if len(r := _ranks(launcher)) == 2 else None,
                      "two ranks", log)
    return [psutil.Process(launcher.pid), *ranks.values()]


def _stopped(sig: int, nproc: int) -> tuple[int, str]:
    """The exit code and the last line of a run stopped by ``sig`` during start-up: rank 0's
    line, which names the rank where the run has several."""
    who = "rank 0 " if nproc > 1 else ""
    return ({signal.SIGINT: 130, signal.SIGTERM: 75}[sig],
            f"megatron-entropy train: {who}stopped by {signal.Signals(sig).name} during start-up")


def _stop_with_group_signal(launcher: subprocess.Popen, processes: list[psutil.Process],
                            sig: int, log: Path) -> None:
    """Send ``sig`` to the launcher's process group (as Ctrl-C does): the run ends within a
    minute with one line and the signal's exit code, and leaves no process."""
    os.killpg(launcher.pid, sig)
    sent = time.monotonic()
    launcher.wait(timeout=120)
    took = time.monotonic() - sent
    out = log.read_text()
    assert (launcher.returncode, out.strip().splitlines()[-1]) == \
        _stopped(sig, len(processes) - 1 or 1), out[-3000:]
    # Not "rank 0 failed first (130)", an abort's 134, Ctrl-C's promise of a step's checkpoint.
    for noise in ("Traceback", "failed first", "stopping after this step", "core dumped"):
        assert noise not in out, out[-3000:]
    assert took < 60, took  # where start-up could not stop at once, imports finish
    assert not [p.pid for p in processes if p.is_running() and p.status() != "zombie"]


@pytest.mark.parametrize("nproc, sig, moment", [
    (1, signal.SIGINT, "imports"), (1, signal.SIGINT, "loading"), (2, signal.SIGINT, "imports"),
    (2, signal.SIGINT, "loading"), (2, signal.SIGTERM, "loading")])
def test_a_signal_to_the_group_during_start_up_is_one_line_and_leaves_nothing(tmp_path, nproc,
                                                                              sig, moment):
    """Ctrl-C (SIGINT to the terminal's process group: the launcher and its ranks) or SIGTERM
    early in start-up (the config and the model's files checked, then seconds of torch and
    Megatron imports, before start-up can be interrupted; the ranks have the signals blocked
    still: the signal acts where the checks end, or once the imports have) or while the
    tokenizer, the prompts, the policy and the engine load (from rank 0's first start-up line on: seconds of start-up are left; the line that
    comes just before the engine's weights left ~0.2 s, which a busy machine's start-up could
    finish before the signal came)."""
    launcher, log = _launch(tmp_path, nproc, {})
    try:
        processes = _processes(launcher, nproc, log)
        if moment == "loading":
            _wait_for(launcher, lambda: "loading the tokenizer and the prompts" in log.read_text(),
                      "start-up line", log)
        elif nproc == 1:  # once the handler is there (before, Python's KeyboardInterrupt)
            _wait_for(launcher, lambda: _catches_sigterm(launcher.pid), "handler", log)
        _stop_with_group_signal(launcher, processes, sig, log)
    finally:
        launcher.kill()
        kill_marked(str(tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_to_the_group_while_rank_0_waits_for_a_server_stops_every_rank(tmp_path, sig):
    """`--nproc 2` whose rollout server takes connections but never answers (a hung server):
    rank 0 waits for its /health, rank 1 for rank 0; Ctrl-C or SIGTERM ends both."""
    model = make_served_model(tmp_path / "model")
    with hung_server() as url:
        launcher, log = _launch(tmp_path, 2, {
            "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
            "rollout": {"engine": "sglang", "n_samples": 2, "max_new_tokens": 8,
                        "max_prompt_tokens": 96,
                        "server": {"urls": [url], "health_timeout_s": 1.0,
                                   "startup_timeout_s": 600}},
            "data": {"prompts_per_step": 2, "apply_chat_template": False,
                     "arithmetic": {"num_train": 16}},
            "trainer": {"steps": 1, "micro_batch_tokens": 400, "save_interval": 0}})
        try:
            processes = _processes(launcher, 2, log)
            _wait_for(launcher, lambda: f"waiting for server 0 ({url}) to answer /health"
                      in log.read_text(), "health wait", log)
            _stop_with_group_signal(launcher, processes, sig, log)
        finally:
            launcher.kill()
            kill_marked(str(tmp_path))


def _ended(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("moment", ["before the ranks join", "once joined"])
def test_sigterm_to_rank_0_alone_during_start_up_ends_the_run_naming_it(tmp_path, moment):
    """SIGTERM to rank 0 of `--nproc 2` alone (not the launcher): it stops (75), and rank 1,
    which waits for it (in the c10d store before they join, where no signal reaches; after, in
    a collective whose peer is gone), ends within 20 s of it: the launcher gives it 15 s, then
    SIGTERM, then SIGKILL 5 s later. One line, rank 0's own, names the rank and the signal; the
    run's exit code is the stop's, not rank 1's (3: its peer is gone). The launcher's line for
    another rank that stops alone: tests/unit/test_cli.py."""
    launcher, log = _launch(tmp_path, 2, {})
    try:
        processes = _processes(launcher, 2, log)
        if moment == "once joined":
            _wait_for(launcher, lambda: "2 ranks joined" in log.read_text(), "join", log)
        # Before: the ranks start with the signals blocked, so rank 0 acts on it once its
        # handler is installed, before it opens the store.
        processes[1].send_signal(signal.SIGTERM)
        _wait_for(launcher, lambda: _ended(processes[1]), "stop", log)
        stopped = time.monotonic()
        launcher.wait(timeout=120)
        took = time.monotonic() - stopped
    finally:
        launcher.kill()
        kill_marked(str(tmp_path))
    out = log.read_text()
    lines = [line for line in out.splitlines() if line.startswith("megatron-entropy train:")]
    assert launcher.returncode == 75, out[-3000:]
    assert lines == ["megatron-entropy train: rank 0 stopped by SIGTERM during start-up"], out
    assert took < 35, took  # 20 s at most, on a loaded machine
    assert not [p.pid for p in processes if p.is_running() and p.status() != "zombie"]


def test_an_error_of_rank_0_is_its_own_line_only(tmp_path):
    """The ranks of `--nproc 2` stop on a bad model (a NaN in a weight, found as the weights
    load): rank 0's line is the last, the launcher adds none ("rank 1 failed first (2)")."""
    model = tmp_path / "nan_model"
    shutil.copytree(REPO / "examples" / "quickstart_model", model)
    weights = load_file(model / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][3, 5] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    launcher, log = _launch(tmp_path, 2, {"model": {"hf_path": str(model)}})
    try:
        processes = _processes(launcher, 2, log)
        launcher.wait(timeout=300)
    finally:
        launcher.kill()
        kill_marked(str(tmp_path))
    out = log.read_text()
    assert launcher.returncode == 2, out[-3000:]
    assert out.strip().splitlines()[-1].startswith(
        "megatron-entropy train: error: model.hf_path: "), out[-3000:]
    assert "failed first" not in out and "Traceback" not in out, out[-3000:]
    assert not [p.pid for p in processes if p.is_running() and p.status() != "zombie"]
    # What this start made (the run folder, its lock, the rank logs) is removed.
    assert not (tmp_path / "runs").exists()
