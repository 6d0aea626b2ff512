"""docs/configuration.md is generated from the settings classes
(megatron_entropy/config/reference.py): it must equal the generator's output, name every key
of the config tree, and show each key's default, bounds and help as the field defines them; a
key without a help line fails."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

from megatron_entropy.cli import main
from megatron_entropy.config import Config
from megatron_entropy.config.reference import COMMAND, PAGE, config_reference, type_name

ROOT = Path(__file__).resolve().parents[3]


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every dotted key of the tree by walking the dataclasses (not the generator's own walk)."""
    keys = []
    for f in dataclasses.fields(cls):
        default = (f.default_factory() if f.default_factory is not dataclasses.MISSING
                   else f.default)
        if dataclasses.is_dataclass(default):
            keys += _leaf_keys(type(default), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_the_page_is_the_generators_output():
    page = (ROOT / PAGE).read_text()
    assert page == config_reference(), (
        f"{PAGE} is out of date with the settings classes; regenerate it: {COMMAND}")


def test_every_key_is_documented_with_its_default_bounds_and_help():
    text = config_reference()
    keys = _leaf_keys(Config)
    assert len(keys) > 150
    missing = [k for k in keys if f"| `{k}` |" not in text]
    assert not missing, missing
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    no_help = [row.split(" | ")[0][2:] for row in rows if row.endswith("|  |")]
    assert not no_help, f"keys without a help line (add help= to the setting): {no_help}"
    row = next(line for line in text.splitlines() if line.startswith("| `model.seq_length` |"))
    f = next(f for f in dataclasses.fields(type(Config().model)) if f.name == "seq_length")
    assert f"`{f.default}`" in row and f">= {f.metadata['ge']}" in row
    assert f.metadata["help"] in row


def test_type_names():
    assert type_name(Optional[str]) == "str or null"
    assert type_name(list[int]) == "list of int"
    assert type_name(Literal["a", "b"]) == "one of `a`, `b`"
    assert type_name(Optional[Literal["a", 1]]) == "one of `a`, 1 or null"


def test_the_command_prints_it(capsys, tmp_path):
    assert main(["config-reference"]) == 0
    assert capsys.readouterr().out == config_reference()
    out = tmp_path / "configuration.md"
    assert main(["config-reference", "--out", str(out)]) == 0
    assert out.read_text() == config_reference()
