"""`megatron-entropy examples`: the shipped examples copied out whole; an existing folder is
refused in one line and left as it was."""

from __future__ import annotations

from pathlib import Path

from megatron_entropy.cli import main
from megatron_entropy.launch.examples import shipped_examples

REPO = Path(__file__).resolve().parents[3]


def _files(top: Path) -> set[str]:
    return {p.relative_to(top).as_posix() for p in top.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_examples_are_copied_whole(tmp_path, capsys):
    assert shipped_examples() == REPO / "examples"  # a checkout: beside the package
    assert main(["examples", str(tmp_path)]) == 0
    assert _files(tmp_path / "examples") == _files(REPO / "examples")
    assert capsys.readouterr().out.splitlines()[-1] == \
        f"  cd {tmp_path} && megatron-entropy train examples/quickstart.yaml"


def test_an_existing_folder_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "examples").mkdir()
    (tmp_path / "examples" / "mine.yaml").write_text("a: 1\n")
    assert main(["examples", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"megatron-entropy examples: error: {tmp_path / 'examples'} exists; name another folder")
    assert _files(tmp_path / "examples") == {"mine.yaml"}
