"""Beside each server an engine launches: stops the server's process group once the process
that launched it is gone, also when that one was killed hard (SIGKILL, the OOM killer), and
exits by itself once the group is gone.

Run by its path (``python -I orphan_watch.py LAUNCHER GROUP GRACE_S``), not as part of the
package: standard library only, so it starts in milliseconds. It is the launcher's child in a
session of its own (a signal to the launcher's process group does not reach it): the launcher is
gone when ``getppid()`` changes, which no reused pid can fake. The server itself cannot die with
its parent by PR_SET_PDEATHSIG: that follows the *thread* that started it, and servers are
(re)started from short-lived threads too.
"""

from __future__ import annotations

import os
import signal
import sys
import time

POLL_S = 0.2


def group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def stop_group(group: int, grace_s: float) -> None:
    """SIGTERM to the group, SIGKILL to what is left after ``grace_s``."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and group_alive(group):
            time.sleep(POLL_S)


def main(argv: list[str]) -> None:
    launcher, group, grace_s = int(argv[0]), int(argv[1]), float(argv[2])
    while group_alive(group):
        if os.getppid() != launcher:
            print(f"orphan_watch: the launcher (pid {launcher}) is gone: stopping the server's "
                  f"process group {group}", flush=True)
            stop_group(group, grace_s)
            return
        time.sleep(POLL_S)


if __name__ == "__main__":
    main(sys.argv[1:])
