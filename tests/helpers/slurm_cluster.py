"""A real multi-node Slurm cluster on one machine, in a folder, for tests: slurmctld, one slurmd per
fake node and munged (Debian's slurm-wlm 22.05, installed by .ci/setup-slurm.sh), run as root
without systemd.

Several nodes on one host: Debian builds slurm-wlm with multiple-slurmd support (its auth/munge
plugin accepts the replayed credentials that one munged hands to several slurmd's, "expected in
multiple slurmd mode", and cgroup/v2 names a scope per node), so ``slurmd -N nodeK`` runs once per
node, each with its own port, spool folder, log and pid file (``%n`` in slurm.conf). Every node has
its own loopback address (127.A.B.K) and the node names resolve to them inside the slurmd's private
mount namespace, where a copy of /etc/hosts that lists them is bind-mounted (``unshare --mount``);
jobs inherit that namespace, so a task on node3 reaches a server on node1 by name, as on a real
cluster. Each node has ``gpus`` fake GPUs: gres.conf names character devices made in the folder
(copies of /dev/null), so Slurm hands them to jobs and steps exactly as real GPUs
(CUDA_VISIBLE_DEVICES, SLURM_STEP_GPUS, SLURM_JOB_GPUS) on a machine without one.

Preemption is configured as a site does it: jobs in partition ``debug`` (the default) can be
preempted by jobs in partition ``urgent``, with ``PreemptMode=REQUEUE`` and ``GraceTime=grace_s``.
A node whose slurmd stops answering is declared DOWN after ``SlurmdTimeout`` (20 s) and its jobs
are requeued, as Slurm does for a dead node. The nodes advertise more CPUs than the machine has
(``SlurmdParameters=config_overrides``). Requeued jobs become eligible after ``cred_expire`` (5 s).

Nothing under /etc or /run is touched outside the daemons' namespace, so it can run beside a system
Slurm or another test cluster (own ports, own addresses). ``stop()`` cancels the jobs, stops the
daemons and kills whatever process of this cluster is left (found by its SLURM_CONF).

Use from pytest (``cluster`` fixture in the tests) or by hand:

    python tests/helpers/slurm_cluster.py start /tmp/slurm  # prints export SLURM_CONF=/tmp/slurm/slurm.conf
    python tests/helpers/slurm_cluster.py stop /tmp/slurm
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "scontrol", "unshare")
NODE_MARK = "ME_TEST_SLURM_NODE"  # in each slurmd's environment (its slurmstepd's inherit it)


def missing_binaries() -> list[str]:
    return [b for b in DAEMONS if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid_file: Path) -> Optional[int]:
    try:
        pid = int(pid_file.read_text().strip())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    items = (kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)
    return dict(items)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


class SlurmCluster:
    def __init__(self, root: os.PathLike, nodes: int = 4, cpus: int = 8, gpus: int = 2,
                 memory_mb: int = 8000, grace_s: int = 120, kill_wait_s: int = 10):
        self.root = Path(root).resolve()
        self.nodes = [f"node{i}" for i in range(1, nodes + 1)]
        self.cpus = cpus
        self.gpus = gpus
        self.memory_mb = memory_mb
        self.grace_s = grace_s
        self.kill_wait_s = kill_wait_s  # SIGTERM, then SIGKILL this long after, to end a job
        self.host = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self.hosts_file = self.root / "hosts"
        self.munge_socket = self.root / "munge" / "run" / "munge.socket"
        # One /24 of the loopback range per cluster: servers on different fake nodes may use the
        # same port, as on real nodes, and two clusters never share an address.
        seed = int.from_bytes(os.urandom(2), "little")
        self._net = f"127.{20 + seed % 200}.{seed // 200 % 250}"

    def address(self, node: str) -> str:
        return f"{self._net}.{self.nodes.index(node) + 1}"

    # ------------------------------------------------------------------------------ environment

    def env(self, **extra: str) -> dict[str, str]:
        """The environment a client command (sbatch, srun, squeue) needs to reach this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        for key in list(env):  # a test run inside a Slurm job must not leak that job's identity
            if key.startswith(("SLURM_", "SBATCH_", "SRUN_")) and key != "SLURM_CONF":
                del env[key]
        env.update(extra)
        return env

    def run(self, *cmd: str, timeout: float = 60, check: bool = True,
            env: Optional[dict] = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env=env or self.env(), capture_output=True, text=True,
                              timeout=timeout, check=check)

    # ------------------------------------------------------------------------------ start / stop

    def start(self, timeout: float = 60) -> "SlurmCluster":
        missing = missing_binaries()
        if missing:
            raise RuntimeError(f"Slurm/munge binaries not found: {', '.join(missing)}; run "
                               ".ci/setup-slurm.sh (apt-get install slurm-wlm munge)")
        if os.geteuid() != 0:
            raise RuntimeError("the test cluster runs its daemons as root")
        for sub in ("state", "log", "dev", "munge/run", "munge/etc",
                    *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        if not _alive(self.root / "slurmctld.pid"):
            subprocess.run(["slurmctld", "-f", str(self.conf)], env=self.env(), check=True,
                           capture_output=True, timeout=30)
        for node in self.nodes:
            self.start_node(node, wait=False)
        self._wait_nodes(self.nodes, timeout)
        return self

    def _start_munge(self) -> None:
        mdir = self.root / "munge"
        run, etc = mdir / "run", mdir / "etc"
        if _alive(run / "munged.pid"):
            return
        # munged insists: key dir private to its user, socket dir traversable by everyone.
        shutil.chown(mdir, "munge", "munge")
        for d, mode in ((mdir, 0o755), (run, 0o755), (etc, 0o700)):
            shutil.chown(d, "munge", "munge")
            d.chmod(mode)
        key = etc / "munge.key"
        if not key.exists():
            subprocess.run(["mungekey", "--create", f"--keyfile={key}"], user="munge", check=True,
                           capture_output=True, timeout=30)
        subprocess.run(["munged", f"--socket={self.munge_socket}", f"--key-file={key}",
                        f"--pid-file={run / 'munged.pid'}", f"--log-file={etc / 'munged.log'}",
                        f"--seed-file={etc / 'munged.seed'}"],
                       user="munge", check=True, capture_output=True, timeout=30)

    def _make_gpu_devices(self) -> list[Path]:
        devices = [self.root / "dev" / f"gpu{i}" for i in range(self.gpus)]
        for dev in devices:
            if not dev.exists():  # slurmd accepts only character or block devices as GRES files
                os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        return devices

    def _write_conf(self) -> None:
        if self.conf.exists() and _alive(self.root / "slurmctld.pid"):
            return
        r = self.root
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        lines = [
            "ClusterName=metest",
            # Job ids (and the trainer's master port, derived from them) differ between clusters.
            f"FirstJobId={1000 + int.from_bytes(os.urandom(2), 'little') % 9000}",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SlurmdParameters=config_overrides",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdTimeout=20",
            f"KillWait={self.kill_wait_s}",
            "MinJobAge=4",  # sbatch --wait polls every 2 s only while 2 < MinJobAge / 2
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool' / '%n'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd-%n.log'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd-%n.pid'}",
        ]
        if self.gpus:
            lines.append("GresTypes=gpu")
            devices = self._make_gpu_devices()
            (r / "gres.conf").write_text(
                f"NodeName={','.join(self.nodes)} Name=gpu "
                f"File={r / 'dev'}/gpu[0-{len(devices) - 1}]\n")
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={self.host} NodeAddr={self.address(node)} "
                         f"Port={_free_port()} CPUs={self.cpus} RealMemory={self.memory_mb}{gres} "
                         "State=UNKNOWN")
        lines += [
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1 "
            f"PreemptMode=REQUEUE GraceTime={self.grace_s}",
            "PartitionName=urgent Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 "
            "PreemptMode=OFF",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        etc_hosts = Path("/etc/hosts").read_text()
        self.hosts_file.write_text(etc_hosts.rstrip("\n") + "\n" + "".join(
            f"{self.address(n)} {n}\n" for n in self.nodes))

    def start_node(self, node: str, wait: bool = True, timeout: float = 60) -> None:
        """Start (or restart) the slurmd of ``node`` in a mount namespace of its own where the
        node names resolve; with ReturnToService=2 a node declared DOWN comes back."""
        if _alive(self.root / f"slurmd-{node}.pid"):
            return
        self.run("unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c",
                 'mount --bind "$0" /etc/hosts && exec "$@"', str(self.hosts_file),
                 "slurmd", "-f", str(self.conf), "-N", node,
                 env=self.env(**{NODE_MARK: node}), timeout=30)
        if wait:
            self._wait_nodes([node], timeout)

    def node_states(self) -> dict[str, str]:
        """Each node's state as sinfo prints it (idle, mix, alloc, down*, ...)."""
        res = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout=10)
        return dict(line.split() for line in res.stdout.splitlines() if len(line.split()) == 2)

    def _wait_nodes(self, nodes: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(n) in ("idle", "mix", "alloc") for n in nodes):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the test cluster's nodes did not come up within {timeout:.0f} s "
                           f"(sinfo: {states}); logs in {self.root / 'log'}")

    def processes(self, job_id: Optional[int] = None, node: Optional[str] = None) -> list[int]:
        """Live processes of this cluster (daemons, step daemons, batch scripts, tasks and their
        children: everything whose environment names this cluster's slurm.conf), optionally only
        those of one job or one node."""
        conf = str(self.conf)
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            env = _environ(int(entry.name))
            if env.get("SLURM_CONF") != conf or _is_zombie(int(entry.name)):
                continue
            if job_id is not None and env.get("SLURM_JOB_ID") != str(job_id):
                continue
            if node is not None and node not in (env.get(NODE_MARK), env.get("SLURMD_NODENAME")):
                continue
            found.append(int(entry.name))
        return found

    def left_after_end(self, job_id: int) -> list[str]:
        """What is left of a job that Slurm has ended (its state no longer COMPLETING or
        REQUEUED, the flags it shows until every node has ended the job's steps and run the
        epilog): nothing that Slurm tracks. A process SIGKILLed at the end of KillWait may still
        be exiting for a moment, so it gets KillWait more; whatever is still there then
        escaped Slurm (its parent died first, and proctrack/linuxproc follows parents), one
        line per process (`describe`)."""
        deadline = time.monotonic() + self.kill_wait_s
        while self.processes(job_id=job_id) and time.monotonic() < deadline:
            time.sleep(0.2)
        return self.describe(self.processes(job_id=job_id))

    @staticmethod
    def describe(pids: list[int]) -> list[str]:
        """One line per process for a failure message: pid, parent, state, job step, command."""
        lines = []
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue  # gone meanwhile
            env = _environ(pid)
            lines.append(f"pid {pid} ppid {stat[1]} state {stat[0]} step "
                         f"{env.get('SLURM_STEP_ID', 'batch')} node {env.get('SLURMD_NODENAME')}: "
                         + " ".join(a.decode(errors="replace") for a in argv if a))
        return lines

    def kill_node(self, node: str) -> None:
        """What a node that loses power looks like to the others: its slurmd, its step daemons
        and every task on it die at once (SIGKILL), with no message to anyone."""
        for pid in self.processes(node=node):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    def stop(self, timeout: float = 60) -> None:
        """Cancel the jobs left, stop the daemons by their pid files, then kill any process of
        this cluster still there (a job's steps outlive slurmd; a job left running would keep its
        ports and step on the next cluster's jobs)."""
        if _alive(self.root / "slurmctld.pid"):
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", "--full", *jobs, check=False)
            deadline = time.monotonic() + timeout
            while jobs and time.monotonic() < deadline:
                time.sleep(0.5)
                jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        pid_files = [self.root / f"slurmd-{n}.pid" for n in self.nodes]
        for pid_file in pid_files + [self.root / "slurmctld.pid",
                                     self.root / "munge" / "run" / "munged.pid"]:
            pid = _alive(pid_file)
            if pid is None:
                continue
            os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and _alive(pid_file):
                time.sleep(0.1)
        for pid in self.processes():
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass

    # ------------------------------------------------------------------------------ jobs

    def sbatch(self, *args: str, timeout: float = 600, env: Optional[dict] = None,
               cwd: Optional[os.PathLike] = None) -> tuple[int, int]:
        """``sbatch --wait ARGS``: returns (job id, exit code of the job)."""
        res = subprocess.run(["sbatch", "--wait", *args], env=env or self.env(), cwd=cwd,
                             capture_output=True, text=True, timeout=timeout)
        m = re.search(r"Submitted batch job (\d+)", res.stdout)
        if not m:
            raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stdout}{res.stderr}")
        return int(m.group(1)), res.returncode

    def submit(self, *args: str, env: Optional[dict] = None,
               cwd: Optional[os.PathLike] = None) -> int:
        """``sbatch ARGS`` without waiting: returns the job id."""
        res = subprocess.run(["sbatch", "--parsable", *args], env=env or self.env(), cwd=cwd,
                             capture_output=True, text=True, timeout=60)
        if res.returncode:
            raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stdout}{res.stderr}")
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int, attempts: int = 5) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...). Retried: on a busy
        machine slurmctld may drop a connection (scontrol then dies of SIGPIPE)."""
        for attempt in range(attempts):
            res = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
            if res.returncode == 0:
                return dict(kv.split("=", 1) for kv in res.stdout.split() if "=" in kv)
            time.sleep(1 + attempt)
        raise RuntimeError(f"scontrol show job {job_id} failed {attempts} times: "
                           f"{res.returncode} {res.stderr.strip()}")

    def wait_state(self, job_id: int, states: tuple[str, ...], timeout: float = 300) -> dict:
        deadline = time.monotonic() + timeout
        info: dict = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} not in {states} after {timeout:.0f} s: {info}")


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("start", "stop"):
        print(__doc__)
        return 2
    cluster = SlurmCluster(argv[1])
    if argv[0] == "start":
        cluster.start()
        print(f"export SLURM_CONF={cluster.conf}")
    else:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
