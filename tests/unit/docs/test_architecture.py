"""docs/architecture.md names only modules that exist: every path of the package it spells out
(``megatron_entropy/trainer/loop.py``, ``rollout/server/``, ``models/bridge.py``), and in the
layout's tree every ``name.py`` said of a package is a module of that package (or of one of its
sub-packages), every package of the tree a folder of the package. A module renamed or removed
without its page fails here."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = ROOT / "megatron_entropy"
PAGE = ROOT / "docs" / "architecture.md"
# A path of the package, spelled from its top or from one of its packages.
PATH = re.compile(r"(?<![\w./-])((?:megatron_entropy/)?(?:[a-z_]+/)+(?:[a-z_]+\.py)?)")
MODULE = re.compile(r"(?<![\w./-])([a-z_]+\.py)\b")
TREE_ENTRY = re.compile(r"^  ([a-z_]+)(/|\.py)\s")


def _exists(path: str) -> bool:
    rel = path.removeprefix("megatron_entropy/")
    return (PACKAGE / rel).exists()


def named_paths(text: str) -> list[str]:
    """The package paths the page spells out that do not exist: those from the package's top
    (``megatron_entropy/...``) or from one of its packages (``models/bridge.py``); other
    folders (``tests/unit/``, ``jsonl/parquet``) are not the package's."""
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    missing = []
    for path in PATH.findall(text):
        first = path.split("/")[0]
        if first in packages | {"megatron_entropy"} and not _exists(path):
            missing.append(path)
    return sorted(set(missing))


def tree_modules(text: str) -> list[str]:
    """In the layout's tree (``megatron_entropy/`` and its indented entries): each package that
    is not a folder of the package, each ``name.py`` its lines name that none of its modules is
    (nor a module at the package's top, as settings.py)."""
    block = text.split("\nmegatron_entropy/\n", 1)[1].split("\n```", 1)[0]
    missing, package = [], None
    for line in block.splitlines():
        entry = TREE_ENTRY.match(line)
        if entry:
            name, kind = entry.groups()
            package = PACKAGE / name if kind == "/" else None
            if not (PACKAGE / (name + kind)).exists():
                missing.append(name + kind)
        elif not line.startswith("   "):
            package = None  # past the package's entries (tools/, tests/ ...)
        if package is not None:
            for module in MODULE.findall(line.split("  ", 2)[-1] if entry else line):
                if not any(package.rglob(module)) and not (PACKAGE / module).is_file():
                    missing.append(f"{package.name}/{module}")
    return missing


def test_every_module_the_page_names_exists():
    text = PAGE.read_text()
    assert named_paths(text) == []
    assert tree_modules(text) == []


def test_the_checks_find_a_module_that_is_not_there():
    text = PAGE.read_text()
    gone = text.replace("(roles.py: replica leader", "(parts.py: replica leader")
    assert tree_modules(gone) == ["runtime/parts.py"]
    assert named_paths("see `megatron_entropy/trainer/looping.py` and `rollout/servers/`") == [
        "megatron_entropy/trainer/looping.py", "rollout/servers/"]
    assert named_paths("`tests/unit/x.py`, `docs/a/`, jsonl/parquet") == []
