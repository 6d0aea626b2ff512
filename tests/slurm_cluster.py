"""A real single-node Slurm cluster (slurmctld + slurmd + munged) in a folder, for tests.

Everything lives under one folder: a private munge socket and key, slurm.conf, state, spool, logs
and pid files; nothing under /etc or /run is touched, so it can run beside a system Slurm. The
daemons run as root without systemd (Debian's slurm-wlm 22.05, installed by .ci/setup-slurm.sh).

The node advertises more CPUs than the machine has (``SlurmdParameters=config_overrides``) so that a
job can hold a server step and a 2-task trainer step at once on a 2-core machine. Requeued jobs
become eligible after ``cred_expire`` seconds (default 120): set to 5 so requeue tests are quick.

Use from pytest (``slurm_cluster`` fixture in the tests) or by hand:

    python tests/slurm_cluster.py start /tmp/slurm  # prints export SLURM_CONF=/tmp/slurm/slurm.conf
    python tests/slurm_cluster.py stop /tmp/slurm
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey", "sbatch", "srun", "scontrol")


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


class SlurmCluster:
    def __init__(self, root: os.PathLike, cpus: int = 8, memory_mb: int = 8000):
        self.root = Path(root).resolve()
        self.cpus = cpus
        self.memory_mb = memory_mb
        self.host = socket.gethostname()
        self.conf = self.root / "slurm.conf"
        self.munge_socket = self.root / "munge" / "run" / "munge.socket"

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
        for sub in ("state", "spool", "log", "munge/run", "munge/etc"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        self._write_conf()
        for daemon in ("slurmctld", "slurmd"):
            if not _alive(self.root / f"{daemon}.pid"):
                subprocess.run([daemon, "-f", str(self.conf)], env=self.env(), check=True,
                               capture_output=True, timeout=30)
        self._wait_idle(timeout)
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

    def _write_conf(self) -> None:
        r = self.root
        lines = [
            "ClusterName=metest",
            # Job ids (and the trainer's master port, derived from them) differ between clusters.
            f"FirstJobId={1000 + int.from_bytes(os.urandom(2), 'little') % 9000}",
            f"SlurmctldHost={self.host}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
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
            "KillWait=10",
            "MinJobAge=4",  # sbatch --wait polls every 2 s only while 2 < MinJobAge / 2
            "SchedulerParameters=sched_interval=1,bf_interval=1",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"NodeName={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} "
            f"RealMemory={self.memory_mb} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        if not (self.conf.exists() and _alive(r / "slurmctld.pid")):
            self.conf.write_text("\n".join(lines) + "\n")

    def _wait_idle(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            res = self.run("sinfo", "-h", "-o", "%t", check=False, timeout=10)
            out = res.stdout.strip() + res.stderr.strip()
            if res.returncode == 0 and out in ("idle", "mix", "alloc"):
                return
            time.sleep(0.3)
        raise RuntimeError(f"the test cluster's node did not come up within {timeout:.0f} s "
                           f"(sinfo: {out!r}); logs in {self.root / 'log'}")

    def stop(self, timeout: float = 60) -> None:
        """Cancel the jobs left, then stop the daemons this folder started, by their pid files.
        (slurmstepd and a job's processes outlive slurmd: a job left running would keep its
        master port and step on the next cluster's jobs.)"""
        if _alive(self.root / "slurmctld.pid"):
            jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
            if jobs:
                self.run("scancel", "--full", *jobs, check=False)
            deadline = time.monotonic() + timeout
            while jobs and time.monotonic() < deadline:
                time.sleep(0.5)
                jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        for pid_file in (self.root / "slurmd.pid", self.root / "slurmctld.pid",
                         self.root / "munge" / "run" / "munged.pid"):
            pid = _alive(pid_file)
            if pid is None:
                continue
            os.kill(pid, 15)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and _alive(pid_file):
                time.sleep(0.1)

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

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, ExitCode, ...)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id)).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

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
