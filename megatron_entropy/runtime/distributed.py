"""Start torch.distributed and Megatron's parallel state for a TP x PP x CP x DP layout."""

from __future__ import annotations

import datetime
import os
import random
import socket
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_entropy.runtime import cpu_compat
from megatron_entropy.runtime.launch_env import (LaunchEnv, check_layout, detect_launch_env,
                                                  raise_open_files_limit)
from megatron_entropy.settings import ConfigError


def pick_backend(requested: str = "auto", launch: Optional[LaunchEnv] = None) -> str:
    """nccl where CUDA is, else gloo. Under Slurm, ``auto`` without a visible CUDA device is an
    error: on a GPU cluster it means the step got no GPU (a job that asked for none, or GPUs that
    came only with --exclusive on a site with ConstrainDevices=yes), and training on the CPU
    instead would be silent and hopeless; a CPU run says parallel.backend=gloo."""
    if requested == "auto":
        if torch.cuda.is_available():
            return "nccl"
        if launch is not None and launch.launcher == "slurm":
            raise ConfigError(
                "parallel.backend=auto, but this Slurm task (rank "
                f"{launch.rank}, node {os.environ.get('SLURMD_NODENAME', '?')}) sees no CUDA "
                f"device: CUDA_VISIBLE_DEVICES={_env_or_unset('CUDA_VISIBLE_DEVICES')}, "
                f"SLURM_STEP_GPUS={_env_or_unset('SLURM_STEP_GPUS')}. Request GPUs on the job "
                "and on every step (sbatch/srun --gpus-per-node=N or --gres=gpu:N; the slurm/ "
                "scripts do it on each step), or set parallel.backend=gloo to train on CPUs")
        return "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("parallel.backend=nccl needs CUDA, which is not available here; use gloo")
    return requested


def _env_or_unset(name: str) -> str:
    value = os.environ.get(name)
    return "(unset)" if value is None else repr(value)


def init_distributed(tensor: int = 1, pipeline: int = 1, backend: str = "auto",
                     timeout_minutes: float = 30.0, launch: Optional[LaunchEnv] = None,
                     init_method: Optional[str] = None,
                     socket_ifname: Optional[str] = None, expert: int = 1,
                     context: int = 1) -> LaunchEnv:
    """Join the job (torchrun, srun or one process), then build Megatron's TP/PP/CP/DP groups
    (``context`` ranks split each sequence; the expert-parallel groups: ``expert`` ranks of the
    DP x CP ranks share out the experts).

    On a machine without CUDA the CPU compatibility layer is applied first. ``socket_ifname``
    (parallel.socket_ifname) becomes NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME: the interface
    whose address NCCL's bootstrap and gloo's sockets use instead of what the host name resolves
    to (often 127.0.1.1, or a management network). A job on one node listens on loopback only:
    rank 0's store on the master address, NCCL's and gloo's sockets on ``lo`` (unless
    socket_ifname or the variables say otherwise). The open-files soft limit is raised to the
    hard limit.
    """
    launch = launch or detect_launch_env()
    check_layout(launch.world_size, tensor, pipeline, expert, context)
    backend = pick_backend(backend, launch)
    raise_open_files_limit()
    if socket_ifname:
        os.environ["NCCL_SOCKET_IFNAME"] = os.environ["GLOO_SOCKET_IFNAME"] = socket_ifname
    elif launch.single_node:
        os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    else:
        cpu_compat.apply()
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store = None if init_method else job_store(launch, timeout)
        dist.init_process_group(
            backend=backend, store=store,
            init_method=None if store else (
                init_method or f"tcp://{launch.master_addr}:{launch.master_port}"),
            rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    # No gloo copies of the DP groups: nothing of ours uses them (the optimizer is built with
    # use_gloo_process_groups=False), and each is one more gloo group per rank, bound to whatever
    # the host name resolves to.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline,
        context_parallel_size=context, expert_model_parallel_size=expert,
        create_gloo_process_groups=False)
    return launch


def job_store(launch: LaunchEnv, timeout: datetime.timedelta) -> Optional[dist.TCPStore]:
    """The c10d store of a job on one node, its server on rank 0 listening on the master
    address only; None (torch's own rendezvous) for a job across nodes or under torchrun's
    agent, which hosts the store itself.

    torch's TCPStore binds its port on every interface (``[::]``, IPv4 and IPv6) whatever host
    it is given; only a socket bound here and handed over (master_listen_fd) limits that."""
    if not launch.single_node or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return None
    if launch.rank != 0:
        return dist.TCPStore(launch.master_addr, launch.master_port, launch.world_size,
                             is_master=False, timeout=timeout)
    family, kind, proto, _, address = socket.getaddrinfo(
        launch.master_addr, launch.master_port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as e:
        listener.close()
        raise RuntimeError(f"rank 0 cannot listen on {launch.master_addr}:{launch.master_port} "
                           f"(MASTER_ADDR:MASTER_PORT): {e}") from e
    listener.listen(max(128, launch.world_size))
    port = listener.getsockname()[1]
    # The store owns the socket from here (it closes it when it is destroyed).
    return dist.TCPStore(launch.master_addr, port, launch.world_size, is_master=True,
                         timeout=timeout, master_listen_fd=listener.detach())


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's model-parallel RNG tracker.

    Megatron's tracker gives every TP rank a different stream for TP-split dropout and the same
    stream for replicated parts; it must be seeded even when dropout is off.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()



def means_over_group(sums: dict[str, tuple[float, float]], group) -> dict[str, float]:
    """Each key's (sum, count) added up over the ranks of ``group`` (None, or one rank: this
    one's), then divided: the mean over every rank's items; keys without items are left out.
    Every rank of the group calls it and gets the same dict."""
    parts: list = [dict(sums)]
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, dict(sums), group=group)
    total: dict[str, list[float]] = {}
    for part in parts:  # rank order: the same sums on every rank
        for key, (value, count) in part.items():
            t = total.setdefault(key, [0.0, 0.0])
            t[0] += value
            t[1] += count
    return {key: value / count for key, (value, count) in sorted(total.items()) if count > 0}
