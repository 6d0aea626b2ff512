"""``megatron-entropy <command>``: one entry point for every user-facing task."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Optional

from megatron_entropy import __version__
from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.models.arch import UnsupportedModelError, load_arch
from megatron_entropy.models.hf_names import check_hf_checkpoint, hf_weight_files
from megatron_entropy.models.lora_settings import check_lora_model
from megatron_entropy.models.tokenizer_files import tokenizer_problem
from megatron_entropy.runtime import (ParallelLayoutError, check_layout, detect_launch_env,
                                      min_world_size)
from megatron_entropy.runtime import files, run_lock
from megatron_entropy.runtime.harmless import silence_harmless_warnings
from megatron_entropy.runtime.launch_env import UrlFileError
from megatron_entropy.runtime.processes import end_rank_at_once, start_held, stop_all
from megatron_entropy.runtime.threads import apply_thread_defaults, usable_cpus
from megatron_entropy.runtime import preemption
from megatron_entropy.runtime.preemption import PREEMPTED_EXIT_CODE as PREEMPTED

# Torch-free above. What needs torch loads inside the function that uses it: `--help` and the
# config checks run without torch (tests/unit/launch/test_slurm.py), and `train` loads torch
# and Megatron only after installing the preemption handler. Of the other commands' modules only
# the one named on the command line loads (the Slurm helpers start without numpy and the
# analysis modules).

# Errors that are the user's to fix: printed as one line, exit code 2, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (FileNotFoundError, ConfigError,
                                                UnsupportedModelError, ParallelLayoutError,
                                                UrlFileError, run_lock.RunLockError)
# The same, of modules that load torch: named, not imported. A class whose module never loaded
# cannot have been raised, so a command without torch does not load it to print an error.
TORCH_USER_ERRORS = (("megatron_entropy.data.dataset", "DatasetError"),
                     ("megatron_entropy.models.megatron_checkpoint", "CheckpointError"),
                     ("megatron_entropy.models.bridge", "NonFiniteWeightError"),
                     # The engine holds other weights; a rollout server failed for good.
                     ("megatron_entropy.trainer.weight_check", "WeightCheckError"),
                     ("megatron_entropy.rollout.server.errors", "ServerError"))


def _user_errors() -> tuple[type[BaseException], ...]:
    return USER_ERRORS + tuple(getattr(sys.modules[module], name)
                               for module, name in TORCH_USER_ERRORS if module in sys.modules)


# ------------------------------------------------------------------------------------ train


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1 (got {text!r})")
    return value


def _add_train_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML config (examples/quickstart.yaml)")
    p.add_argument("overrides", nargs="*", help="dotted overrides: algorithm.loss=kl_cov ...")
    p.add_argument("--nproc", type=_positive_int, default=None,
                   help="processes to start on this machine when not under torchrun/srun "
                        "(default: parallel.tensor x parallel.pipeline)")


# Set for the ranks `--nproc` starts: their launcher names the rank that ended first.
LAUNCHED = "MEGATRON_ENTROPY_LOCAL_RANK_OF_LAUNCHER"
# After the first rank is killed: how long the others get to end on their own (their messages
# are clearer), then after SIGTERM, before SIGKILL. A rank still starting up only records SIGTERM.
STOP_GRACE_S = 5.0
# The first wait after a stop that was asked for (a signal passed on), or a rank's own (an
# error, a signal to it alone), once one rank has ended on it: the others end with it (they
# leave a step together, meet the same bad input and say it), unless one waits for it in a
# place no signal reaches (the c10d store, at start-up).
ASKED_STOP_GRACE_S = 15.0


def _spawn_local(args: argparse.Namespace, nproc: int, run_dir: Path,
                 start: Optional[run_lock.FolderStart]) -> int:
    """Start ``nproc`` ranks of this command on this machine; rank 0 prints, the others log to
    ``<run_dir>/logs/rank_N.log``. The first rank to fail stops the rest (SIGTERM, then
    SIGKILL), at any moment of start-up too. SIGTERM/SIGUSR1 are passed on; Ctrl-C asks every
    rank for a checkpoint (as SIGTERM), a second one stops them at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "megatron_entropy.cli", "train", args.config, *args.overrides]
    procs: list[subprocess.Popen] = []
    interrupts: list[int] = []
    asked: list[int] = []  # the signals this process got, to pass on
    sent: list[int] = []

    def send(signum: int) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    def forward(signum, frame):
        asked.append(signum)
        if signum == signal.SIGINT:
            interrupts.append(signum)
            # The terminal sent SIGINT to the ranks too: they count Ctrl-Cs themselves; one
            # sent to the launcher alone asks them for the same through SIGTERM.
            signum = signal.SIGKILL if len(interrupts) > 1 else signal.SIGTERM
        sent.append(signum)
        send(signum)

    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    # Recorded by this process before `forward` took over: SIGTERM or Ctrl-C starts no rank.
    preemption.stop_if_requested()
    if preemption.requested():
        forward(signal.SIGUSR1, None)
    for rank in range(nproc):
        # Threads per rank: already in our environment (runtime/threads.py, set before torch).
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(nproc), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), LAUNCHED: "1"}
        out = None if rank == 0 else _open_rank_log(run_dir / "logs" / f"rank_{rank}.log")
        procs.append(start_held(cmd, env=env, stdout=out,
                                stderr=subprocess.STDOUT if out else None))
    for signum in list(sent):  # the ranks started after a signal came have not had it
        send(signum)
    order, stopped = _wait_for_ranks(procs, asked)
    code = _launcher_exit_code([p.returncode for p in procs], order, stopped, asked,
                               len(interrupts), run_dir)
    if code and start is not None and not _started(run_dir):
        # Bad input every rank met: the terminal has rank 0's line, and no line names the logs.
        start.undo(logs=all(p.returncode == 2 for p in procs))
    return code


# How a rank ends when all is well: done; checkpointed on a signal (or stopped by SIGTERM or
# SIGUSR1 during start-up); stopped by Ctrl-C during start-up.
ENDED_WELL = (0, PREEMPTED, 128 + signal.SIGINT)
# A rank that stopped alone, on a signal sent to it: the signal its exit code stands for.
STOPPED_BY = {PREEMPTED: "SIGTERM", 128 + signal.SIGINT: "SIGINT"}


def _wait_for_ranks(procs: list[subprocess.Popen], asked: list[int]
                    ) -> tuple[list[int], list[int]]:
    """Until every rank has ended: the first to fail stops the others (SIGTERM, then SIGKILL);
    after a stop (one asked for, or a rank's own: a signal sent to it alone) the others get a
    grace period once one has ended. Returns (the ranks in the order they ended, those this
    launcher had to stop)."""
    order: list[int] = []
    stopped: list[int] = []
    while None in (polled := [p.poll() for p in procs]):
        order += [r for r, c in enumerate(polled) if c is not None and r not in order]
        codes = [polled[r] for r in order]
        if any(c not in ENDED_WELL for c in codes):  # killed, an error, a peer gone
            killed = any(c < 0 for c in codes)
            stopped = stop_all(procs, STOP_GRACE_S if killed else ASKED_STOP_GRACE_S,
                               STOP_GRACE_S)
            break
        if any(codes) or (asked and codes):
            # The others end with it, or wait for it where no signal reaches (the c10d store at
            # start-up): they are stopped.
            stopped = stop_all(procs, ASKED_STOP_GRACE_S, None if asked else STOP_GRACE_S)
            break
        time.sleep(0.2)
    for p in procs:
        p.wait()
    return order + [r for r in range(len(procs)) if r not in order], stopped


def _launcher_exit_code(codes: list[int], order: list[int], stopped: list[int],
                        asked: list[int], interrupts: int, run_dir: Path) -> int:
    """The local launcher's exit code from its ranks' (``codes``), and its line on stderr where
    rank 0's own (on this terminal) does not say what happened. ``order``: the ranks in the
    order they ended; ``stopped``: those this launcher stopped; ``asked``: the signals it
    passed on."""
    logs = f"logs of ranks > 0 are in {run_dir / 'logs'}"
    failed = [r for r in order if codes[r] not in ENDED_WELL and r not in stopped]
    # A rank whose peer is gone (PEER_LOST_EXIT_CODE) only follows the one that left.
    culprits = [r for r in failed if codes[r] != PEER_LOST_EXIT_CODE]
    stops = [r for r in order if codes[r] in STOPPED_BY and r not in stopped]
    if interrupts > 1:
        first = (culprits or failed or [0])[0]
        print("megatron-entropy train: stopped at once by a second Ctrl-C (no checkpoint of the "
              f"step in progress); {logs}", file=sys.stderr)
    elif culprits or (failed and not stops and not asked):
        first = (culprits or failed)[0]
        if codes[0] in (1, 2) and 0 not in stopped and codes[first] > 0:
            # Rank 0 ended on an error it named on this terminal (a bad model or a full disk:
            # every rank meets it); which rank met it first adds nothing. A rank that was
            # killed, or rank 0 stopped because another is gone, is named here.
            return codes[0]
        stopped_too = f"; stopped {_ranks(stopped)}" if stopped else ""
        print(f"megatron-entropy train: rank {first} failed first "
              f"({_exit_status(codes[first])}){stopped_too}; {logs}", file=sys.stderr)
    elif asked:
        if 0 not in stopped and codes[0] in ENDED_WELL:
            return codes[0]  # 0, or the stop that rank 0 printed (75, or 130 in start-up)
        # Rank 0 said nothing: it waited for the others in a place no signal reaches, or
        # another rank left before it.
        waited = f"; {_ranks(stopped)} did not end on it and had to be stopped" if stopped \
            else ""
        print(f"megatron-entropy train: stopped by {signal.Signals(asked[0]).name}{waited}",
              file=sys.stderr)
        return 128 + signal.SIGINT if interrupts else PREEMPTED
    elif stops and (stopped or failed) and 0 not in stops:
        # A signal to one rank alone, not rank 0 (whose own line names itself and the signal).
        first = stops[0]
        stopped_too = f"; stopped {_ranks(stopped)}" if stopped else ""
        print(f"megatron-entropy train: rank {first} stopped by {STOPPED_BY[codes[first]]} "
              f"(exit {codes[first]}){stopped_too}; {logs}", file=sys.stderr)
    else:
        first = stops[0] if stops else 0  # they ended as one, or rank 0 said how
    code = codes[first]
    return 128 - code if code < 0 else code  # killed by a signal: as a shell reports it


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"


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
    # First: a USR1/TERM/INT during the minutes of start-up is held, not fatal.
    with preemption.installed():
        return _train_command(args)


def _train_command(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    launch = detect_launch_env()
    p = cfg.parallel
    fewest = min_world_size(p.tensor, p.pipeline, p.expert, p.context)
    if launch.launcher == "single":  # ranks this command starts: their threads, before torch
        apply_thread_defaults(args.nproc or fewest)
    _check_model(cfg)  # before any rank starts
    nproc = (args.nproc or fewest) if launch.launcher == "single" else launch.world_size
    check_layout(nproc, p.tensor, p.pipeline, p.expert, p.context)
    if launch.launcher == "single" and nproc > usable_cpus():
        print(f"warning: {nproc} ranks on {usable_cpus()} cores: each rank gets one thread and "
              "they take turns on the cores, slower than fewer ranks (docs/performance.md)",
              file=sys.stderr)
    preemption.stop_if_requested()  # Ctrl-C while the model's files were checked
    with _run_folder_lock(cfg.run_dir, launch.rank) as start:  # none for a bad start above
        if launch.launcher == "single" and nproc > 1:
            return _spawn_local(args, nproc, cfg.run_dir, start)
        # In a process that trains: `--nproc`'s launcher needs no torch (seconds of imports).
        silence_harmless_warnings()
        from megatron_entropy.trainer.loop import train

        train(cfg)
    if launch.rank == 0:
        print(finished_summary(cfg.run_dir, cfg.trainer.steps))
    return 0


def finished_summary(run_dir: Path, steps: int) -> str:
    """The line a finished run ends with: where its checkpoint and metrics are."""
    pointer = run_dir / "checkpoints" / "latest"
    checkpoint = pointer.parent / pointer.read_text().strip() if pointer.is_file() else None
    return (f"finished: {steps} step{'s' * (steps != 1)}; last checkpoint "
            f"{checkpoint or '(none)'}; metrics "
            f"{run_dir / 'metrics.jsonl'} (megatron-entropy plot {run_dir})")


# Set by the local launcher for its ranks: the lock it holds for them (they die with it).
RUN_LOCK_HELD = "MEGATRON_ENTROPY_RUN_LOCK_HELD"


@contextlib.contextmanager
def _run_folder_lock(run_dir: Path, rank: int) -> Iterator[Optional[run_lock.FolderStart]]:
    """One trainer per run folder: rank 0 of the job (or the local launcher, for its ranks)
    holds ``RUN/train.lock`` while it runs; a second trainer there stops with one line naming
    the holder's host and pid (runtime/run_lock.py). A start that fails before the run begins
    removes the lock and folders it made (yielded, for the launcher's failures)."""
    lock = run_dir / "train.lock"
    if rank != 0 or os.environ.get(RUN_LOCK_HELD) == str(lock):
        yield None
        return
    start = run_lock.FolderStart(run_dir, lock)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = run_lock.acquire(lock, "run folder")
    os.environ[RUN_LOCK_HELD] = str(lock)  # for the ranks this process starts
    try:
        yield start
    except BaseException:
        if not _started(run_dir):
            start.undo(logs=False)
        raise
    finally:
        del os.environ[RUN_LOCK_HELD]
        run_lock.release(fd)


def _started(run_dir: Path) -> bool:
    """Whether a run has begun in ``run_dir`` (its config is written once start-up is over)."""
    return (run_dir / "config.yaml").is_file()


def _check_model(cfg) -> None:
    """The model the run will train, checked from its files before any rank starts: its
    architecture against parallel.tensor/pipeline, (HF weights) every tensor's name and shape
    against config.json, from the safetensors headers only, and the tokenizer's files."""
    m = cfg.model
    key = "model.megatron_ckpt" if m.megatron_ckpt else "model.hf_path"
    if not (m.megatron_ckpt or m.hf_path):
        raise ConfigError("model.hf_path: set an HF model folder (or model.megatron_ckpt, a "
                          "converted checkpoint)")
    try:
        if m.megatron_ckpt:
            # A dist checkpoint's module loads torch: only for a run that starts from one.
            from megatron_entropy.models.megatron_checkpoint import read_arch

            arch = read_arch(m.megatron_ckpt)
        else:
            arch = load_arch(m.hf_path)
            check_hf_checkpoint(hf_weight_files(m.hf_path), arch, m.hf_path)
    except PermissionError as e:  # these are reads, whatever the errno would suggest
        raise ConfigError(f"{key}: {files.describe(e, 'read')}") from None
    except (KeyError, ValueError, FileNotFoundError) as e:
        where = files.relative_note(m.megatron_ckpt or m.hf_path) \
            if not Path(m.megatron_ckpt or m.hf_path).exists() else ""
        raise ConfigError(f"{key}: {e.args[0] if isinstance(e, KeyError) else e}{where}") \
            from None
    arch.check_parallel(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert)
    check_lora_model(m.lora, arch.is_moe, cfg.parallel.tensor,
                     adapter_sync=cfg.rollout.weight_sync.strategy == "adapters")
    # The tokenizer and chat template come from hf_path, else the checkpoint's hf/ folder.
    key, folder = ("model.hf_path", m.hf_path) if m.hf_path else \
        ("model.megatron_ckpt", Path(m.megatron_ckpt) / "hf")
    problem = tokenizer_problem(folder, chat_template=cfg.data.apply_chat_template)
    if problem:
        raise ConfigError(f"{key}: {problem}")


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
        "examples": "megatron_entropy.launch.examples:EXAMPLES",
    })


# What `--help` prints: plain text (the module docstring is reStructuredText).
DESCRIPTION = "megatron-entropy COMMAND: one entry point for every user-facing task."


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # train sets its ranks' own (their count is in the config), study its runs' (they share the
    # cores); every other command computes in this one process (eval generates, convert
    # reshards): the same defaults as a one-process run, before a command's module loads torch.
    if argv and argv[0] not in ("train", "study"):
        apply_thread_defaults(1)
    parser = argparse.ArgumentParser(prog="megatron-entropy", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"megatron-entropy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = _commands()
    # The command is the first argument (the top level has no option but --help and --version).
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
        # A rank of several names itself: a signal may have reached it alone.
        who = f"rank {os.environ.get('RANK')} " if _world_size() > 1 else ""
        print(f"megatron-entropy {args.command}: {who}{e}", file=sys.stderr)
        end_rank_at_once(e.exit_code)  # a rank of a group: no teardown of its collectives
        return e.exit_code
    except _user_errors() as e:
        print(f"megatron-entropy {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if e.errno not in files.WRITE_ERRNOS:
            raise
        # A full, read-only or unwritable disk: the path and errno, not a traceback.
        print(f"megatron-entropy {args.command}: error: {files.describe(e)}", file=sys.stderr)
        return 1
    except RuntimeError as e:
        if not _peer_lost(e):
            raise
        # Another rank died (killed, out of memory): its own log says why; this one's
        # traceback of the broken collective would only hide that. On `--nproc`'s terminal
        # the launcher's line names that rank instead.
        if os.environ.get("RANK") != "0" or not os.environ.get(LAUNCHED):
            print(f"megatron-entropy {args.command}: rank {os.environ.get('RANK')} stopped: "
                  f"another rank of the job is gone ({_peer_lost_cause(e)})", file=sys.stderr)
        return PEER_LOST_EXIT_CODE


# A rank that stopped because another one is gone (not 1: the local launcher then names the rank
# that failed first, which rank 0's line does not).
PEER_LOST_EXIT_CODE = 3
# gloo's errors when the other end of a collective has gone away.
PEER_LOST_MESSAGES = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _peer_lost(error: RuntimeError) -> bool:
    return _world_size() > 1 and any(m in str(error) for m in PEER_LOST_MESSAGES)


def _peer_lost_cause(error: RuntimeError) -> str:
    """gloo's own sentence of the error, without the source file it names first and the
    advice that follows ("[.../pair.cc:553] Connection closed by peer [127.0.0.1]:37040. This is
    typically caused by ...")"""
    line = re.sub(r"^\[[^\]]*\]\s*", "", str(error).splitlines()[0])
    return line.split(". ")[0].rstrip(".")


if __name__ == "__main__":
    sys.exit(main())
