"""Python child processes that answer one JSON line per request line: the math reward's checker
and the reward pool's workers.

Plain subprocesses, not multiprocessing: they never fork the trainer's threads, never re-run its
main module and need no resource-tracker process that could outlive the run. A child sees the
parent's ``sys.path`` (the same copy of this package, the user's reward module; set from
the command line, before the child imports anything of ours), leads its own
process group (a kill on an overrun also ends what it started: a pool worker's math checker),
dies with the parent (PR_SET_PDEATHSIG) and exits when its stdin closes.
"""

from __future__ import annotations

import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

from megatron_entropy.runtime.processes import die_with_parent

STARTUP_TIMEOUT_S = 120.0
_READY = "ready"


class ChildUnavailable(RuntimeError):
    """A child process did not start (its stderr's end is the message)."""


class ChildExited(RuntimeError):
    """A child process ended while a request was in flight."""


class TimedOut:
    """``LineProcess.read``'s answer when no line came in time."""


TIMED_OUT = TimedOut()


class LineProcess:
    """A child that runs ``target`` ("module:function", called with ``args``), which returns the
    handler of one request; the child then answers each JSON request line with the handler's
    result as one JSON line. Started by ``start()``; ``kill()`` ends it and its process group."""

    def __init__(self, target: str, *args: str) -> None:
        self._argv = [target, *args]
        self._proc: Optional[subprocess.Popen] = None
        self._stderr = None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def launch(self) -> None:
        """Start the child; ``wait_ready`` waits for it (launch several, then wait for each)."""
        self.kill()
        # The child's sys.path is this one ('' = the working directory, which both share).
        path = json.dumps([p or os.getcwd() for p in sys.path])
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: it can never fill up
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
             "from megatron_entropy.rewards.workers import _child_main; _child_main()", path,
             str(os.getpid()), *self._argv],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            bufsize=1, start_new_session=True)

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        reply = self.read(timeout_s) if self.running else TIMED_OUT
        if reply != _READY:
            log = self.stderr_tail()
            self.kill()
            raise ChildUnavailable(log or f"no answer within {timeout_s:g} s")

    def start(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.launch()
        try:
            self.wait_ready(timeout_s)
        except ChildExited as e:
            raise ChildUnavailable(str(e)) from None

    def fileno(self) -> int:
        return self._proc.stdout.fileno()

    def send(self, request: Any) -> None:
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()

    def read(self, timeout_s: float) -> Any:
        """The next answer, or TIMED_OUT. Raises ChildExited if the child ended instead. One
        request is in flight at a time, so no second line can wait in the pipe's buffer."""
        ready, _, _ = select.select([self._proc.stdout], [], [], max(timeout_s, 0.0))
        if not ready:
            return TIMED_OUT
        line = self._proc.stdout.readline()
        if not line:
            code = self._proc.wait()
            tail = self.stderr_tail(500)
            raise ChildExited(f"exit code {code}" + (f": {tail}" if tail else ""))
        return json.loads(line)

    def stderr_tail(self, chars: int = 2000) -> str:
        if self._stderr is None:
            return ""
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")[-chars:].strip()

    def kill(self) -> None:
        if self._proc is not None:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it and its group are gone already
                pass
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout, self._stderr):
                f.close()
            self._proc = self._stderr = None


def start_stopped(workers: Sequence[LineProcess]) -> None:
    """Launch every worker of ``workers`` that is not running (killed after an overrun, or never
    started), then wait until each is ready (raises ChildUnavailable or ChildExited)."""
    stopped = [w for w in workers if not w.running]
    for worker in stopped:
        worker.launch()
    for worker in stopped:
        worker.wait_ready()


def run_requests(workers: Sequence[LineProcess], requests: Sequence[Any], timeout_s: float,
                 restart: Callable[[], None], answered: Callable[[int, Any], Any],
                 overran: Callable[[int], Any]) -> list[Any]:
    """Each request on the first free worker, at most ``timeout_s`` from when it is sent: the
    outcome of request i is ``answered(i, answer)``, where the answer is the worker's, or
    ``{"died": why}`` when the worker died on it (the worker is killed), or ``overran(i)`` when
    it ran past the timeout (its worker is killed: ``restart()`` starts the killed workers before
    their next request). The callbacks run as calls end and may raise."""
    outcomes: list[Any] = [None] * len(requests)
    todo = deque(range(len(requests)))
    idle = list(workers)
    busy: dict[LineProcess, tuple[int, float]] = {}  # worker -> (request, deadline)
    while todo or busy:
        while todo and idle:
            worker = idle.pop()
            if not worker.running:  # killed after an overrun
                restart()
            i = todo.popleft()
            try:
                worker.send(requests[i])
            except OSError as e:  # it died since the check above
                worker.kill()
                outcomes[i] = answered(i, {"died": type(e).__name__})
                idle.append(worker)
                continue
            busy[worker] = (i, time.monotonic() + timeout_s)
        if not busy:
            continue
        wait = min(deadline for _, deadline in busy.values()) - time.monotonic()
        ready, _, _ = select.select(list(busy), [], [], max(wait, 0.0))
        for worker in ready:
            i, _ = busy.pop(worker)
            try:
                answer = worker.read(0.0)
            except ChildExited as e:
                answer = {"died": str(e)}
                worker.kill()
            outcomes[i] = answered(i, answer)
            idle.append(worker)
        now = time.monotonic()
        for worker, (i, deadline) in list(busy.items()):
            if now >= deadline:
                del busy[worker]
                worker.kill()
                outcomes[i] = overran(i)
                idle.append(worker)
    return outcomes


def _child_main() -> None:
    """The child: argv = [sys.path, parent pid, "module:function", args...]."""
    parent, target, *args = sys.argv[2:]
    die_with_parent(parent=int(parent))
    module, _, name = target.partition(":")
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what the handler prints goes to stderr, not between the answers
    handler: Callable[[Any], Any] = getattr(importlib.import_module(module), name)(*args)
    answers.write(json.dumps(_READY) + "\n")
    for line in sys.stdin:
        answers.write(json.dumps(handler(json.loads(line))) + "\n")
