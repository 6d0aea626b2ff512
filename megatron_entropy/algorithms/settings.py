"""The settings of the pure algorithms: the policy loss, the entropy-aware token rules and the
rollout correction. The config tree composes them (``algorithm`` is a ``PolicyLossSettings``,
``algorithm.token_rules`` a ``TokenRuleSettings``, ``algorithm.rollout_correction`` a
``RolloutCorrectionSettings``), so each default, bound and rule exists here once. Standard
library only: the config validates them without loading torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_entropy.settings import SettingError, Settings, setting

LossName = Literal["ppo_clip", "clip_cov", "kl_cov", "gspo", "gmpo", "cispo", "sapo", "ce_gppo",
                   "dppo_tv", "dppo_kl", "gpg"]
CovModifier = Literal["none", "clip_cov", "kl_cov"]
AdvantageName = Literal["grpo", "drgrpo", "rloo", "reinforce_plus_plus",
                        "reinforce_plus_plus_baseline", "opo", "grpo_passk", "remax"]
# Their ratio and clip decision span the whole response: a token's term is not its own, so Cov
# selection (a per-token rule) is not defined on them.
SEQUENCE_LOSSES = ("gspo", "gmpo")
COV_LOSSES = ("clip_cov", "kl_cov")
AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                  "seq-mean-token-sum-norm"]
KlType = Literal["k1", "abs", "k3"]
AGG_MODES = typing.get_args(AggMode)
KL_TYPES = typing.get_args(KlType)


@dataclass
class PolicyLossSettings(Settings):
    """The loss's knobs (``algorithms/policy_loss.py``)."""

    loss: LossName = setting("kl_cov", help="the policy loss (algorithms/policy_loss.py)")
    clip_ratio_low: float = setting(0.2, ge=0, help="the ratio's clip floor is 1 - it")
    clip_ratio_high: float = setting(0.28, ge=0, help="the ratio's clip ceiling is 1 + it")
    dual_clip_c: Optional[float] = setting(None, gt=1, help="ppo_clip dual-clip constant (>1), "
                                                            "null=off")
    clip_cov_ratio: float = setting(2e-4, gt=0, le=1, help="fraction of tokens detached by "
                                                           "Clip-Cov")
    clip_cov_lb: float = setting(1.0, help="Clip-Cov: candidates have Cov above it")
    clip_cov_ub: float = setting(5.0, help="Clip-Cov: candidates have Cov below it")
    kl_cov_ratio: float = setting(2e-3, gt=0, le=1, help="fraction of tokens KL-penalised by "
                                                         "KL-Cov")
    kl_cov_coef: float = setting(1.0, ge=0, help="KL-Cov: weight of |logp - old_logp| on the "
                                                 "selected tokens")
    cov_modifier: CovModifier = setting(
        "none", help="Clip-Cov's detach or KL-Cov's penalty on top of a token-level loss "
                     "(clip_cov_*/kl_cov_* settings); not for gspo, gmpo, clip_cov, kl_cov")
    sapo_tau_pos: float = setting(1.0, gt=0, help="sapo: gate temperature where A > 0")
    sapo_tau_neg: float = setting(1.05, gt=0, help="sapo: gate temperature where A <= 0")
    ce_gppo_beta1: float = setting(0.75, ge=0, help="ce_gppo: gradient scale of A < 0 tokens "
                                                    "below 1 - clip_ratio_low")
    ce_gppo_beta2: float = setting(1.0, ge=0, help="ce_gppo: gradient scale of A > 0 tokens "
                                                   "above 1 + clip_ratio_high")
    dppo_ratio_cap: float = setting(3.0, ge=1, help="dppo_tv/dppo_kl: cap of the detached IS "
                                                    "ratio (verl's: its clip_ratio_c, 3)")
    loss_agg_mode: AggMode = setting(
        "token-mean", help="token-mean: over the step's tokens; seq-mean-token-*: each "
                           "sequence's token mean (or sum), then the mean over sequences; "
                           "seq-mean-token-sum-norm: the token sum / (sequences x "
                           "loss_scale_factor), Dr. GRPO's constant normaliser")
    loss_scale_factor: Optional[int] = setting(
        None, ge=1, help="seq-mean-token-sum-norm: the constant L (verl's name); null = "
                         "rollout.max_new_tokens; the other modes ignore it")
    entropy_coef: float = setting(0.0, ge=0, help="weight of the entropy bonus (subtracted from "
                                                  "the loss); 0 = none")
    kl_coef: float = setting(0.0, ge=0, help="> 0 loads a frozen reference model (with "
                                             "model.lora: the policy, adapters off)")
    kl_type: KlType = setting("k3", help="estimator of the KL to the reference: k1, |k1| or k3 "
                                         "(low variance)")

    def validate(self) -> None:
        super().validate()
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise SettingError("clip_cov_lb", f"{self.clip_cov_lb} must be below clip_cov_ub "
                                              f"({self.clip_cov_ub})")
        if self.cov_modifier != "none" and self.loss in SEQUENCE_LOSSES + COV_LOSSES:
            why = ("its ratio and clip decision span the whole response, so no token's term is "
                   "its own to detach or penalise" if self.loss in SEQUENCE_LOSSES else
                   "it already selects by Cov")
            raise SettingError("cov_modifier", f"{self.cov_modifier} cannot modify the "
                               f"{self.loss} loss: {why}; use a token-level loss (ppo_clip, "
                               "cispo, sapo, ce_gppo, dppo_tv, dppo_kl, gpg)")

    def with_response_budget(self, max_new_tokens: int) -> "PolicyLossSettings":
        """These settings with ``loss_scale_factor`` null replaced by ``max_new_tokens``: the
        longest response, the constant L of seq-mean-token-sum-norm (verl's default, the padded
        response length, is that maximum)."""
        if self.loss_scale_factor is not None:
            return self
        return dataclasses.replace(self, loss_scale_factor=max_new_tokens)

    @property
    def cov_rule(self) -> Optional[str]:
        """Which Cov selection this loss runs: clip_cov, kl_cov or None."""
        if self.loss in COV_LOSSES:
            return self.loss
        return None if self.cov_modifier == "none" else self.cov_modifier


@dataclass
class TokenRuleSettings(Settings):
    """Entropy-aware token rules (``algorithms/token_rules.py``); each is off unless enabled."""

    high_entropy_minority: bool = setting(False, help="policy gradient on the top-rho tokens by "
                                                      "entropy only (80/20 rule; ppo_clip)")
    high_entropy_rho: float = setting(0.2, gt=0, le=1, help="the fraction of tokens kept")
    high_entropy_scope: Literal["micro_batch", "global"] = setting(
        "micro_batch", help="the tokens ranked together: each micro-batch's, or the whole "
                            "optimizer step's")
    entropy_clip: bool = setting(False, help="wider clip range, weaker KL above the entropy "
                                             "quantile (Archer; ppo_clip)")
    entropy_clip_quantile: float = setting(0.8, gt=0, lt=1, help="tokens above this entropy "
                                                                 "quantile are high-entropy")
    entropy_clip_scope: Literal["response", "micro_batch", "global"] = setting(
        "response", help="where the quantile is taken: each response, each micro-batch or the "
                         "whole optimizer step")
    high_clip_ratio_low: float = setting(0.5, ge=0, lt=1, help="the ratio's floor is 1 - it")
    high_clip_ratio_high: float = setting(0.5, ge=0, help="the ratio's ceiling is 1 + it")
    high_entropy_kl_coef: float = setting(0.0, ge=0, help="KL coefficient of the high-entropy "
                                                          "tokens (kl_coef: the others)")
    entropy_advantage: bool = setting(False, help="A <- A + min(alpha H, |A| / kappa)")
    entropy_advantage_alpha: float = setting(0.4, gt=0, help="alpha: weight of the entropy term")
    entropy_advantage_kappa: float = setting(2.0, ge=1, help="below 1 the entropy term could "
                                                             "turn a negative advantage positive")


def check_token_rules(rules: TokenRuleSettings, loss: PolicyLossSettings) -> None:
    """Refuse the combinations the references do not support (algorithms/token_rules.py)."""
    if rules.high_entropy_minority and loss.loss != "ppo_clip":
        raise SettingError("high_entropy_minority", f"combines with ppo_clip only, not "
                           f"{loss.loss}: the 80/20 mask drops the low-entropy tokens whose "
                           "Cov-based restraint the loss exists for")
    if rules.entropy_clip and loss.loss != "ppo_clip":
        raise SettingError("entropy_clip", f"combines with ppo_clip only, not {loss.loss}: "
                           "clip_cov's candidates depend on its own clip range and kl_cov has "
                           "no clipping")
    if rules.high_entropy_minority and rules.entropy_clip:
        raise SettingError("entropy_clip", "does not combine with high_entropy_minority (both "
                           "split tokens by the same entropy quantile; Archer keeps the "
                           "low-entropy tokens in the gradient)")
    if rules.entropy_clip:
        if rules.high_clip_ratio_low < loss.clip_ratio_low or \
                rules.high_clip_ratio_high < loss.clip_ratio_high:
            narrower = "high_clip_ratio_low" if rules.high_clip_ratio_low < loss.clip_ratio_low \
                else "high_clip_ratio_high"
            raise SettingError(narrower, f"high-entropy tokens get a wider clip "
                               f"range: ({rules.high_clip_ratio_low}, "
                               f"{rules.high_clip_ratio_high}) must not be narrower than "
                               f"clip_ratio_low/high ({loss.clip_ratio_low}, "
                               f"{loss.clip_ratio_high})")
        if rules.high_entropy_kl_coef > loss.kl_coef:
            raise SettingError("high_entropy_kl_coef", f"high-entropy tokens get a weaker KL "
                               f"term: {rules.high_entropy_kl_coef} must not exceed kl_coef "
                               f"({loss.kl_coef})")
        if loss.kl_coef > 0 and loss.loss_agg_mode != "token-mean":
            raise SettingError("entropy_clip", "with a KL to the reference (kl_coef > 0) needs "
                               "loss_agg_mode token-mean (Archer averages each group's KL over "
                               f"its own tokens); got {loss.loss_agg_mode}")


@dataclass
class RolloutCorrectionSettings(Settings):
    """Train/rollout mismatch correction from the engine's log-probs
    (``algorithms/rollout_correction.py``); rho = exp(recompute - engine) per token."""

    mode: Literal["none", "tis", "mis"] = setting(
        "none", help="none; tis: pg term x min(rho, tis_cap); mis: tokens with rho outside "
                     "[mis_low, mis_high] leave the loss and its denominator")
    level: Literal["token", "geometric"] = setting(
        "token", help="geometric: rho = exp(mean log rho) over the sequence, for all its tokens")
    tis_cap: float = setting(2.0, gt=0, help="tis: the weight's cap C")
    mis_low: float = setting(0.5, ge=0, le=1, help="mis: smallest rho kept (inclusive); a "
                                                   "token with ratio 1 (on-policy) must be kept")
    mis_high: float = setting(2.0, ge=1, help="mis: largest rho kept (inclusive)")
