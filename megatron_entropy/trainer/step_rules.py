"""The token rules of one optimizer step (algorithms/token_rules.py through the actor): what the
whole step decides before its training forwards, and what each micro-batch decides in its own."""

from __future__ import annotations

from typing import Optional

import torch

from megatron_entropy.algorithms import token_rules as rules_ops
from megatron_entropy.algorithms.policy_loss import TokenAdjustments
from megatron_entropy.algorithms.settings import PolicyLossSettings, TokenRuleSettings


class StepRules:
    """The token rules of one optimizer step: what the whole step decides before the training
    forwards (``global`` populations, the 80/20 normalizer), and per micro-batch the rest.
    Built on the last PP stage (where the loss runs) by every rank of its DP group."""

    def __init__(self, rules: TokenRuleSettings, loss: PolicyLossSettings, masks: list,
                 select_entropies: Optional[list], dp_group) -> None:
        self.rules, self.loss = rules, loss
        self.adjust: dict[int, TokenAdjustments] = {}
        self.metrics: dict[int, dict] = {i: {} for i in range(len(masks))}
        self.pg_normalizer: Optional[float] = None
        mode = loss.loss_agg_mode
        if rules.high_entropy_minority and rules.high_entropy_scope == "global":
            chosen, norm = rules_ops.select_high_entropy_global(rules, select_entropies, masks,
                                                                mode, dp_group)
            for i, (sel, h, m) in enumerate(zip(chosen, select_entropies, masks)):
                self.adjust[i] = TokenAdjustments(pg_mask=sel, pg_normalizer=norm)
                self.metrics[i].update(rules_ops.high_entropy_metrics(sel, h, m))
        elif rules.high_entropy_minority:
            self.pg_normalizer = rules_ops.high_entropy_normalizer(rules, masks, mode, dp_group)
        if rules.entropy_clip and rules.entropy_clip_scope == "global":
            adjusts, metrics = rules_ops.entropy_clip_global(rules, loss, select_entropies,
                                                             masks, dp_group)
            for i, (a, m) in enumerate(zip(adjusts, metrics)):
                self.adjust[i] = a
                self.metrics[i].update(m)

    @staticmethod
    def needs_select_entropies(rules: TokenRuleSettings) -> bool:
        return (rules.high_entropy_minority and rules.high_entropy_scope == "global") or \
            (rules.entropy_clip and rules.entropy_clip_scope == "global")

    def for_micro_batch(self, index: int, entropy: torch.Tensor, mask: torch.Tensor
                        ) -> tuple[Optional[TokenAdjustments], dict]:
        """(adjustments, metrics) of micro-batch ``index``; ``entropy`` is its training
        forward's, for the per-micro-batch populations."""
        r = self.rules
        metrics = dict(self.metrics[index])
        if index in self.adjust:
            return self.adjust[index], metrics
        if r.high_entropy_minority:
            chosen = rules_ops.select_high_entropy(r, entropy, mask)
            metrics.update(rules_ops.high_entropy_metrics(chosen, entropy.detach(), mask))
            return TokenAdjustments(pg_mask=chosen, pg_normalizer=self.pg_normalizer), metrics
        if r.entropy_clip:
            adjust, m = rules_ops.entropy_clip_micro_batch(r, self.loss, entropy, mask)
            metrics.update(m)
            return adjust, metrics
        return None, metrics
