"""One server process (rollout/server/process.py): started in a session of its own after a log
header, with the caller's preexec_fn; its whole group stopped by a first signal, then SIGKILL
after the grace; and the blocking wait for its /health."""

from __future__ import annotations

import contextlib
import http.server
import os
import re
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from harness import free_port

from megatron_entropy.rollout.server.process import kill_process_group, start_process, wait_healthy

# A leader and a worker of its own, both ignoring SIGTERM (as a hung server would).
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"  # inherited by the worker through exec
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
    "print('worker', w.pid, flush=True)\n"
    "time.sleep(60)\n")


def _signal_group(proc, sig: int) -> None:
    """``sig`` to the process's whole group (nothing if it is gone)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _wait_for_line(log: Path, prefix: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text().splitlines():
            if line.startswith(prefix):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no line {prefix!r} in {log}:\n{log.read_text()}")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_server_starts_in_its_own_session_after_a_log_header_with_its_preexec(tmp_path):
    log, marker = tmp_path / "server.log", tmp_path / "preexec"

    def preexec() -> None:  # in the child, before exec: note which process ran it
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)

    argv = [sys.executable, "-c", "import os; print('sid', os.getsid(0), os.getpgid(0))"]
    proc = start_process(argv, {}, log, "first launch", "test server", preexec_fn=preexec)
    assert proc.wait(timeout=30) == 0
    header, out = log.read_text().strip().splitlines()
    assert re.fullmatch(r"==== \d{4}-\d\d-\d\d \d\d:\d\d:\d\d launch \(first launch\): "
                        + re.escape(shlex.join(argv)), header)
    assert out == f"sid {proc.pid} {proc.pid}" != f"sid {os.getsid(0)} {os.getpgid(0)}"
    assert marker.read_text() == str(proc.pid)


def test_the_environment_is_ours_without_the_rank_variables_plus_extra_env(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("RANK", "3")
    log = tmp_path / "server.log"
    argv = [sys.executable, "-c", "import os; print(os.environ.get('RANK'), os.environ['X'])"]
    assert start_process(argv, {"X": "1"}, log, "test", "test server").wait(timeout=30) == 0
    assert log.read_text().splitlines()[-1] == "None 1"


def test_kill_process_group_escalates_to_sigkill_for_a_group_that_ignores_sigterm(tmp_path):
    log = tmp_path / "server.log"
    proc = start_process([sys.executable, "-c", STUBBORN], {}, log, "test", "test server")
    try:
        worker = int(_wait_for_line(log, "worker").split()[1])
        _signal_group(proc, signal.SIGTERM)
        time.sleep(0.3)
        assert proc.poll() is None and not _gone(worker)  # ignored
        started = time.monotonic()
        kill_process_group(proc, grace_s=1.0)
        assert time.monotonic() - started >= 1.0  # the grace was given first
        assert proc.returncode == -signal.SIGKILL and _gone(worker)
    finally:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def test_kill_process_group_sends_the_callers_first_signal_and_stops_early(tmp_path):
    log = tmp_path / "server.log"
    stops_on_sigint = ("import signal, sys, time\n"
                       "signal.signal(signal.SIGINT, lambda *a: sys.exit(7))\n"
                       "print('ready', flush=True)\n"
                       "time.sleep(60)\n")
    proc = start_process([sys.executable, "-c", stops_on_sigint], {}, log, "test", "test server")
    _wait_for_line(log, "ready")
    started = time.monotonic()
    kill_process_group(proc, grace_s=30.0, first=signal.SIGINT)
    assert proc.returncode == 7 and time.monotonic() - started < 10
    _signal_group(proc, signal.SIGKILL)  # a group that is gone: nothing happens
    kill_process_group(None)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_url():
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


def test_wait_healthy_says_how_the_wait_ended(tmp_path, health_url):
    def sleeper():
        return start_process([sys.executable, "-c", "import time; time.sleep(60)"], {},
                             tmp_path / "server.log", "test", "test server")

    silent = f"http://127.0.0.1:{free_port()}"
    proc = sleeper()
    try:
        assert wait_healthy(proc, health_url, 10.0, interval_s=0.05) == "up"
        started = time.monotonic()
        assert wait_healthy(proc, silent, 0.3, interval_s=0.05) == "timeout"
        assert time.monotonic() - started < 5
        assert wait_healthy(proc, silent, 10.0, lambda: True) == "stopped"
    finally:
        kill_process_group(proc, grace_s=1.0)
    assert wait_healthy(proc, health_url, 10.0) == "exited"
