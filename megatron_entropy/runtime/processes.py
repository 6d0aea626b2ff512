"""Child processes that never outlive their parent, and a rank that ends without waiting on its
peers."""

from __future__ import annotations

import atexit
import ctypes
import functools
import os
import signal
import subprocess
import sys
import time
from typing import Optional

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int = signal.SIGKILL, parent: Optional[int] = None) -> None:
    """In a child process: have the kernel send ``sig`` to it when its parent dies.

    ``parent`` is the pid the child was started by: if the parent died before the request took
    effect (the child was re-parented already), the child exits at once with code 1. Linux only
    (elsewhere the request is skipped and only the check on ``parent`` applies). Safe in a
    ``preexec_fn`` and in an after-fork hook: no allocation beyond one ctypes call.
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"prctl(PR_SET_PDEATHSIG): {os.strerror(errno)}")
    if parent is not None and os.getppid() != parent:
        os._exit(1)


# What the trainer's ranks handle (runtime/preemption.py: checkpoint, then exit 75); named here,
# below the trainer, for the launcher that starts them.
HELD_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def _start_held(parent: int) -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    die_with_parent(signal.SIGKILL, parent)


def start_held(cmd: list[str], **popen_kwargs) -> subprocess.Popen:
    """Start ``cmd`` with HELD_SIGNALS blocked (the mask survives exec): one sent before the
    child installs its handler waits for it, instead of killing the child by its default
    action during start-up. The child dies with this process (SIGKILL)."""
    return subprocess.Popen(cmd, preexec_fn=functools.partial(_start_held, os.getpid()),
                            **popen_kwargs)


def stop_all(procs: list[subprocess.Popen], grace_s: float,
             kill_after_s: Optional[float] = None) -> list[int]:
    """End every process of ``procs`` still running: wait ``grace_s`` for them to end on their
    own, then SIGTERM, ``kill_after_s`` (default ``grace_s``) more, then SIGKILL. Returns the
    indices of those that had to be stopped (a rank in start-up only records a SIGTERM, so the
    SIGKILL is what ends it)."""
    stopped: list[int] = []
    waits = (grace_s, grace_s if kill_after_s is None else kill_after_s, grace_s)
    for sig, wait in zip((None, signal.SIGTERM, signal.SIGKILL), waits):
        running = [i for i, p in enumerate(procs) if p.poll() is None]
        if not running:
            break
        if sig is not None:
            stopped = stopped or running
            for i in running:
                procs[i].send_signal(sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(procs[i].poll() is None for i in running):
            time.sleep(0.1)
    for p in procs:
        p.wait()
    return stopped


def end_rank_at_once(code: int) -> None:
    """End this rank with ``code`` now: the exit handlers run (atexit: engines' and reward
    workers' shutdown, logging) and the output is flushed, but the interpreter's teardown is
    skipped. After a stop cut a collective short (a signal during start-up, while another rank
    waits for this one), tearing down gloo's process group can abort the process
    (std::terminate on a joinable thread) or wait on a peer that is leaving too. Does nothing
    (returns) where no process group was started."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    atexit._run_exitfuncs()  # what a normal exit runs first; os._exit runs none of it
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)
