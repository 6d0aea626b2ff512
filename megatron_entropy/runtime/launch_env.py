"""Where this process sits in the job: read from the variables torchrun or Slurm's srun set.

No torch here: the Slurm helpers (launch/slurm.py) import this module in processes that do not
train (the layout, waiting for servers), whose start-up would otherwise pay torch's import."""

from __future__ import annotations

import ipaddress
import math
import os
import re
import resource
import shutil
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

from megatron_entropy.runtime.files import relative_note


@dataclass(frozen=True)
class LaunchEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    launcher: str  # "torchrun", "slurm" or "single"
    # Every rank runs on this machine: nothing of the job needs to listen beyond loopback.
    single_node: bool = True


class ParallelLayoutError(ValueError):
    pass


def min_world_size(tensor: int, pipeline: int, expert: int = 1, context: int = 1) -> int:
    """The fewest ranks of a layout: TP x PP x CP x the DP ranks that EP needs beside CP."""
    return tensor * pipeline * context * (expert // math.gcd(expert, context))


def check_layout(world_size: int, tensor: int, pipeline: int, expert: int = 1,
                 context: int = 1) -> int:
    """Return the data-parallel size, or raise naming the config keys if the world does not factor.
    Expert parallelism splits the experts over the data- and context-parallel ranks (Megatron's
    expert groups fold into DP x CP): it must divide DP x CP."""
    if tensor < 1 or pipeline < 1 or context < 1:
        raise ParallelLayoutError(
            f"parallel.tensor={tensor}, parallel.pipeline={pipeline} and parallel.context="
            f"{context} must all be >= 1")
    model = tensor * pipeline * context
    if world_size % model:
        names = "parallel.tensor x parallel.pipeline" + (" x parallel.context" if context > 1
                                                         else "")
        sizes = f"{tensor} x {pipeline}" + (f" x {context}" if context > 1 else "")
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by {names} = {sizes} = {model}; use a "
            f"world size that is a multiple of {model} or change the layout")
    dp = world_size // model
    if expert < 1 or (dp * context) % expert:
        raise ParallelLayoutError(
            f"parallel.expert={expert} must divide the data-parallel size {dp}"
            + (f" x parallel.context={context}" if context > 1 else "")
            + f" (world size {world_size} / parallel.tensor x parallel.pipeline = {tensor} x "
            f"{pipeline})")
    return dp


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


# The master port of a Slurm job: SLURM_MASTER_PORT_BASE + job id % SLURM_MASTER_PORT_SPAN, the
# same on every task without talking, different for jobs that share a node. The range lies below
# Linux's default ephemeral range (net.ipv4.ip_local_port_range, 32768-60999), from which every
# outgoing connection on the master node takes its local port (a rank's rollout requests, NCCL's
# and gloo's own sockets) and so may hold the port before the TCPStore binds it, and below the
# rollout servers' default base_port (30000). MASTER_PORT overrides it.
SLURM_MASTER_PORT_BASE = 10000
SLURM_MASTER_PORT_SPAN = 20000


def _slurm_port(env: Mapping[str, str]) -> int:
    job = int(env.get("SLURM_JOB_ID", "0") or 0)
    return SLURM_MASTER_PORT_BASE + job % SLURM_MASTER_PORT_SPAN


def detect_launch_env(env: Optional[Mapping[str, str]] = None) -> LaunchEnv:
    """torchrun's RANK/WORLD_SIZE/... first, then Slurm's SLURM_PROCID/..., else a single process."""
    env = os.environ if env is None else env
    if "RANK" in env and "WORLD_SIZE" in env:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in env]
        if missing and int(env["WORLD_SIZE"]) > 1:
            raise RuntimeError(f"RANK/WORLD_SIZE are set but {', '.join(missing)} is not; "
                               "launch with torchrun or set them yourself")
        master = env.get("MASTER_ADDR", "127.0.0.1")
        # torchrun and `megatron-entropy train --nproc` say how many ranks run on this machine.
        single = (env.get("LOCAL_WORLD_SIZE") == env["WORLD_SIZE"] or is_loopback(master))
        return LaunchEnv(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0)),
                         master, int(env.get("MASTER_PORT", 29500)), "torchrun", single)
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1"
        hosts = expand_nodelist(nodelist)
        nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or len(hosts))
        # A step on one node meets on loopback; across nodes on the first node's name.
        master = env.get("MASTER_ADDR") or ("127.0.0.1" if nodes == 1 else hosts[0])
        port = int(env.get("MASTER_PORT") or _slurm_port(env))
        return LaunchEnv(int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"]),
                         int(env.get("SLURM_LOCALID", 0)), master, port, "slurm", nodes == 1)
    # Port 0: the one-process store binds a free port itself, so single-process runs on one
    # machine (a study's, other users') never collide on a fixed port.
    return LaunchEnv(0, 1, 0, "127.0.0.1", int(env.get("MASTER_PORT", 0)), "single")


def is_loopback(host: str) -> bool:
    """A loopback address literal (127.0.0.0/8, ::1) or "localhost"; names are not resolved (a
    node's own name may resolve to 127.0.1.1 on the node and to its real address elsewhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# What a launcher tells a trainer rank about its place in the job. A server or helper started
# from a rank must not inherit them: a serving stack that reads RANK/WORLD_SIZE/MASTER_PORT would
# take itself for a rank of the trainer's job (and try to join its store).
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                  "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK",
                  "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
                  "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


def server_environment(extra: Optional[Mapping[str, str]] = None,
                       env: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """The environment of a rollout server started from this process: ours without the rank
    variables (RANK_VARIABLES), plus ``extra``."""
    env = os.environ if env is None else env
    return {**{k: v for k, v in env.items() if k not in RANK_VARIABLES}, **(extra or {})}


def healthy(url: str, timeout: float = 5.0) -> bool:
    """Whether the (rollout) server at ``url`` answers GET /health with 200 within ``timeout``."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/health", timeout=timeout) as r:
            return r.status == 200
    except OSError:
        return False


def raise_open_files_limit() -> tuple[int, int]:
    """Raise this process's open-files soft limit to its hard limit; returns (soft, hard).

    Rank 0 holds a socket per rollout request in flight (servers x rollout.server.max_concurrency)
    beside its checkpoint and library files; the usual soft limit of 1024 refuses the rest, and a
    refused connection marks a healthy server dead. The hard limit is the site's to set."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        # Linux refuses an infinite soft limit for files (nr_open caps it): take nr_open then.
        target = hard if hard != resource.RLIM_INFINITY else _nr_open(soft)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft, hard


def _nr_open(fallback: int) -> int:
    try:
        return int(Path("/proc/sys/fs/nr_open").read_text())
    except (OSError, ValueError):
        return fallback


class UrlFileError(ValueError):
    """A server URL file that cannot be used; the message names the file and the line."""


def read_urls_file(path: str | os.PathLike) -> list[str]:
    """The URLs of a server URL file (``rollout.server.urls_file``; the slurm/ scripts write one
    once every server answers): one per line, blank lines and '#' comments ignored. The one
    reader of these files, for the server pool and the Slurm helpers alike."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"rollout.server.urls_file {str(p)!r} does not exist (the "
                                "slurm/ scripts write it once every server answers)"
                                f"{relative_note(p)}")
    urls = [line.strip() for line in p.read_text().splitlines()]
    urls = [u for u in urls if u and not u.startswith("#")]
    if not urls:
        raise UrlFileError(f"rollout.server.urls_file {str(p)!r} lists no URL")
    for u in urls:
        if not u.startswith(("http://", "https://")):
            raise UrlFileError(f"rollout.server.urls_file {str(p)!r}: {u!r} is not an http(s) "
                               "URL")
    return urls
