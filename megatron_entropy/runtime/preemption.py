"""SIGUSR1 / SIGTERM / SIGINT (Ctrl-C): a request to checkpoint and exit 75 (to be requeued or
resumed); and the job's clock, which asks the same before the job's end time would cut a step or a
checkpoint short. A second Ctrl-C stops the process at once by SIGINT's default action. During
start-up SIGTERM and SIGINT end the start at once instead (``interruptible``,
``stop_if_requested``): there is nothing to checkpoint yet.

The handler only records the request, so it is installed first thing in ``megatron-entropy train``
(this module imports nothing heavy), before torch, Megatron, the model and the rollout engine load
for minutes: a signal that comes during start-up (Slurm's time-limit warning, a preemption) is kept
until the loop looks at it, instead of killing the rank by the signal's default action. A request
lasts as long as the process (the trainer exits on it). The loop looks between rollout refill
rounds, before the update and at the end of each step. The local launcher starts its ranks with
these signals blocked (runtime/processes.py: start_held); ``install`` unblocks them, so one sent
before it is delivered to the handler then, not lost nor fatal.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Iterator, Mapping, Optional

from megatron_entropy.runtime.processes import HELD_SIGNALS

PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: checkpointed on a signal, resume later
SIGNALS = HELD_SIGNALS  # SIGUSR1, SIGTERM, SIGINT
_received: list[int] = []
_starting = False  # inside interruptible(): SIGTERM/SIGINT end the start-up at once
_stopping = False  # StartupInterrupted was raised: a later SIGTERM is only recorded
_running = False  # start-up is over: a Ctrl-C asks for a checkpoint at the end of the step
# Printed once the steps run; during start-up a Ctrl-C stops it, without this note.
CTRL_C_NOTE = (b"Ctrl-C: stopping after this step "
               b"with a checkpoint and exit 75 (run the same command to resume); Ctrl-C again "
               b"stops now without one\n")


def _record(signum: int, frame: object) -> None:
    global _stopping
    if _starting and not _stopping and signum in (signal.SIGTERM, signal.SIGINT):
        _received.append(signum)
        # interruptible(): start-up ends where it waits. Once: Ctrl-C reaches a launcher's ranks
        # with the SIGTERM the launcher passes on, which must not replace the first.
        _stopping = True
        raise StartupInterrupted(signum)
    if signum == signal.SIGINT:
        if signal.SIGINT in _received:  # the second Ctrl-C: stop now, as SIGINT does
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            return
        if _running and os.environ.get("RANK", "0") == "0":
            os.write(2, CTRL_C_NOTE)  # not print(): the handler may interrupt a print
    _received.append(signum)


def install() -> None:
    """Record SIGUSR1/SIGTERM/SIGINT from now on, and unblock them (a launcher may have started
    this process with them blocked); a request recorded or pending before is kept."""
    for sig in SIGNALS:
        signal.signal(sig, _record)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


@contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the body; the earlier handlers come back after it (for callers that go
    on after a run: a test, a program that calls the CLI's main), unless the body ended on a
    signal: then more may follow (a launcher passes Ctrl-C on as SIGTERM), and by the default
    action they would kill the process on its way out."""
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    install()
    try:
        yield
    finally:
        for sig, handler in previous.items():
            if handler is not None and not _received:  # None: set outside Python
                signal.signal(sig, handler)


def requested() -> bool:
    return bool(_received)


class StartupInterrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT during start-up: the trainer stops where it is (it has nothing new to
    checkpoint yet). Raised from the handler inside whatever start-up runs, so it is what
    libraries let through there: not an ``Exception`` (transformers' tokenizer load turns any
    into "Can't load tokenizer"), and a KeyboardInterrupt (asyncio logs any other exception of
    a callback and goes on, and keeps a task's in the task: the wait for a server went on)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name} during start-up")
        self.signum = signum

    @property
    def exit_code(self) -> int:
        """75 for SIGTERM (resume later, as after a preemption's checkpoint), else 128 + n."""
        return PREEMPTED_EXIT_CODE if self.signum == signal.SIGTERM else 128 + self.signum


def stop_if_requested() -> None:
    """In start-up, where it may stop: raise ``StartupInterrupted`` if SIGINT or SIGTERM was
    recorded. Ctrl-C is named first: a launcher passes it on to its ranks as SIGTERM, and the
    terminal's SIGINT reaches them too."""
    global _stopping
    for sig in (signal.SIGINT, signal.SIGTERM):
        if sig in _received:
            _stopping = True
            raise StartupInterrupted(sig)


@contextmanager
def interruptible() -> Iterator[None]:
    """For start-up (the model loads, the rollout servers come up, the first contact):
    SIGTERM and SIGINT raise ``StartupInterrupted`` at once, whatever the body waits for, from
    the recording handler (which the body may install again); one recorded before (while torch
    and Megatron were imported, where an exception from a handler could abort the process) is
    raised on entry. SIGUSR1 is still only recorded. Only in the main thread (where Python runs
    signal handlers); elsewhere the body runs as it is. A Ctrl-C after a body that returned asks
    for a checkpoint at the end of the step."""
    global _starting, _running
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    stop_if_requested()
    install()
    _starting, _running = True, False
    try:
        yield
    finally:
        _starting = False
    _running = True


@contextmanager
def held() -> Iterator[None]:
    """Block SIGUSR1/SIGTERM/SIGINT in this thread while the body runs (one that comes meanwhile is
    still recorded: by another thread at once, or when the block ends). The processes the body
    starts inherit the block and keep it: dist_checkpointing's writer processes and the Manager
    it keeps for the rest of the run. Slurm delivers a signal to a task's whole process tree
    under proctrack/linuxproc (and to its process group under proctrack/pgid), and by their
    default action those helpers would die and break the save."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        # multiprocessing starts its resource tracker with the first spawned process and
        # unblocks SIGTERM (and SIGINT) in this thread right after; started here, it does so now
        # (and the tracker inherits the block), so block again for what the body starts.
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


# ------------------------------------------------------------------------------ the job's clock


def parse_slurm_time_left(text: str) -> Optional[float]:
    """Seconds in squeue's ``%L`` (time left: [days-]hours:minutes:seconds, minutes:seconds);
    None for a job without a limit (UNLIMITED, NOT_SET, INVALID)."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", text.strip())
    if not m:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return float(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


def slurm_job_end(env: Optional[Mapping[str, str]] = None) -> Optional[float]:
    """The Slurm job's end time (Unix seconds), or None outside Slurm or without a limit:
    SLURM_JOB_END_TIME when Slurm set it, else squeue's time left for SLURM_JOB_ID (the limit
    as it is now, after any `scontrol update TimeLimit`)."""
    env = os.environ if env is None else env
    end = env.get("SLURM_JOB_END_TIME", "")
    if end.isdigit() and int(end) > 0:
        return float(end)
    job = env.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job, "-o", "%L"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    left = parse_slurm_time_left(out.stdout) if out.returncode == 0 else None
    return None if left is None else time.time() + left


class JobClock:
    """When the run should checkpoint and exit so that the job's end does not cut a step or a
    checkpoint short (Slurm ends the job at its time limit with TIMEOUT, which is not requeued).

    ``deadline`` (Unix seconds; None: no limit) is the earliest of the job's end time and
    trainer.exit_duration_minutes after the start. A step is started only if the longest of the
    last ``window`` steps, a checkpoint (the longest measured; before the first, the longest
    step) and ``margin_s`` still fit before it; inside a step, the run stops when a checkpoint
    and the margin no longer would."""

    def __init__(self, deadline: Optional[float], margin_s: float, window: int = 5,
                 now=time.time) -> None:
        self.deadline = deadline
        self.margin_s = margin_s
        self.steps: deque[float] = deque(maxlen=window)
        self.checkpoint_s = 0.0
        self.now = now

    def step_took(self, seconds: float) -> None:
        self.steps.append(seconds)

    def checkpoint_took(self, seconds: float) -> None:
        self.checkpoint_s = max(self.checkpoint_s, seconds)

    def _checkpoint_estimate(self) -> float:
        return self.checkpoint_s or max(self.steps, default=0.0)

    def _left(self) -> float:
        return float("inf") if self.deadline is None else self.deadline - self.now()

    def stop_before_next_step(self) -> bool:
        return (max(self.steps, default=0.0) + self._checkpoint_estimate() + self.margin_s
                > self._left())

    def stop_inside_step(self) -> bool:
        return self._checkpoint_estimate() + self.margin_s > self._left()

    def describe(self) -> str:
        if self.deadline is None:
            return "no time limit"
        return (f"{self._left():.0f} s left; longest recent step "
                f"{max(self.steps, default=0.0):.0f} s, checkpoint {self._checkpoint_estimate():.0f}"
                f" s, margin {self.margin_s:.0f} s")


def job_clock(exit_duration_minutes: float, margin_s: float, started: float,
              reads_job: bool) -> JobClock:
    """The run's JobClock. ``reads_job``: this rank asks Slurm for the job's end (one rank
    does; the loop shares its decision), else it knows only exit_duration_minutes."""
    ends = [started + 60 * exit_duration_minutes] if exit_duration_minutes else []
    job_end = slurm_job_end() if reads_job else None
    if job_end is not None:
        ends.append(job_end)
    return JobClock(min(ends, default=None), margin_s)
