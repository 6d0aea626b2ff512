"""`--help` of every command (and of each sub-command) is plain text: no reStructuredText
markup (double backquotes, roles) from the docstrings it is built from; a bad `--nproc` is one
line; how `--nproc`'s launcher reports the way its ranks ended."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
