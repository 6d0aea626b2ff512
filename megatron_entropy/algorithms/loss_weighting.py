"""Methods that weigh the policy-gradient terms of tokens by what they do to the entropy:
EntroPIC's PI-controlled term on high-probability tokens and positive-advantage reweighting.

EntroPIC (Yang et al., "EntroPIC: Towards Stable Long-Term Training of LLMs via Entropy
Stabilization with Proportional-Integral Control", arXiv 2511.15248; the authors' dp_actor.py and
core_algos.py). Per optimizer step k, with e_k = H_k - H_target (H_k the step's token-mean
entropy) and I_k the sum of the earlier steps' errors:

    alpha_k = clip(kp e_k + ki I_k, -alpha_max, alpha_max),   I_{k+1} = I_k + e_k
    loss += alpha_k * sum_{t in HP} (-ratio_t |A_t|) / |HP|,  HP = {valid t: pi_old(t) > high_prob}

With alpha > 0 (entropy above target) every confident token's probability is pushed up, which
lowers the entropy; alpha < 0 pushes them down. The authors update alpha and I per micro-batch,
from that micro-batch's entropy in the training forward (I by e times the micro-batch's share of
the mini-batch), and normalise the term by the micro-batch's high-probability tokens. Here both
belong to the optimizer step, so the update does not depend on how the step is split: H_k is the
token mean over the step's valid tokens on every DP rank of the entropies the step selects with
(the recompute's, or a fresh pass: ``global_selection_logprobs``), HP is chosen with those
log-probs, and |HP| (the term's normaliser, at the loss's aggregation mode) is counted over the
whole step. On the first update of an on-policy step these equal the training forward's.

Positive-advantage reweighting ("Revisiting Entropy in Reinforcement Learning for Large
Reasoning Models", arXiv 2511.05993): the policy-gradient term of each token with A > 0 is
multiplied by ``weight`` (the paper's finding: those tokens drive the entropy's fall). A detached
per-token weight, as TIS's: pointwise, so split-invariant as it stands.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import Tensor

from megatron_entropy.algorithms.aggregation import aggregate
from megatron_entropy.algorithms.method_settings import EntroPICSettings, PositiveReweightSettings
from megatron_entropy.algorithms.metrics import mean_metric


class EntroPICController:
    """The PI loop of one run: ``step(entropy)`` gives the optimizer step's alpha."""

    def __init__(self, settings: EntroPICSettings) -> None:
        self.settings = settings
        self.integral = 0.0
        self.steps = 0
        self.last: dict[str, float] = {}

    def step(self, entropy: float) -> float:
        """alpha for the optimizer step whose token-mean entropy is ``entropy``; then the integral
        takes its error (every rank runs the same float arithmetic on the same reduced entropy)."""
        if not math.isfinite(entropy):
            raise ValueError(f"EntroPIC needs a finite entropy; got {entropy!r}")
        s = self.settings
        error = entropy - s.target
        alpha = min(max(s.kp * error + s.ki * self.integral, -s.alpha_max), s.alpha_max)
        self.integral += error
        self.steps += 1
        self.last = {"entropic/alpha": alpha, "entropic/error": error,
                     "entropic/integral": self.integral}
        return alpha

    def state_dict(self) -> dict[str, Any]:
        return {"integral": self.integral, "steps": self.steps, "last": dict(self.last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.integral = float(state["integral"])
        self.steps = int(state["steps"])
        self.last = {k: float(v) for k, v in state["last"].items()}


def high_prob_tokens(settings: EntroPICSettings, select_logp: Tensor, mask: Tensor) -> Tensor:
    """bool [B, S]: valid tokens whose selecting log-prob is above log(high_prob)."""
    return mask.bool() & (select_logp.detach() > math.log(settings.high_prob))


def entropic_term(alpha: float, logp: Tensor, old_logp: Tensor, advantages: Tensor,
                  high: Tensor, mask: Tensor, mode: str, normalizer: Optional[float]
                  ) -> tuple[Tensor, dict[str, Tensor]]:
    """alpha * (-ratio |A|) over the high-probability tokens, aggregated at ``mode`` with the
    step's ``normalizer`` over them (None: the step has none; the term is an exact 0 in the
    graph). Returns (term, metrics)."""
    ratio = torch.exp(torch.clamp(logp - old_logp.detach(), -20.0, 20.0))
    per_token = torch.where(high, -ratio * advantages.detach().abs(), 0)
    metrics = {"entropic/high_prob_frac": mean_metric(high.double(), mask)}
    if normalizer is None:
        return per_token.sum() * 0.0, metrics
    return alpha * aggregate(per_token, high, mode, normalizer), metrics


def positive_weight(settings: PositiveReweightSettings, advantages: Tensor) -> Tensor:
    """[B, S]: ``weight`` where A > 0, 1 elsewhere."""
    return torch.where(advantages > 0, torch.full_like(advantages, settings.weight),
                       torch.ones_like(advantages))
