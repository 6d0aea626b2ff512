"""The entropy-performance law R = -a * exp(H) + b (Cui et al., 2025).

It is linear in x = exp(H), so a and b come from ordinary least squares; at H = 0 the law predicts
the ceiling R = b - a. ``fit_and_predict`` fits on the first k points and reports how well that fit
predicts the rest (the paper's claim that the end of training is predictable from its start).
``ceiling_interval`` gives a seeded bootstrap interval of the ceiling.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

# Below this R^2 the law explains less than half of the variance: it does not describe the run.
R2_WARNING = 0.5


@dataclass(frozen=True)
class EntropyLawFit:
    a: float
    b: float
    r2: float  # coefficient of determination on the fitted points
    n: int

    @property
    def ceiling(self) -> float:
        """Predicted performance when entropy is exhausted (H = 0)."""
        return self.b - self.a

    def predict(self, entropy: Sequence[float]) -> np.ndarray:
        return -self.a * np.exp(np.asarray(entropy, dtype=np.float64)) + self.b

    def to_dict(self) -> dict[str, float]:
        return {**asdict(self), "ceiling": self.ceiling}


def _clean(entropy: Sequence[float], reward: Sequence[float]) -> tuple[np.ndarray, np.ndarray]:
    h = np.asarray(entropy, dtype=np.float64)
    r = np.asarray(reward, dtype=np.float64)
    if h.shape != r.shape or h.ndim != 1:
        raise ValueError(f"entropy and reward must be 1-D of the same length, got {h.shape} and "
                         f"{r.shape}")
    keep = np.isfinite(h) & np.isfinite(r)
    return h[keep], r[keep]


def fit_entropy_law(entropy: Sequence[float], reward: Sequence[float]) -> EntropyLawFit:
    """Least-squares fit of R = -a*exp(H) + b; non-finite pairs are ignored."""
    h, r = _clean(entropy, reward)
    if len(h) < 2:
        raise ValueError(f"need at least 2 (entropy, reward) points to fit, got {len(h)}")
    x = np.exp(h)
    if np.ptp(x) == 0:
        raise ValueError("all entropy values are equal: the law's slope is undetermined")
    design = np.stack([-x, np.ones_like(x)], axis=1)
    (a, b), *_ = np.linalg.lstsq(design, r, rcond=None)
    resid = r - design @ np.array([a, b])
    total = float(((r - r.mean()) ** 2).sum())
    r2 = 1.0 - float((resid ** 2).sum()) / total if total > 0 else 1.0
    return EntropyLawFit(a=float(a), b=float(b), r2=r2, n=len(h))


def law_warning(fit: EntropyLawFit, reward: Sequence[float]) -> str:
    """A warning when the law does not describe the points it was fitted to, else ''."""
    r = np.asarray(reward, dtype=np.float64)
    r = r[np.isfinite(r)]
    if r.size and np.ptp(r) == 0:
        return ("the performance is the same at every step: the law is undetermined (its R^2 of "
                "1 says nothing)")
    if fit.r2 >= R2_WARNING:
        return ""
    return (f"R^2 = {fit.r2:.3f} < {R2_WARNING}: the entropy law does not describe this run; "
            "a, b and the ceiling b - a say little about it")


@dataclass(frozen=True)
class CeilingInterval:
    low: float
    high: float
    confidence: float
    resamples: int  # resamples with a determined slope (others are dropped)
    seed: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def ceiling_interval(entropy: Sequence[float], reward: Sequence[float], resamples: int = 1000,
                     confidence: float = 0.95, seed: int = 0) -> CeilingInterval:
    """Percentile bootstrap interval of the ceiling b - a: the (H, R) pairs are resampled with
    replacement ``resamples`` times from ``np.random.default_rng(seed)`` (reproducible), the law
    refitted on each; resamples whose entropies are all equal have no slope and are dropped.
    Pairs are treated as exchangeable, which steps of one run are only approximately."""
    h, r = _clean(entropy, reward)
    if len(h) < 3:
        raise ValueError(f"need at least 3 (entropy, reward) points for an interval, got {len(h)}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    if resamples < 1:
        raise ValueError(f"resamples must be >= 1, got {resamples}")
    x = np.exp(h)
    idx = np.random.default_rng(seed).integers(0, len(h), size=(resamples, len(h)))
    xs, rs = x[idx], r[idx]
    dx = xs - xs.mean(axis=1, keepdims=True)
    sxx = (dx * dx).sum(axis=1)
    ok = sxx > 1e-12 * (x * x).sum()  # all-equal draws leave only rounding in sxx
    if not ok.any():
        raise ValueError("every resample has equal entropies: the ceiling is undetermined")
    slope = (dx[ok] * (rs[ok] - rs[ok].mean(axis=1, keepdims=True))).sum(axis=1) / sxx[ok]
    # R = slope * x + intercept with slope = -a, so the ceiling (x = exp(0) = 1) is
    # intercept + slope = mean R + slope * (1 - mean x).
    ceilings = rs[ok].mean(axis=1) + slope * (1.0 - xs[ok].mean(axis=1))
    tail = (1.0 - confidence) / 2 * 100
    low, high = np.percentile(ceilings, [tail, 100 - tail])
    return CeilingInterval(low=float(low), high=float(high), confidence=confidence,
                           resamples=int(ok.sum()), seed=seed)


@dataclass(frozen=True)
class Extrapolation:
    fit: EntropyLawFit  # on the first k points
    k: int
    mae: float  # mean |predicted - actual| on the points after the first k
    rmse: float
    max_abs_error: float
    final_error: float  # predicted - actual at the last point

    def to_dict(self) -> dict[str, float]:
        return {"k": self.k, "mae": self.mae, "rmse": self.rmse,
                "max_abs_error": self.max_abs_error, "final_error": self.final_error,
                **{f"fit/{key}": v for key, v in self.fit.to_dict().items()}}


def fit_and_predict(entropy: Sequence[float], reward: Sequence[float], k: int) -> Extrapolation:
    """Fit on the first ``k`` (finite) points, predict the remaining ones."""
    h, r = _clean(entropy, reward)
    if not 2 <= k < len(h):
        raise ValueError(f"k must be in [2, {len(h) - 1}] for {len(h)} points, got {k}")
    fit = fit_entropy_law(h[:k], r[:k])
    err = fit.predict(h[k:]) - r[k:]
    return Extrapolation(fit=fit, k=k, mae=float(np.abs(err).mean()),
                         rmse=float(np.sqrt((err ** 2).mean())),
                         max_abs_error=float(np.abs(err).max()), final_error=float(err[-1]))
