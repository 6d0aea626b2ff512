"""The package's shape, held by the code itself: no function over MAX_FUNCTION_LINES lines,
imports point down the layer order of docs/architecture.md, and product text speaks of the
product (no tracker numbers or words of the work that made it)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path
from typing import Iterator


ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_entropy"
# A function reads in one screen: from its ``def`` line to its last (a nested function counts in
# its parent and on its own). Modules are cut by job, at any length.
MAX_FUNCTION_LINES = 80

# Bottom to top (docs/architecture.md#layout): a package imports only those before it.
LAYERS = ("settings", "runtime", "ops", "algorithms", "models", "config", "data", "rewards",
          "rollout", "weight_sync", "tool_use", "trainer", "evaluation", "analysis", "launch", "cli",
          "testing")

PRODUCT_TEXT = ("megatron_entropy", "docs", "examples", "bench", "README.md")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".txt", ".toml"}
TRACKER_WORDS = re.compile(
    r"\bissue\s*#?\d+"                       # a tracker number
    r"|\b(?:this|that|the|last|previous|next)\s+session(?:'s)?\b(?!\s+(?:of|leader|id)\b)"
    r"|\bsubmission\b",                      # a round of work, not a process session
    re.IGNORECASE)


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _layer(path: Path) -> str:
    """The top-level part of the package a file belongs to (``cli`` for cli.py)."""
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported(tree: ast.AST, path: Path) -> Iterator[str]:
    """Every ``megatron_entropy`` module a file imports, at the top or inside a function."""
    package = ".".join(("megatron_entropy",) + path.relative_to(PACKAGE).parent.parts)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: resolved against the file's package
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if module == "megatron_entropy":  # `from megatron_entropy import trainer`
                yield from (f"{module}.{a.name}" for a in node.names)
            else:
                yield module


def upward_imports(files: list[Path]) -> list[str]:
    """``file: imports module`` for each import of a package at or above the file's own layer
    (its own package excepted)."""
    found = []
    for path in files:
        layer = _layer(path)
        for module in _imported(ast.parse(path.read_text()), path):
            parts = module.split(".")
            # The root package (its __version__) sits below every layer.
            if parts[0] != "megatron_entropy" or len(parts) < 2 or parts[1] == layer \
                    or parts[1].startswith("__"):
                continue
            if LAYERS.index(parts[1]) > LAYERS.index(layer):
                found.append(f"{path.relative_to(ROOT)}: imports {module}")
    return found


def package_graph(files: list[Path]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (at the top or inside a function)."""
    graph: dict[str, set[str]] = {}
    for path in files:
        layer = _layer(path)
        edges = graph.setdefault(layer, set())
        for module in _imported(ast.parse(path.read_text()), path):
            parts = module.split(".")
            if parts[0] == "megatron_entropy" and len(parts) > 1 and parts[1] != layer \
                    and not parts[1].startswith("__"):
                edges.add(parts[1])
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The packages that import each other in a loop: each strongly connected set of more than
    one package (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while not members or members[-1] != node:
                members.append(stack.pop())
            if len(members) > 1:
                cycles.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(cycles)


def long_functions(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.name}() "
                                 f"{lines} lines")
    return found


def tracker_words(files: list[Path]) -> list[str]:
    found = []
    for path in files:
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for m in TRACKER_WORDS.finditer(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {m.group(0)!r}")
    return found


def _product_text() -> list[Path]:
    files = []
    for name in PRODUCT_TEXT:
        top = ROOT / name
        paths = [top] if top.is_file() else top.rglob("*")
        files += [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts]
    return sorted(files)


def test_every_package_has_a_layer():
    unknown = sorted({_layer(p) for p in _modules()} - set(LAYERS) - {"__init__"})
    assert not unknown, f"add {unknown} to LAYERS (and to docs/architecture.md#layout)"


def test_no_function_is_over_80_lines():
    found = long_functions(_modules())
    assert not found, "split these into steps with names:\n" + "\n".join(found)


def test_imports_point_down():
    found = upward_imports(_modules())
    assert not found, "imports of a higher layer (LAYERS):\n" + "\n".join(found)


def test_no_packages_import_each_other_in_a_loop():
    cycles = import_cycles(package_graph(_modules()))
    assert not cycles, "packages that import each other (directly or around a loop):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)


def test_product_text_has_no_tracker_words():
    found = tracker_words(_product_text())
    assert not found, "say what the product does instead:\n" + "\n".join(found)


def test_the_checks_find_planted_violations(tmp_path, monkeypatch):
    package = tmp_path / "megatron_entropy"
    for sub in ("ops", "runtime", "trainer"):
        (package / sub).mkdir(parents=True)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", package)
    up = package / "ops" / "up.py"
    up.write_text("def f():\n    from megatron_entropy.trainer import loop\n")
    relative = package / "runtime" / "rel.py"
    relative.write_text("from ..config import schema\nfrom megatron_entropy import trainer\n")
    down = package / "trainer" / "down.py"
    down.write_text("from megatron_entropy.ops import covariance\nfrom . import loop\n")
    assert upward_imports([up, relative, down]) == [
        "megatron_entropy/ops/up.py: imports megatron_entropy.trainer",
        "megatron_entropy/runtime/rel.py: imports megatron_entropy.config",
        "megatron_entropy/runtime/rel.py: imports megatron_entropy.trainer"]
    assert import_cycles(package_graph([up, relative, down])) == [["ops", "trainer"]]
    assert import_cycles(package_graph([relative, down])) == []  # all one way
    loop = package / "trainer" / "loop.py"
    loop.write_text("from megatron_entropy.ops import covariance\n")
    back = package / "ops" / "back.py"
    back.write_text("from megatron_entropy.runtime import rel\n")
    assert import_cycles(package_graph([loop, back, relative])) == [["ops", "runtime",
                                                                     "trainer"]]
    long = package / "runtime" / "long.py"
    fits = "def fits():\n" + "    x = 1\n" * (MAX_FUNCTION_LINES - 1)  # the limit exactly
    over = ("class C:\n    async def over(self):\n" + "        x = 1\n" * (MAX_FUNCTION_LINES - 1)
            + "        def inner():\n            pass\n")
    long.write_text(fits + over)
    assert long_functions([long, down]) == [
        f"megatron_entropy/runtime/long.py:{MAX_FUNCTION_LINES + 2}: over() "
        f"{MAX_FUNCTION_LINES + 2} lines"]
    text = tmp_path / "notes.md"
    text.write_text("Fixed in issue 12.\nOn this session's machine.\nIn a session of its own.\n"
                    "aiohttp.ClientSession() as session\n")
    assert [f.split(":")[1] for f in tracker_words([text])] == ["1", "2"]  # lines 3-4: technical
