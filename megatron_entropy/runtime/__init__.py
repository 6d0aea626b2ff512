"""Distributed start-up, Megatron parallel state, seeding and the CPU compatibility layer."""

from megatron_entropy.runtime.distributed import (ParallelLayoutError, check_layout,
                                                  init_distributed, set_seed, shutdown)
from megatron_entropy.runtime.launch_env import LaunchEnv, detect_launch_env, expand_nodelist

__all__ = ["LaunchEnv", "ParallelLayoutError", "check_layout", "detect_launch_env",
           "expand_nodelist", "init_distributed", "set_seed", "shutdown"]
