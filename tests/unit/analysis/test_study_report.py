"""The study report's plateau judgement (analysis/study_report.py::plateau) against the
least-squares line computed here by hand."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from megatron_entropy.analysis.study_report import plateau


def _result(values: dict[int, float], steps: int) -> SimpleNamespace:
    records = [{"step": s, "val/acc/mean": v} for s, v in sorted(values.items())]
    records.insert(1, {"step": 1, "entropy/seq_mean": 0.5})  # a step without validation
    return SimpleNamespace(records=records, steps=steps)


def _rise_and_se(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """The fitted line's rise over x's span and its standard error, from the normal equations."""
    design = np.stack([np.ones_like(x), x], axis=1)
    coef, res, _, _ = np.linalg.lstsq(design, y, rcond=None)
    sigma2 = float(res[0]) / (len(x) - 2)
    var_slope = sigma2 * np.linalg.inv(design.T @ design)[1, 1]
    span = x[-1] - x[0]
    return float(coef[1] * span), math.sqrt(var_slope) * span


def test_flat_noisy_points_are_a_plateau_and_the_numbers_are_the_fits():
    rng = np.random.default_rng(3)
    steps = np.arange(0, 61, 4)
    runs = [_result({int(s): 0.6 + rng.normal(0, 0.01) for s in steps}, 60) for _ in range(3)]
    got = plateau(runs)
    rises, ses = [], []
    for run in runs:
        pts = [(r["step"], r["val/acc/mean"]) for r in run.records
               if "val/acc/mean" in r and r["step"] >= 40]
        x, y = np.array(pts, dtype=float).T
        rise, se = _rise_and_se(x, y)
        rises.append(rise)
        ses.append(se)
    assert got["from_step"] == 40
    assert got["rise"] == pytest.approx(np.mean(rises), abs=1e-12)
    assert got["se"] == pytest.approx(math.sqrt(sum(s * s for s in ses)) / 3, rel=1e-9)
    assert got["level"] == pytest.approx(np.mean([r["val/acc/mean"] for run in runs
                                                  for r in run.records
                                                  if r["step"] >= 40 and "val/acc/mean" in r]))
    assert got["flat"]


def test_points_still_rising_are_no_plateau():
    steps = range(0, 61, 4)
    runs = [_result({s: 0.3 + 0.01 * s + 0.004 * (-1) ** (s // 4) for s in steps}, 60)]
    got = plateau(runs)
    assert got["rise"] == pytest.approx(0.2, abs=0.01) and not got["flat"]


def test_a_measurable_rise_under_two_points_is_still_a_plateau():
    """A nearly deterministic policy: points 0.1 points apart, rising by 1 point over the
    window, many standard errors, yet no longer improving in any sense that matters."""
    steps = range(0, 61, 4)
    runs = [_result({s: 0.6 + 0.0005 * (s - 40) * (s >= 40) + 0.001 * (-1) ** (s // 4)
                     for s in steps}, 60)]
    got = plateau(runs)
    assert 0.009 < got["rise"] < 0.011 and got["rise"] > 4 * got["se"] and got["flat"]


def test_too_few_points_in_the_window_is_not_judged():
    assert plateau([_result({0: 0.3, 30: 0.5, 50: 0.6, 60: 0.6}, 60)]) is None
