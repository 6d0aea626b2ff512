"""The quickstart figures README.md quotes are those of the pages that record them: its table of
three losses is docs/results.md's quickstart table, its validation accuracy that table's KL-Cov
row, its time examples/README.md's, its step count examples/quickstart.yaml's. (The
recipe table of examples/README.md is held to `plan` in tests/unit/launch/test_plan.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[3]


def _rows(text: str, header_start: str) -> dict[str, list[str]]:
    """The rows of the first Markdown table whose header starts with ``header_start``: first
    cell -> the other cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"| {header_start}"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        rows[cells[0]] = cells[1:]
    return rows


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]



def test_readme_quickstart_table_is_the_one_in_results():
    readme = _rows(_section((ROOT / "README.md").read_text(), "Results"), "loss")
    recorded = _rows(_section((ROOT / "docs" / "results.md").read_text(),
                              "The quickstart, three losses"), "loss")
    assert readme and set(readme) == set(recorded)
    for loss, (val, selected, drift) in readme.items():
        series, _, _, recorded_selected, recorded_drift, _ = recorded[loss]
        accuracies = series.split(" / ")
        assert val == f"{accuracies[0]} -> {accuracies[-1]}", loss
        assert (selected, drift) == (recorded_selected, recorded_drift), loss


def test_readme_quickstart_run_is_the_recorded_one():
    """The steps and validation accuracy the README's quickstart states are the config's and
    docs/results.md's KL-Cov row; its measured time is the one examples/README.md states."""
    quickstart = " ".join(_section((ROOT / "README.md").read_text(), "Quickstart").split())
    said = re.search(r"(\d+) steps, val ([\d.]+) -> ([\d.]+)\.", quickstart)
    steps, start, end = said.groups()
    config = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    assert int(steps) == config["trainer"]["steps"]
    recorded = _rows(_section((ROOT / "docs" / "results.md").read_text(),
                              "The quickstart, three losses"), "loss")
    series = recorded["KL-Cov (k = 2e-3)"][0].split(" / ")
    assert (start, end) == (series[0], series[-1])
    took = re.search(r"It took (\d+:\d\d on [^(]*?) \(", quickstart).group(1)
    examples = " ".join((ROOT / "examples" / "README.md").read_text().split())
    assert f"({took};" in examples
