"""Entropy regularisers whose strength adapts: SIREN's selective, self-anchored term, Skywork-OR1's
adaptive entropy coefficient, and AER's difficulty-weighted coefficient.

All three measure an entropy per optimizer step k over the step's population (every valid token
of the step on every DP rank; the entropies the step selects with, ``global_selection_logprobs``:
the recompute's or a fresh pass, equal to the training forward's on the first update of an
on-policy step). Every rank reduces the same numbers in rank order, so the controllers' floats
agree on every rank without a collective of their own.

SIREN ("Rethinking Entropy Regularization in Large Reasoning Models", arXiv 2509.25133; the
authors' dp_actor.py). H^p(t) is the entropy of the top-p nucleus at token t
(ops/vocab_stats.py); the peak mask keeps each response's tokens above its own
``peak_quantile`` of H^p (the order statistic of ops/quantile.py: the authors' nanquantile up to
interpolation rounding); the step's value is the sequence mean of each response's token mean
over its masked tokens,

    Hbar_k = (1/N) sum_i (1/|M_i|) sum_{t in M_i} H^p(t),   N = responses with a masked token,

and the loss gains coef (Hbar - H_anchor)^2, H_anchor = Hbar of the run's first step (over the
whole step, as the authors' trainer sets it from the first batch). Its gradient, 2 coef (Hbar -
H_anchor) dHbar, is taken with Hbar_k from the selecting pass (a number for the whole step) and
dHbar from the training forward's H^p (with gradient), so it does not depend on the split; the
authors square each micro-batch's own Hbar (weighted by its share), which does.

Skywork-OR1 ("Skywork Open Reasoner 1 Technical Report", arXiv 2505.22312; TRL's
use_adaptive_entropy): with e_k the step's token-mean entropy, the bonus coefficient is
alpha_k = c_k 1[e_k <= target], and c_{k+1} = clip(c_k + delta, min, max) if e_k <= target else
clip(c_k - delta, min, max); c_0 = ``initial``.

AER (Zhang et al., "Rediscovering Entropy Regularization: Adaptive Coefficient Unlocks Its
Potential for LLM Reinforcement Learning", arXiv 2510.10959). Its three parts: difficulty-aware
allocation, each response's bonus weighted by w = 1 - (its prompt's accuracy over its group);
an initial-anchored target H* = target_ratio x e_0 (e_0 the run's first step's entropy); and a
global coefficient alpha_{k+1} = clip(alpha_k + lr (H* - e_k) / H*, 0, coef_max). The paper's
full text was not available here: the form of the allocation and of the update are this
project's reading of its abstract and summaries (docs/algorithms/entropy_regularizers.md).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.algorithms.method_settings import AdaptiveEntropySettings, AERSettings
from megatron_entropy.ops import covariance as cov_ops
from megatron_entropy.ops import quantile


def step_token_mean(values: Sequence[Tensor], masks: Sequence[Tensor],
                    group: Optional[dist.ProcessGroup]) -> float:
    """Token mean of ``values`` over every rank's valid tokens (float64, one all-gather)."""
    device = masks[0].device if masks else torch.device("cpu")
    local = torch.zeros(2, dtype=torch.float64, device=device)
    for v, m in zip(values, masks):
        valid = m.bool()
        local[0] += torch.where(valid, v.detach().double(), 0).sum()
        local[1] += valid.sum()
    total = cov_ops.gather_in_rank_order(local, group).sum(dim=0)
    if total[1] == 0:
        raise ValueError("the optimizer step has no valid (mask = 1) token on any data-parallel "
                         "rank: no entropy to measure")
    return float(total[0] / total[1])


# ------------------------------------------------------------------------------------ SIREN


def peak_mask(top_p_entropy: Tensor, mask: Tensor, q: float) -> Tensor:
    """bool [B, S]: each row's valid tokens strictly above the row's q-quantile of H^p."""
    valid = mask.bool()
    threshold = quantile.row_quantiles(top_p_entropy, valid, q)
    return valid & (top_p_entropy.detach() > threshold[:, None])


def masked_sequence_mean(values: Sequence[Tensor], masks: Sequence[Tensor],
                         group: Optional[dist.ProcessGroup]) -> tuple[float, int]:
    """(sequence mean of each row's token mean over its masked tokens, N rows with one), over
    every rank (float64, one all-gather); (0.0, 0) when no row has a masked token."""
    device = masks[0].device if masks else torch.device("cpu")
    local = torch.zeros(2, dtype=torch.float64, device=device)
    for v, m in zip(values, masks):
        m = m.bool()
        n = m.sum(-1)
        rows = n > 0
        per_row = torch.where(m, v.detach().double(), 0).sum(-1) / n.clamp(min=1)
        local[0] += per_row[rows].sum()
        local[1] += rows.sum()
    total = cov_ops.gather_in_rank_order(local, group).sum(dim=0)
    count = int(total[1])
    return (float(total[0] / count) if count else 0.0), count


def siren_term(coef: float, h_bar: float, anchor: float, top_p_entropy: Tensor, masked: Tensor,
               num_rows: int) -> Tensor:
    """This micro-batch's share of the gradient of coef (Hbar - anchor)^2: 2 coef (Hbar - anchor)
    x its rows' token means of H^p over the masked tokens / N (an exact 0 in the graph when
    the step has no masked token)."""
    m = masked.bool()
    per_row = torch.where(m, top_p_entropy, 0).sum(-1) / m.sum(-1).clamp(min=1)
    if num_rows == 0:
        return per_row.sum() * 0.0
    return 2.0 * coef * (h_bar - anchor) * per_row.sum() / num_rows


# ------------------------------------------------------------------- adaptive coefficients


class AdaptiveEntropyCoef:
    """Skywork-OR1's coefficient: ``step(e_k)`` gives alpha_k and moves c for the next step."""

    def __init__(self, settings: AdaptiveEntropySettings) -> None:
        self.settings = settings
        self.coef = float(settings.initial)
        self.last: dict[str, float] = {}

    def step(self, entropy: float) -> float:
        s = self.settings
        below = entropy <= s.target
        alpha = self.coef if below else 0.0
        moved = self.coef + s.delta if below else self.coef - s.delta
        self.last = {"adaptive_entropy/alpha": alpha, "adaptive_entropy/coef": self.coef,
                     "adaptive_entropy/entropy": entropy}
        self.coef = min(max(moved, s.coef_min), s.coef_max)
        return alpha

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last": dict(self.last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef = float(state["coef"])
        self.last = {k: float(v) for k, v in state["last"].items()}


class AERCoef:
    """AER's global coefficient: ``step(e_k)`` gives alpha_k (the first step's entropy anchors
    the target) and moves alpha for the next step."""

    def __init__(self, settings: AERSettings) -> None:
        self.settings = settings
        self.alpha = float(settings.initial)
        self.initial_entropy: Optional[float] = None
        self.last: dict[str, float] = {}

    def step(self, entropy: float) -> float:
        if not (math.isfinite(entropy) and entropy > 0):
            raise ValueError(f"AER needs a positive finite entropy; got {entropy!r}")
        s = self.settings
        if self.initial_entropy is None:
            self.initial_entropy = entropy
        target = s.target_ratio * self.initial_entropy
        used = self.alpha
        self.alpha = min(max(self.alpha + s.lr * (target - entropy) / target, 0.0), s.coef_max)
        self.last = {"aer/alpha": used, "aer/target": target, "aer/entropy": entropy}
        return used

    def state_dict(self) -> dict[str, Any]:
        return {"alpha": self.alpha, "initial_entropy": self.initial_entropy,
                "last": dict(self.last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.alpha = float(state["alpha"])
        self.initial_entropy = state["initial_entropy"]
        self.last = {k: float(v) for k, v in state["last"].items()}


def difficulty_weights(rewards: Sequence[float], groups: Sequence[int]) -> list[float]:
    """AER's allocation: each response's weight 1 - its group's accuracy (reward > 0), the group
    being every response of its prompt in ``rewards`` (one DP rank holds whole groups)."""
    correct: dict[int, list[bool]] = {}
    for r, g in zip(rewards, groups):
        correct.setdefault(g, []).append(r > 0)
    return [1.0 - sum(correct[g]) / len(correct[g]) for g in groups]
