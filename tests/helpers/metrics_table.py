"""docs/metrics.md's table (the first one headed `| key | meaning |`) is the one list of metric
names users read: every key a run logs must match one of its entries.

A table row's first cell lists keys in backticks, each written in full or shortened from the
one before it: `_max` after `a/b_mean` is `a/b_max`, `/drift_max` after `w/drift_mean` is
`w/drift_max`, `kl_k3` after `r/kl_k1` is `r/kl_k3`. `<word>` stands for one path segment (a
data source, a phase).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

METRICS_PAGE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _expand(names: list[str]) -> list[str]:
    full: list[str] = []
    for name in names:
        if full and name.startswith("_"):
            name = full[-1].rsplit("_", 1)[0] + name
        elif full and name.startswith("/"):
            name = full[-1].rsplit("/", 1)[0] + name
        elif full and "/" not in name and "/" in full[-1]:
            name = full[-1].rsplit("/", 1)[0] + "/" + name
        full.append(name)
    return full


@functools.lru_cache(maxsize=None)  # read once: tests poll metrics_rows while a run writes
def documented_metrics(page: Path = METRICS_PAGE) -> tuple[re.Pattern, ...]:
    """One pattern per key the metrics table names."""
    lines = page.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if line.replace(" ", "") == "|key|meaning|"),
                 None)
    if start is None:
        raise ValueError(f"{page}: no table headed '| key | meaning |'")
    rows = []
    for line in lines[start + 1:]:
        if rows and not line.startswith("|"):
            break
        if line.startswith("| `"):
            rows.append(line.split(" | ")[0])
    patterns = []
    for cell in rows:
        for name in _expand(re.findall(r"`([^`]+)`", cell)):
            patterns.append(re.compile(re.sub(r"<[a-z_]+>", "[^/]+", re.escape(name)
                                              .replace(r"\<", "<").replace(r"\>", ">"))))
    return tuple(patterns)


def undocumented_metrics(keys, page: Path = METRICS_PAGE) -> list[str]:
    """The keys no entry of the metrics table names (``step`` is the row's index)."""
    patterns = documented_metrics(page)
    return sorted(k for k in set(keys) - {"step"}
                  if not any(p.fullmatch(k) for p in patterns))
