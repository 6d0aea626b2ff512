"""``megatron-entropy <command>``: one entry point for every user-facing task."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Callable, Optional

# Errors that are the user's to fix: printed as one line, exit code 2, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (FileNotFoundError,)

# megatron-core's start-up notes that are known to be harmless, matched by the start of their
# message: fallbacks on machines without Transformer Engine/Apex, deprecations inside
# megatron-core and torch that a user cannot act on. Every other warning stays.
HARMLESS_WARNINGS = (
    (UserWarning, r"Transformer Engine and Apex are not installed"),
    (UserWarning, r"Apex is not installed"),
    (UserWarning, r"full scope is deprecated"),
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    (FutureWarning, r"`torch\.distributed\.reduce_scatter_tensor` is deprecated"),
    # On every resume, from torch.distributed.checkpoint as megatron-core calls it.
    (FutureWarning, r"`load_state_dict` is deprecated"),
    (FutureWarning, r"Please use DTensor instead and we are deprecating ShardedTensor"),
)
# A GPU hint (CUDA_DEVICE_MAX_CONNECTIONS), only noise where there is no GPU.
CPU_ONLY_HARMLESS_WARNINGS = (
    (UserWarning, r"When using async grad allreduce it is recommended to set the environment "
                  r"variable CUDA_DEVICE_MAX_CONNECTIONS"),
)
# Printed through megatron-core's logger at WARNING on every start.
HARMLESS_LOG_LINES = ("Implicit initialization of Rerun State Machine!",
                      "RerunStateMachine initialized in mode RerunMode.DISABLED")


def _keep_log_record(record) -> bool:
    return record.getMessage() not in HARMLESS_LOG_LINES


def silence_harmless_warnings() -> None:
    """Hide the known-harmless start-up lines of megatron-core (this process only)."""
    import torch

    cpu_only = () if torch.cuda.is_available() else CPU_ONLY_HARMLESS_WARNINGS
    for category, message in HARMLESS_WARNINGS + cpu_only:
        warnings.filterwarnings("ignore", message=message, category=category)
    logging.getLogger("megatron.core.rerun_state_machine").addFilter(_keep_log_record)


def _user_errors() -> tuple[type[BaseException], ...]:
    from megatron_entropy.config import ConfigError
    from megatron_entropy.data import DatasetError
    from megatron_entropy.models.arch import UnsupportedModelError
    from megatron_entropy.runtime import ParallelLayoutError

    return USER_ERRORS + (ConfigError, DatasetError, UnsupportedModelError, ParallelLayoutError)


# ------------------------------------------------------------------------------------ train


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (examples/quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides: algorithm.loss=kl_cov ...")
    p.add_argument("--nproc", type=int, default=None,
                   help="processes to start on this machine when not under torchrun/srun "
                        "(default: parallel.tensor x parallel.pipeline)")


def _spawn_local(args: argparse.Namespace, nproc: int, run_dir: Path) -> int:
    """Start ``nproc`` ranks of this command on this machine; rank 0 prints, the others log to
    ``<run_dir>/logs/rank_N.log``. The first rank to fail stops the rest."""
    import socket
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_entropy.cli", "train", args.config, *args.overrides]
    procs = []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": os.environ.get(
                   "OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))}
        out = None if rank == 0 else open(run_dir / "logs" / f"rank_{rank}.log", "w")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT
                                      if out else None))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code = 0
    while procs and any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed:
            code = failed[0].returncode
            time.sleep(5)  # let the others fail on their own (their messages are clearer)
            for p in procs:
                if p.poll() is None:
                    p.terminate()
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    codes = [p.returncode for p in procs]
    if code == 0:
        code = next((c for c in codes if c != 0), 0)
    if code not in (0, 75):
        bad = [r for r, c in enumerate(codes) if c != 0]
        print(f"ranks {bad} exited with {[codes[r] for r in bad]}; logs of ranks > 0 are in "
              f"{run_dir / 'logs'}", file=sys.stderr)
    return code


def _run_train(args: argparse.Namespace) -> int:
    from megatron_entropy.trainer import preemption

    preemption.install()  # first: a USR1/TERM during the minutes of start-up is held, not fatal
    from megatron_entropy.config import load_config
    from megatron_entropy.runtime import check_layout, detect_launch_env

    silence_harmless_warnings()

    cfg = load_config(args.config, args.overrides)
    launch = detect_launch_env()
    tp, pp = cfg.parallel.tensor, cfg.parallel.pipeline
    if launch.launcher == "single":
        nproc = args.nproc or tp * pp
        check_layout(nproc, tp, pp)
        if nproc > 1:
            return _spawn_local(args, nproc, cfg.run_dir)
    check_layout(launch.world_size, tp, pp)
    from megatron_entropy.trainer.loop import train

    train(cfg)
    return 0


# ------------------------------------------------------------------------------------ table


def _commands() -> dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                                   Callable[[argparse.Namespace], int]]]:
    """name -> (help, add_arguments, run). Each run imports its module lazily (fast --help)."""
    return {
        "train": ("run (or resume) an RL job from a YAML config", _add_train_args, _run_train),
        "plan": importlib.import_module("megatron_entropy.plan").PLAN,
        "plot": importlib.import_module("megatron_entropy.analysis.commands").PLOT,
        "fit": importlib.import_module("megatron_entropy.analysis.commands").FIT,
        "study": importlib.import_module("megatron_entropy.analysis.commands").STUDY,
    }


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="megatron-entropy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _commands()
    for name, (help_text, add_args, _) in commands.items():
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        return commands[args.command][2](args) or 0
    except _user_errors() as e:
        print(f"megatron-entropy {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
