"""Python code run in a sandbox: its own processes with hard limits, a scratch folder, no network
where the machine allows a network namespace, and nothing left running after the call.

Each call starts ``python -I sandbox_entry.py`` (standard library only) in a session of its own
with the code in a fresh scratch folder, which is removed afterwards. Where Linux lets the entry
create network and PID namespaces (as root, or through a user namespace) the code has no network
(a loopback that is down) and runs under a supervisor that is PID 1 of its own PID namespace:
when the code ends or the call is killed, the kernel ends every process it started, even one
that left its session. Limits: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``), the
size of any file it writes, its output included (``RLIMIT_FSIZE``), open files, and processes:
as root, a ``pids`` cgroup of its own where the machine lets one be made; otherwise
``RLIMIT_NPROC`` on top of what the user runs already. As root the code runs as ``nobody`` when
``nobody`` can run this Python (a Python under ``/root`` it cannot: the code then runs as root).
At the timeout the whole process group is killed, and after every call too (what the code left
running where no PID namespace holds it). The result is what the code printed: stdout, and on a
failure the end of stderr (the traceback) and why it failed, cut to ``max_chars``.

What it does not protect against: reading and writing what the user the code runs as may (the
file system is not isolated: root's code may write anywhere); CPU and memory pressure up to the
limits while it runs; without namespaces, the network and a process that leaves its session;
kernel exploits. Run untrusted code on machines that give it an unprivileged user.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil

from megatron_entropy.tool_use.sandbox_entry import (CGROUP_PREFIX, CGROUP_ROOTS, cgroup_path,
                                                     remove_cgroup)
from megatron_entropy.config.tools import SandboxSettings

ENTRY = Path(__file__).resolve().parent / "sandbox_entry.py"
NOBODY = 65534
NO_NAMESPACES, BAD_SETTINGS = 90, 91


@dataclass(frozen=True)
class SandboxResult:
    """One run: what the code printed (cut), and how it ended."""

    output: str
    status: str  # "ok", "error" (a nonzero exit, a limit), "timeout"
    detail: str = ""  # why it failed: "exit code 1", "cpu time limit", "output limit", ...
    seconds: float = 0.0


def probe_isolation() -> str:
    """'' where the sandbox gets its network and PID namespaces on this machine, else why not."""
    out = subprocess.run([sys.executable, "-I", str(ENTRY), "--probe"], capture_output=True,
                         text=True, timeout=60)
    answer = out.stdout.strip()
    return "" if answer == "isolated" else (answer.removeprefix("not isolated: ")
                                            or out.stderr.strip()[-300:] or "no answer")


def _others_may_run(paths: list[str]) -> bool:
    """Whether a user without rights of its own can reach and read ``paths`` (this Python)."""
    for path in paths:
        parts = Path(path).resolve().parts
        for i in range(1, len(parts) + 1):
            mode = os.stat(Path(*parts[:i])).st_mode
            if not mode & stat.S_IROTH or (stat.S_ISDIR(mode) and not mode & stat.S_IXOTH):
                return False
    return True


def run_as() -> Optional[int]:
    """The user the code runs as: ``nobody`` when this process is root and ``nobody`` can run
    this Python (the process limit then counts, and nothing of root's may be written); else the
    user itself (None)."""
    if os.geteuid() != 0:
        return None
    ok = _others_may_run([sys.executable, os.path.dirname(os.__file__),
                          os.path.dirname(json.__file__)])
    return NOBODY if ok else None


def _tasks_of(uid: int) -> int:
    """Threads of every process whose real user is ``uid`` (what RLIMIT_NPROC counts)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        if int(fields.get("Uid", "-1").split()[0]) == uid:
            total += int(fields.get("Threads", "1"))
    return total


def remove_stale_cgroups() -> None:
    """The empty cgroups of sandboxes whose entry is gone (a worker killed with its call, a
    busy machine slow to let go of the last task)."""
    if os.geteuid() != 0:
        return
    for root in CGROUP_ROOTS:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            pid = name.removeprefix(CGROUP_PREFIX)
            if name.startswith(CGROUP_PREFIX) and pid.isdigit() and not psutil.pid_exists(int(pid)):
                try:
                    os.rmdir(os.path.join(root, name))
                except OSError:
                    pass


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read(path: Path, chars: int, tail: bool = False) -> tuple[str, bool]:
    """The first (or last) ``chars`` characters of a file the code wrote, and whether it held
    more."""
    try:
        with open(path, "rb") as f:
            if tail:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 4 * chars))
                data = f.read().decode(errors="replace")
                return data[-chars:], len(data) > chars or size > 4 * chars
            data = f.read(4 * chars + 4).decode(errors="replace")
    except OSError:
        return "", False
    return data[:chars], len(data) > chars


def _failure(code: int, s: SandboxSettings) -> str:
    """Why the code's process ended with ``code``."""
    if code == NO_NAMESPACES:
        return "no namespaces"
    if code > 128:
        sig = code - 128
        if sig == signal.SIGXFSZ:
            return f"file size limit ({s.file_mb} MiB)"
        if sig in (signal.SIGXCPU, signal.SIGKILL):
            return f"cpu time limit ({s.cpu_seconds} s)" if sig == signal.SIGXCPU else "killed"
        return f"killed by {signal.Signals(sig).name}"
    return f"exit code {code}"


def run_python(code: str, settings: SandboxSettings, timeout_s: float, max_chars: int,
               scratch_root: Optional[str] = None) -> SandboxResult:
    """Run ``code`` in the sandbox (module docstring), at most ``timeout_s`` seconds of wall
    time."""
    started = time.monotonic()
    remove_stale_cgroups()
    scratch = Path(tempfile.mkdtemp(prefix="me-tool-", dir=scratch_root))
    try:
        (scratch / "main.py").write_text(code, encoding="utf-8")
        uid = run_as()
        if uid is not None:  # the code's folder is its own
            for path in (scratch, scratch / "main.py"):
                os.chown(path, uid, uid)
        box = {"code": str(scratch / "main.py"), "scratch": str(scratch),
               "stdout": str(scratch / ".stdout"), "stderr": str(scratch / ".stderr"),
               "cpu_seconds": max(1, int(settings.cpu_seconds)), "memory_mb": settings.memory_mb,
               "file_mb": settings.file_mb, "processes": settings.processes,
               "uid": uid, "parent": os.getpid(), "user_processes": 0 if os.geteuid() == 0 and uid is None else
               _tasks_of(os.getuid() if uid is None else uid), "isolation": settings.isolation}
        entry_err = scratch / ".entry"
        with open(entry_err, "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", str(ENTRY), json.dumps(box)],
                                    stdin=subprocess.DEVNULL, stdout=err, stderr=err,
                                    start_new_session=True)
        status, detail = "ok", ""
        try:
            code_ = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.wait()
            status, detail = "timeout", f"timed out after {timeout_s:g} s"
        finally:
            _kill_group(proc.pid)  # whatever it left running in its group
            for path in cgroup_path(proc.pid):  # the entry's, if it could not remove it
                if os.path.isdir(path):
                    remove_cgroup(path, patience_s=10.0)
        if status == "ok" and code_ != 0:
            status, detail = "error", _failure(code_, settings)
            if (scratch / ".stdout").stat().st_size >= settings.file_mb << 20:
                detail = f"output limit ({settings.file_mb} MiB)"
            if code_ in (NO_NAMESPACES, BAD_SETTINGS):
                detail = _read(entry_err, 300)[0].strip() or detail
        out, cut = _read(scratch / ".stdout", max_chars)
        parts = [out + ("\n[output cut]" if cut else "")] if out else []
        if status != "ok":
            err_text, err_cut = _read(scratch / ".stderr", max_chars, tail=True)
            if err_text.strip():
                parts.append(("[...]" if err_cut else "") + err_text.rstrip())
            parts.append(f"[{detail}]")
        text = "\n".join(p for p in parts if p)[-max_chars:] if status != "ok" else \
            "\n".join(parts)
        return SandboxResult(text, status, detail, time.monotonic() - started)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
