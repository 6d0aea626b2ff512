"""The lemma's metrics (trainer/entropy_change.py, ``lemma_metrics``) against their formulas on
the pooled tokens, when the tokens are split over two DP ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import run_distributed

from megatron_entropy.trainer.entropy_change import lemma_metrics


def _tokens(n: int = 40, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    before = torch.rand(n, generator=g, dtype=torch.float64) * 2
    prediction = torch.randn(n, generator=g, dtype=torch.float64) * 0.01
    after = before + 0.9 * prediction + 0.002 * torch.randn(n, generator=g, dtype=torch.float64)
    old_logp = -torch.rand(n, generator=g, dtype=torch.float64) * 5
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return before, after, prediction, old_logp, adv


def _reference(before, after, prediction, old_logp, adv) -> dict:
    delta = (after - before).numpy()
    pg = (-(old_logp - old_logp.mean()) * (adv - adv.mean())).numpy()
    out = {}
    for name, x in (("", prediction.numpy()), ("pg_", pg)):
        out[f"lemma/{name}corr"] = float(np.corrcoef(x, delta)[0, 1])
        out[f"lemma/{name}slope"] = float(np.polyfit(x, delta, 1)[0])
    out["lemma/delta_mean"] = float(delta.mean())
    out["lemma/prediction_mean"] = float(prediction.mean())
    out["lemma/tokens"] = float(len(delta))
    return out


def _worker():
    import torch.distributed as dist

    rank = dist.get_rank()
    parts = [t[:13] if rank == 0 else t[13:] for t in _tokens()]
    return lemma_metrics(*parts, group=dist.group.WORLD)


def test_lemma_metrics_over_two_ranks_equal_the_pooled_formulas():
    want = _reference(*_tokens())
    assert 0.9 < want["lemma/corr"] < 1 and abs(want["lemma/slope"] - 0.9) < 0.05
    for got in run_distributed(_worker, 2) + [lemma_metrics(*_tokens())]:
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
