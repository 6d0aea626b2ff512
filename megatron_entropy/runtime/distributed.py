"""Start torch.distributed and Megatron's parallel state for a TP x PP x DP layout."""

from __future__ import annotations

import datetime
import random
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron_entropy.runtime import cpu_compat
from megatron_entropy.runtime.launch_env import LaunchEnv, detect_launch_env


class ParallelLayoutError(ValueError):
    pass


def check_layout(world_size: int, tensor: int, pipeline: int) -> int:
    """Return the data-parallel size, or raise naming the config keys if the world does not factor."""
    if tensor < 1 or pipeline < 1:
        raise ParallelLayoutError(
            f"parallel.tensor={tensor} and parallel.pipeline={pipeline} must both be >= 1")
    if world_size % (tensor * pipeline):
        raise ParallelLayoutError(
            f"world size {world_size} is not divisible by parallel.tensor x parallel.pipeline = "
            f"{tensor} x {pipeline} = {tensor * pipeline}; use a world size that is a multiple of "
            f"{tensor * pipeline} or change the layout")
    return world_size // (tensor * pipeline)


def pick_backend(requested: str = "auto") -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("parallel.backend=nccl needs CUDA, which is not available here; use gloo")
    return requested


def init_distributed(tensor: int = 1, pipeline: int = 1, backend: str = "auto",
                     timeout_minutes: float = 30.0, launch: Optional[LaunchEnv] = None,
                     init_method: Optional[str] = None) -> LaunchEnv:
    """Join the job (torchrun, srun or one process), then build Megatron's TP/PP/DP groups.

    On a machine without CUDA the CPU compatibility layer is applied first.
    """
    launch = launch or detect_launch_env()
    check_layout(launch.world_size, tensor, pipeline)
    backend = pick_backend(backend)
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank % torch.cuda.device_count())
    else:
        cpu_compat.apply()
    if not dist.is_initialized():
        dist.init_process_group(
            backend=backend,
            init_method=init_method or f"tcp://{launch.master_addr}:{launch.master_port}",
            rank=launch.rank, world_size=launch.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes))
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor, pipeline_model_parallel_size=pipeline)
    return launch


def set_seed(seed: int) -> None:
    """Seed python, numpy, torch and Megatron's model-parallel RNG tracker.

    Megatron's tracker gives every TP rank a different stream for TP-split dropout and the same
    stream for replicated parts; it must be seeded even when dropout is off.
    """
    from megatron.core import tensor_parallel

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def shutdown() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0
