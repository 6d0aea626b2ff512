"""Entropy-aware token rules of the work that followed the paper, beside the Cov selection.

Pure tensor math on [B, S] micro-batch tensors (lists of them with the DP group for the
``global`` population: every valid token of the optimizer step). Each rule ends in a
``TokenAdjustments`` for ``policy_loss`` or in shaped advantages. H is the per-token entropy
over the full vocabulary, detached: it only chooses and weights. Which forward's H: the one that
trains (the references) in the per-micro-batch populations; in ``global`` the step's recompute
(or ``fresh``) pass, chosen before the training forwards, as for the global Cov selection.

High-entropy minority (Wang et al. 2025, "Beyond the 80/20 Rule"; their verl fork's
``get_global_entropy_top_mask``, ``compute_policy_loss_vanilla``): the policy-gradient term only
on the k = max(1, int(N rho + 0.9999)) highest-entropy valid tokens of the population (rho =
0.2; N its valid tokens; ties to the first in (DP rank, micro-batch, row, column) order, which
torch.topk leaves open). The other tokens leave that term, numerator and denominator: with
token-mean it is divided by the step's number of selected tokens. The entropy bonus and the KL to
the reference keep all valid tokens. With seq-mean-* the denominator stays the step's sequence
count and a sequence's token mean runs over its selected tokens (0 for none: the reference's
0/0). Population ``high_entropy_scope``: ``micro_batch`` (the reference) or ``global``.

Entropy-dependent clipping (Archer: Wang et al. 2025, "Stabilizing Knowledge, Promoting
Reasoning: Dual-Token Constraints for RLVR"; their verl fork, ``use_token_entropy_separate``): a
token is high-entropy when H > the q-quantile of its population (q = 0.8; the order statistic is
defined in ``ops/quantile.py``). High-entropy tokens clip the ratio to [1 - high_clip_ratio_low,
1 + high_clip_ratio_high] (0.5, 0.5) instead of the loss's clip_ratio_low/high, and the KL to the
reference becomes kl_coef * (mean over low-entropy tokens) + high_entropy_kl_coef (0.0) * (mean
over high-entropy tokens): per token the coefficient c_g N / N_g, N and N_g counted over the
population (in the micro-batch populations this weights micro-batches by their tokens, the
project's token-mean). Population ``entropy_clip_scope``: ``response`` (the reference: each
row's own quantile; counts over the micro-batch), ``micro_batch`` or ``global``.

Entropy advantage shaping (Cheng et al. 2025, "Reasoning with Exploration: An Entropy
Perspective"): A <- A + min(alpha H, |A| / kappa) per valid token (alpha 0.4, kappa 2). Pointwise,
no population. With clip_cov / kl_cov their Cov is computed on the shaped advantage: it is the one
the gradient uses, and the entropy change follows Cov(logp, A) of that advantage.

Combinations (``check_token_rules``):

    rule                   ppo_clip  clip_cov  kl_cov
    high-entropy minority  yes       no        no
    entropy clip           yes       no        no
    advantage shaping      yes       yes       yes

The 80/20 mask drops the low-entropy majority from the policy-gradient term, and that is where
the high-Cov tokens (confident: high log-prob) that Clip-Cov detaches and KL-Cov penalises (its
penalty is part of that term) mostly are; the two would cancel. Clip-Cov's candidates are the
tokens its own clip range leaves unclipped, per-token ranges would change them; KL-Cov has no
clip range to widen. The 80/20 rule and Archer split by the same quantile and Archer argues
against masking, so they do not combine either. Archer's per-group KL means are defined for
token-mean only.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.algorithms.aggregation import sum_over_group
from megatron_entropy.algorithms.metrics import mean_metric
from megatron_entropy.algorithms.policy_loss import TokenAdjustments
from megatron_entropy.algorithms.settings import PolicyLossSettings, TokenRuleSettings
from megatron_entropy.ops import covariance as cov_ops
from megatron_entropy.ops import quantile

# ------------------------------------------------------------------------ high-entropy minority


def select_high_entropy(rules: TokenRuleSettings, entropy: Tensor, mask: Tensor) -> Tensor:
    """The ``micro_batch`` population: bool [B, S], the top k(N_mb) valid tokens by entropy."""
    n = int(mask.bool().sum())
    return cov_ops.top_k_mask(entropy.detach(), mask,
                              quantile.top_fraction_count(n, rules.high_entropy_rho))


def high_entropy_normalizer(rules: TokenRuleSettings, masks: Sequence[Tensor],
                            loss_agg_mode: str, dp_group: Optional[dist.ProcessGroup]
                            ) -> Optional[float]:
    """The ``micro_batch`` population's ``pg_normalizer`` for one step, from the masks alone:
    token-mean: the step's selected tokens, sum of k(N_mb) (one all-reduce); seq-mean-*: None
    (the loss's own normalizer). Call it once per step on every DP rank."""
    if loss_agg_mode != "token-mean":
        return None
    local = sum(quantile.top_fraction_count(int(m.bool().sum()), rules.high_entropy_rho)
                for m in masks)
    return sum_over_group(float(local), dp_group)


def select_high_entropy_global(rules: TokenRuleSettings, entropies: Sequence[Tensor],
                               masks: Sequence[Tensor], loss_agg_mode: str,
                               dp_group: Optional[dist.ProcessGroup]
                               ) -> tuple[list[Tensor], Optional[float]]:
    """The ``global`` population: (one bool [B_i, S_i] mask per micro-batch of this rank, the
    step's ``pg_normalizer``: k(N_step) for token-mean, None otherwise).

    Equals ``select_high_entropy`` on the concatenated step. Three all-gathers: the valid count,
    then ``global_top_k``'s two (each rank's top k values; counts above/at the k-th).
    """
    n = cov_ops.global_valid_count(masks, dp_group)
    if n == 0:
        raise ValueError("the optimizer step has no valid (mask = 1) token on any data-parallel "
                         "rank: nothing to select from")
    k = quantile.top_fraction_count(n, rules.high_entropy_rho)
    selected = cov_ops.global_top_k(entropies, masks, k, dp_group)
    return selected, (float(k) if loss_agg_mode == "token-mean" else None)


def high_entropy_metrics(selected: Tensor, entropy: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """Reducible metrics: the fraction of valid tokens in the policy-gradient term and the mean
    entropy of those and of the others."""
    valid = mask.bool()
    chosen = selected.bool() & valid
    return {"entropy_rule/pg_token_frac": mean_metric(chosen.double(), valid),
            "entropy_rule/pg_token_entropy_mean": mean_metric(entropy, chosen),
            "entropy_rule/other_token_entropy_mean": mean_metric(entropy, valid & ~chosen)}


# ------------------------------------------------------------------------ entropy-dependent clip


def _entropy_clip_adjustment(rules: TokenRuleSettings, loss: PolicyLossSettings, high: Tensor,
                             num_valid: int, num_high: int) -> TokenAdjustments:
    """Per-token clip ranges, and KL coefficients c_g N / N_g (None without a KL term)."""
    f64 = dict(dtype=torch.float64, device=high.device)
    clip_low = torch.where(high, torch.tensor(rules.high_clip_ratio_low, **f64),
                           torch.tensor(loss.clip_ratio_low, **f64))
    clip_high = torch.where(high, torch.tensor(rules.high_clip_ratio_high, **f64),
                            torch.tensor(loss.clip_ratio_high, **f64))
    kl_coef = None
    if loss.kl_coef > 0:
        num_low = num_valid - num_high
        low_coef = loss.kl_coef * num_valid / num_low if num_low else 0.0
        high_coef = rules.high_entropy_kl_coef * num_valid / num_high if num_high else 0.0
        kl_coef = torch.where(high, torch.tensor(high_coef, **f64), torch.tensor(low_coef, **f64))
    return TokenAdjustments(clip_low=clip_low, clip_high=clip_high, kl_coef=kl_coef)


def entropy_clip_micro_batch(rules: TokenRuleSettings, loss: PolicyLossSettings, entropy: Tensor,
                             mask: Tensor) -> tuple[TokenAdjustments, dict[str, Tensor]]:
    """The ``response`` and ``micro_batch`` populations (no collective): adjustments and
    reducible metrics for one micro-batch."""
    valid = mask.bool()
    entropy = entropy.detach()
    q = rules.entropy_clip_quantile
    if rules.entropy_clip_scope == "response":
        thresholds = quantile.row_quantiles(entropy, valid, q)
        high = valid & (entropy > thresholds[:, None])
        rows = valid.any(dim=-1)
        threshold_metric = mean_metric(thresholds, rows)
    elif rules.entropy_clip_scope == "micro_batch":
        threshold = quantile.micro_batch_quantile(entropy, valid, q)
        if threshold is None:  # no valid token
            high = torch.zeros_like(valid)
            threshold_metric = torch.zeros(2, dtype=torch.float64, device=valid.device)
        else:
            high = valid & (entropy > threshold)
            threshold_metric = mean_metric(threshold.reshape(1),
                                           torch.ones(1, dtype=torch.bool, device=valid.device))
    else:
        raise ValueError("entropy_clip_scope global: call entropy_clip_global once per step")
    adjust = _entropy_clip_adjustment(rules, loss, high, int(valid.sum()), int(high.sum()))
    return adjust, _entropy_clip_metrics(high, valid, threshold_metric)


def entropy_clip_global(rules: TokenRuleSettings, loss: PolicyLossSettings,
                        entropies: Sequence[Tensor], masks: Sequence[Tensor],
                        dp_group: Optional[dist.ProcessGroup]
                        ) -> tuple[list[TokenAdjustments], list[dict[str, Tensor]]]:
    """The ``global`` population: one adjustment (and metrics) per micro-batch of this rank.

    Equals the ``micro_batch`` rule on the concatenated step. Two all-gathers for the quantile
    (count, each rank's top values), a third for the high-entropy count when a KL term needs it.
    """
    threshold, num_valid = quantile.global_quantile(entropies, masks,
                                                    rules.entropy_clip_quantile, dp_group)
    highs = [m.bool() & (h.detach().double() > threshold) for h, m in zip(entropies, masks)]
    num_high = 0
    if loss.kl_coef > 0:
        device = masks[0].device if masks else torch.device("cpu")
        flat = cov_ops.flat_valid(entropies, masks).to(device)
        num_high = int(cov_ops.global_counts_at(flat, threshold, dp_group)[:, 0].sum())
    out, metrics = [], []
    for high, m in zip(highs, masks):
        valid = m.bool()
        out.append(_entropy_clip_adjustment(rules, loss, high, num_valid, num_high))
        metrics.append(_entropy_clip_metrics(
            high, valid, mean_metric(threshold.reshape(1), valid.any().reshape(1))))
    return out, metrics


def _entropy_clip_metrics(high: Tensor, valid: Tensor, threshold: Tensor) -> dict[str, Tensor]:
    return {"entropy_rule/high_entropy_frac": mean_metric(high.double(), valid),
            "entropy_rule/entropy_threshold": threshold}


# ------------------------------------------------------------------------ advantage shaping


def shape_advantages(rules: TokenRuleSettings, advantages: Tensor, entropy: Tensor,
                     mask: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """(A + min(alpha H, |A| / kappa) at valid tokens (A unchanged elsewhere), reducible metrics:
    the mean bonus and the fraction of tokens where the |A| / kappa cap binds)."""
    valid = mask.bool()
    advantages = advantages.detach()
    bonus = rules.entropy_advantage_alpha * entropy.detach().to(advantages.dtype)
    cap = advantages.abs() / rules.entropy_advantage_kappa
    psi = torch.minimum(bonus, cap)
    shaped = torch.where(valid, advantages + psi, advantages)
    return shaped, {"entropy_rule/adv_bonus_mean": mean_metric(psi, valid),
                    "entropy_rule/adv_bonus_capped_frac": mean_metric((cap < bonus).double(),
                                                                      valid)}
