"""Where this process sits in the job: read from the variables torchrun or Slurm's srun set."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a Slurm node list ("gpu[01-03,07],login1") into host names.

    Uses ``scontrol show hostnames`` when it exists (the authority), else the same syntax parsed here.
    """
    if shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True,
                                 capture_output=True, text=True, timeout=30).stdout.split()
            if out:
                return out
        except (subprocess.SubprocessError, OSError):
            pass
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?[^,]*", nodelist):
        m = re.fullmatch(r"(.*)\[([^\]]*)\](.*)", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, suffix = m.groups()
        for rng in ranges.split(","):
            if "-" in rng:
                lo, hi = rng.split("-")
                hosts.extend(f"{prefix}{i:0{len(lo)}d}{suffix}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(f"{prefix}{rng}{suffix}")
    return hosts


def _slurm_port(env: Mapping[str, str]) -> int:
    # Derived from the job id so that jobs sharing a node do not collide, and all tasks agree.
    job = int(env.get("SLURM_JOB_ID", "0") or 0)
    return 20000 + job % 20000


def detect_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """torchrun's RANK/WORLD_SIZE/... first, then Slurm's SLURM_PROCID/..., else a single process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing and int(env["WORLD_SIZE"]) > 1:
            raise RuntimeError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not; "
                               "launch with torchrun or set them yourself")
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         env.get("MASTER_ADDR", "127.0.0.1"), int(env.get("MASTER_PORT", 29500)),
                         "torchrun")
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        master = env.get("MASTER_ADDR") or expand_nodelist(nodelist)[0]
        port = int(env.get("MASTER_PORT") or _slurm_port(env))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), master, port, "slurm")
    # Port 0: the one-process store binds a free port itself, so single-process runs on one
    # machine (a study's, other users') never collide on a fixed port.
    return LaunchEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", 0)), "single")
