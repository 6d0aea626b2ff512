"""Running a planned study (analysis/study.py): one ``train`` process per run, in plan order,
resumable, then its report (analysis/study_report.py: the numbers; analysis/study_plots.py: the
figures). The module of the study's process, above the plan, the report and the figures."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from megatron_entropy.analysis.plots import read_metrics, series
from megatron_entropy.analysis.study import (RUN_EVAL_FILE, RUN_LOG_FILE, StudyError,
                                             StudyPlan, StudyRun, check_same_run,
                                             checkpoint_step, last_step, read_run_state,
                                             run_wall_seconds, settings_of, write_run_state)
from megatron_entropy.analysis.study_plots import plot_study
from megatron_entropy.analysis.study_report import load_results, render_report, summarize
from megatron_entropy.analysis.study_tuning import add_tuned_runs
from megatron_entropy.runtime import run_lock
from megatron_entropy.runtime.processes import die_with_parent
from megatron_entropy.runtime.preemption import PREEMPTED_EXIT_CODE


class _Interrupt:
    """SIGTERM, SIGINT or SIGUSR1 to the study: the running train run is asked to checkpoint at
    the end of its step (SIGTERM, which its ranks handle), and the study stops after it."""

    def __init__(self) -> None:
        self.raised = False
        self.child: Optional[subprocess.Popen] = None
        self._previous = {sig: signal.signal(sig, self._handle)
                          for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}

    def _handle(self, signum, frame) -> None:
        self.raised = True
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

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


def _child(run: StudyRun, cmd: list[str], interrupt: _Interrupt, pass_fds: tuple = ()) -> int:
    """Run ``cmd`` with its output appended to the run's log; its exit code. SIGTERM when the
    study dies: a train run checkpoints at the end of its step and exits."""
    with open(run.run_dir / RUN_LOG_FILE, "a") as log:
        log.write(f"\n=== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(cmd)}\n")
        log.flush()
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, pass_fds=pass_fds,
                                 preexec_fn=functools.partial(die_with_parent, signal.SIGTERM,
                                                              os.getpid()))
        interrupt.child = child
        try:
            return child.wait()
        finally:
            interrupt.child = None


def _train(run: StudyRun, config_path: str, lock_fd: Optional[int], interrupt: _Interrupt
           ) -> tuple[int, float]:
    cmd = [sys.executable, "-m", "megatron_entropy.cli", "train", config_path, *run.overrides]
    start = time.perf_counter()
    # The lock's descriptor goes with the run: the lock is free only when both have ended.
    code = _child(run, cmd, interrupt, pass_fds=() if lock_fd is None else (lock_fd,))
    return code, time.perf_counter() - start


def _eval(run: StudyRun, config_path: str, interrupt: _Interrupt) -> None:
    """``megatron-entropy eval`` of the run's last checkpoint into its folder (its log goes to
    the run's log); a failed eval stops the study."""
    out = run.run_dir / RUN_EVAL_FILE
    cmd = [sys.executable, "-m", "megatron_entropy.cli", "eval", config_path, *run.overrides,
           "--checkpoint", str(run.run_dir), "--out", str(out)]
    code = _child(run, cmd, interrupt)
    if code != 0 and not interrupt.raised:
        raise StudyError(f"eval of run {run.name} failed (exit code {code}); its log: "
                         f"{run.run_dir / RUN_LOG_FILE}\n{_tail(run.run_dir / RUN_LOG_FILE)}")


def _eval_if_wanted(plan: StudyPlan, run: StudyRun, interrupt: _Interrupt,
                    echo: Callable[[str], None], head: str) -> None:
    # A tuning run only chooses on the validation split: the test split is not its to read.
    reported = any(role != "tune" for role, _ in run.roles)
    if plan.study.eval_runs and reported and not (run.run_dir / RUN_EVAL_FILE).is_file():
        start = time.perf_counter()
        _eval(run, plan.config_path, interrupt)
        if not interrupt.raised:
            echo(f"{head}: eval in {time.perf_counter() - start:.0f} s "
                 f"({run.run_dir / RUN_EVAL_FILE})")


def execute(plan: StudyPlan, echo: Callable[[str], None] = print) -> int:
    """Run every run of the plan that has not finished (the tuning runs first, then the runs of
    the values they chose: analysis/study_tuning.py), then write the report. Returns 0, or 75
    when interrupted (run the same command again to go on)."""
    plan.out.mkdir(parents=True, exist_ok=True)
    # Another study of this folder, or a run a killed study started that still finishes its step.
    lock_fd = run_lock.acquire(plan.out / "study.lock", "study folder", wait=echo)
    interrupt = _Interrupt()
    try:
        done = 0
        while True:
            while done < len(plan.runs):
                run = plan.runs[done]
                done += 1
                total = len(plan.runs) + len(plan.pending) * len(plan.seeds)
                code = _one_run(plan, run, f"[{done}/{total}] {run.name}", lock_fd, interrupt,
                                echo)
                if code is not None:
                    return code
            if not add_tuned_runs(plan):
                break
        report = write_report(plan)
        echo(f"report: {report}")
        return 0
    finally:
        interrupt.restore()
        run_lock.release(lock_fd)


def _one_run(plan: StudyPlan, run: StudyRun, head: str, lock_fd: Optional[int],
             interrupt: _Interrupt, echo: Callable[[str], None]) -> Optional[int]:
    """Train (or resume, or skip when finished) one run and eval it; the study's exit code when
    it must stop (interrupted), else None."""
    state = read_run_state(run)
    if state is not None:
        check_same_run(run, state)
        if state.get("finished"):
            echo(f"{head}: finished earlier ({run_wall_seconds(state):.0f} s), "
                 "not re-run")
            _eval_if_wanted(plan, run, interrupt, echo, head)
            if interrupt.raised:
                return PREEMPTED_EXIT_CODE
            return None
    run.run_dir.mkdir(parents=True, exist_ok=True)
    state = state or {"name": run.name, "fingerprint": run.fingerprint,
                      "settings": settings_of(run.config), "overrides": run.overrides,
                      "attempts": [], "finished": False}
    done = checkpoint_step(run.run_dir)
    if done:
        echo(f"{head}: resuming from the checkpoint of step {done} "
             f"(log: {run.run_dir / RUN_LOG_FILE})")
    else:
        echo(f"{head}: training (log: {run.run_dir / RUN_LOG_FILE})")
    state["attempts"].append({"started": time.strftime("%Y-%m-%dT%H:%M:%S"),
                              "from_step": done, "wall_s": None, "exit_code": None})
    write_run_state(run, state)
    code, wall = _train(run, plan.config_path, lock_fd, interrupt)
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
    _eval_if_wanted(plan, run, interrupt, echo, head)
    if interrupt.raised:
        return PREEMPTED_EXIT_CODE
    return None


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
