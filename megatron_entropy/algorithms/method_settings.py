"""The settings of the entropy methods that followed the paper (algorithms/entropy_methods.py and
its families): each a section of ``algorithm`` (``algorithm.entropic``, ``.siren``, ...), off
unless enabled, with its paper's defaults. Standard library only: the config validates them
without loading torch. ``check_methods`` refuses the combinations a paper does not define.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from megatron_entropy.algorithms.settings import SEQUENCE_LOSSES, KlType
from megatron_entropy.settings import SettingError, Settings, setting

# Losses with a clip range a schedule can move (kl_cov, sapo and gpg have none).
CLIPPED_LOSSES = ("ppo_clip", "clip_cov", "gspo", "gmpo", "cispo", "ce_gppo", "dppo_tv",
                  "dppo_kl")
ClipShape = Literal["constant", "increase_decrease", "decrease_increase_decrease",
                    "oscillating_decay"]


@dataclass
class EntroPICSettings(Settings):
    """EntroPIC (Yang et al., arXiv 2511.15248; the authors' run_entropic.sh): a PI loop on the
    entropy error sets alpha; the loss gains alpha * token-mean(-ratio |A|) over the tokens with
    probability above ``high_prob``."""

    enabled: bool = setting(False, help="add EntroPIC's PI-weighted term on confident tokens")
    target: float = setting(0.1, gt=0, help="the target entropy, nats (token mean)")
    kp: float = setting(1.0, ge=0, help="proportional gain on entropy - target")
    ki: float = setting(0.01, ge=0, help="integral gain on the sum of past errors")
    high_prob: float = setting(0.95, gt=0, lt=1, help="tokens with pi > it get the term")
    alpha_max: float = setting(1.0, gt=0, help="alpha is clipped to [-alpha_max, alpha_max]")


@dataclass
class SirenSettings(Settings):
    """SIREN ("Rethinking Entropy Regularization in Large Reasoning Models", arXiv 2509.25133;
    the authors' siren.sh): the entropy of the top-p
    nucleus on each response's top (1 - peak_quantile) tokens by it, anchored to its value at
    the first step: loss += coef (H_masked - H_anchor)^2."""

    enabled: bool = setting(False, help="add SIREN's self-anchored selective entropy term")
    coef: float = setting(0.005, gt=0, help="weight of (H_masked - H_anchor)^2")
    top_p: float = setting(0.8, gt=0, le=1, help="the nucleus: the prefix whose mass stays below")
    top_k: int = setting(10000, ge=1, help="the nucleus lies within the top_k tokens")
    peak_quantile: float = setting(0.8, ge=0, lt=1, help="each response's tokens above this "
                                                         "quantile of top-p entropy count")


@dataclass
class LpRegSettings(Settings):
    """Lp-Reg (Huang et al., arXiv 2510.03222; the authors' recipe): a KL towards the min-p
    filtered proxy of the old policy on the lowest-probability tokens of negative samples."""

    enabled: bool = setting(False, help="add Lp-Reg's KL to the min-p proxy")
    min_p: float = setting(0.02, gt=0, le=1, help="the proxy keeps tokens with p >= min_p * "
                                                  "p_max (at temperature 1)")
    neg_fraction: float = setting(0.01, ge=0, le=1, help="fraction of the negative-advantage "
                                                         "tokens, lowest probability first")
    pos_fraction: float = setting(0.0, ge=0, le=1, help="the same for positive advantages")
    coef: float = setting(1.0, gt=0, help="weight of the KL term")
    kl_type: KlType = setting("k3", help="the KL estimator (k3: the recipe's low_var_kl)")


@dataclass
class EntropyRatioClipSettings(Settings):
    """Entropy Ratio Clipping (Su et al., arXiv 2512.05591; the authors' recipe): a token whose
    entropy ratio H_new / H_old leaves (low, high) passes no policy gradient."""

    enabled: bool = setting(False, help="detach the policy term where H / H_old leaves the band")
    low: float = setting(0.95, gt=0, lt=1, help="the band's lower end (exclusive)")
    high: float = setting(1.05, gt=1, help="the band's upper end (exclusive)")


@dataclass
class PositiveReweightSettings(Settings):
    """Positive-advantage reweighting ("Revisiting Entropy in Reinforcement Learning for Large
    Reasoning Models", arXiv 2511.05993): the policy term of tokens
    with A > 0 is multiplied by ``weight``."""

    enabled: bool = setting(False, help="scale the policy term of positive-advantage tokens")
    weight: float = setting(0.5, ge=0, help="their weight (< 1 slows the entropy's fall)")


@dataclass
class ClipScheduleSettings(Settings):
    """Dynamic clip thresholds (Chen et al., arXiv 2602.09782): clip_ratio_high follows a shape
    over the run, from the loss's clip_ratio_high towards ``high_peak``."""

    shape: ClipShape = setting("constant", help="constant (off); increase_decrease; "
                                                "decrease_increase_decrease; oscillating_decay")
    high_peak: float = setting(0.4, gt=0, help="the schedule's extreme clip_ratio_high")
    high_floor: float = setting(0.1, gt=0, help="decrease_increase_decrease: its low point")
    periods: int = setting(4, ge=1, help="oscillating_decay: oscillations over the run")


@dataclass
class AdaptiveEntropySettings(Settings):
    """Skywork-OR1's adaptive entropy coefficient (arXiv 2505.22312; TRL's
    use_adaptive_entropy): c += delta while the entropy is at or below the target, -= delta
    above it; the bonus c H applies only while the entropy is at or below the target."""

    enabled: bool = setting(False, help="an entropy bonus whose coefficient follows the target")
    target: float = setting(0.2, gt=0, help="target entropy, nats (token mean)")
    delta: float = setting(0.005, gt=0, help="the coefficient's step per optimizer step")
    coef_min: float = setting(0.0, ge=0, help="lower bound of the coefficient")
    coef_max: float = setting(1.0, gt=0, help="upper bound of the coefficient")
    initial: float = setting(0.0, ge=0, help="the coefficient at the first step")


@dataclass
class AERSettings(Settings):
    """AER (Zhang et al., arXiv 2510.10959): an entropy bonus weighted per prompt by its
    difficulty (1 - group accuracy), with a global coefficient that moves to hold the entropy at
    ``target_ratio`` x the first step's."""

    enabled: bool = setting(False, help="AER's adaptive, difficulty-weighted entropy bonus")
    target_ratio: float = setting(0.4, gt=0, le=1, help="target entropy / initial entropy")
    lr: float = setting(1e-3, gt=0, help="step of the global coefficient per unit of relative "
                                         "entropy error")
    initial: float = setting(0.0, ge=0, help="the global coefficient at the first step")
    coef_max: float = setting(0.1, gt=0, help="upper bound of the global coefficient")


def check_methods(a: Any) -> None:
    """Refuse the combinations the papers do not define (``a``: the algorithm section, a
    PolicyLossSettings carrying these sections)."""
    loss = a.loss
    bonus = [name for name, on in (("adaptive_entropy", a.adaptive_entropy.enabled),
                                   ("aer", a.aer.enabled), ("siren", a.siren.enabled)) if on]
    if len(bonus) > 1:
        raise SettingError(f"{bonus[1]}.enabled", f"two entropy regularisers at once "
                           f"({' and '.join(bonus)}): each sets the entropy term's coefficient")
    control = getattr(a, "entropy_control", None)
    if bonus and control is not None and control.enabled and control.knob == "entropy_coef":
        raise SettingError(f"{bonus[0]}.enabled", "sets the entropy coefficient itself; the "
                           "entropy controller cannot drive entropy_coef beside it")
    if bonus and a.entropy_coef > 0:
        raise SettingError(f"{bonus[0]}.enabled", f"sets the entropy term itself; entropy_coef "
                           f"must be 0 (got {a.entropy_coef})")
    if a.entropy_ratio_clip.enabled and loss in SEQUENCE_LOSSES:
        raise SettingError("entropy_ratio_clip.enabled", f"detaches single tokens' policy terms, "
                           f"which {loss} does not have (its ratio spans the whole response)")
    if a.lp_reg.enabled and loss != "ppo_clip":
        raise SettingError("lp_reg.enabled", f"combines with ppo_clip only, not {loss}: the "
                           "paper adds its KL to PPO-clip's token terms")
    if a.clip_schedule.shape != "constant" and loss not in CLIPPED_LOSSES:
        raise SettingError("clip_schedule.shape", f"moves the clip range, which {loss} does not "
                           f"have; clipped losses: {', '.join(CLIPPED_LOSSES)}")
    if a.clip_schedule.shape != "constant" and a.clip_schedule.high_floor >= a.clip_ratio_high:
        raise SettingError("clip_schedule.high_floor", f"{a.clip_schedule.high_floor} must be "
                           f"below clip_ratio_high ({a.clip_ratio_high})")


@dataclass
class EntropyMethodSections(Settings):
    """The methods' sections of the ``algorithm`` section (config/schema.py's AlgorithmConfig
    derives from it, then from PolicyLossSettings: the loss keys come first)."""

    entropic: EntroPICSettings = setting(default_factory=EntroPICSettings)
    siren: SirenSettings = setting(default_factory=SirenSettings)
    lp_reg: LpRegSettings = setting(default_factory=LpRegSettings)
    entropy_ratio_clip: EntropyRatioClipSettings = setting(
        default_factory=EntropyRatioClipSettings)
    positive_reweight: PositiveReweightSettings = setting(
        default_factory=PositiveReweightSettings)
    clip_schedule: ClipScheduleSettings = setting(default_factory=ClipScheduleSettings)
    adaptive_entropy: AdaptiveEntropySettings = setting(default_factory=AdaptiveEntropySettings)
    aer: AERSettings = setting(default_factory=AERSettings)

    def validate(self) -> None:
        super().validate()
        check_methods(self)
