"""The policy losses beyond PPO-clip and the Cov losses, as per-token loss matrices [B, S].

Each function takes the loss settings, a ``LossBatch`` (masked positions already zeroed) and a
metrics dict, and returns the per-token loss that ``aggregation.aggregate`` turns into the
micro-batch's share of the step loss, so every loss runs at every aggregation mode and scope.
ratio = exp(logp - old_logp), A the advantage, eps_low / eps_high = clip_ratio_low / _high,
sg = stop-gradient; the formulas are in docs/algorithms/policy_losses.md.

The sequence-level losses (gspo, gmpo) put on each token a term whose value is the sequence's
loss and whose gradient is that token's share of the sequence's gradient (the "token form"):
under seq-mean-token-mean that is the paper's sequence objective exactly, in value and gradient;
token-mean weighs each sequence by its length. Every response lies in one row of one
micro-batch (trainer/batch.py), so the row sums here see the whole response on every layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch import Tensor

from megatron_entropy.algorithms.metrics import mean_metric as _mean
from megatron_entropy.algorithms.settings import PolicyLossSettings


@dataclass
class LossBatch:
    logp: Tensor
    old_logp: Tensor
    advantages: Tensor
    valid: Tensor  # bool
    num_valid: int
    clip_low: Optional[Tensor] = None   # per-token eps (TokenAdjustments), else the settings'
    clip_high: Optional[Tensor] = None


def ppo_surrogates(s: PolicyLossSettings, b: LossBatch, log_ratio: Tensor
                   ) -> tuple[Tensor, Tensor, Tensor]:
    """(L1 = -A ratio, L2 = -A clamp(ratio, 1 - eps_low, 1 + eps_high), ratio)."""
    ratio = torch.exp(log_ratio)
    l1 = -b.advantages * ratio
    low = s.clip_ratio_low if b.clip_low is None else b.clip_low.to(ratio.dtype)
    high = s.clip_ratio_high if b.clip_high is None else b.clip_high.to(ratio.dtype)
    l2 = -b.advantages * torch.clamp(ratio, 1 - low, 1 + high)
    return l1, l2, ratio


def _log_ratio(b: LossBatch) -> Tensor:
    """log ratio clamped to +-20 (as verl's token-level losses), against overflow."""
    return torch.clamp(b.logp - b.old_logp, -20.0, 20.0)


def _row_mean(values: Tensor, valid: Tensor) -> Tensor:
    """[B, 1] mean of each row over its valid tokens (0 for an empty row)."""
    summed = torch.where(valid, values, 0).sum(-1, keepdim=True)
    return summed / valid.sum(-1, keepdim=True).clamp(min=1)


def _dual_clip(s: PolicyLossSettings, b: LossBatch, loss: Tensor, metrics: dict) -> Tensor:
    """With ``dual_clip_c`` = c, tokens with A < 0 take min(loss, -A c)."""
    if s.dual_clip_c is None:
        return loss
    l3 = -b.advantages * s.dual_clip_c
    negative = b.advantages < 0
    metrics["pg_clipfrac_lower"] = _mean(((loss > l3) & negative).double(), b.valid)
    return torch.where(negative, torch.minimum(l3, loss), loss)


def gspo(s: PolicyLossSettings, b: LossBatch, metrics: dict) -> Tensor:
    """GSPO (Zheng et al., "Group Sequence Policy Optimization", arXiv 2507.18071), token form:
    s_i = exp(mean_t log ratio) (length-normalised, capped at exp(10) as verl), the token's
    ratio sg(s_i) pi_t / sg(pi_t), clipped as PPO at the sequence's value."""
    seq_log_ratio = _row_mean(b.logp - b.old_logp, b.valid).detach()
    log_s = torch.clamp(b.logp - b.logp.detach() + seq_log_ratio, max=10.0)
    l1, l2, _ = ppo_surrogates(s, b, log_s)
    metrics["pg_clipfrac"] = _mean((l2 > l1).double(), b.valid)
    return torch.maximum(l1, l2)


def _gmpo_clipped_log_ratio(s: PolicyLossSettings, b: LossBatch
                            ) -> tuple[Tensor, Tensor, Tensor]:
    """(the sequence advantage [B, 1], the sign-aware clipped log ratio c_t, the tokens it
    clipped)."""
    adv = _row_mean(b.advantages, b.valid)
    sign = torch.sign(adv)
    lr = b.logp - b.old_logp
    clamped = torch.clamp(lr, -s.clip_ratio_low, s.clip_ratio_high)
    c = sign * torch.minimum(sign * lr, sign * clamped)
    return adv, c, (c != lr) & (sign != 0)


def gmpo(s: PolicyLossSettings, b: LossBatch, metrics: dict) -> Tensor:
    """GMPO (Zhao et al., "Geometric-Mean Policy Optimization", arXiv 2507.20673): the
    sequence's ratio is the geometric mean of its token ratios, each clipped in log space to
    [-eps_low, eps_high] on the side the advantage's sign makes pessimistic; loss_i =
    -A_i exp(mean_t c_t), in token form -A_i sg(exp(mean c)) exp(c_t - sg(c_t))."""
    adv, c, clipped = _gmpo_clipped_log_ratio(s, b)
    seq_ratio = torch.exp(_row_mean(c, b.valid)).detach()
    metrics["pg_clipfrac"] = _mean(clipped.double(), b.valid)
    return -adv * seq_ratio * torch.exp(c - c.detach())


def cispo(s: PolicyLossSettings, b: LossBatch, metrics: dict) -> Tensor:
    """CISPO (MiniMax, "MiniMax-M1", arXiv 2506.13585): REINFORCE with a clipped, detached IS
    weight, -sg(clamp(ratio, 1 - eps_low, 1 + eps_high)) A logp; no token loses its gradient."""
    ratio = torch.exp(_log_ratio(b))
    weight = torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    metrics["pg_clipfrac"] = _mean((ratio != weight).double(), b.valid)
    return -weight.detach() * b.advantages * b.logp


def sapo(s: PolicyLossSettings, b: LossBatch, metrics: dict) -> Tensor:
    """SAPO (Gao et al., "Soft Adaptive Policy Optimization", arXiv 2511.20347): a soft gate in
    place of the clip, -A (4 / tau) sigmoid(tau (ratio - 1)), tau = tau_pos where A > 0 else
    tau_neg (its gradient at ratio 1 is PPO's)."""
    ratio = torch.exp(_log_ratio(b))
    tau = torch.where(b.advantages > 0, torch.full_like(ratio, s.sapo_tau_pos),
                      torch.full_like(ratio, s.sapo_tau_neg))
    return -b.advantages * torch.sigmoid(tau * (ratio - 1)) * (4.0 / tau)


def ce_gppo(s: PolicyLossSettings, b: LossBatch, metrics: dict) -> Tensor:
    """CE-GPPO (Su et al., "CE-GPPO: Coordinating Entropy via Gradient-Preserving Clipping
    Policy Optimization", arXiv 2509.20712): PPO-clip whose out-of-clip tokens keep a bounded
    gradient: A < 0 and ratio < 1 - eps_low: -beta1 (1 - eps_low) A ratio / sg(ratio);
    A > 0 and ratio > 1 + eps_high: -beta2 (1 + eps_high) A ratio / sg(ratio); else -A ratio;
    then dual-clip when ``dual_clip_c`` is set (the authors' code uses c = 3)."""
    loss, clipped = _ce_gppo_terms(s, b)
    metrics["pg_clipfrac"] = _mean(clipped.double(), b.valid)
    return _dual_clip(s, b, loss, metrics)


def _ce_gppo_terms(s: PolicyLossSettings, b: LossBatch) -> tuple[Tensor, Tensor]:
    """CE-GPPO's loss before the dual clip, and its out-of-clip tokens."""
    lr = b.logp - b.old_logp
    ratio = torch.exp(lr)
    unit = torch.exp(lr - lr.detach())  # value 1, gradient of log pi
    low = (ratio < 1 - s.clip_ratio_low) & (b.advantages < 0)
    high = (ratio > 1 + s.clip_ratio_high) & (b.advantages > 0)
    loss = torch.where(low, -s.ce_gppo_beta1 * (1 - s.clip_ratio_low) * b.advantages * unit,
                       torch.where(high, -s.ce_gppo_beta2 * (1 + s.clip_ratio_high) *
                                   b.advantages * unit, -b.advantages * ratio))
    return loss, low | high


def _dppo_keep(s: PolicyLossSettings, b: LossBatch, kind: str) -> Tensor:
    """DPPO's trust region: the tokens whose divergence from the old policy stays inside it."""
    p, old_p = torch.exp(b.logp.detach()), torch.exp(b.old_logp)
    if kind == "tv":
        up, down = (p - old_p) <= s.clip_ratio_high, (p - old_p) >= -s.clip_ratio_low
    else:
        kl = old_p * (b.old_logp - b.logp.detach()) + (1 - old_p) * torch.log(
            (1 - old_p + 1e-8) / (1 - p + 1e-8))
        up, down = (kl <= s.clip_ratio_high) | (p <= old_p), (kl <= s.clip_ratio_low) | \
            (p >= old_p)
    return torch.where(b.advantages > 0, up, down)


def _dppo(s: PolicyLossSettings, b: LossBatch, metrics: dict, kind: str) -> Tensor:
    ratio = torch.exp(_log_ratio(b))
    keep = _dppo_keep(s, b, kind)
    weight = torch.clamp(ratio, max=s.dppo_ratio_cap).detach()
    metrics["pg_clipfrac"] = _mean((~keep).double(), b.valid)
    return -b.advantages * weight * b.logp * keep.to(ratio.dtype)


def dppo_tv(s: PolicyLossSettings, b: LossBatch, metrics: dict) -> Tensor:
    """DPPO-Binary-TV (Qi et al., "Rethinking the Trust Region in LLM Reinforcement Learning",
    arXiv 2602.04879, as verl's ``dppo_tv``): -A sg(min(ratio, cap)) logp on the tokens with
    pi - pi_old <= eps_high (A > 0) or >= -eps_low (A <= 0), 0 elsewhere."""
    return _dppo(s, b, metrics, "tv")


def dppo_kl(s: PolicyLossSettings, b: LossBatch, metrics: dict) -> Tensor:
    """DPPO-Binary-KL (Qi et al., arXiv 2602.04879, as verl's ``dppo_kl``): as dppo_tv, the
    region being the binary KL(pi_old || pi) of the token <= eps_high (A > 0) / eps_low
    (A <= 0), or a move of pi against the advantage's direction."""
    return _dppo(s, b, metrics, "kl")


def gpg(s: PolicyLossSettings, b: LossBatch, metrics: dict) -> Tensor:
    """GPG (Chu et al., "GPG: A Simple and Strong Reinforcement Learning Baseline for Model
    Reasoning", arXiv 2504.02546): plain policy gradient, -A logp, no ratio and no clip."""
    return -b.advantages * b.logp


FAMILY_LOSSES: dict[str, Callable[..., Tensor]] = {
    "gspo": gspo, "gmpo": gmpo, "cispo": cispo, "sapo": sapo, "ce_gppo": ce_gppo,
    "dppo_tv": dppo_tv, "dppo_kl": dppo_kl, "gpg": gpg,
}


def frozen_tokens(s: PolicyLossSettings, b: LossBatch) -> Tensor:
    """bool [B, S]: the tokens the token-level loss itself already passes no gradient (PPO's
    clipped side, dual-clip's cap, DPPO's outside of the region). Clip-Cov draws only among
    the others, as the paper's Clip-Cov leaves PPO's clipped tokens out."""
    frozen = torch.zeros_like(b.valid)
    if s.loss == "ppo_clip":
        l1, l2, _ = ppo_surrogates(s, b, _log_ratio(b))
        frozen = l2 > l1
        if s.dual_clip_c is not None:
            frozen |= (b.advantages < 0) & (torch.maximum(l1, l2) > -b.advantages * s.dual_clip_c)
    elif s.loss == "ce_gppo" and s.dual_clip_c is not None:
        loss, _ = _ce_gppo_terms(s, b)
        frozen = (b.advantages < 0) & (loss > -b.advantages * s.dual_clip_c)
    elif s.loss in ("dppo_tv", "dppo_kl"):
        frozen = ~_dppo_keep(s, b, s.loss[len("dppo_"):])
    return frozen & b.valid
