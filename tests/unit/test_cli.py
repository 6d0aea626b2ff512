"""`--help` of every command (and of each sub-command) is plain text: no reStructuredText
markup (double backquotes, roles) from the docstrings it is built from; a bad `--nproc` is one
line."""

from __future__ import annotations

import re

import pytest

from megatron_entropy.cli import _commands, main

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
