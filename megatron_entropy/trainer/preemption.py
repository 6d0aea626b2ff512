"""SIGUSR1 / SIGTERM: a request to checkpoint at the end of the step and exit 75 (to be requeued).

The handler only records the request, so it is installed first thing in ``megatron-entropy train``
(this module imports nothing heavy), before torch, Megatron, the model and the rollout engine load
for minutes: a signal that comes during start-up (Slurm's time-limit warning, a preemption) is kept
until the loop looks at it, instead of killing the rank by the signal's default action. A request
lasts as long as the process (the trainer exits on it).
"""

from __future__ import annotations

import signal
from contextlib import contextmanager
from multiprocessing import resource_tracker
from typing import Iterator

SIGNALS = (signal.SIGUSR1, signal.SIGTERM)
_received: list[int] = []


def _record(signum: int, frame: object) -> None:
    _received.append(signum)


def install() -> None:
    """Record SIGUSR1/SIGTERM from now on; a request recorded before is kept."""
    for sig in SIGNALS:
        signal.signal(sig, _record)


def requested() -> bool:
    return bool(_received)


@contextmanager
def held() -> Iterator[None]:
    """Block SIGUSR1/SIGTERM in this thread while the body runs (one that comes meanwhile is
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
