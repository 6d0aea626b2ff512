"""CPU threads of the ranks that ``megatron-entropy train`` starts on one machine itself (a single
process, or ``--nproc N``): OpenMP threads per rank and how an idle OpenMP thread waits.

Set in the environment before torch loads (OpenMP reads it once, when the library loads), and
inherited by the ranks the launcher starts. A variable already set in the environment wins, so
``OMP_NUM_THREADS=4 OMP_WAIT_POLICY=ACTIVE megatron-entropy train ...`` overrides both.

Measured on the quickstart (bench/bench_vs_trl.py, 2 cores): with OpenMP's default wait policy an
idle thread spins for a while before it sleeps, and on a machine with any other load two
threads of a rank spin while their partner is descheduled: 10x the CPU time, a step 12x slower.
PASSIVE threads sleep at once; then 2 threads a rank cost no more than 1 on a busy machine and
are as fast on a quiet one. torch's inter-op pool is not used on this path (no thread of it is
started), so it is left alone.
"""

from __future__ import annotations

import os
from typing import MutableMapping, Optional


def thread_defaults(ranks_here: int, cpus: int) -> dict[str, str]:
    """The environment for ``ranks_here`` ranks sharing ``cpus`` cores: the cores split among
    the ranks (at least one thread each), idle threads sleeping."""
    return {"OMP_NUM_THREADS": str(max(1, cpus // max(1, ranks_here))),
            "OMP_WAIT_POLICY": "PASSIVE"}


def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask, e.g. a Slurm or container limit)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def apply_thread_defaults(ranks_here: int,
                          env: Optional[MutableMapping[str, str]] = None) -> dict[str, str]:
    """Set in ``env`` (this process's environment) each of `thread_defaults` that is not set
    there already; returns the variables it set. Call it before torch is imported."""
    env = os.environ if env is None else env
    chosen = {k: v for k, v in thread_defaults(ranks_here, usable_cpus()).items()
              if not env.get(k)}
    env.update(chosen)
    return chosen
