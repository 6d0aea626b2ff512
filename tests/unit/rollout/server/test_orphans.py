"""No launched server outlives the process that launched it: killed hard (SIGKILL), that
process leaves its servers to their orphan watch (orphan_watch.py), which stops their whole
process group; a pool stopped normally leaves no process either, its watches included."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import psutil

from harness import free_port

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.server.eventloop import EventLoopRunner
from megatron_entropy.rollout.server.supervisor import Supervisor

# A server with a worker process of its own (the group the watch must stop), answering /health.
SERVER = (
    "import http.server, subprocess, sys\n"
    "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
    "print('worker', w.pid, flush=True)\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers()\n"
    "    def log_message(self, *a): pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


def supervisor(run_dir: str, port: int) -> Supervisor:
    cfg = ServerConfig(launch=1, base_port=port, startup_timeout_s=60)
    return Supervisor(cfg, run_dir, "test", "unused",
                      lambda port, model: [sys.executable, "-c", SERVER, str(port)], None,
                      "/health", EventLoopRunner("test"))


def _group_gone(group: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def _worker(log: Path) -> int:
    return int(next(line for line in log.read_text().splitlines()
                    if line.startswith("worker")).split()[1])


def _launch_and_wait(run_dir: str, port: int, said: Connection) -> None:
    """The launcher, forked: starts one server through the real Supervisor from a thread that
    then ends (as a restart on a short-lived thread does), says the server's pid, waits to be
    killed."""
    sup = supervisor(run_dir, port)
    starter = threading.Thread(target=sup.start)
    starter.start()
    starter.join()
    said.send(sup.servers[0].process.pid)
    time.sleep(300)


def test_a_launched_server_and_its_workers_end_when_the_launcher_is_killed_hard(tmp_path):
    log = tmp_path / "servers" / "test-0.log"
    ours, theirs = multiprocessing.Pipe()
    launcher = multiprocessing.get_context("fork").Process(
        target=_launch_and_wait, args=(str(tmp_path), free_port(), theirs), daemon=True)
    launcher.start()
    server = 0
    try:
        assert ours.poll(120), f"the launcher exited with {launcher.exitcode}"
        server = ours.recv()
        worker = _worker(log)
        # Both outlived the thread that started them.
        assert psutil.Process(server).status() != psutil.STATUS_ZOMBIE
        assert psutil.Process(worker).status() != psutil.STATUS_ZOMBIE
        assert os.getpgid(worker) == server
        launcher.kill()  # SIGKILL: no exit handler, no stop of the pool
        launcher.join()
        # The watch polls 5 times a second; the server stops on SIGTERM (grace 5 s).
        assert _group_gone(server, 30.0), \
            f"the server's group {server} outlived its launcher:\n{log.read_text()}"
        assert "the launcher (pid" in log.read_text()
    finally:
        launcher.kill()
        launcher.join()
        if server:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server, signal.SIGKILL)


def test_a_stopped_pool_or_a_killed_server_leaves_no_process(tmp_path):
    sup = supervisor(str(tmp_path), free_port())
    sup.start()
    try:
        server = sup.servers[0]
        first, watcher = server.process.pid, server.watcher
        assert watcher.poll() is None and os.getsid(watcher.pid) == watcher.pid != first
        # The server's group killed by hand (as tests do): its watch ends by itself.
        os.killpg(first, signal.SIGKILL)
        server.process.wait()
        assert watcher.wait(timeout=30) == 0
        assert sup._restart(server) and server.process.pid != first
    finally:
        sup.stop()
    assert server.process.returncode is not None and server.watcher.returncode is not None
    assert _group_gone(server.process.pid, 0.1)
    assert not [p for p in psutil.Process().children(recursive=True)
                if "orphan_watch" in " ".join(p.cmdline())]
