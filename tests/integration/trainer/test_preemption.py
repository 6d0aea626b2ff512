"""Preemption requests (SIGUSR1/SIGTERM/SIGINT): one that arrives while `megatron-entropy train`
is still starting up is held until the next point of the start-up that looks (the run exits 75
with nothing to checkpoint, instead of dying by the signal's default action); one during a step
stops it after the rollout round, before anything of the step is applied; the job's clock;
helper processes started during a checkpoint (dist_checkpointing's writers and Manager) do not
die of one sent to the whole process tree, as Slurm's proctrack/linuxproc delivers it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from harness import free_port, hung_server, kill_marked, metrics_rows
from serving_model import make_served_model, make_tp2_model

from megatron_entropy.config.schema import ServerConfig
from megatron_entropy.rollout.server.pool import ServerPool
from megatron_entropy.rollout.server.supervisor import Supervisor
from megatron_entropy.runtime import preemption

REPO = Path(__file__).resolve().parents[3]
FAKE_SGLANG = Path(__file__).resolve().parents[2] / "helpers" / "fake_sglang_server.py"


@pytest.mark.slow
def test_usr1_during_start_up_ends_the_start_once_the_engine_is_up(tmp_path):
    """Also: the server the trainer launches does not inherit the rank's RANK/MASTER_PORT/..."""
    model = make_served_model(tmp_path / "model")
    started, go = tmp_path / "server-started", tmp_path / "go"
    server_env, requests = tmp_path / "server.env", tmp_path / "requests.jsonl"
    # The rollout server the trainer launches during its start-up waits for the test: the
    # signal comes while the trainer is building its engine, long after torch and Megatron load.
    gate = (f'env > {server_env}; touch {started}; while [ ! -e {go} ]; do sleep 0.1; done; '
            'exec "$0" "$@"')
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 1, "backend": "gloo"},
        "rollout": {"engine": "sglang", "n_samples": 4, "max_new_tokens": 12,
                    "max_prompt_tokens": 96,
                    "server": {"launch": 1, "base_port": 32300, "startup_timeout_s": 120,
                               "launch_command": ["/bin/sh", "-c", gate, sys.executable,
                                                  str(FAKE_SGLANG), "--model-path", "{model}",
                                                  "--host", "{host}", "--port", "{port}",
                                                  "--weight-version", "{weight_version}",
                                                  "--request-log", str(requests)]}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": 4, "apply_chat_template": False, "dynamic_sampling": False,
                 "arithmetic": {"num_train": 64}},
        "trainer": {"steps": 3, "lr": 1e-3, "micro_batch_tokens": 400, "save_interval": 0},
        "logging": {"name": "early", "runs_dir": str(tmp_path / "runs"), "progress_bar": False},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    mark = str(tmp_path)
    # Rank 0 of a one-rank torchrun-style launch.
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", "ME_TEST_MARK": mark, "RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
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
        kill_marked(mark)
    out = log.read_text()
    assert rc == 75, f"exit {rc}\n{out[-3000:]}"
    assert "signal received during start-up: nothing to checkpoint; exiting with 75" in out
    run = tmp_path / "runs" / "early"
    assert not (run / "metrics.jsonl").exists() or metrics_rows(run) == []
    assert not (run / "checkpoints" / "latest").exists()
    # The start ended once the engine was up: nothing was generated, no update reached the
    # server, and the server it launched was stopped.
    paths = [json.loads(line)["path"] for line in requests.read_text().splitlines()] \
        if requests.exists() else []
    assert "/generate" not in paths and "/update_weights_from_disk" not in paths, paths
    assert not [p for p in psutil.process_iter() if _marked(p, mark)]
    env_vars = dict(line.split("=", 1) for line in server_env.read_text().splitlines()
                    if "=" in line)
    assert not {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"} & env_vars.keys()
    assert env_vars["ME_TEST_MARK"] == mark  # the rest of the environment is passed on


def _marked(p: psutil.Process, mark: str) -> bool:
    try:
        return p.environ().get("ME_TEST_MARK") == mark and p.status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False


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


@pytest.fixture
def fresh_signals(monkeypatch):
    """preemption's state as in a new process; this process's handlers back after the test."""
    for name, value in (("_received", []), ("_stopping", False), ("_starting", False),
                        ("_running", False)):
        monkeypatch.setattr(preemption, name, value)
    previous = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_signal_during_the_hold_is_not_lost(fresh_signals):
    preemption.install()
    with preemption.held():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
    time.sleep(0.1)
    assert preemption.requested()
    assert preemption._received == [signal.SIGUSR1]


def test_a_stop_during_start_up_passes_through_a_librarys_except_exception(monkeypatch,
                                                                           fresh_signals):
    """SIGTERM while transformers loads the tokenizer (it turns any ``Exception`` from its file
    lookup into an OSError "Can't load tokenizer"): the start-up stop reaches the caller as
    itself, as it does in a rank whose model loads when Ctrl-C comes."""
    import transformers.tokenization_utils_base as tokenization

    from megatron_entropy.data.dataset import load_tokenizer

    lookup = tokenization.cached_file

    def lookup_then_signalled(where, name, *args, **kwargs):
        found = lookup(where, name, *args, **kwargs)
        if name == "vocab.json":  # one of the files looked up inside that except
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises inside the sleep
        return found

    monkeypatch.setattr(tokenization, "cached_file", lookup_then_signalled)
    with pytest.raises(preemption.StartupInterrupted) as stopped:
        with preemption.interruptible():
            load_tokenizer(REPO / "examples" / "quickstart_model")
    assert stopped.value.signum == signal.SIGTERM


@pytest.mark.parametrize("lands_in", ["task", "callback"])
def test_a_stop_during_start_up_ends_the_wait_for_a_server_wherever_it_lands(
        tmp_path, monkeypatch, fresh_signals, lands_in):
    """SIGTERM while the start-up waits for a hung server's /health (the server pool's event
    loop in the main thread): the handler raises inside a probe (a task, gathered with the
    others' outcomes) or inside a plain callback of the loop (as aiohttp's and the timers' are),
    and the wait ends at once with the stop, not with a "did not come up" error nor (asyncio
    logs a callback's exception and goes on) after startup_timeout_s."""
    probe = Supervisor.probe

    def signalled():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises inside the sleep

    async def signalled_probe(self, session, server):
        if lands_in == "task":
            signalled()
        else:
            asyncio.get_running_loop().call_soon(signalled)
        return await probe(self, session, server)

    monkeypatch.setattr(Supervisor, "probe", signalled_probe)
    with hung_server() as url:
        cfg = ServerConfig(urls=[url],
                           health_timeout_s=1.0, startup_timeout_s=60)
        pool = ServerPool(cfg, tmp_path, "sglang", str(tmp_path), lambda port, model: [])
        started = time.monotonic()
        try:
            with pytest.raises(preemption.StartupInterrupted):
                with preemption.interruptible():
                    pool.start()
        finally:
            pool.stop()
    assert time.monotonic() - started < 30


# --------------------------------------------------------------- a stop request inside a step


def _train_signalled_in_step(cfg: dict, signal_step: int) -> dict:
    """Worker: the RL loop, with SIGINT (Ctrl-C) sent to this rank while step ``signal_step``'s
    first rollout round generates. Returns the exit code, the rollout rounds and updates of that
    step, and the data position it started from (where step ``signal_step - 1`` left it)."""
    from megatron_entropy.config import load_config
    from megatron_entropy.trainer import loop

    seen: dict = {"rounds": 0, "updates": 0}
    plain_rollout = loop.Trainer.rollout

    def rollout(self, step):
        if step == signal_step:
            seen["sampler"] = self.sampler.state_dict()
            generate, update = self.engine.generate, self.actor.update

            def generate_and_signal(*args, **kwargs):
                seen["rounds"] += 1
                os.kill(os.getpid(), signal.SIGINT)
                return generate(*args, **kwargs)

            def counted_update(*args, **kwargs):
                seen["updates"] += 1
                return update(*args, **kwargs)

            self.engine.generate, self.actor.update = generate_and_signal, counted_update
        return plain_rollout(self, step)

    loop.Trainer.rollout = rollout
    try:
        loop.train(load_config(data=cfg))
        seen["rc"] = 0
    except SystemExit as e:
        seen["rc"] = e.code
    return seen


def test_a_signal_during_a_rollout_round_stops_before_the_next_round_and_applies_nothing(
        tmp_path, capfd):
    """Ctrl-C (SIGINT, handled as SIGTERM and SIGUSR1 are) while step 2's first round generates
    (dynamic sampling would refill: a random model scores no group): the run leaves after that
    round, without updating, checkpoints step 1 (save_interval 0: not saved before) with step
    1's data position, not the abandoned step's, and exits 75."""
    from harness import run_distributed

    model = make_tp2_model(tmp_path / "model")
    cfg = {
        "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 256},
        "parallel": {"tensor": 1, "backend": "gloo"},
        "rollout": {"n_samples": 2, "max_new_tokens": 6, "max_prompt_tokens": 96},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.05},
        "data": {"prompts_per_step": 2, "apply_chat_template": False, "dynamic_sampling": True,
                 "max_refill_rounds": 1, "arithmetic": {"num_train": 64}},
        "trainer": {"steps": 3, "lr": 1e-3, "micro_batch_tokens": 400, "save_interval": 0},
        "logging": {"name": "stopped", "runs_dir": str(tmp_path / "runs"), "progress_bar": False},
    }
    [seen] = run_distributed(_train_signalled_in_step, 1, cfg, 2, timeout=300)
    run = tmp_path / "runs" / "stopped"
    assert seen["rc"] == 75
    assert (seen["rounds"], seen["updates"]) == (1, 0), "the step went on after the signal"
    assert [r["step"] for r in metrics_rows(run)] == [1]
    assert (run / "checkpoints" / "latest").read_text() == "step_00000001"
    state = json.loads((run / "checkpoints" / "step_00000001" / "trainer_state.json").read_text())
    assert state["step"] == 1 and state["sampler"] == seen["sampler"]
    said = capfd.readouterr()
    assert "signal received during step 2 (not applied): checkpointed step 1" in said.out
    # Said once, past start-up.
    assert said.err.count("Ctrl-C: stopping after this step with a checkpoint") == 1


# ------------------------------------------------------------------------------ the job's clock


def test_job_clock_starts_a_step_only_if_it_and_a_checkpoint_fit():
    now = [1000.0]
    clock = preemption.JobClock(deadline=1000.0 + 600, margin_s=60, now=lambda: now[0])
    assert not clock.stop_before_next_step() and not clock.stop_inside_step()
    for seconds in (100.0, 200.0, 150.0):
        clock.step_took(seconds)
    # No checkpoint measured yet: it is guessed as long as the longest step (200 s).
    now[0] = 1000.0 + 600 - (200 + 200 + 60) - 1
    assert not clock.stop_before_next_step()
    now[0] += 2
    assert clock.stop_before_next_step()
    assert not clock.stop_inside_step()  # inside a step only a checkpoint must still fit
    clock.checkpoint_took(30.0)  # measured: replaces the guess
    assert not clock.stop_before_next_step()
    now[0] = 1000.0 + 600 - (30 + 60) + 1
    assert clock.stop_inside_step()
    # Only the last `window` steps count.
    clock = preemption.JobClock(deadline=10_000.0, margin_s=0, window=2, now=lambda: 9_000.0)
    for seconds in (900.0, 10.0, 10.0):
        clock.step_took(seconds)
    assert not clock.stop_before_next_step()
    assert not preemption.JobClock(None, 60).stop_before_next_step()  # no limit


def test_job_end_from_slurm_and_exit_duration(monkeypatch):
    assert preemption.parse_slurm_time_left("1-02:03:04") == 93784
    assert preemption.parse_slurm_time_left("02:03:04\n") == 7384
    assert preemption.parse_slurm_time_left("03:04") == 184
    for unlimited in ("UNLIMITED", "NOT_SET", "INVALID", ""):
        assert preemption.parse_slurm_time_left(unlimited) is None
    assert preemption.slurm_job_end({"SLURM_JOB_END_TIME": "1765000000"}) == 1765000000.0
    assert preemption.slurm_job_end({}) is None  # not a Slurm job
    monkeypatch.setenv("SLURM_JOB_END_TIME", "5000")
    assert preemption.job_clock(0, 60, started=1000.0, reads_job=True).deadline == 5000.0
    assert preemption.job_clock(10, 60, started=1000.0, reads_job=True).deadline == 1600.0
    assert preemption.job_clock(0, 60, started=1000.0, reads_job=False).deadline is None
