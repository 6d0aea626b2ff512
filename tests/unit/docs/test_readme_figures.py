"""The quickstart figures README.md quotes are those of the pages that record them: its table of
three losses is docs/results.md's quickstart table, its time is examples/README.md's and covers
the wall times docs/results.md measured, its step count is examples/quickstart.yaml's. (The
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


def _minutes(clock: str) -> float:
    minutes, seconds = clock.split(":")
    return int(minutes) + int(seconds) / 60


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


def test_readme_quickstart_time_is_the_recorded_one():
    said = re.search(r"^(\d+) steps, ([\d.]+)-([\d.]+) minutes on 2 CPU cores \(([^)]*)\)",
                     (ROOT / "README.md").read_text(), re.M)
    steps, low, high, machines = said.groups()
    examples = (ROOT / "examples" / "README.md").read_text()
    assert f"takes {low}-{high} minutes on 2 CPU cores ({steps} steps; {machines})" in examples
    config = yaml.safe_load((ROOT / "examples" / "quickstart.yaml").read_text())
    assert int(steps) == config["trainer"]["steps"]
    results = (ROOT / "docs" / "results.md").read_text()
    walls = [row[-1] for row in _rows(_section(results, "The quickstart, three losses"),
                                      "loss").values()]
    for clock in walls + re.findall(r"\d+:\d\d", machines):
        assert float(low) <= _minutes(clock) <= float(high), clock
