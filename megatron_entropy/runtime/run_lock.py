"""One writer per folder: an exclusive lock on a file in it (``train``: RUN/train.lock; the
study: OUT/study.lock), held for the life of the process and of the children it passes the
descriptor to. The kernel frees it when the last holder dies, however it dies, so a lock is
never stale in the kernel's view; the file's text (``host pid time``) names the holder while it
lives, and is cleared on a clean release: text found in a free lock is a holder that died.

flock(2) works across hosts on NFSv4 (and on Lustre mounted with ``flock``); a file system
that refuses it leaves the folder unguarded, with a warning."""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Callable, Optional


class RunLockError(RuntimeError):
    """The folder is held by another live process; the message names its host and pid."""


def _holder(fd: int) -> str:
    text = os.pread(fd, 256, 0).decode(errors="replace").split()
    if len(text) < 2:
        return "an unknown process"
    host, pid, *since = text
    return f"host {host}, pid {pid}" + (f" (since {' '.join(since)})" if since else "")


def acquire(path: Path, what: str, wait: Optional[Callable[[str], None]] = None) -> Optional[int]:
    """Lock ``path`` (created if need be) for this process; returns its descriptor (pass it to a
    child to share the lock), or None where the file system cannot lock (warned). Held by a live
    process: RunLockError naming it, or with ``wait`` (called once with a line saying so) block
    until it is free. A lock left by a holder that died is taken over, and that is said on
    stderr. ``what``: the folder's role in the messages ("run folder", "study folder")."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    waited = False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        if wait is None:
            os.close(fd)
            raise RunLockError(f"{what} {path.parent} is in use by {holder} (lock {path}); "
                               "stop that process or choose another folder") from None
        wait(f"{what} {path.parent} is in use by {holder}; waiting for it")
        fcntl.flock(fd, fcntl.LOCK_EX)
        waited = True
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL):
            os.close(fd)
            raise
        os.close(fd)
        print(f"warning: {path.parent}: the file system cannot lock {path} ({e.strerror}): "
              f"nothing stops a second process from using this {what}", file=sys.stderr)
        return None
    if os.pread(fd, 1, 0) and not waited:
        print(f"{what} {path.parent}: taking over the lock of {_holder(fd)}, which ended "
              "without releasing it", file=sys.stderr)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{socket.gethostname()} {os.getpid()} {stamp}\n".encode(), 0)
    return fd


def release(fd: Optional[int]) -> None:
    """Clear the holder's text (a clean end) and free the lock (children passed the descriptor
    still hold it)."""
    if fd is None:
        return
    try:
        os.ftruncate(fd, 0)
    except OSError:
        pass  # a full or read-only file system: the lock still goes with the descriptor
    os.close(fd)


class FolderStart:
    """What a start makes in its folder before the work begins (the folder itself and missing
    parents, the lock file, ``logs/``), noted before it makes them: ``undo`` removes them again
    after a start that failed, so that a bad start leaves nothing behind; what the folder held
    before, and anything else the start wrote, stays."""

    def __init__(self, folder: Path, lock: Path) -> None:
        self.lock = lock
        self.logs = folder / "logs"
        self.made = [p for p in (folder, *folder.parents) if not p.exists()]  # deepest first
        self.lock_made, self.logs_made = not lock.exists(), not self.logs.exists()

    def undo(self, logs: bool) -> None:
        """Remove what this start made; ``logs``: its ``logs/`` too (with the ranks' copies of
        an error the terminal showed)."""
        if self.lock_made:
            self.lock.unlink(missing_ok=True)
        if logs and self.logs_made:
            shutil.rmtree(self.logs, ignore_errors=True)
        for folder in self.made:
            try:
                folder.rmdir()
            except OSError:  # something else was written there: it stays
                return
