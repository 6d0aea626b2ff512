"""Faults: nothing lost, nothing left behind. A rank killed inside a checkpoint write leaves no
process behind and its run resumes; a damaged checkpoint is skipped for the newest intact one."""

from __future__ import annotations

import contextlib
import errno
import json
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch

from harness import init_megatron, run_distributed
from tiny_models import tiny_hf_config

from megatron_entropy import cli
# What `train` loads before it writes, loaded here: a child that becomes another user
# (_as_nobody) can no longer read the Python installation under /root.
from megatron_entropy.models import (bridge, hf_io, megatron_checkpoint,  # noqa: F401
                                     tokenizer_files)
from megatron_entropy.models.arch import arch_from_hf_config
from megatron_entropy.models.megatron_checkpoint import CheckpointError
from megatron_entropy.trainer.checkpoint import CheckpointManager


def _model_and_optimizer():
    from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    init_megatron()
    arch = arch_from_hf_config(tiny_hf_config("qwen2"))
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64),
        ParallelConfig())
    optimizer, _ = build_optimizer(chunks, TrainerConfig(lr=1e-2, steps=1, weight_decay=0.0))
    return arch, chunks, optimizer


def _train_step(chunks, optimizer, step: int) -> None:
    for p in chunks[0].parameters():
        p.main_grad.normal_(generator=torch.Generator().manual_seed(step))
    optimizer.step()


def _save_steps(run_dir: str, steps: list[int]) -> None:
    arch, chunks, optimizer = _model_and_optimizer()
    manager = CheckpointManager(run_dir, keep_last=3)
    for step in steps:
        _train_step(chunks, optimizer, step)
        manager.save(step, chunks, optimizer, {"step": step}, arch, "unused")


def _victim(run_dir: str) -> None:
    """Saves step 1, then dies (SIGKILL from the test) while step 2's writers write."""
    os.setsid()  # its own session: every process it starts can be found by session id
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0,
                                         world_size=1)
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    arch, chunks, optimizer = _model_and_optimizer()
    manager = CheckpointManager(run_dir, keep_last=3)
    _train_step(chunks, optimizer, 1)
    manager.save(1, chunks, optimizer, {"step": 1}, arch, "unused")
    write = FileSystemWriterAsync.write_preloaded_data

    def stalled_write(*args, **kwargs):
        (Path(run_dir) / f"writer_{os.getpid()}").touch()
        time.sleep(300)
        return write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(stalled_write)
    _train_step(chunks, optimizer, 2)
    manager.save(2, chunks, optimizer, {"step": 2}, arch, "unused")


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # Fields after the command's closing parenthesis: state ppid pgrp session ...
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _resume_and_save(run_dir: str) -> int:
    arch, chunks, optimizer = _model_and_optimizer()
    manager = CheckpointManager(run_dir, keep_last=3)
    state = manager.load(manager.latest(), chunks, optimizer)
    _train_step(chunks, optimizer, state["step"] + 1)
    manager.save(state["step"] + 1, chunks, optimizer, {"step": state["step"] + 1}, arch,
                 "unused")
    return state["step"]


def test_rank_killed_inside_a_checkpoint_write_leaves_no_process_and_resumes(tmp_path):
    victim = mp.get_context("fork").Process(target=_victim, args=(str(tmp_path),))
    victim.start()
    try:
        deadline = time.monotonic() + 120
        while not list(tmp_path.glob("writer_*")):
            assert victim.is_alive(), "the victim died before its writers started"
            assert time.monotonic() < deadline, "no checkpoint writer started"
            time.sleep(0.1)
        assert _session_members(victim.pid)  # the rank and its writers
        os.kill(victim.pid, signal.SIGKILL)
        victim.join()
        deadline = time.monotonic() + 10
        while _session_members(victim.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        survivors = _session_members(victim.pid)
        assert not survivors, [Path(f"/proc/{p}/cmdline").read_bytes() for p in survivors]
    finally:
        for pid in _session_members(victim.pid):
            os.kill(pid, signal.SIGKILL)
    # The rerun resumes from the last complete checkpoint and saves over the partial one.
    assert run_distributed(_resume_and_save, 1, str(tmp_path)) == [1]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_00000001", "step_00000002"]


def _damage(ckpt: Path, kind: str) -> Path:
    """Damages one file of checkpoint folder ``ckpt``; returns that file."""
    if kind in ("delete distcp", "truncate distcp"):
        target = sorted(ckpt.glob("*.distcp"))[0]
        if kind == "delete distcp":
            target.unlink()
        else:
            with target.open("r+b") as f:
                f.truncate(target.stat().st_size // 2)
    else:
        target = ckpt / {"delete .metadata": ".metadata",
                         "delete trainer_state.json": "trainer_state.json",
                         "truncate trainer_state.json": "trainer_state.json"}[kind]
        if kind.startswith("delete"):
            target.unlink()
        else:
            target.write_text(target.read_text()[:10])
    return target


DAMAGES = ("delete distcp", "truncate distcp", "delete .metadata", "delete trainer_state.json",
           "truncate trainer_state.json")


def test_damaged_newest_checkpoint_is_skipped_for_the_previous(tmp_path, capfd):
    saved = tmp_path / "saved"
    run_distributed(_save_steps, 1, str(saved), [1, 2])
    for kind in DAMAGES:
        run = tmp_path / kind.replace(" ", "_")
        shutil.copytree(saved, run)
        bad = _damage(run / "checkpoints" / "step_00000002", kind)
        capfd.readouterr()
        assert CheckpointManager(run).latest() == run / "checkpoints" / "step_00000001", kind
        warnings = [line for line in capfd.readouterr().err.splitlines()
                    if line.startswith("warning:")]
        assert len(warnings) == 1 and bad.name in warnings[0], (kind, warnings)
    # One real resume from a damaged newest checkpoint: the previous one loads.
    assert run_distributed(_resume_and_save, 1, str(tmp_path / "delete_distcp")) == [1]


def test_no_intact_checkpoint_is_one_clear_error(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000001")
    with pytest.raises(CheckpointError, match=r"no intact checkpoint .*trainer_state.json"):
        CheckpointManager(run).latest()
    assert CheckpointManager(tmp_path / "fresh").latest() is None


def _metrics_file(run: Path, steps: list[int], tail: str) -> Path:
    run.mkdir(parents=True)
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in steps)
                    + tail)
    return path


def test_torn_metrics_tail_is_dropped_with_a_warning(tmp_path, capsys):
    from megatron_entropy.config import LoggingConfig
    from megatron_entropy.trainer.metrics import MetricsLogger

    path = _metrics_file(tmp_path / "run", [0, 1, 2, 3], '{"step": 4, "rew')
    MetricsLogger(tmp_path / "run", 5, True, LoggingConfig(progress_bar=False), start_step=2)
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1, 2]
    err = capsys.readouterr().err
    assert f"warning: {path}:5: dropped an incomplete line" in err


def test_run_restarted_before_its_first_checkpoint_logs_step_0_once(tmp_path):
    from megatron_entropy.config import LoggingConfig
    from megatron_entropy.trainer.metrics import MetricsLogger

    path = _metrics_file(tmp_path / "run", [0, 1], "")
    logger = MetricsLogger(tmp_path / "run", 5, True, LoggingConfig(progress_bar=False), start_step=0)
    logger.log(0, {"val/acc/mean": 0.25})
    logger.log(1, {"reward/mean": 0.5})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [0, 1]


REPO = Path(__file__).resolve().parents[3]


def _cli_config(tmp_path: Path, model: Path = REPO / "examples" / "quickstart_model",
                **sections) -> Path:
    import yaml

    cfg = {"model": {"hf_path": str(model)},
           "logging": {"runs_dir": str(tmp_path / "runs"), "name": "r", "progress_bar": False},
           **sections}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _one_error_line(capsys, cli_args: list[str]) -> str:
    from megatron_entropy.cli import main

    assert main(cli_args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bad_starts_are_one_line_before_any_rank_starts(tmp_path, capsys):
    config = _cli_config(tmp_path)
    (tmp_path / "empty.yaml").write_text("# nothing yet\n")
    empty = str(tmp_path / "empty.yaml")
    assert "empty.yaml' is empty" in _one_error_line(capsys, ["train", empty])
    assert "model.hf_path: set an HF model folder" in _one_error_line(
        capsys, ["train", str(config), "model.hf_path="])
    # Options anywhere: an override after --nproc is read (and its error reported).
    assert "trainer.steps: expected an integer, got 'x'" in _one_error_line(
        capsys, ["train", str(config), "--nproc", "2", "trainer.steps=x"])
    # The model's heads, not only the process count, are checked before ranks start.
    assert "parallel.tensor=3 does not divide the model's 4 attention heads" in _one_error_line(
        capsys, ["train", str(config), "parallel.tensor=3"])
    # Weights that do not fit config.json: truncated, or another vocabulary size.
    truncated, revocab = tmp_path / "truncated", tmp_path / "revocab"
    for model in (truncated, revocab):
        shutil.copytree(REPO / "examples" / "quickstart_model", model)
    weights = truncated / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    hf_config = json.loads((revocab / "config.json").read_text())
    (revocab / "config.json").write_text(json.dumps({**hf_config,
                                                     "vocab_size": hf_config["vocab_size"] + 64}))
    assert f"model.hf_path: {weights} is not a complete safetensors file" in _one_error_line(
        capsys, ["train", str(config), f"model.hf_path={truncated}"])
    assert re.search(r"model.hf_path: model.embed_tokens.weight has shape \(\d+, \d+\), but "
                     r"config.json implies", _one_error_line(
                         capsys, ["train", str(config), f"model.hf_path={revocab}"]))
    # A process count the layout does not divide.
    assert "world size 3 is not divisible" in _one_error_line(
        capsys, ["train", str(config), "--nproc", "3", "parallel.tensor=2"])
    assert not (tmp_path / "runs").exists()  # no rank started, no run folder made


def test_a_start_that_fails_in_the_ranks_removes_what_it_made(tmp_path):
    """An error the ranks find at start-up (here an empty data file), met in a fresh process:
    one line, exit 2, and the run folder this start made (with its lock) is gone; a run folder
    that existed keeps what it held, without a lock of this start's. (`--nproc`, whose launcher
    also removes the rank logs it made: test_start_up_faults.py.)"""
    config = _cli_config(tmp_path)
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "runs" / "old").mkdir(parents=True)
    (tmp_path / "runs" / "old" / "notes.txt").write_text("kept")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    runs = {name: subprocess.Popen(
        [sys.executable, "-m", "megatron_entropy.cli", "train", str(config),
         f"data.train_files=[{tmp_path / 'empty.jsonl'}]", f"logging.name={name}"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for name in ("new", "old")}
    for name, run in runs.items():
        _, err = run.communicate(timeout=600)
        assert run.returncode == 2 and len(err.strip().splitlines()) == 1, err[-3000:]
        assert "empty.jsonl" in err
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["old"]
    assert [p.name for p in (tmp_path / "runs" / "old").iterdir()] == ["notes.txt"]


def test_run_config_is_kept_per_start_and_rank_logs_are_appended(tmp_path):
    from megatron_entropy.cli import _exit_status, _open_rank_log
    from megatron_entropy.config import load_config
    from megatron_entropy.trainer.run_folder import save_run_config

    run = tmp_path / "run"
    run.mkdir()
    first, second = load_config(data={"trainer": {"lr": 1e-5}}), load_config(data={})
    save_run_config(first, run)
    save_run_config(first, run)  # the same config again: nothing to keep
    save_run_config(second, run)
    assert sorted(p.name for p in run.iterdir()) == ["config.1.yaml", "config.yaml"]
    assert load_config(run / "config.1.yaml").trainer.lr == 1e-5
    assert load_config(run / "config.yaml") == second
    for attempt in ("first", "second"):
        with _open_rank_log(run / "rank_1.log") as log:
            log.write(f"{attempt} attempt failed\n")
    lines = (run / "rank_1.log").read_text().splitlines()
    assert [line.startswith("===== megatron-entropy train started") for line in lines] == \
        [True, False, True, False]
    assert lines[1::2] == ["first attempt failed", "second attempt failed"]
    assert _exit_status(-9) == "killed by SIGKILL" and _exit_status(3) == "3"


def test_rank_whose_peer_died_ends_with_one_line(monkeypatch, capsys):
    from megatron_entropy import cli

    gloo = ("[../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:18145: Connection reset "
            "by peer. This is typically caused by a remote worker hanging")

    def broken_collective(args):
        raise RuntimeError(gloo)

    monkeypatch.setattr(cli, "_commands", lambda: {"train": ("", cli._add_train_args,
                                                             broken_collective)})
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert cli.main(["train", "c.yaml"]) == cli.PEER_LOST_EXIT_CODE  # not an error of its own
    err = capsys.readouterr().err.strip().splitlines()
    # gloo's sentence, without the source file it names and the advice that follows.
    assert err == ["megatron-entropy train: rank 0 stopped: another rank of the job is gone "
                   "(Read error [127.0.0.1]:18145: Connection reset by peer)"]
    monkeypatch.setenv(cli.LAUNCHED, "1")  # `--nproc`'s rank 0: the launcher names the rank
    assert cli.main(["train", "c.yaml"]) == cli.PEER_LOST_EXIT_CODE
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("WORLD_SIZE", "1")  # alone, the same error is no peer's death: raised
    with pytest.raises(RuntimeError, match="Connection reset"):
        cli.main(["train", "c.yaml"])


# ------------------------------------------------------------ a full or read-only file system


@contextlib.contextmanager
def _tmpfs(path: Path, options: str):
    """A small file system of its own at ``path`` (root only: skipped elsewhere)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs",
                                            str(path)], capture_output=True).returncode != 0:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def _fill(disk: Path, leave_bytes: int) -> None:
    with open(disk / "filler", "wb") as f:
        free = shutil.disk_usage(disk).free - leave_bytes
        f.write(b"\0" * max(0, free))


@pytest.mark.parametrize("nproc", [1, 2])
def test_full_disk_is_one_line_leaves_nothing_partial_and_keeps_the_steps_metrics(tmp_path, nproc):
    """A 6 MiB file system as runs_dir: the first checkpoint does not fit. With `--nproc 2` each
    rank meets it: rank 0's line is the run's only one."""
    import yaml

    with _tmpfs(tmp_path / "disk", "size=6m") as disk:
        cfg = {"model": {"hf_path": str(REPO / "examples" / "quickstart_model"),
                         "seq_length": 256},
               "rollout": {"n_samples": 2, "max_new_tokens": 8, "max_prompt_tokens": 96},
               "data": {"prompts_per_step": 2, "dynamic_sampling": False,
                        "arithmetic": {"num_train": 32, "num_val": 2}},
               "trainer": {"steps": 2, "micro_batch_tokens": 2048, "save_interval": 1},
               "parallel": {"tensor": 1},
               "logging": {"runs_dir": str(disk / "runs"), "name": "full",
                           "progress_bar": False}}
        (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        done = subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "train",
                               str(tmp_path / "c.yaml"), "--nproc", str(nproc)],
                              capture_output=True, text=True, env=env, timeout=600)
        run = disk / "runs" / "full"
        assert done.returncode == 1, done.stderr[-3000:]
        for noise in ("Traceback", "encountered an error", "failed first"):
            assert noise not in done.stderr, done.stderr[-3000:]
        assert re.fullmatch(
            rf"megatron-entropy train: error: cannot write {run}/checkpoints/\.step_00000001\.tmp"
            r": ENOSPC \(No space left on device \(\d+ KiB free\)\)",
            done.stderr.strip().splitlines()[-1]), done.stderr[-3000:]
        assert not list(run.rglob("*.tmp"))  # the partial checkpoint is gone: the disk is free
        assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text()
                .splitlines()] == [1]
        # The run's config written where the disk has no room left: the old one stays, whole,
        # and no temporary file is left behind.
        from megatron_entropy.config import load_config
        from megatron_entropy.trainer.run_folder import save_run_config

        before = (run / "config.yaml").read_text()
        _fill(disk, leave_bytes=0)
        with pytest.raises(OSError) as raised:
            save_run_config(load_config(data={"trainer": {"lr": 3e-5}}), run)
        assert raised.value.errno == errno.ENOSPC
        assert (run / "config.yaml").read_text() == before
        assert not list(run.glob(".*.tmp"))


def test_read_only_runs_dir_is_one_line_naming_the_path_and_errno(tmp_path, capsys):
    from megatron_entropy.cli import main

    config = _cli_config(tmp_path, parallel={"tensor": 1})
    with _tmpfs(tmp_path / "runs", "size=1m,ro"):
        assert main(["train", str(config)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron-entropy train: error: cannot write {tmp_path / 'runs' / 'r'}: "
                   "EROFS (Read-only file system)"]


NOBODY = 65534  # a user with no rights on root's files


def _as_nobody(argv: list[str], err: Path) -> int:
    """``main(argv)`` in a forked child that has given up root (root writes through any
    permission bits) for ``NOBODY``; its stderr in ``err``. Forked, not started: the Python
    installation under /root is closed to that user, so what the command needs is imported
    first."""
    pid = os.fork()
    if pid == 0:
        code = 70
        with open(err, "w") as out:
            try:
                sys.stderr = out
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
                code = cli.main(argv)
            except BaseException:  # noqa: BLE001 - for the test to show, not pytest's to run
                import traceback
                traceback.print_exc(file=out)
            finally:
                out.flush()
                os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@contextlib.contextmanager
def _shared_folder() -> Iterator[Path]:
    """A folder the other user can reach: pytest's tmp_path is root's alone, and so may be the
    checkout (a clone in a home folder, or in mktemp's 0700 folder)."""
    shared = Path(tempfile.mkdtemp(prefix="me-eacces-"))
    try:
        shared.chmod(0o755)
        yield shared
    finally:
        shutil.rmtree(shared)


def _readable_model(shared: Path) -> Path:
    """The quickstart model where the other user can read it."""
    return Path(shutil.copytree(REPO / "examples" / "quickstart_model", shared / "model"))


@pytest.mark.parametrize("closed", ["runs_dir", "run folder"])
def test_unwritable_run_folder_is_one_line_naming_the_path_and_errno(tmp_path, closed):
    """EACCES on a writable file system: runs_dir, or an earlier run's folder, that the user
    may not write to."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    with _shared_folder() as shared:
        config = _cli_config(shared, _readable_model(shared), parallel={"tensor": 1})
        closed_dir = shared / "runs" / ("r" if closed == "run folder" else "")
        closed_dir.mkdir(parents=True)
        closed_dir.chmod(0o555)
        code = _as_nobody(["train", str(config)], tmp_path / "err")
    err = (tmp_path / "err").read_text().strip().splitlines()
    path = shared / "runs" / "r" / ("train.lock" if closed == "run folder" else "")
    assert (code, err) == (1, [f"megatron-entropy train: error: cannot write {path}: EACCES "
                               "(Permission denied)"])


@pytest.mark.parametrize("closed", ["folder", "config.json"])
def test_a_model_the_user_cannot_read_is_one_line_saying_so(tmp_path, closed):
    """EACCES while reading (not writing): the model folder, or its config.json, closed to the
    user."""
    if os.geteuid() != 0:
        pytest.skip("needs root to become another user")
    with _shared_folder() as shared:
        model = _readable_model(shared)
        (model if closed == "folder" else model / "config.json").chmod(0o700)
        code = _as_nobody(["train", str(_cli_config(shared, model))], tmp_path / "err")
    err = (tmp_path / "err").read_text().strip().splitlines()
    entered = f": {model} cannot be entered" if closed == "folder" else ""
    assert (code, err) == (2, [f"megatron-entropy train: error: model.hf_path: cannot read "
                               f"{model / 'config.json'}: EACCES (Permission denied{entered})"])


# ------------------------------------------------------------------------- bad model folders


def test_model_folder_without_tokenizer_files_is_one_line_naming_the_file(tmp_path, capsys):
    config = _cli_config(tmp_path)
    cases = {"none": ["tokenizer.json", "tokenizer_config.json"],
             "no_template": ["tokenizer_config.json"]}
    for name, removed in cases.items():
        shutil.copytree(REPO / "examples" / "quickstart_model", tmp_path / name)
        for f in removed:
            (tmp_path / name / f).unlink()
    (tmp_path / "bpe_half").mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(REPO / "examples" / "quickstart_model" / f, tmp_path / "bpe_half")
    (tmp_path / "bpe_half" / "vocab.json").write_text("{}")
    assert _one_error_line(capsys, ["train", str(config), f"model.hf_path={tmp_path / 'none'}"]) \
        == (f"megatron-entropy train: error: model.hf_path: {tmp_path / 'none'} has no tokenizer: "
            "none of tokenizer.json, tokenizer.model, vocab.json + merges.txt, vocab.txt (copy "
            "the tokenizer files of the model)")
    assert _one_error_line(capsys, ["train", str(config),
                                    f"model.hf_path={tmp_path / 'bpe_half'}"]) == (
        f"megatron-entropy train: error: model.hf_path: {tmp_path / 'bpe_half'} has vocab.json "
        "but no merges.txt: the tokenizer is incomplete")
    line = _one_error_line(capsys, ["train", str(config),
                                    f"model.hf_path={tmp_path / 'no_template'}"])
    assert "data.apply_chat_template=true but there is no tokenizer_config.json" in line
    # Plain text needs no template.
    from megatron_entropy.models.tokenizer_files import tokenizer_problem

    assert tokenizer_problem(tmp_path / "no_template") is None


def _cli_exit_and_stderr(argv: list[str]) -> tuple[int, str]:
    """Worker: ``megatron-entropy ARGV`` in a forked rank, its exit code and stderr."""
    import io

    from megatron_entropy.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def test_nan_in_a_weight_is_one_line_naming_the_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    from harness import run_distributed

    model = tmp_path / "nan_model"
    shutil.copytree(REPO / "examples" / "quickstart_model", model)
    weights = load_file(model / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name][3, 5] = float("nan")
    save_file(weights, str(model / "model.safetensors"), metadata={"format": "pt"})
    config = _cli_config(tmp_path, parallel={"tensor": 1})
    [(code, err)] = run_distributed(_cli_exit_and_stderr,
                                    1, ["train", str(config), f"model.hf_path={model}"],
                                    timeout=300)
    assert code == 2, err
    assert err.strip().splitlines() == [
        f"megatron-entropy train: error: model.hf_path: {model / 'model.safetensors'}: tensor "
        f"{name} holds NaN or inf (the first such tensor of the model): the weights are damaged"]


def test_resume_takes_a_checkpoints_folder_or_a_run_folder_as_convert_does(tmp_path):
    from megatron_entropy.config import load_config
    from megatron_entropy.trainer.checkpoint import resume_checkpoint

    run = tmp_path / "run"
    run_distributed(_save_steps, 1, str(run), [1])
    manager = CheckpointManager(tmp_path / "other_run")
    step = run / "checkpoints" / "step_00000001"
    for given in (step, run / "checkpoints", run):
        assert resume_checkpoint(str(given), manager) == step
    with pytest.raises(CheckpointError, match=r"trainer.resume='nowhere': nowhere/"
                                              r"trainer_state.json is missing"):
        resume_checkpoint("nowhere", manager)
    # `trainer.resume=None` on the command line (YAML reads it as the text "None"): no resume.
    resume = load_config(overrides=["trainer.resume=None"]).trainer.resume
    assert resume == "none" and resume_checkpoint(resume, manager) is None
