"""The sandbox's first process: run as a script (``python -I sandbox_entry.py SETTINGS``) by
tool_use/sandbox.py, standard library only, so nothing of the package or the trainer is loaded.

SETTINGS (JSON): the code file, the scratch folder, the limits, the user to run as and the
isolation mode. The entry leaves the network and the PID namespaces (``unshare``: as root
directly, otherwise inside a new user namespace) and forks a supervisor, PID 1 of the new
namespace, which forks the process that runs the code. The code's process joins the process
cgroup the entry made (root only: ``pids.max``), applies the resource limits, takes the user it
runs as, moves into the scratch folder with an empty environment and runs the code. It may leave
its session, but the supervisor stays in the entry's process group, which the timeout kills, and
when the supervisor ends the kernel ends every process left in the namespace. The entry exits
with the code's exit status (128 + N when signal N ended it); 90 when namespaces are required
and unavailable, 91 for bad settings.

``--probe`` prints whether the namespaces can be entered (``isolated`` / ``not isolated: why``).
"""

import ctypes
import json
import os
import resource
import sys
import time
import traceback

CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
PR_SET_PDEATHSIG = 1
NO_NAMESPACES = 90
BAD_SETTINGS = 91
# Where a root entry makes the code's process cgroup: cgroup v1's pids hierarchy, or v2's root.
CGROUP_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")


def enter_namespaces() -> str:
    """Leave the network and PID namespaces; '' on success, else why not."""
    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNET | CLONE_NEWPID
    if os.geteuid() != 0:
        flags |= CLONE_NEWUSER  # an unprivileged process may create both inside its own
    if libc.unshare(flags) == 0:
        return ""
    errno = ctypes.get_errno()
    return f"unshare: {os.strerror(errno)}"


CGROUP_PREFIX = "megatron-entropy-tool-"


def cgroup_path(entry_pid: int) -> list[str]:
    """The cgroup folders a root entry of pid ``entry_pid`` may make (tool_use/sandbox.py
    removes the one left by an entry it killed)."""
    return [os.path.join(root, f"{CGROUP_PREFIX}{entry_pid}") for root in CGROUP_ROOTS]


def make_cgroup(processes: int) -> str:
    """A process cgroup holding at most ``processes`` tasks (as root, where cgroups allow it);
    '' where none could be made."""
    if os.geteuid() != 0:
        return ""
    for root, path in zip(CGROUP_ROOTS, cgroup_path(os.getpid())):
        try:
            if root == "/sys/fs/cgroup":
                with open(os.path.join(root, "cgroup.subtree_control")) as f:
                    if "pids" not in f.read().split():
                        continue
            os.mkdir(path)
            with open(os.path.join(path, "pids.max"), "w") as f:
                f.write(str(processes + 1))  # the code's own process too
            return path
        except OSError:
            try:
                os.rmdir(path)
            except OSError:
                pass
    return ""


def remove_cgroup(path: str, patience_s: float = 0.5) -> None:
    for _ in range(int(patience_s / 0.01)):  # the kernel takes a moment to let go of the tasks
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)


def limit(which: int, value: int) -> None:
    soft, hard = resource.getrlimit(which)
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(which, (value, value))


def run_code(s: dict, cgroup: str) -> None:
    """In the forked process: cgroup, limits, identity, folder, environment, then the code."""
    out = os.open(s["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    err = os.open(s["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
    with open(s["code"], encoding="utf-8") as f:
        source = f.read()
    if cgroup:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
            f.write("0")  # this process, and all it starts
    # The CPU limit ends the process with SIGXCPU (soft) or SIGKILL (one second later).
    resource.setrlimit(resource.RLIMIT_CPU, (s["cpu_seconds"], s["cpu_seconds"] + 1))
    limit(resource.RLIMIT_AS, s["memory_mb"] << 20)
    limit(resource.RLIMIT_FSIZE, s["file_mb"] << 20)
    limit(resource.RLIMIT_CORE, 0)
    limit(resource.RLIMIT_NOFILE, 256)
    if s["uid"] is not None and os.geteuid() == 0:
        os.setgroups([])
        os.setgid(s["uid"])
        os.setuid(s["uid"])
    if os.geteuid() != 0:
        # Counted per user (threads included): on top of what the user runs already.
        limit(resource.RLIMIT_NPROC, s["processes"] + s["user_processes"])
    os.chdir(s["scratch"])
    os.environ.clear()
    os.environ.update({"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": s["scratch"],
                       "TMPDIR": s["scratch"], "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"})
    sys.argv = ["main.py"]
    sys.path[:] = [p for p in sys.path if p] + [s["scratch"]]
    code = 0
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException as e:  # noqa: BLE001 - the code's own error, reported as its traceback
        # Its frames only (this file's are not the code's).
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def status_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def supervise(s: dict, cgroup: str) -> None:
    """PID 1 of the namespace: runs the code in a child (which may leave its session, but
    never this process's group, which the timeout kills) and reaps what is re-parented to it;
    its exit ends every process left in the namespace."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # the entry killed: this one too
        child = os.fork()
        if child == 0:
            try:
                run_code(s, cgroup)
            finally:
                os._exit(1)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == child:
                os._exit(status_code(status))
    finally:
        os._exit(1)


def main() -> None:
    if sys.argv[1:] == ["--probe"]:
        why = enter_namespaces()
        print("isolated" if not why else f"not isolated: {why}")
        return
    try:
        s = json.loads(sys.argv[1])
    except (IndexError, ValueError):
        sys.exit(BAD_SETTINGS)
    # The process that started it killed (a tool worker at its timeout): this one too.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if os.getppid() != s["parent"]:
        sys.exit(BAD_SETTINGS)
    why = enter_namespaces() if s["isolation"] != "off" else "off"
    if why and s["isolation"] == "required":
        print(f"the tool sandbox needs network and PID namespaces: {why}", file=sys.stderr)
        sys.exit(NO_NAMESPACES)
    cgroup = make_cgroup(s["processes"])
    pid = os.fork()
    if pid == 0:
        supervise(s, cgroup)
    _, status = os.waitpid(pid, 0)
    if cgroup:
        remove_cgroup(cgroup)
    sys.exit(status_code(status))


if __name__ == "__main__":
    main()
