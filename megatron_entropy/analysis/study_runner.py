"""Running a planned study (analysis/study.py): one ``train`` process per run, ``jobs`` of them
at once in plan order, resumable, then its report (analysis/study_report.py: the numbers;
analysis/study_plots.py: the figures). The module of the study's process, above the plan, the
report and the figures.

Every process is watched from the study's one thread: a run is a generator that starts its
processes (train, then eval) one after another and yields each, and the loop here polls them,
so a signal reaches every running run at once and no process is forked from a second thread.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Generator, Optional

from megatron_entropy.analysis.plots import read_metrics, series
from megatron_entropy.analysis.study import (RUN_EVAL_FILE, RUN_LOG_FILE, StudyError,
                                             StudyPlan, StudyRun, check_same_run,
                                             checkpoint_step, last_step, read_run_state,
                                             run_wall_seconds, settings_of, write_run_state)
from megatron_entropy.analysis.study_plots import plot_study
from megatron_entropy.analysis.study_report import load_results, render_report, summarize
from megatron_entropy.analysis.study_tuning import add_tuned_runs
from megatron_entropy.runtime import min_world_size, run_lock
from megatron_entropy.runtime.processes import die_with_parent
from megatron_entropy.runtime.preemption import PREEMPTED_EXIT_CODE
from megatron_entropy.runtime.threads import apply_thread_defaults

POLL_S = 0.2  # how often the running processes are looked at (a run takes minutes)

# A run's course: yields each process it starts and is sent its exit code; returns None when
# the run is done, else the study's exit code (interrupted).
RunSteps = Generator[subprocess.Popen, int, Optional[int]]


class _Interrupt:
    """SIGTERM, SIGINT or SIGUSR1 to the study: every running train run is asked to checkpoint
    at the end of its step (SIGTERM, which its ranks handle), and the study stops after them."""

    def __init__(self) -> None:
        self.raised = False
        self.children: set[subprocess.Popen] = set()
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}

    def _handle(self, signum, frame) -> None:
        self.stop()

    def stop(self) -> None:
        """Start no more processes; SIGTERM to those running."""
        self.raised = True
        for child in list(self.children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return ""


def _summary_line(run: StudyRun) -> str:
    records = read_metrics(run.run_dir)
    parts = []
    for key, short in (("entropy/seq_mean", "H"), ("val/acc/mean", "val")):
        _, values = series(records, key)
        if values:
            parts.append(f"{short} {values[0]:.3f} -> {values[-1]:.3f}")
    return f" ({', '.join(parts)})" if parts else ""


def _thread_env(processes: int) -> dict[str, str]:
    """The environment of a process of a run: the thread defaults (runtime/threads.py) of
    ``processes`` processes sharing this machine's cores; what the user set wins."""
    env = dict(os.environ)
    apply_thread_defaults(processes, env)
    return env


def _train_env(run: StudyRun, state: dict, jobs: int) -> dict[str, str]:
    """A train run's environment: OpenMP threads as one of ``jobs`` runs of its ranks sharing
    the cores; a run that resumes keeps the count it started with (on the CPU fp32 sums differ
    with it: a run's numbers come from one count whatever ``jobs`` became)."""
    p = run.config.parallel
    env = _thread_env(jobs * min_world_size(p.tensor, p.pipeline, p.expert, p.context))
    started = [a["threads"] for a in state["attempts"] if a.get("threads")]
    if started and checkpoint_step(run.run_dir):
        env["OMP_NUM_THREADS"] = started[-1]
    return env


def _start(run: StudyRun, cmd: list[str], interrupt: _Interrupt, env: dict[str, str],
           pass_fds: tuple = ()) -> subprocess.Popen:
    """Start ``cmd`` with its output appended to the run's log. SIGTERM when the study dies: a
    train run checkpoints at the end of its step and exits."""
    with open(run.run_dir / RUN_LOG_FILE, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, pass_fds=pass_fds,
                                 env=env, preexec_fn=functools.partial(
                                     die_with_parent, signal.SIGTERM, os.getpid()))
    interrupt.children.add(child)
    return child


def _eval_if_wanted(plan: StudyPlan, run: StudyRun, interrupt: _Interrupt, jobs: int,
                    echo: Callable[[str], None], head: str) -> RunSteps:
    """``megatron-entropy eval`` of a reported run's last checkpoint into its folder (its log
    goes to the run's log); a failed eval stops the study."""
    # A tuning run only chooses on the validation split: the test split is not its to read.
    reported = any(role != "tune" for role, _ in run.roles)
    out = run.run_dir / RUN_EVAL_FILE
    if not (plan.study.eval_runs and reported) or out.is_file():
        return None
    if interrupt.raised:
        return PREEMPTED_EXIT_CODE
    cmd = [sys.executable, "-m", "megatron_entropy.cli", "eval", plan.config_path,
           *run.overrides, "--checkpoint", str(run.run_dir), "--out", str(out)]
    start = time.perf_counter()
    code = yield _start(run, cmd, interrupt, _thread_env(jobs))
    if interrupt.raised:
        return PREEMPTED_EXIT_CODE
    if code != 0:
        raise StudyError(f"eval of run {run.name} failed (exit code {code}); its log: "
                         f"{run.run_dir / RUN_LOG_FILE}\n{_tail(run.run_dir / RUN_LOG_FILE)}")
    echo(f"{head}: eval in {time.perf_counter() - start:.0f} s ({out})")
    return None


def _say(line: str) -> None:
    print(line, flush=True)


def execute(plan: StudyPlan, echo: Callable[[str], None] = _say, jobs: int = 1) -> int:
    """Run every run of the plan that has not finished, ``jobs`` at once in plan order (an arm's
    tuning runs before the runs of the value they choose: analysis/study_tuning.py), then write
    the report. Returns 0, or 75 when interrupted (run the same command again to go on)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    # Another study of this folder, or a run a killed study started that still finishes its step.
    lock_fd = run_lock.acquire(plan.out / "study.lock", "study folder", wait=echo)
    interrupt = _Interrupt()
    try:
        code = _run_all(plan, jobs, lock_fd, interrupt, echo)
        if code is not None:
            return code
        report = write_report(plan)
        echo(f"report: {report}")
        return 0
    finally:
        interrupt.restore()
        run_lock.release(lock_fd)


def _run_all(plan: StudyPlan, jobs: int, lock_fd: Optional[int], interrupt: _Interrupt,
             echo: Callable[[str], None]) -> Optional[int]:
    """The runs, up to ``jobs`` at a time: the next in plan order starts when one ends. A run
    that fails or is interrupted stops the others (they checkpoint); the study's exit code when
    interrupted, None when every run is done; a failure is raised once all have stopped."""
    total = len(plan.runs) + len(plan.pending) * len(plan.seeds)
    running: dict[str, tuple[RunSteps, subprocess.Popen]] = {}
    finished: set[str] = set()
    stopped: Optional[int] = None
    failure: Optional[Exception] = None
    started = 0

    def advance(name: str, steps: RunSteps, code: Optional[int]) -> None:
        nonlocal stopped, failure
        try:
            running[name] = (steps, steps.send(code))
            return
        except StopIteration as end:
            if end.value is None:
                finished.add(name)
            elif stopped is None:
                stopped = end.value
        except Exception as e:  # noqa: BLE001 - raised once the other runs have stopped
            failure = failure or e
        running.pop(name, None)
        if (stopped is not None or failure is not None) and not interrupt.raised:
            interrupt.stop()  # once: a second SIGTERM would not let a run finish its checkpoint

    while True:
        if not interrupt.raised:
            try:  # an arm whose tuning runs are done: its runs, at the value they chose
                add_tuned_runs(plan, finished)
            except Exception as e:  # noqa: BLE001 - raised once the other runs have stopped
                failure = e
                interrupt.stop()
        while len(running) < jobs and started < len(plan.runs) and not interrupt.raised:
            run = plan.runs[started]
            started += 1
            steps = _one_run(plan, run, f"[{started}/{total}] {run.name}", lock_fd, interrupt,
                             jobs, echo)
            advance(run.name, steps, None)
        if not running:
            break
        time.sleep(POLL_S)
        for name, (steps, child) in list(running.items()):
            code = child.poll()
            if code is not None:
                interrupt.children.discard(child)
                advance(name, steps, code)
    if failure is not None:
        raise failure
    if interrupt.raised:
        return stopped if stopped is not None else PREEMPTED_EXIT_CODE
    return None


def _one_run(plan: StudyPlan, run: StudyRun, head: str, lock_fd: Optional[int],
             interrupt: _Interrupt, jobs: int, echo: Callable[[str], None]) -> RunSteps:
    """Train (or resume, or skip when finished) one run and eval it; returns the study's exit
    code when it must stop (interrupted), else None."""
    state = read_run_state(run)
    if state is not None:
        check_same_run(run, state)
        if state.get("finished"):
            echo(f"{head}: finished earlier ({run_wall_seconds(state):.0f} s), "
                 "not re-run")
            return (yield from _eval_if_wanted(plan, run, interrupt, jobs, echo, head))
    if interrupt.raised:
        return PREEMPTED_EXIT_CODE
    run.run_dir.mkdir(parents=True, exist_ok=True)
    state = state or {"name": run.name, "fingerprint": run.fingerprint,
                      "settings": settings_of(run.config), "overrides": run.overrides,
                      "attempts": [], "finished": False}
    env = _train_env(run, state, jobs)
    done = checkpoint_step(run.run_dir)
    if done:
        echo(f"{head}: resuming from the checkpoint of step {done} "
             f"(log: {run.run_dir / RUN_LOG_FILE})")
    else:
        echo(f"{head}: training (log: {run.run_dir / RUN_LOG_FILE})")
    state["attempts"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "start_unix": round(time.time(), 3),
                              "from_step": done, "threads": env.get("OMP_NUM_THREADS"),
                              "wall_s": None, "exit_code": None})
    write_run_state(run, state)
    cmd = [sys.executable, "-m", "megatron_entropy.cli", "train", plan.config_path,
           *run.overrides]
    start = time.perf_counter()
    # The lock's descriptor goes with the run: the lock is free only when every run has ended.
    code = yield _start(run, cmd, interrupt, env, () if lock_fd is None else (lock_fd,))
    wall = time.perf_counter() - start
    state["attempts"][-1].update(wall_s=round(wall, 3), exit_code=code)
    steps = run.config.trainer.steps
    if code == 0 and last_step(run.run_dir) >= steps:
        state["finished"] = True
    write_run_state(run, state)
    if interrupt.raised or code == PREEMPTED_EXIT_CODE:
        echo(f"{head}: interrupted after {wall:.0f} s at step {last_step(run.run_dir)}; "
             "run the same command again to resume")
        return PREEMPTED_EXIT_CODE
    if not state["finished"]:
        raise StudyError(
            f"run {run.name} failed (exit code {code}, at step "
            f"{last_step(run.run_dir)} of {steps}); its log: "
            f"{run.run_dir / RUN_LOG_FILE}\n{_tail(run.run_dir / RUN_LOG_FILE)}")
    echo(f"{head}: done in {wall:.0f} s{_summary_line(run)}")
    return (yield from _eval_if_wanted(plan, run, interrupt, jobs, echo, head))


def write_report(plan: StudyPlan) -> Path:
    """The study's report (OUT/report.md, returned), OUT/summary.json and the figures, from the
    runs' metrics as they are."""
    results = load_results(plan)
    summary = summarize(plan, results)
    figures = plot_study(plan, results, summary, plan.out)
    (plan.out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    report = plan.out / "report.md"
    report.write_text(render_report(summary, figures))
    return report
