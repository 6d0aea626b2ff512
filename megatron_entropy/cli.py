"""``megatron-entropy <command>``: one entry point for every user-facing task."""

from __future__ import annotations

import argparse
import datetime
import importlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.models.arch import UnsupportedModelError, load_arch
from megatron_entropy.runtime import ParallelLayoutError, check_layout, detect_launch_env
from megatron_entropy.runtime.launch_env import UrlFileError
from megatron_entropy.trainer import preemption

# Torch-free above. What needs torch loads inside the function that uses it: `--help` and the
# config checks run without torch (tests/slurm/test_slurm_layout.py), and `train` loads torch
# and Megatron only after installing the preemption handler. Of the other commands' modules only
# the one named on the command line loads (the Slurm helpers start without numpy and the
# analysis modules).

# Errors that are the user's to fix: printed as one line, exit code 2, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (FileNotFoundError, ConfigError,
                                                UnsupportedModelError, ParallelLayoutError,
                                                UrlFileError)
# The same, of modules that load torch: named, not imported. A class whose module never loaded
# cannot have been raised, so a command without torch does not load it to print an error.
TORCH_USER_ERRORS = (("megatron_entropy.data.dataset", "DatasetError"),
                     ("megatron_entropy.models.megatron_checkpoint", "CheckpointError"),
                     # The engine holds other weights; a rollout server failed for good.
                     ("megatron_entropy.trainer.weight_check", "WeightCheckError"),
                     ("megatron_entropy.rollout.server.errors", "ServerError"))

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
    return USER_ERRORS + tuple(getattr(sys.modules[module], name)
                               for module, name in TORCH_USER_ERRORS if module in sys.modules)


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
        out = None if rank == 0 else _open_rank_log(run_dir / "logs" / f"rank_{rank}.log")
        procs.append(subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT
                                      if out else None))

    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    code, first = 0, None
    while procs and any(p.poll() is None for p in procs):
        failed = [p for p in procs if p.poll() not in (None, 0)]
        if failed:
            code, first = failed[0].returncode, procs.index(failed[0])
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
        cause = f"rank {first} failed first ({_exit_status(codes[first])}); " \
            if first is not None else ""
        print(f"{cause}ranks {bad} exited with {', '.join(_exit_status(codes[r]) for r in bad)}; "
              f"logs of ranks > 0 are in {run_dir / 'logs'}", file=sys.stderr)
    if code < 0:  # killed by a signal: exit as a shell reports it (128 + signal number)
        code = 128 - code
    return code


def _exit_status(code: int) -> str:
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return str(code)


def _open_rank_log(path: Path):
    """Rank logs are appended to, after a line that marks this start: a failed attempt's log
    stays for the next start to read."""
    log = path.open("a")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    log.write(f"===== megatron-entropy train started {stamp} =====\n")
    log.flush()
    return log


def _run_train(args: argparse.Namespace) -> int:
    preemption.install()  # first: a USR1/TERM during the minutes of start-up is held, not fatal
    silence_harmless_warnings()

    cfg = load_config(args.config, args.overrides)
    launch = detect_launch_env()
    tp, pp, ep = cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert
    _check_model(cfg)  # before any rank starts
    if launch.launcher == "single":
        nproc = args.nproc or tp * pp * ep
        check_layout(nproc, tp, pp, ep)
        if nproc > 1:
            return _spawn_local(args, nproc, cfg.run_dir)
    check_layout(launch.world_size, tp, pp, ep)
    from megatron_entropy.trainer.loop import train

    train(cfg)
    return 0


def _check_model(cfg) -> None:
    """The model the run will train, checked from its files before any rank starts: its
    architecture against parallel.tensor/pipeline and (HF weights) every tensor's name and shape
    against config.json, from the safetensors headers only."""
    from megatron_entropy.models.bridge import check_hf_checkpoint
    from megatron_entropy.models.hf_io import hf_weight_files
    from megatron_entropy.models.megatron_checkpoint import read_arch

    m = cfg.model
    if m.megatron_ckpt:
        arch = read_arch(m.megatron_ckpt)
    elif not m.hf_path:
        raise ConfigError("model.hf_path: set an HF model folder (or model.megatron_ckpt, a "
                          "converted checkpoint)")
    else:
        arch = load_arch(m.hf_path)
        try:
            check_hf_checkpoint(hf_weight_files(m.hf_path), arch, m.hf_path)
        except (KeyError, ValueError) as e:
            raise ConfigError(f"model.hf_path: {e.args[0] if isinstance(e, KeyError) else e}") \
                from None
    arch.check_parallel(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert)


# ------------------------------------------------------------------------------------ table


Command = tuple[str, Callable[[argparse.ArgumentParser], None],
                Callable[[argparse.Namespace], int]]


class _CommandTable(Mapping[str, Command]):
    """name -> (help, add_arguments, run); a command defined in another module (``module:NAME``)
    loads when it is looked up."""

    def __init__(self, commands: dict[str, Command | str]) -> None:
        self._commands = commands

    def __getitem__(self, name: str) -> Command:
        command = self._commands[name]
        if isinstance(command, str):
            module, attribute = command.split(":")
            return getattr(importlib.import_module(module), attribute)
        return command

    def __iter__(self) -> Iterator[str]:
        return iter(self._commands)

    def __len__(self) -> int:
        return len(self._commands)


def _commands() -> Mapping[str, Command]:
    """name -> (help, add_arguments, run). Each run imports its module lazily (fast --help)."""
    return _CommandTable({
        "train": ("run (or resume) an RL job from a YAML config", _add_train_args, _run_train),
        "plan": "megatron_entropy.launch.plan:PLAN",
        "slurm": "megatron_entropy.launch.slurm:SLURM",
        "convert": "megatron_entropy.launch.convert:CONVERT",
        "plot": "megatron_entropy.analysis.commands:PLOT",
        "fit": "megatron_entropy.analysis.commands:FIT",
        "study": "megatron_entropy.analysis.commands:STUDY",
        "eval": "megatron_entropy.evaluation.command:EVAL",
        "config-reference": "megatron_entropy.config.reference:CONFIG_REFERENCE",
    })


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="megatron-entropy", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _commands()
    # The command is the first argument (the top level has no option but --help).
    named = [argv[0]] if argv and argv[0] in commands else list(commands)
    for name in named:
        help_text, add_args, _ = commands[name]
        add_args(sub.add_parser(name, help=help_text, description=help_text))
    # Options may come anywhere, also after the dotted overrides of ``train``.
    args, extra = parser.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(a.startswith("-") for a in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides += extra
    try:
        return commands[args.command][2](args) or 0
    except preemption.StartupInterrupted as e:
        print(f"megatron-entropy {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except _user_errors() as e:
        print(f"megatron-entropy {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if not _peer_lost(e):
            raise
        # Another rank died (killed, out of memory): its own log says why; this one's
        # traceback of the broken collective would only hide that.
        print(f"megatron-entropy {args.command}: rank {os.environ.get('RANK')} stopped: another "
              f"rank of the job is gone ({str(e).splitlines()[0][:200]})", file=sys.stderr)
        return 1


# gloo's errors when the other end of a collective has gone away.
PEER_LOST_MESSAGES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _peer_lost(error: RuntimeError) -> bool:
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and any(
        m in str(error) for m in PEER_LOST_MESSAGES)


if __name__ == "__main__":
    sys.exit(main())
