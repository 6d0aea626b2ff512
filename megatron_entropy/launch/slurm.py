"""The Slurm side of a run: which nodes serve rollouts and which train, and the server URL file.

The sbatch scripts in slurm/ call it through the CLI; each command reads the same config as the
trainer:

    megatron-entropy slurm layout CONFIG [overrides]   # KEY=VALUE lines to eval
    megatron-entropy slurm serve CONFIG [overrides]    # one server (a task)
    megatron-entropy slurm wait-servers --urls-dir D --count N --out FILE

A disaggregated job gives its first ``cluster.server_nodes`` nodes to rollout servers
(``servers_per_node`` servers of ``server_gpus`` GPUs each) and the rest to the trainer (one task
per GPU); ``layout`` also says how many GPUs per node each step asks for. Each server task writes
its URL to ``urls-dir/<index>`` once it answers /health; ``wait-servers`` gathers them into the
file the trainer reads (``rollout.server.urls_file``). A server task ignores SIGTERM and SIGUSR1
(preemption and the time-limit warning are the trainer's) and stops on SIGUSR2 from the script.
"""

from __future__ import annotations

import argparse
import dataclasses
import fcntl
import functools
import ipaddress
import math
import os
import shlex
import signal
import socket
import struct
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Sequence

from megatron_entropy.config import Config, ConfigError, load_config
from megatron_entropy.runtime.launch_env import (ParallelLayoutError, check_layout,
                                                 expand_nodelist, healthy, read_urls_file,
                                                 server_environment)
from megatron_entropy.runtime.files import write_text_atomic
from megatron_entropy.runtime.processes import die_with_parent


class NotEnoughNodesError(ValueError):
    """The job holds fewer nodes than the config needs."""


@dataclass(frozen=True)
class JobLayout:
    server_nodes: list[str]  # where the server step runs (the first trainer node when shared)
    trainer_nodes: list[str]
    servers_per_node: int
    server_gpus: int
    trainer_tasks_per_node: int
    shared: bool  # servers run beside the trainer on its first node

    @property
    def num_servers(self) -> int:
        return len(self.server_nodes) * self.servers_per_node

    @property
    def trainer_tasks(self) -> int:
        return len(self.trainer_nodes) * self.trainer_tasks_per_node


def min_trainer_nodes(tensor: int, pipeline: int, gpus_per_node: int) -> int:
    """The fewest nodes that hold one model replica (TP x PP GPUs)."""
    return math.ceil(tensor * pipeline / gpus_per_node)


def split_nodes(nodes: Sequence[str], server_nodes: int, trainer_nodes_needed: int,
                what: str = "") -> tuple[list[str], list[str]]:
    """First ``server_nodes`` nodes serve, the rest train; raise if fewer than needed remain."""
    needed = server_nodes + trainer_nodes_needed
    if len(nodes) < needed:
        raise NotEnoughNodesError(
            f"the job has {len(nodes)} node{'s' if len(nodes) != 1 else ''} "
            f"({', '.join(nodes) or 'none'}) but the config needs {needed}: {server_nodes} for "
            f"rollout servers (cluster.server_nodes) + {trainer_nodes_needed} for the trainer"
            f"{' (' + what + ')' if what else ''}; submit with --nodes={needed} or more")
    return list(nodes[:server_nodes]), list(nodes[server_nodes:])


def script_starts_servers(cfg: Config) -> bool:
    """Servers are the job's to start: a server engine with neither fixed URLs nor self-launch."""
    s = cfg.rollout.server
    return cfg.rollout.engine != "inprocess" and not s.urls and s.launch == 0


def job_layout(cfg: Config, nodes: Sequence[str]) -> JobLayout:
    """Split the job's nodes for this config. A mistake raises ConfigError, ParallelLayoutError
    or NotEnoughNodesError, naming the config keys."""
    c, p = cfg.cluster, cfg.parallel
    servers = script_starts_servers(cfg)
    if c.server_nodes and not servers:
        raise ConfigError(
            f"cluster.server_nodes={c.server_nodes} but no servers are started by the job "
            f"(rollout.engine={cfg.rollout.engine}, rollout.server.urls or .launch set); "
            "set cluster.server_nodes=0")
    if p.tensor > c.gpus_per_node:
        raise ParallelLayoutError(
            f"parallel.tensor={p.tensor} exceeds cluster.gpus_per_node={c.gpus_per_node}: tensor "
            "parallelism must stay inside a node")
    if c.server_gpus > c.gpus_per_node:
        raise ConfigError(f"cluster.server_gpus={c.server_gpus} exceeds cluster.gpus_per_node="
                          f"{c.gpus_per_node}: one server must fit on a node")
    per_node = c.servers_per_node or (c.gpus_per_node // c.server_gpus if c.server_nodes else 1)
    if c.server_nodes and per_node * c.server_gpus > c.gpus_per_node:
        raise ConfigError(
            f"cluster.servers_per_node={per_node} x cluster.server_gpus={c.server_gpus} GPUs "
            f"exceeds cluster.gpus_per_node={c.gpus_per_node}")
    need = min_trainer_nodes(p.tensor, p.pipeline * p.context, c.gpus_per_node)
    model = (f"TP x PP x CP = {p.tensor} x {p.pipeline} x {p.context}" if p.context > 1
             else f"TP x PP = {p.tensor} x {p.pipeline}")
    server_nodes, trainer_nodes = split_nodes(
        nodes, c.server_nodes, need, f"{model} GPUs at {c.gpus_per_node} GPUs per node")
    check_layout(len(trainer_nodes) * c.gpus_per_node, p.tensor, p.pipeline,
                 context=p.context)
    shared = servers and not c.server_nodes
    return JobLayout(server_nodes=trainer_nodes[:1] if shared else server_nodes,
                     trainer_nodes=trainer_nodes, servers_per_node=per_node if servers else 0,
                     server_gpus=c.server_gpus, trainer_tasks_per_node=c.gpus_per_node,
                     shared=shared)


def job_gpus_on_node(env: Optional[dict[str, str]] = None) -> int:
    """The job's GPUs on this node (the batch script's): SLURM_JOB_GPUS, else SLURM_GPUS_ON_NODE;
    0 when the job holds none."""
    env = os.environ if env is None else env
    ids = env.get("SLURM_JOB_GPUS", "")
    return len(ids.split(",")) if ids else int(env.get("SLURM_GPUS_ON_NODE") or 0)


def step_gpus(cfg: Config, layout: JobLayout, job_gpus: int) -> tuple[int, int]:
    """GPUs per node that the trainer step and the server step ask for (srun --gpus-per-node).

    A step gets only the GPUs it asks for: GPUs that came with the job's --exclusive alone are
    not handed to its steps (and with ConstrainDevices=yes the tasks then see no device at all),
    so every step asks whenever the job holds GPUs. ``job_gpus`` is the job's count on a node;
    0 is a CPU job, whose steps ask for none and whose trainer must say parallel.backend=gloo.
    """
    c = cfg.cluster
    if not job_gpus:
        if cfg.parallel.backend != "gloo":
            raise ConfigError(
                f"the job holds no GPUs (SLURM_JOB_GPUS is not set) but parallel.backend="
                f"{cfg.parallel.backend} trains on GPUs: submit with --gpus-per-node="
                f"{c.gpus_per_node} (or --gres=gpu:{c.gpus_per_node}), or set "
                "parallel.backend=gloo for a CPU run")
        return 0, 0
    if job_gpus < c.gpus_per_node:
        raise ConfigError(
            f"the job holds {job_gpus} GPU(s) per node but cluster.gpus_per_node="
            f"{c.gpus_per_node} (one trainer task per GPU): submit with --gpus-per-node="
            f"{c.gpus_per_node} or set cluster.gpus_per_node={job_gpus}")
    return c.gpus_per_node, layout.servers_per_node * layout.server_gpus


def layout_shell(cfg: Config, nodes: Sequence[str], job_gpus: int) -> str:
    """``KEY=value`` lines (shell-quoted) for the sbatch scripts to ``eval``; ``job_gpus`` is the
    job's GPU count per node (job_gpus_on_node)."""
    layout = job_layout(cfg, nodes)
    trainer_step_gpus, server_step_gpus = step_gpus(cfg, layout, job_gpus)
    run_dir = cfg.run_dir.resolve()
    # Config validation makes a server engine without urls/launch name its urls_file.
    urls_file = Path(cfg.rollout.server.urls_file or run_dir / "server_urls.txt").resolve()
    values = {
        "RUN_DIR": run_dir,
        "LOG_DIR": run_dir / "logs",
        "ENGINE": cfg.rollout.engine,
        "START_SERVERS": int(layout.num_servers > 0),
        "SHARED_NODE": int(layout.shared),
        "SERVER_NODELIST": ",".join(layout.server_nodes) if layout.num_servers else "",
        "NUM_SERVER_NODES": len(layout.server_nodes) if layout.num_servers else 0,
        "SERVERS_PER_NODE": layout.servers_per_node,
        "NUM_SERVERS": layout.num_servers,
        "SERVER_GPUS": layout.server_gpus,
        "STARTUP_TIMEOUT": int(cfg.rollout.server.startup_timeout_s),
        "URLS_FILE": urls_file,
        "URLS_DIR": urls_file.parent / (urls_file.name + ".d"),
        "TRAINER_NODELIST": ",".join(layout.trainer_nodes),
        "NUM_TRAINER_NODES": len(layout.trainer_nodes),
        "TRAINER_TASKS_PER_NODE": layout.trainer_tasks_per_node,
        "TRAINER_TASKS": layout.trainer_tasks,
        "TRAINER_STEP_GPUS": trainer_step_gpus,
        "SERVER_STEP_GPUS": server_step_gpus if layout.num_servers else 0,
    }
    return "".join(f"{k}={shlex.quote(str(v))}\n" for k, v in values.items())


# ------------------------------------------------------------------------------------- URL files


def write_url(urls_dir: os.PathLike, index: int, url: str) -> Path:
    """Publish one server's URL atomically (readers never see half a line)."""
    d = Path(urls_dir)
    d.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(d / str(index), url + "\n")


def write_urls_file(path: os.PathLike, urls: Sequence[str]) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(p, "".join(u + "\n" for u in urls))


def all_healthy(urls: Sequence[str], timeout: float = 5.0) -> bool:
    """Whether every URL answers /health, asked all at once: a dead node costs one timeout,
    not one per server."""
    if not urls:
        return True
    with ThreadPoolExecutor(max_workers=min(len(urls), 64)) as pool:
        return all(pool.map(lambda u: healthy(u, timeout), urls))


def wait_for_servers(urls_dir: os.PathLike, count: int, out: os.PathLike, timeout: float,
                     alive: Callable[[], bool] = lambda: True, poll_s: float = 1.0) -> list[str]:
    """Wait until ``count`` servers published a URL and answer /health; write them to ``out``.

    ``alive`` says whether the server step still runs: a step that died fails at once instead of
    after the whole timeout.
    """
    d = Path(urls_dir)
    deadline = time.monotonic() + timeout
    while True:
        files = sorted((f for f in d.glob("*") if f.name.isdigit()), key=lambda f: int(f.name)) \
            if d.is_dir() else []
        urls = [f.read_text().strip() for f in files]
        if len(urls) >= count and all_healthy(urls):
            return read_urls_file(write_urls_file(out, urls))
        if not alive():
            raise RuntimeError(f"the server step ended before {count} servers came up "
                               f"({len(urls)} did); see the server logs")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(urls)} of {count} servers came up within {timeout:.0f} s; "
                               "see the server logs")
        time.sleep(poll_s)


# ------------------------------------------------------------------------------------- one server


def _visible_gpus(local_id: int, gpus: int, gpus_per_node: int) -> Optional[str]:
    """The CUDA_VISIBLE_DEVICES of server ``local_id`` on its node (None: leave as it is)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(gpus_per_node)]
    if len(devices) == gpus:  # Slurm bound this task to its own GPUs already
        return None
    mine = devices[local_id * gpus:(local_id + 1) * gpus]
    if len(mine) < gpus:
        raise RuntimeError(f"server {local_id} needs GPUs {local_id * gpus}..."
                           f"{(local_id + 1) * gpus - 1} but the node shows {len(devices)}")
    return ",".join(mine)


def server_command(cfg: Config, host: str, port: int) -> tuple[list[str], dict[str, str]]:
    """Command line and extra environment of one rollout server for ``rollout.engine``.

    The engines' own ``server_argv`` (rollout/server/vllm.py, rollout/server/sglang.py) builds
    the argv, so a server started by Slurm runs with exactly the flags of one the engine starts
    itself (vLLM's processed log-probs, SGLang's weight version). The server's tensor parallel
    size is ``cluster.server_gpus``.
    ``rollout.server.extra_env`` is read by the parser of the servers the engines launch
    themselves, so both kinds get the same environment (and an item without ``=`` is an error).
    """
    # Here, not at the top: the engines import torch, and `layout`/`wait-servers` start without.
    from megatron_entropy.rollout.server import sglang, vllm
    from megatron_entropy.rollout.server.process import parse_extra_env

    s = dataclasses.replace(cfg.rollout.server, host=host)
    if cfg.rollout.weight_sync.strategy == "adapters":  # vLLM: the adapters load at every sync
        s = vllm.lora_serving(s, cfg.model.lora.rank)
    tp = cfg.cluster.server_gpus
    env = parse_extra_env(s.extra_env)
    if cfg.rollout.engine == "vllm":
        argv = vllm.server_argv(s, cfg.model.hf_path, port)
        env = vllm.server_env(env)  # the weight reload endpoints; AMX permission on CPU
        tp_flag = ["--tensor-parallel-size", str(tp)]
    elif cfg.rollout.engine == "sglang":
        argv = sglang.server_argv(s, cfg.model.hf_path, port)
        tp_flag = ["--tp-size", str(tp)]
    else:
        raise ConfigError(f"rollout.engine={cfg.rollout.engine} has no server to start")
    return argv + (tp_flag if tp > 1 and not s.launch_command else []), env


# The signal that stops a server task: the job script sends it to the server step's srun, which
# forwards it to every task as it is. Not SIGTERM: Slurm sends SIGTERM to every task of every step
# when a preemption's grace time begins, and the servers must keep serving the step the trainer
# finishes before its checkpoint; not SIGINT, which srun takes for its own Ctrl-C handling.
STOP_SIGNAL = signal.SIGUSR2
SERVER_STOP_GRACE_S = 20.0  # then the server's process group gets SIGKILL


def _server_process_setup(task_pid: int) -> None:
    """In the server process, before exec: keep SIGTERM and SIGUSR1 blocked (proctrack/linuxproc
    signals a task's whole process tree, and the serving stacks install handlers that stop on TERM;
    a blocked signal stays pending and never reaches them), and die with this task (SIGKILL on the
    parent's death) so that no server outlives its step."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    die_with_parent(signal.SIGKILL, task_pid)


SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def interface_address(ifname: str) -> str:
    """The IPv4 address of network interface ``ifname`` (e.g. ib0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR,
                                 struct.pack("256s", ifname.encode()[:15]))
        except OSError as e:
            raise ConfigError(f"parallel.socket_ifname={ifname!r}: no IPv4 address on that "
                              f"interface ({e})") from e
    return socket.inet_ntoa(packed[20:24])


def server_bind_address(cfg: Config, node: str, job_nodes: int) -> tuple[str, str]:
    """(address the server listens on, host in its published URL).

    A job on one node serves on loopback. Across nodes, the address the other nodes reach: that
    of parallel.socket_ifname when it names one interface, else what the node's name resolves to
    here; a name that resolves to loopback here (127.0.1.1 on Debian-style hosts) while the job
    spans nodes cannot be bound for the others, and the server listens on every interface then.
    """
    if job_nodes <= 1:
        return "127.0.0.1", "127.0.0.1"
    ifname = cfg.parallel.socket_ifname
    if ifname and not any(c in ifname for c in ",^="):
        address = interface_address(ifname)
        return address, address
    try:
        address = socket.gethostbyname(node)
    except OSError:
        return "0.0.0.0", node
    if ipaddress.ip_address(address).is_loopback:
        return "0.0.0.0", node
    return address, node


def serve(cfg: Config, urls_dir: os.PathLike, task: int, local_id: int,
          node: Optional[str] = None) -> int:
    """Run one rollout server in the foreground; publish its URL once it answers /health.

    Stops on STOP_SIGNAL (or SIGINT): SIGINT to the server, SIGKILL after SERVER_STOP_GRACE_S;
    returns 0 then. SIGTERM and SIGUSR1 are ignored (preemption and the time-limit warning are the
    trainer's to act on). Any other end of the server is a failure (non-zero).
    """
    # Here, not at the top: the server modules import torch (see server_command).
    from megatron_entropy.rollout.server.process import (kill_process_group, start_process,
                                                         wait_healthy)

    s = cfg.rollout.server
    port = s.base_port + local_id
    node = node or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    bind, url_host = server_bind_address(cfg, node, int(os.environ.get("SLURM_JOB_NUM_NODES")
                                                        or os.environ.get("SLURM_NNODES") or 1))
    cmd, extra_env = server_command(cfg, bind, port)
    env = server_environment(extra_env)
    gpus = _visible_gpus(local_id, cfg.cluster.server_gpus, cfg.cluster.gpus_per_node)
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    print(f"[serve {task}] {node}:{port} (listening on {bind}) GPUs "
          f"{gpus or env.get('CUDA_VISIBLE_DEVICES', '-')}: {shlex.join(cmd)}", flush=True)

    def ignored(signum: int, frame: object) -> None:
        print(f"[serve {task}] {signal.Signals(signum).name} ignored: the job script stops the "
              f"servers ({STOP_SIGNAL.name})", flush=True)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, ignored)
    stop_requested: list[int] = []
    # The handler only takes note: the stop itself (a blocking wait) runs in the loop below.
    for sig in (STOP_SIGNAL, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_requested.append(signum))
    proc = start_process(cmd, {}, None, "slurm task", f"server task {task}", env=env,
                         preexec_fn=functools.partial(_server_process_setup, os.getpid()))
    url = f"http://{url_host}:{port}"
    try:
        state = wait_healthy(proc, url, s.startup_timeout_s, lambda: bool(stop_requested))
        if state == "up":
            write_url(urls_dir, task, url)
            print(f"[serve {task}] ready at {url}", flush=True)
            while proc.poll() is None and not stop_requested:
                time.sleep(0.5)
        elif state == "timeout":
            print(f"[serve {task}] no answer on {url}/health within "
                  f"{s.startup_timeout_s:.0f} s", flush=True)
    finally:
        # SIGINT is the serving stacks' clean stop; what is left of the group gets SIGKILL.
        kill_process_group(proc, SERVER_STOP_GRACE_S, first=signal.SIGINT)
        proc.wait()
    if stop_requested and state != "timeout":
        return 0
    print(f"[serve {task}] the server exited with {proc.returncode}", flush=True)
    return proc.returncode if proc.returncode and proc.returncode > 0 else 1


# ------------------------------------------------------------------------------------- CLI


def add_slurm_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="slurm_command", required=True,
                           metavar="{layout,serve,wait-servers}")
    lay = sub.add_parser("layout", help="print the job's node split as KEY=value lines")
    lay.add_argument("config")
    lay.add_argument("overrides", nargs="*")
    lay.add_argument("--nodelist", default=os.environ.get("SLURM_JOB_NODELIST"),
                     help="Slurm node list (default: $SLURM_JOB_NODELIST)")
    lay.add_argument("--job-gpus", type=int, default=job_gpus_on_node(),
                     help="the job's GPUs per node (default: from $SLURM_JOB_GPUS)")
    srv = sub.add_parser("serve", help="run one rollout server (one srun task)")
    srv.add_argument("config")
    srv.add_argument("overrides", nargs="*")
    srv.add_argument("--urls-dir", required=True)
    wait = sub.add_parser("wait-servers", help="wait for the servers; write the URL file")
    wait.add_argument("--urls-dir", required=True)
    wait.add_argument("--count", type=int, required=True)
    wait.add_argument("--out", required=True)
    wait.add_argument("--timeout", type=float, default=600.0)
    wait.add_argument("--pid", type=int, help="the server step's srun: fail early if it ends")


def run_slurm(args: argparse.Namespace) -> int:
    """One helper of the sbatch scripts; a mistake prints ``error: ...`` and returns 1."""
    try:
        if args.slurm_command == "layout":
            if not args.nodelist:
                raise NotEnoughNodesError("no node list: run inside a Slurm job or pass --nodelist")
            cfg = load_config(args.config, args.overrides)
            sys.stdout.write(layout_shell(cfg, expand_nodelist(args.nodelist), args.job_gpus))
            return 0
        if args.slurm_command == "serve":
            cfg = load_config(args.config, args.overrides)
            return serve(cfg, args.urls_dir, int(os.environ.get("SLURM_PROCID", 0)),
                         int(os.environ.get("SLURM_LOCALID", 0)))
        alive = (lambda: _pid_alive(args.pid)) if args.pid else (lambda: True)
        for url in wait_for_servers(args.urls_dir, args.count, args.out, args.timeout, alive):
            print(url)
        return 0
    # ServerError (rollout/server/errors.py: a bad extra_env item) is a RuntimeError.
    except (ConfigError, ParallelLayoutError, NotEnoughNodesError, RuntimeError,
            TimeoutError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


SLURM = ("helpers of the slurm/ scripts: layout (the job's node split), serve (one rollout "
         "server), wait-servers (the URL file)", add_slurm_args, run_slurm)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # A zombie (exited, not yet reaped by the batch shell) counts as ended.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except (OSError, IndexError):
        return True
