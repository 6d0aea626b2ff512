"""Train/rollout drift (trainer/drift.py): the per-source quantiles over a DP group equal
torch.quantile over every rank's tokens; the trend's slope is the least-squares line's, its
warning follows the documented rule; the window survives a checkpoint's JSON."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from harness import run_distributed

from megatron_entropy.trainer.batch import Sample
from megatron_entropy.trainer.drift import (FLOOR, QUANTILES, WINDOW, DriftTrend, drift_metrics,
                                            exact_quantiles)

# Rank r's samples: (source, response length); "b" lives on both ranks, "a" and "c" on one each.
RANK_SAMPLES = [[("a", 7), ("b", 12), ("a", 0), ("b", 3)], [("c", 5), ("b", 9), ("b", 1)]]


def _samples(rank: int) -> list[Sample]:
    g = torch.Generator().manual_seed(rank)
    out = []
    for source, n in RANK_SAMPLES[rank]:
        old = -5 * torch.rand(n, generator=g)
        # Drift of several magnitudes, ties included (exact zeros: engine == recompute).
        shift = torch.randn(n, generator=g, dtype=torch.float64) * \
            10.0 ** torch.randint(-6, 0, (n,), generator=g)
        shift[::4] = 0
        out.append(Sample(prompt_ids=[1, 2], response_ids=list(range(3, 3 + n)),
                          engine_logprobs=(old.double() + shift).tolist(), reward=0.0, group=0,
                          source=source, old_logprobs=old))
    return out


def _drift_worker():
    import torch.distributed as dist

    return drift_metrics(_samples(dist.get_rank()), dist.group.WORLD)


def test_quantiles_over_the_dp_group_equal_torch_quantile_of_every_token():
    got = run_distributed(_drift_worker, 2)
    assert got[0] == got[1]  # every rank the same
    m = got[0]
    tokens: dict[str, list] = {}
    for rank in range(2):
        for s in _samples(rank):
            d = (s.old_logprobs.double() - torch.tensor(s.engine_logprobs,
                                                        dtype=torch.float64)).abs()
            tokens.setdefault(s.source, []).append(d)
    every = torch.cat([t for parts in tokens.values() for t in parts])
    assert sorted(k for k in m if k.endswith("_p50")) == \
        [f"rollout/{s}/logprob_drift_p50" for s in "abc"]
    for source, parts in tokens.items():
        values = torch.cat(parts)
        want = torch.quantile(values, torch.tensor(QUANTILES, dtype=torch.float64))
        for q, w in zip(QUANTILES, want.tolist()):
            assert m[f"rollout/{source}/logprob_drift_p{round(q * 100)}"] == w  # exact
        # Sums of a few dozen float64 terms in another order.
        assert m[f"rollout/{source}/logprob_drift"] == pytest.approx(float(values.mean()),
                                                                      rel=1e-14)
    assert m["rollout/logprob_drift"] == pytest.approx(float(every.mean()), rel=1e-14)
    assert m["rollout/logprob_drift_max"] == float(every.max())


def test_exact_quantiles_of_few_values_and_of_none():
    one, two = torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.0, 4.0],
                                                                      dtype=torch.float64)
    out = exact_quantiles([one, two, torch.zeros(0, dtype=torch.float64)], (0.0, 0.25, 1.0))
    assert out[0].tolist() == [0.3] * 3
    assert out[1].tolist() == [0.0, 1.0, 4.0]
    assert torch.isnan(out[2]).all()


def _observe(trend: DriftTrend, series, start: int = 1, key: str = "rollout/logprob_drift"):
    warnings: list[str] = []
    slopes = [trend.observe(step, {key: v}, warnings.append).get(f"{key}_slope")
              for step, v in enumerate(series, start)]
    return slopes, warnings


def test_slope_is_the_least_squares_line_over_the_window():
    series = [0.02, 0.011, 0.05, 0.013, 0.04, 0.02, 0.018, 0.03, 0.02, 0.025, 0.015, 0.01]
    slopes, warnings = _observe(DriftTrend(), series)
    assert slopes[0] is None  # one point has no slope
    for i in range(1, len(series)):
        first = max(0, i + 1 - WINDOW)
        x = np.arange(first + 1, i + 2)
        assert slopes[i] == pytest.approx(np.polyfit(x, series[first:i + 1], 1)[0], rel=1e-9,
                                          abs=1e-15)
    assert not warnings  # not growing: last <= 2 x first in every window


def test_warning_when_the_drift_keeps_growing_and_again_only_after_it_stopped():
    # 0.011 -> 0.036 over 30 steps (the slime + SGLang report): x1.042 per step, so a window of
    # 10 (9 steps apart) grows x1.45 < 2: not yet "keeps growing"; x1.1 per step grows x2.36.
    slow = [0.011 * 1.042 ** i for i in range(30)]
    _, warnings = _observe(DriftTrend(), slow)
    assert not warnings
    fast = [0.01 * 1.1 ** i for i in range(15)]
    plateau = [fast[-1]] * 12
    again = [fast[-1] * 1.1 ** i for i in range(1, 12)]
    trend = DriftTrend()
    _, first = _observe(trend, fast)
    assert len(first) == 1 and "at step 10" in first[0] and "keeps growing" in first[0]
    _, flat = _observe(trend, plateau, start=16)
    assert not flat
    _, second = _observe(trend, again, start=28)
    # Warned again when the window grows x2 once more: 1.1^8 > 2 at step 28 + 7.
    assert len(second) == 1 and "at step 35" in second[0]
    # Tiny drift (rounding) grows without a warning; a source's mean gets its own trend.
    tiny = [FLOOR / 100 * 1.2 ** i for i in range(12)]
    _, quiet = _observe(DriftTrend(), tiny, key="rollout/math/logprob_drift")
    assert not quiet
    _, loud = _observe(DriftTrend(), [v * 1000 for v in tiny], key="rollout/math/logprob_drift")
    assert len(loud) == 1 and loud[0].startswith("warning: rollout/math/logprob_drift keeps")


def test_the_window_survives_the_checkpoint():
    series = [0.01 * 1.1 ** i for i in range(14)]
    whole = DriftTrend()
    want_slopes, want_warnings = _observe(whole, series)
    before = DriftTrend()
    slopes, warnings = _observe(before, series[:12])
    after = DriftTrend()
    after.restore(json.loads(json.dumps(before.state())))  # as trainer_state.json holds it
    more, more_warnings = _observe(after, series[12:], start=13)
    assert slopes + more == want_slopes
    assert warnings + more_warnings == want_warnings and len(want_warnings) == 1
    fresh = DriftTrend()
    fresh.restore({})  # a checkpoint written before the window existed: starts empty
    assert fresh.points == {} and fresh.growing == set()
