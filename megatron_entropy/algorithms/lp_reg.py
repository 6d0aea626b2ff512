"""Lp-Reg (Huang et al., "Low-probability Tokens Sustain Exploration in Reinforcement Learning with
Verifiable Reward", arXiv 2510.03222; the authors' Lp-Reg-dev core_algos.py and dp_actor.py).

The proxy pi_proxy is the old policy with its noise filtered out: the tokens whose probability
is below ``min_p`` x the top token's are dropped and the rest renormalised (min-p; at temperature
1 for the filter, as the authors apply it to the raw logits; ops/vocab_stats.py gives log
pi_proxy - log pi_old, exactly 0 where nothing is filtered). Among the step's negative-advantage
tokens, the k = max(1, int(N_neg x neg_fraction)) with the lowest log-probability (only when
k > 1, as the authors' code; likewise ``pos_fraction`` for A > 0) whose proxy probability is
above the old policy's (the proxy would raise them: "reasoning sparks" the update is about to
extinguish; the authors compare with the training forward's log-prob, the same on the first
update of an on-policy step) get the KL towards the proxy:

    loss_t += coef * KL(logp_t, log pi_proxy(t)),  k3: exp(lq - lp) - (lq - lp) - 1

aggregated with the loss's mode and normaliser. The authors put it on the unclipped -A ratio in
place of PPO-clip's term; with their clip_ratio_low = 1.0 (no floor on the ratio) the two are the
same for A < 0, so here it is added to the loss's own term.

Population: the authors rank the tokens of each micro-batch by its training forward's log-probs.
Here the whole optimizer step over the DP group is ranked (N_neg, k and the lowest k are global:
``covariance.global_top_k`` on -logp) with the log-probs that select
(``global_selection_logprobs``), so the update does not depend on the split; the proxy is the
recompute's (the authors' ``minp_old_log_prob``).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.algorithms.aggregation import aggregate
from megatron_entropy.algorithms.method_settings import LpRegSettings
from megatron_entropy.algorithms.metrics import mean_metric
from megatron_entropy.algorithms.regularizers import kl_penalty
from megatron_entropy.ops import covariance as cov_ops


def _side(select_logps: Sequence[Tensor], advantages: Sequence[Tensor], masks: Sequence[Tensor],
          fraction: float, positive: bool, group: Optional[dist.ProcessGroup]) -> list[Tensor]:
    """The lowest-probability k of one advantage side over every rank (none unless k > 1)."""
    side = [m.bool() & ((a > 0) if positive else (a < 0)) for a, m in zip(advantages, masks)]
    n = cov_ops.global_valid_count(side, group)
    k = max(1, int(n * fraction)) if n else 0
    if k <= 1:
        return [torch.zeros_like(s) for s in side]
    return cov_ops.global_top_k([-lp for lp in select_logps], side, k, group)


def select_lp_reg(settings: LpRegSettings, select_logps: Sequence[Tensor],
                  proxy_shifts: Sequence[Tensor], advantages: Sequence[Tensor],
                  masks: Sequence[Tensor], group: Optional[dist.ProcessGroup]) -> list[Tensor]:
    """bool [B_i, S_i] per micro-batch of this rank: the tokens that get the KL (module
    docstring), the proxy's log-prob being the old one + ``proxy_shifts`` (the selecting pass's
    log-probs are the old ones but for ``fresh``); the result equals the rule on one process over
    every rank's micro-batches."""
    neg = _side(select_logps, advantages, masks, settings.neg_fraction, False, group)
    pos = _side(select_logps, advantages, masks, settings.pos_fraction, True, group)
    return [(n | p) & (shift > 0) for n, p, shift in zip(neg, pos, proxy_shifts)]


def lp_reg_term(settings: LpRegSettings, logp: Tensor, proxy_logp: Tensor, selected: Tensor,
                mask: Tensor, mode: str, normalizer: float) -> tuple[Tensor, dict[str, Tensor]]:
    """coef x the KL to the proxy on the selected tokens, aggregated as the policy loss."""
    valid = mask.bool()
    sel = selected.bool() & valid
    safe_proxy = torch.where(sel, proxy_logp, logp.detach())  # -inf off the selected tokens
    kl = torch.where(sel, kl_penalty(logp, safe_proxy.detach(), settings.kl_type), 0)
    metrics = {"lp_reg/selected_frac": mean_metric(sel.double(), valid),
               "lp_reg/kl": mean_metric(kl, sel)}
    return settings.coef * aggregate(kl, valid, mode, normalizer), metrics
