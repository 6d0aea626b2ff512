"""Distributed start-up, Megatron parallel state, seeding, the CPU compatibility layer and child
processes that die with their parent (processes.py).

The torch-bound parts (runtime/distributed.py) load on first use, so that the Slurm helpers
(`megatron-entropy slurm layout / wait-servers`, launch/slurm.py) start without torch."""

from megatron_entropy.runtime.launch_env import (LaunchEnv, ParallelLayoutError, check_layout,
                                                 detect_launch_env, expand_nodelist,
                                                 min_world_size)

__all__ = ["LaunchEnv", "ParallelLayoutError", "check_layout", "detect_launch_env",
           "expand_nodelist", "init_distributed", "min_world_size", "set_seed", "shutdown"]

_DISTRIBUTED = ("init_distributed", "set_seed", "shutdown")


def __getattr__(name: str):
    if name in _DISTRIBUTED:
        from megatron_entropy.runtime import distributed

        return getattr(distributed, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
