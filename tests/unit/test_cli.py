"""`--help` of every command (and of each sub-command) is plain text: no reStructuredText
markup (double backquotes, roles) from the docstrings it is built from; a bad `--nproc` is one
line; how `--nproc`'s launcher reports the way its ranks ended; the launcher loads no torch."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cli_modules import cli_modules
from megatron_entropy.cli import _commands, _launcher_exit_code, main

MARKUP = re.compile(r"``|:(func|class|mod|meth|attr):`")


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


def test_help_has_no_rst_markup(capsys):
    pages = {"": _help(capsys)}
    for name in _commands():
        pages[name] = _help(capsys, name)
        # Sub-commands: the names between braces on the usage line.
        subs = re.search(r"^usage: .*?\{([\w,-]+)\}", pages[name], re.M | re.S)
        for sub in (subs.group(1).split(",") if subs else []):
            pages[f"{name} {sub}"] = _help(capsys, name, sub)
    marked = {name: MARKUP.findall(text) for name, text in pages.items() if MARKUP.search(text)}
    assert not marked, marked
    assert len(pages) > len(_commands()) + 1  # the sub-commands were reached


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_nproc_below_one_is_refused_in_one_line(capsys, value, tmp_path):
    """`--nproc 0` used to run with the default process count."""
    with pytest.raises(SystemExit) as done:
        main(["train", str(tmp_path / "missing.yaml"), "--nproc", value])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"megatron-entropy train: error: argument --nproc: must be a whole number >= 1 "
        f"(got '{value}')")


RUN = Path("runs/r")
LOGS = f"logs of ranks > 0 are in {RUN / 'logs'}"


@pytest.mark.parametrize("codes, order, stopped, code, line", [
    # All ended as one (done, or checkpointed on a signal): rank 0 said so.
    ([0, 0], [0, 1], [], 0, None), ([75, 75], [1, 0], [], 75, None),
    # A signal to rank 0 alone in start-up: its own line names it; rank 1 waited (stopped) or
    # found its peer gone (3): no failure of its own.
    ([75, -9], [0, 1], [1], 75, None), ([75, 3], [1, 0], [], 75, None),
    ([130, 3], [0, 1], [], 130, None),
    # ... to another rank alone: the launcher's line names it.
    ([3, 75], [0, 1], [], 75, f"rank 1 stopped by SIGTERM (exit 75); {LOGS}"),
    ([-9, 130], [1, 0], [0], 130, f"rank 1 stopped by SIGINT (exit 130); stopped rank 0; {LOGS}"),
    # A rank killed, its peer gone after it, whichever the launcher saw first.
    ([3, -9], [0, 1], [], 137, f"rank 1 failed first (killed by SIGKILL); {LOGS}"),
    ([-15, -9, 3], [1, 2], [0], 137,
     f"rank 1 failed first (killed by SIGKILL); stopped rank 0; {LOGS}"),
    # An error rank 0 named on the terminal itself.
    ([2, 2], [1, 0], [], 2, None),
])
def test_launcher_names_the_rank_that_ended_first(capsys, codes, order, stopped, code, line):
    assert _launcher_exit_code(codes, order, stopped, asked=[], interrupts=0, run_dir=RUN) == code
    err = capsys.readouterr().err.strip()
    assert err == (f"megatron-entropy train: {line}" if line else "")


def _config(tmp_path: Path, model: Path) -> Path:
    config = tmp_path / "c.yaml"
    config.write_text(f"model:\n  hf_path: {model}\nlogging:\n  runs_dir: {tmp_path / 'runs'}\n")
    return config


def test_messages_point_the_right_way(tmp_path, capsys, monkeypatch):
    """A config path that is a folder, a model folder that does not exist, `--nproc` above the
    cores (a warning), the summary of a one-step run."""
    from megatron_entropy import cli
    from megatron_entropy.runtime import run_lock

    def error(*argv: str) -> str:
        assert main(list(argv)) == 2
        return capsys.readouterr().err.strip()

    assert error("train", str(tmp_path)) == (
        f"megatron-entropy train: error: config file '{tmp_path}' is a folder: give a YAML file "
        "in it (e.g. examples/quickstart.yaml)")
    assert error("train", str(_config(tmp_path, tmp_path / "nowhere"))) == (
        f"megatron-entropy train: error: model.hf_path: '{tmp_path / 'nowhere'}' does not exist")
    # Four ranks on two cores are said before they start (here a held run folder stops them).
    config = _config(tmp_path, Path(__file__).parents[2] / "examples" / "quickstart_model")
    (tmp_path / "runs" / "run").mkdir(parents=True)
    held = run_lock.acquire(tmp_path / "runs" / "run" / "train.lock", "run folder")
    monkeypatch.setattr(cli, "usable_cpus", lambda: 2)
    try:
        lines = error("train", str(config), "--nproc", "4").splitlines()
    finally:
        run_lock.release(held)
    assert lines[0] == ("warning: 4 ranks on 2 cores: each rank gets one thread and they take "
                        "turns on the cores, slower than fewer ranks (docs/performance.md)")
    assert "is in use by" in lines[1]
    assert cli.finished_summary(tmp_path, 1).startswith("finished: 1 step; last checkpoint")


def test_the_launcher_checks_the_model_without_torch(tmp_path):
    """`train --nproc 2` checks the config and the model's files (every tensor's name and shape
    from the safetensors headers, the tokenizer) before any rank starts, without loading torch
    (seconds of imports the launcher, which trains nothing itself, does not need): here the
    run folder is held by another trainer, the last check before the ranks would start."""
    from megatron_entropy.runtime import run_lock

    config = _config(tmp_path, Path(__file__).parents[2] / "examples" / "quickstart_model")
    (tmp_path / "runs" / "run").mkdir(parents=True)
    held = run_lock.acquire(tmp_path / "runs" / "run" / "train.lock", "run folder")
    try:
        loaded, err = cli_modules("train", str(config), "--nproc", "2", code=2)
    finally:
        run_lock.release(held)
    assert "is in use by host" in err[-1], err
    assert {"megatron_entropy.models.hf_names", "megatron_entropy.models.tokenizer_files"} \
        <= loaded
    assert "torch" not in loaded
