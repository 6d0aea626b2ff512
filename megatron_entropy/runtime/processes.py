"""Child processes that never outlive their parent."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
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
