"""Clipping rules that act on the entropy: Entropy Ratio Clipping and dynamic clip thresholds.

Entropy Ratio Clipping (Su et al., "Entropy Ratio Clipping as a Soft Global Constraint for Stable
Reinforcement Learning", arXiv 2512.05591; the authors' compute_policy_loss_grpo_erc): with
rho_t = (H_t + 1e-8) / (H_old_t + 1e-8), H_t the entropy of the training forward (detached) and
H_old_t the old policy's at the same position, a token with rho_t outside (low, high) keeps its
policy-gradient term's value but passes no gradient. Pointwise: no population, the same at every
split and layout. Composes with every token-level loss (the paper adds it to DAPO and GPPO).

Dynamic clip thresholds (Chen et al., "Flexible Entropy Control in RLVR with Gradient-Preserving
Perspective", arXiv 2602.09782): clip_ratio_high moves over the run along a shape, t = (step - 1)
/ (steps - 1) in [0, 1], eps0 = the loss's clip_ratio_high, peak = ``high_peak``:
- increase_decrease: eps0 -> peak at t = 1/2 -> eps0 (linear);
- decrease_increase_decrease: eps0 -> ``high_floor`` at 1/3 -> peak at 2/3 -> floor at 1;
- oscillating_decay: eps0 + (peak - eps0) (1 - t) |sin(pi periods t)|.
A wider upper clip lets positive-advantage tokens with high ratios (rare tokens gaining
probability) keep their gradient, which raises the entropy; a narrower one lowers it. The
paper's full text was not available here: the three shapes follow its abstract's names, their
exact forms are this project's (docs/algorithms/clipping.md).
"""

from __future__ import annotations

import math

from torch import Tensor

from megatron_entropy.algorithms.method_settings import (ClipScheduleSettings,
                                                         EntropyRatioClipSettings)


def entropy_ratio_outside(settings: EntropyRatioClipSettings, entropy: Tensor,
                          old_entropy: Tensor, mask: Tensor) -> Tensor:
    """bool [B, S]: valid tokens whose entropy ratio leaves (low, high) (their policy term is
    detached)."""
    ratio = (entropy.detach().double() + 1e-8) / (old_entropy.detach().double() + 1e-8)
    inside = (ratio > settings.low) & (ratio < settings.high)
    return mask.bool() & ~inside


def _linear(t: float, points: list[tuple[float, float]]) -> float:
    for (t0, v0), (t1, v1) in zip(points, points[1:]):
        if t <= t1:
            return v0 + (v1 - v0) * (t - t0) / (t1 - t0)
    return points[-1][1]


def scheduled_clip_high(settings: ClipScheduleSettings, base: float, step: int,
                        steps: int) -> float:
    """clip_ratio_high at RL step ``step`` (1-based) of ``steps``."""
    t = (step - 1) / max(steps - 1, 1)
    peak, floor = settings.high_peak, settings.high_floor
    if settings.shape == "constant":
        return base
    if settings.shape == "increase_decrease":
        return _linear(t, [(0.0, base), (0.5, peak), (1.0, base)])
    if settings.shape == "decrease_increase_decrease":
        return _linear(t, [(0.0, base), (1 / 3, floor), (2 / 3, peak), (1.0, floor)])
    return base + (peak - base) * (1 - t) * abs(math.sin(math.pi * settings.periods * t))


def clip_schedule_knobs(settings: ClipScheduleSettings, base: float, step: int,
                        steps: int) -> dict[str, float]:
    """The step's loss knob ({} when the schedule is constant), as the entropy controller's."""
    if settings.shape == "constant":
        return {}
    return {"clip_ratio_high": scheduled_clip_high(settings, base, step, steps)}


