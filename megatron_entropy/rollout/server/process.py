"""One inference server process: its command line, port, environment and log; started in a
session of its own and stopped with all its workers.

The one place that starts a server and signals or kills its process group, for the
servers an engine launches (supervisor.py decides when) and for the one a Slurm task runs in
the foreground (launch/slurm.py, with its own signal mask and parent-death signal as
``preexec_fn``); and the watch beside an engine's server that stops it when the trainer is
killed hard (orphan_watch.py). No asyncio here.

Also the blocking wait for a server's /health (``wait_healthy``), for the Slurm task's server;
supervisor.py waits for the engines' servers on its event loop.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.server.errors import ServerError
from megatron_entropy.runtime.launch_env import healthy, server_environment

# A server's command for a port and a model folder (the latest weights); env added on launch.
LaunchCommand = Callable[[int, str], list[str]]

ORPHAN_WATCH = str(Path(__file__).resolve().parent / "orphan_watch.py")
ORPHAN_GRACE_S = 5.0  # SIGTERM to SIGKILL, for the group of a server whose launcher is gone


def compose_argv(c: ServerConfig, own_argv: list[str], max_model_len_flag: str,
                   model_dir: str, port: int, weight_version: Optional[str]) -> list[str]:
    """The command line of one server: the user's ``rollout.server.launch_command`` with its
    {python}, {model}, {host}, {port}, {weight_version} placeholders filled when there is one,
    else the serving stack's own ``own_argv``, then ``max_model_len`` (if set) under the stack's
    name for it, then ``extra_args``."""
    if c.launch_command:
        return [a.format(python=c.server_python, model=model_dir, host=c.host, port=port,
                         weight_version=str(weight_version)) for a in c.launch_command]
    limit = [max_model_len_flag, str(c.max_model_len)] if c.max_model_len else []
    return own_argv + limit + list(c.extra_args)


def log_tail(path: Optional[Path], lines: int = 30) -> str:
    if path is None or not path.is_file():
        return ""
    text = path.read_text(errors="replace").splitlines()[-lines:]
    return "\n".join("    " + line for line in text)


def port_is_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str, start: int, taken: set[int]) -> int:
    for port in range(start, min(start + 1000, 65536)):
        if port not in taken and port_is_free(host, port):
            return port
    raise ServerError(f"no free port on {host} in [{start}, {start + 1000})")


def parse_extra_env(items: list[str]) -> dict[str, str]:
    """``rollout.server.extra_env`` (KEY=VALUE items) as a dict: the one parser, for the servers
    the engines launch and for those `megatron-entropy slurm serve` starts."""
    env = {}
    for item in items:
        if "=" not in item:
            raise ServerError(f"rollout.server.extra_env item {item!r} must look like KEY=VALUE")
        key, value = item.split("=", 1)
        env[key] = value
    return env


def start_process(argv: list[str], extra_env: dict[str, str], log_path: Optional[Path],
                  reason: str, name: str, preexec_fn: Optional[Callable[[], None]] = None,
                  env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """Start server ``name`` (its description, for the error) as ``argv`` in a session of its
    own, its output appended to ``log_path`` after a line with the time, ``reason`` and the
    command (None: this process's stdout). ``env`` replaces the server environment built from
    ``extra_env``; ``preexec_fn`` runs in the child before exec."""
    env = server_environment(extra_env) if env is None else env  # not the rank's RANK, ...
    log = open(log_path, "a") if log_path is not None else None
    try:
        if log is not None:
            log.write(f"\n==== {time.strftime('%Y-%m-%d %H:%M:%S')} launch ({reason}): "
                      f"{shlex.join(argv)}\n")
            log.flush()
        # Own session: stopping the server stops its worker processes too.
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT if log else None,
                                env=env, start_new_session=True, preexec_fn=preexec_fn)
    except OSError as e:
        raise ServerError(f"cannot start {name}: {shlex.join(argv)}: {e}") from e
    finally:
        if log is not None:
            log.close()


def start_orphan_watch(proc: subprocess.Popen, log_path: Optional[Path]) -> subprocess.Popen:
    """Start orphan_watch.py for the server ``proc`` (its process group): it stops the group if
    this process dies without stopping the server, and ends once the group is gone. Its lines
    go to the server's log. Not needed where the server is started from the main thread of a
    process that lives as long as it (launch/slurm.py: a parent-death signal there)."""
    log = open(log_path, "a") if log_path is not None else None
    try:
        return subprocess.Popen([sys.executable, "-I", ORPHAN_WATCH, str(os.getpid()),
                                 str(proc.pid), str(ORPHAN_GRACE_S)],
                                stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT if log else None,
                                start_new_session=True)
    finally:
        if log is not None:
            log.close()


def kill_process_group(proc: Optional[subprocess.Popen], grace_s: float = 10.0,
                       first: int = signal.SIGTERM) -> None:
    """Stop the server's whole process group (its workers outlive a killed leader): ``first``
    (SIGTERM), then SIGKILL after ``grace_s``."""
    if proc is None:
        return
    for sig, wait in ((first, grace_s), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            proc.poll()
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            continue
        break
    proc.poll()


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float,
                 should_stop: Callable[[], bool] = lambda: False,
                 interval_s: float = 0.5) -> str:
    """Poll GET ``url``/health until the server answers 200 ("up"), its process exits
    ("exited"), ``should_stop()`` turns true ("stopped") or ``timeout_s`` passes ("timeout")."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            return "exited"
        if should_stop():
            return "stopped"
        if healthy(url):
            return "up"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(interval_s)
