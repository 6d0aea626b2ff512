"""Train/rollout mismatch correction.

The engine (vLLM, SGLang) samples with log-probs that differ from the trainer's own recompute of
the same policy (kernels, precision, staleness). Per valid token, with ``old_logp`` the trainer's
recompute at the start of the step (PPO's old policy) and ``engine_logp`` the sampler's:

    log rho_t = old_logp_t - engine_logp_t, clamped to [-20, 20] before exp (verl's bound)
    level token:      rho_t
    level geometric:  exp(mean over the sequence's valid tokens of log rho_t), for all its tokens

Modes (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL
Training"; verl ``rollout_corr_helper``; slime ``--use-tis`` and MIS; NeMo-RL ``tis``):

- ``none``: nothing changes (the metrics are still reported).
- ``tis``, truncated importance sampling: each token's policy-gradient term times
  w_t = min(rho_t, C) (C = ``tis_cap``, 2), detached: the weight changes the measure, not the
  objective (verl). The denominator does not change.
- ``mis``, masked importance sampling (rejection): tokens whose ratio lies outside
  [lo, hi] (``mis_low`` 0.5, ``mis_high`` 2; inclusive, verl's ``rollout_rs``) — at level
  geometric whole sequences — leave the loss: the returned ``mask`` drops them from the
  policy-gradient term, the regularisers, the denominator (``step_normalizer`` over the new masks)
  and the Cov population, as verl's modified ``response_mask`` and slime since its MIS fix (PR 657).
  NeMo-RL's ``icepop`` zeroes their weight but keeps them in the denominator; here they go.

Losses: as in verl's ``compute_policy_loss_vanilla``/``_clip_cov``/``_kl_cov``, the weight
multiplies the per-token policy-gradient loss after everything else — PPO and dual clipping,
Clip-Cov's detach, KL-Cov's penalty — for all three; the entropy bonus and the KL to the
reference are not weighted. The mask of ``mis`` is the mask of the whole step for all three.

Metrics (reducible, over the input's valid tokens): ``rollout_corr/ratio_mean|_max`` (rho at the
level), ``rollout_corr/weight_mean|_max`` and ``rollout_corr/clipped_frac`` (tis: rho > C),
``rollout_corr/masked_frac`` and ``rollout_corr/seq_masked_frac`` (mis), and KL(engine ||
trainer) per token, from tokens the engine sampled: ``rollout_corr/kl_k1`` = mean(engine_logp -
old_logp) (unbiased, can be negative) and ``rollout_corr/kl_k3`` = mean(rho - 1 - log rho)
(unbiased and >= 0, Schulman's k3 with the ratio trainer / engine), overall and per data source
as ``rollout_corr/<source>/kl_k1|kl_k3``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch import Tensor

from megatron_entropy.algorithms.metrics import max_metric, mean_metric
from megatron_entropy.algorithms.policy_loss import TokenAdjustments
from megatron_entropy.algorithms.settings import RolloutCorrectionSettings

LOG_RATIO_BOUND = 20.0


@dataclass
class RolloutCorrection:
    """One micro-batch's correction: the mask the whole loss uses (``mis`` drops tokens), the
    adjustment for ``policy_loss`` (``tis``: the weight) and reducible metrics."""

    mask: Tensor
    adjust: TokenAdjustments
    metrics: dict[str, Tensor] = field(default_factory=dict)

    def merged_into(self, adjust: Optional[TokenAdjustments], device: torch.device
                    ) -> Optional[TokenAdjustments]:
        """Other adjustments (the token rules') with this correction's weight (tis) merged in."""
        if self.adjust.weight is None:
            return adjust
        weight = TokenAdjustments(weight=self.adjust.weight.to(device))
        return weight if adjust is None else adjust.merged(weight)


def correct_rollout(settings: RolloutCorrectionSettings, old_logp: Tensor, engine_logp: Tensor,
                    mask: Tensor, sources: Optional[Sequence[str]] = None) -> RolloutCorrection:
    """The correction of one [B, S] micro-batch (per token or per row: any split of the step
    gives the same result). ``sources``: the data source of each row, for the per-source KL."""
    if not old_logp.shape == engine_logp.shape == mask.shape or old_logp.dim() != 2:
        raise ValueError(f"old_logp {tuple(old_logp.shape)}, engine_logp "
                         f"{tuple(engine_logp.shape)} and mask {tuple(mask.shape)} must share "
                         "one [B, S] shape")
    if sources is not None and len(sources) != mask.shape[0]:
        raise ValueError(f"sources names {len(sources)} rows, the micro-batch has "
                         f"{mask.shape[0]}")
    valid = mask.bool()
    for name, t in (("old_logp", old_logp), ("engine_logp", engine_logp)):
        if (~torch.isfinite(t.detach()) & valid).any():
            raise ValueError(f"{name} contain NaN or inf at valid (mask = 1) tokens")
    old = torch.where(valid, old_logp.detach().double(), 0)
    engine = torch.where(valid, engine_logp.detach().double(), 0)
    log_ratio = (old - engine).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    if settings.level == "geometric":
        per_row = log_ratio.sum(-1) / valid.sum(-1).clamp(min=1)
        level_log_ratio = per_row[:, None].expand_as(log_ratio)
    else:
        level_log_ratio = log_ratio
    rho = torch.exp(level_log_ratio)

    metrics = {"rollout_corr/ratio_mean": mean_metric(rho, valid),
               "rollout_corr/ratio_max": max_metric(rho, valid)}
    metrics.update(_kl_metrics(log_ratio, valid, sources))
    new_mask, adjust = mask, TokenAdjustments()
    if settings.mode == "tis":
        weight = torch.clamp(rho, max=settings.tis_cap)
        adjust = TokenAdjustments(weight=torch.where(valid, weight, 0).to(old_logp.dtype))
        metrics["rollout_corr/weight_mean"] = mean_metric(weight, valid)
        metrics["rollout_corr/weight_max"] = max_metric(weight, valid)
        metrics["rollout_corr/clipped_frac"] = mean_metric((rho > settings.tis_cap).double(),
                                                          valid)
    elif settings.mode == "mis":
        keep = (rho >= settings.mis_low) & (rho <= settings.mis_high)
        masked = valid & ~keep
        new_mask = torch.where(masked, torch.zeros_like(mask), mask)
        rows = valid.any(dim=-1)
        metrics["rollout_corr/masked_frac"] = mean_metric(masked.double(), valid)
        metrics["rollout_corr/seq_masked_frac"] = mean_metric(masked.any(dim=-1).double(), rows)
    return RolloutCorrection(new_mask, adjust, metrics)


def _kl_metrics(log_ratio: Tensor, valid: Tensor, sources: Optional[Sequence[str]]
                ) -> dict[str, Tensor]:
    """KL(engine || trainer) per token: k1 = E[-log rho], k3 = E[rho - 1 - log rho]."""
    k1 = -log_ratio
    k3 = torch.exp(log_ratio) - 1 - log_ratio
    out = {"rollout_corr/kl_k1": mean_metric(k1, valid),
           "rollout_corr/kl_k3": mean_metric(k3, valid)}
    for src in sorted(set(sources or ())):
        rows = torch.tensor([s == src for s in sources], dtype=torch.bool, device=valid.device)
        where = valid & rows[:, None]
        out[f"rollout_corr/{src}/kl_k1"] = mean_metric(k1, where)
        out[f"rollout_corr/{src}/kl_k3"] = mean_metric(k3, where)
    return out
