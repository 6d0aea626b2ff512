"""The code tool's sandbox against hostile code: a snippet that hangs, spins, crashes, prints
10 MB, forks without end, escapes into a session of its own, opens a socket or asks for too much
memory is contained (its call answered with why, in bounded time), nothing it started is left
running, and the pool goes on answering."""

from __future__ import annotations

import os
import time
from pathlib import Path

import psutil
import pytest

from megatron_entropy.tool_use.pool import ToolCall, ToolPool
from megatron_entropy.tool_use.sandbox import ENTRY, probe_isolation, run_python
from megatron_entropy.config.tools import SandboxSettings, ToolSettings

TIMEOUT = 4.0  # room for a busy machine's Python start-up
FORK_BOMB = """
import os, time
n = 0
while True:
    try:
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        n += 1
    except OSError as e:
        print("fork failed after", n, type(e).__name__)
        break
"""
ESCAPE = """
import os, sys, time
if os.fork() == 0:
    os.setsid()
    time.sleep(1.5)
    open(sys.argv[0] + "", "w")  # placeholder: replaced by the test
    os._exit(0)
print("left a child behind")
"""


def _leftovers() -> list[psutil.Process]:
    """Processes of a sandbox still alive (their command line names the entry script)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if str(ENTRY) in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


@pytest.fixture(scope="module")
def pool():
    p = ToolPool(ToolSettings(names=["python"], timeout_s=TIMEOUT, workers=2,
                              max_result_chars=300,
                              sandbox=SandboxSettings(processes=8, isolation="required")))
    yield p
    p.close()


def _run(pool: ToolPool, code: str):
    started = time.monotonic()
    (result,) = pool.run([ToolCall("python", {"code": code})])
    return result, time.monotonic() - started


def test_this_machine_gives_the_sandbox_its_namespaces():
    assert probe_isolation() == ""


def test_output_is_the_result(pool):
    result, _ = _run(pool, "print(sum(range(10)))\nprint('done')")
    assert (result.status, result.text) == ("ok", "45\ndone\n")


@pytest.mark.parametrize("code, status, detail", [
    ("import time\ntime.sleep(600)", "timeout", f"timed out after {TIMEOUT:g} s"),
    ("while True:\n    pass", "timeout", f"timed out after {TIMEOUT:g} s"),
    ("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", "error", "killed by SIGSEGV"),
    ("1 / 0", "error", "exit code 1"),
    ("x = bytearray(8 << 30)", "error", "exit code 1"),
    ("print('x' * 10_000_000)", "error", "output limit (4 MiB)"),
])
def test_hostile_code_is_contained_and_reported(pool, code, status, detail):
    result, seconds = _run(pool, code)
    assert (result.status, result.detail) == (status, detail)
    assert seconds < TIMEOUT + 5
    assert len(result.text) <= 300 and result.text.endswith(f"[{detail}]")
    assert not _leftovers()
    assert _run(pool, "print(1)")[0].text == "1\n"  # and the pool goes on


def test_the_failures_say_why_in_the_text(pool):
    assert "ZeroDivisionError: division by zero" in _run(pool, "1 / 0")[0].text
    assert "MemoryError" in _run(pool, "x = bytearray(8 << 30)")[0].text
    printed = _run(pool, "print('x' * 10_000_000)")[0].text
    assert printed.startswith("x" * 100) and "[output cut]" in printed


def test_a_fork_bomb_hits_the_process_limit_and_leaves_nothing(pool):
    result, _ = _run(pool, FORK_BOMB)
    assert result.status == "ok" and result.text.startswith("fork failed after")
    assert int(result.text.split()[3]) <= 8
    assert not _leftovers()


def test_a_socket_has_no_network(pool):
    result, _ = _run(pool, "import socket\ns = socket.socket()\ns.settimeout(5)\n"
                           "s.connect(('1.1.1.1', 80))")
    assert result.status == "error" and "Network is unreachable" in result.text


def test_a_child_that_leaves_the_session_dies_with_the_call(pool, tmp_path):
    marker = tmp_path / "escaped"
    os.chmod(tmp_path, 0o777)  # the code may run as nobody
    result, _ = _run(pool, ESCAPE.replace('sys.argv[0] + ""', repr(str(marker))))
    assert result.text == "left a child behind\n"
    time.sleep(2.5)  # past the time the child would write its marker
    assert not marker.exists() and not _leftovers()


def test_a_timeout_kills_the_code_and_everything_it_started(tmp_path):
    settings = SandboxSettings(isolation="required")
    code = "import os, time\nfor _ in range(3):\n    os.fork()\ntime.sleep(600)"
    started = time.monotonic()
    result = run_python(code, settings, 1.0, 200, scratch_root=str(tmp_path))
    assert result.status == "timeout" and time.monotonic() - started < 5
    assert not _leftovers() and not list(Path(tmp_path).iterdir())  # scratch folder removed


def test_a_killed_tool_worker_takes_its_sandbox_with_it():
    pool = ToolPool(ToolSettings(names=["python"], timeout_s=60.0, workers=1))
    try:
        pool._start()
        (worker,) = pool._workers
        worker.send({"name": "python", "arguments": {"code": "import time\ntime.sleep(600)"}})
        # This test's sandbox (a descendant of this process until its worker dies), by process
        # id: other tests on the machine may run sandboxes of their own.
        ours = psutil.Process()
        deadline = time.monotonic() + 30
        while not (sandbox := [p for p in _leftovers() if p in ours.children(recursive=True)]) \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sandbox  # the call runs
        worker.kill()  # as the pool does when a call overruns its worker's time
        deadline = time.monotonic() + 10
        while any(p.is_running() for p in sandbox) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.is_running() for p in sandbox)
    finally:
        pool.close()
