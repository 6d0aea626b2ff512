"""Train/rollout drift you can act on: |old_logp - engine_logp| per response token (the trainer's
recompute against the engine's log-prob of the token it sampled), per step and data source, and
its trend over the last steps with a warning when it keeps growing.

Per step, over the valid tokens of the whole DP group:
- ``rollout/logprob_drift`` (mean) and ``_max``; per source ``rollout/<source>/logprob_drift``;
- ``rollout/<source>/logprob_drift_p50|p90|p99``: exact quantiles, equal to ``torch.quantile``
  (linear interpolation) over the concatenation of every rank's tokens. Computed by bisection
  on the float64 bit patterns (for non-negative doubles their order is the values' order): each
  of the ~63 rounds all-reduces one count per wanted order statistic, so no rank ever holds
  another rank's tokens (a gather would cost O(tokens of the step) on every rank);
- ``rollout/logprob_drift_slope`` and ``rollout/<source>/logprob_drift_slope``: the
  least-squares slope (nats per step) of the mean over the last ``WINDOW`` steps that trained
  (at least 2).

"Keeps growing": the window is full (``WINDOW`` = 10 steps), its slope is > 0, its last mean is
more than ``GROWTH`` (2) times its first, and the last mean is at least ``FLOOR`` (1e-3 nats;
below that the drift is rounding). One warning line is written when a mean starts growing, and
again only after it has stopped. The window goes into the checkpoint's trainer state, so a
resumed run continues it.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

QUANTILES = (0.5, 0.9, 0.99)
WINDOW = 10
GROWTH = 2.0
FLOOR = 1e-3
STATE_KEY = "drift_trend"
MEAN = "rollout/logprob_drift"
_INF_BITS = int(torch.tensor(float("inf"), dtype=torch.float64).view(torch.int64))


def _source_mean(source: str) -> str:
    return f"rollout/{source}/logprob_drift"


def _all_reduce(t: Tensor, group, op=dist.ReduceOp.SUM) -> Tensor:
    """``t`` reduced over ``group`` (on the GPU under NCCL); itself without a group."""
    if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    dev = t.cuda() if dist.get_backend(group) == "nccl" else t.clone()
    dist.all_reduce(dev, op=op, group=group)
    return dev.cpu()


def exact_quantiles(values: Sequence[Tensor], qs: Sequence[float], group=None) -> Tensor:
    """[len(values), len(qs)]: ``torch.quantile`` of each key's non-negative float64 values,
    concatenated over the ranks of ``group`` (every rank passes its own part of each key, in
    one agreed order; NaN where a key has no value anywhere)."""
    bits = [torch.sort(v.double().reshape(-1).view(torch.int64)).values for v in values]
    counts = _all_reduce(torch.tensor([b.numel() for b in bits], dtype=torch.int64), group)
    q = torch.tensor(list(qs), dtype=torch.float64)
    ranks = q[None, :] * (counts[:, None] - 1).double()           # torch.quantile's positions
    below, above = ranks.long(), ranks.ceil().long()
    wanted = torch.cat([below, above], dim=1)                      # [keys, 2 Q] order statistics
    lo = torch.full(wanted.shape, -1, dtype=torch.int64)           # count(<= lo) <= rank
    hi = torch.full(wanted.shape, _INF_BITS, dtype=torch.int64)    # count(<= hi) > rank
    while bool(((hi - lo) > 1).any()):
        mid = lo + (hi - lo) // 2
        local = torch.stack([torch.searchsorted(b, m, right=True) for b, m in zip(bits, mid)])
        above_mid = _all_reduce(local, group) > wanted              # the statistic is <= mid
        hi, lo = torch.where(above_mid, mid, hi), torch.where(above_mid, lo, mid)
    stats = hi.view(torch.float64)
    n_q = len(qs)
    out = stats[:, :n_q].lerp(stats[:, n_q:], ranks - below)
    return torch.where(counts[:, None] > 0, out, float("nan"))


def drift_metrics(samples: Sequence[Any], group=None) -> dict[str, float]:
    """The step's drift metrics (module docstring) over this rank's samples (``old_logprobs``
    filled) and the DP ``group``; every rank of the group calls it and gets the same dict."""
    per_source: dict[str, list[Tensor]] = defaultdict(list)
    for s in samples:
        if s.response_ids:  # the generated tokens: inserted ones have no engine log-prob
            engine = torch.tensor(s.engine_logprobs, dtype=torch.float64)
            per_source[s.source].append(s.generated((s.old_logprobs.double() - engine).abs()))
    names = sorted(per_source)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, names, group=group)
        names = sorted(set().union(*map(set, gathered)))
    if not names:
        return {}
    values = [torch.cat(per_source[n]) if per_source[n] else torch.zeros(0, dtype=torch.float64)
              for n in names]
    sums = _all_reduce(torch.tensor([[float(v.sum()), v.numel()] for v in values],
                                    dtype=torch.float64), group)
    peak = _all_reduce(torch.tensor([float(v.max()) if v.numel() else 0.0 for v in values],
                                    dtype=torch.float64), group, dist.ReduceOp.MAX)
    quantiles = exact_quantiles(values, QUANTILES, group)
    total, count = sums.sum(0).tolist()
    out = {MEAN: total / count, f"{MEAN}_max": float(peak.max())}
    for name, (s, c), qv in zip(names, sums.tolist(), quantiles.tolist()):
        if c > 0:
            out[_source_mean(name)] = s / c
            for q, v in zip(QUANTILES, qv):
                out[f"{_source_mean(name)}_p{round(q * 100)}"] = v
    return out


def least_squares_slope(points: Sequence[tuple[int, float]]) -> float:
    """Slope of the least-squares line through (step, value) points (at least 2 steps)."""
    x = torch.tensor([p[0] for p in points], dtype=torch.float64)
    y = torch.tensor([p[1] for p in points], dtype=torch.float64)
    dx = x - x.mean()
    return float((dx * (y - y.mean())).sum() / (dx * dx).sum())


class DriftTrend:
    """The per-step mean drift (overall and per source) over the last ``WINDOW`` trained steps;
    ``observe`` adds a step and returns the slopes, warning once when a mean keeps growing."""

    def __init__(self) -> None:
        self.points: dict[str, list[tuple[int, float]]] = {}
        self.growing: set[str] = set()

    def observe(self, step: int, metrics: dict[str, float],
                warn: Optional[Callable[[str], None]] = None) -> dict[str, float]:
        out = {}
        for key in sorted(k for k in metrics if k == MEAN or
                          (k.startswith("rollout/") and k.endswith("/logprob_drift"))):
            window = (self.points.get(key, []) + [(step, float(metrics[key]))])[-WINDOW:]
            self.points[key] = window
            if len(window) < 2:
                continue
            slope = least_squares_slope(window)
            out[f"{key}_slope"] = slope
            first, last = window[0][1], window[-1][1]
            growing = (len(window) == WINDOW and slope > 0 and last > GROWTH * first
                       and last >= FLOOR)
            if growing and key not in self.growing and warn is not None:
                warn(f"warning: {key} keeps growing: {first:.3g} at step {window[0][0]} -> "
                     f"{last:.3g} at step {step} (slope {slope:.2e} nats/step over "
                     f"{WINDOW} steps); the engine and the trainer drift apart (engine "
                     "precision/kernels, weight sync): see algorithm.rollout_correction")
            if growing:
                self.growing.add(key)
            else:
                self.growing.discard(key)
        return out

    def state(self) -> dict[str, Any]:
        """The trainer-state entry of the checkpoint (JSON)."""
        return {STATE_KEY: {"points": {k: [list(p) for p in v] for k, v in self.points.items()},
                            "growing": sorted(self.growing)}}

    def restore(self, saved: dict[str, Any]) -> None:
        """From a checkpoint's trainer state; one written without the window starts empty."""
        state = saved.get(STATE_KEY, {"points": {}, "growing": []})
        self.points = {k: [(int(s), float(v)) for s, v in pts]
                       for k, pts in state["points"].items()}
        self.growing = set(state["growing"])
