"""The entropy-ops benchmark runs end to end (quick mode) and counts the collectives it reports."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_bench_quick_mode_runs_and_counts_collectives():
    out = subprocess.run([sys.executable, "bench/bench_entropy_ops.py", "--quick", "--reps", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # Without verl the first line says why (the import error), not only that it is missing.
    assert re.search(r"verl (available|unavailable \(\w+(Error|Exception): .+\));", out.stdout), \
        out.stdout[:500]
    rows = [[c.strip() for c in line.strip("|").split("|")]
            for line in out.stdout.splitlines() if line.startswith("| logits") or
            line.startswith("| hidden")]
    by_key = {(r[0], r[1], r[5]): r for r in rows}
    for scenario in ("logits", "hidden H=64"):
        assert by_key[(scenario, "1", "ours-chunked")][10] == "0/0"
        assert by_key[(scenario, "2", "ours-chunked")][10] == "1/0"
    assert by_key[("hidden H=64", "2", "ours-fused")][10] == "1/0"
    # Every measured row has a positive time and a peak.
    for r in rows:
        if r[6] not in ("unavailable",) and not r[6].startswith("skipped"):
            assert float(r[6]) > 0 and float(r[9]) >= 0
