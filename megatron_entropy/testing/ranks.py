"""Forked gloo ranks on one machine, for tests and benchmarks.

A process that has already imported megatron (the pytest process through tests/conftest.py, a
benchmark at its top) forks its ranks in ~0.3 s instead of the ~8 s of a fresh interpreter. A
failing rank's traceback is raised in the caller; a rank that hangs is killed after ``timeout``
seconds, with every rank's Python stack dumped to stderr first.
"""

from __future__ import annotations

import faulthandler
import gc
import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

import psutil
import torch

from megatron_entropy.runtime.distributed import init_distributed, set_seed


def free_port() -> int:
    """A TCP port on the loopback interface that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, results, timeout, args, kwargs):
    status, payload = "error", None
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        # Dump this rank's stack shortly before the parent gives up on it.
        faulthandler.dump_traceback_later(max(timeout - 3, 1), exit=False)
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        out = fn(*args, **kwargs)
        buf = io.BytesIO()
        torch.save(out, buf)
        status, payload = "ok", buf.getvalue()
    except BaseException:  # noqa: BLE001 - everything goes back to the caller
        payload = f"rank {rank} failed:\n{traceback.format_exc()}"
    finally:
        results.put((rank, status, payload))
        results.close()
        results.join_thread()
        sys.stdout.flush()
        sys.stderr.flush()
        # os._exit skips multiprocessing's finalizers: helper processes this rank started (the
        # spawn Manager and resource tracker of dist_checkpointing saves) would outlive it and
        # hold pytest's output pipe open.
        for child in psutil.Process().children(recursive=True):
            child.kill()
        os._exit(0)


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120,
                    **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` forked gloo ranks; return the results by rank.

    ``fn`` runs with torch.distributed initialised (RANK etc. set); it returns anything torch.save
    can write. Raises AssertionError with the first failing rank's traceback, or on timeout.
    """
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    # Not daemonic: dist_checkpointing starts helper processes inside a rank.
    procs = [ctx.Process(target=_worker, daemon=False,
                         args=(fn, r, world_size, port, results, timeout, args, kwargs))
             for r in range(world_size)]
    # The ranks inherit this process's objects (~440k in pytest: megatron, transformers, the
    # models of module fixtures). Frozen, their garbage collector never walks them: each
    # collection of a rank would otherwise touch, and so copy, the whole inherited heap
    # (measured: a rank that collects once costs 0.44 s of CPU instead of 0.035 s). This process
    # unfreezes at once and collects as before.
    gc.freeze()
    try:
        for p in procs:
            p.start()
    finally:
        gc.unfreeze()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs))
                raise AssertionError(f"ranks {missing} did not finish within {timeout} s "
                                     "(stacks dumped to stderr)")
            try:
                rank, status, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in outputs]
                if dead and results.empty():
                    time.sleep(0.2)
                    if results.empty():
                        raise AssertionError(f"ranks {dead} died without reporting "
                                             f"(exit codes {[procs[r].exitcode for r in dead]})")
                continue
            if status != "ok":
                raise AssertionError(payload)
            outputs[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                p.kill()
                p.join()
    return [outputs[r] for r in range(world_size)]


def init_megatron(tensor: int = 1, pipeline: int = 1, seed: int = 1234, expert: int = 1,
                  context: int = 1) -> None:
    """Inside a rank of ``run_distributed``: Megatron parallel state on the already-initialised
    gloo group, seeded."""
    init_distributed(tensor=tensor, pipeline=pipeline, backend="gloo", expert=expert,
                     context=context)
    set_seed(seed)
