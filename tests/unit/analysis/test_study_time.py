"""The study's run time (analysis/study.py::elapsed_seconds): the union of its runs' recorded
attempts, so runs trained at once (``study.jobs``) count once, against a sum worked by hand."""

from __future__ import annotations

import pytest

from megatron_entropy.analysis.study import elapsed_seconds


def _attempt(start, wall):
    return {"start_unix": start, "wall_s": wall}


def test_overlapping_attempts_count_once_and_older_records_count_whole():
    states = [
        {"attempts": [_attempt(100.0, 50.0), _attempt(300.0, 10.0)]},  # 100-150, 300-310
        {"attempts": [_attempt(120.0, 60.0)]},  # 120-180: overlaps the first
        {"attempts": [_attempt(130.0, 5.0)]},  # inside both
        {"attempts": [{"wall_s": 7.0}, {"wall_s": None}]},  # recorded before start times were
        None,  # a run not started
        {"attempts": [_attempt(400.0, None)]},  # killed with its study: no time recorded
    ]
    # 100-180 (80) + 300-310 (10) + 7.
    assert elapsed_seconds(states) == pytest.approx(97.0)
    # One run at a time: the sum.
    assert elapsed_seconds([{"attempts": [_attempt(0.0, 3.0), _attempt(3.0, 4.0)]}]) == 7.0
