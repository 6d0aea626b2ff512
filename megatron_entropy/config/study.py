"""The study's own settings: the ``study`` section of the config tree (ignored by ``train``).

Torch-free, as the whole config tree is.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_entropy.settings import SettingError, Settings
from megatron_entropy.settings import setting as _f  # a field with bounds and help


@dataclass
class StudyLoss(Settings):
    """One arm of a study's comparison: a name and the overrides that make it."""

    name: str = _f("", help="names its runs (NAME-seedS) and its curves; --losses picks by it")
    overrides: list[str] = _f(default_factory=list, help="dotted overrides, e.g. "
                                                         "algorithm.loss=clip_cov")
    tune_key: str = _f("", help="a dotted key the study chooses on the validation split: one "
                                "run per tune_values entry at study.tuning_seed, the best "
                                "by study.tuning_metric then runs at every seed")
    tune_values: list[float] = _f(default_factory=list, help="the candidates of tune_key, the "
                                                             "default first (it wins ties)")


@dataclass
class EntropyBonusSweep(Settings):
    """The entropy bonus the paper shows failing (Fig. 6): the base arm at each coefficient."""

    base: str = _f("grpo", help="the study.losses arm the runs start from")
    key: str = _f("algorithm.entropy_coef", help="the dotted config key that is varied")
    values: list[float] = _f(default_factory=lambda: [1e-4, 1e-3, 1e-2],
                             help="empty: no such runs")


@dataclass
class ThresholdSweep(Settings):
    """The threshold sweep (Fig. 7): more tokens restrained should keep more entropy."""

    base: str = _f("kl_cov", help="the study.losses arm the runs start from")
    key: str = _f("algorithm.kl_cov_ratio", help="the dotted config key that is varied "
                                                 "(algorithm.clip_cov_ratio for Clip-Cov)")
    values: list[float] = _f(default_factory=lambda: [2e-4, 2e-3, 2e-2],
                             help="empty: no such runs")


def _default_study_losses() -> list[StudyLoss]:
    return [StudyLoss("grpo", ["algorithm.loss=ppo_clip"]),
            # The paper's Clip-Cov runs use eps_low = eps_high = 1.
            StudyLoss("clip_cov", ["algorithm.loss=clip_cov", "algorithm.clip_ratio_low=1.0",
                                   "algorithm.clip_ratio_high=1.0"]),
            StudyLoss("kl_cov", ["algorithm.loss=kl_cov"])]


@dataclass
class StudyConfig(Settings):
    """The run matrix of ``megatron-entropy study`` (ignored by ``train``)."""

    losses: list[StudyLoss] = _f(default_factory=_default_study_losses,
                                 help="the arms compared, each with its overrides")
    baseline: str = _f("grpo", help="the arm the targets compare the others with")
    seeds: list[int] = _f(default_factory=lambda: [1, 2, 3], help="each arm runs once per seed")
    seed_keys: list[str] = _f(default_factory=lambda: ["trainer.seed", "rollout.seed",
                                                       "data.seed"],
                              help="config keys each run sets to its seed")
    entropy_bonus: EntropyBonusSweep = _f(default_factory=EntropyBonusSweep)
    threshold_sweep: ThresholdSweep = _f(default_factory=ThresholdSweep)
    sweep_seeds: int = _f(1, ge=1, help="the first K of seeds run the entropy-bonus and "
                                        "threshold sweeps")
    window: int = _f(5, ge=1, help="steps averaged for a run's start and end values")
    early_fraction: float = _f(1 / 3, gt=0, lt=1, help="early prediction: the law fitted on "
                                                       "this first fraction of the steps")
    bootstrap: int = _f(1000, ge=0, help="resamples of the ceiling's interval; 0 = none")
    bootstrap_seed: int = _f(0, help="seed of the bootstrap resamples")
    time_budget_minutes: float = _f(90.0, gt=0, help="target wall time of the whole study")
    quick: list[str] = _f(default_factory=list, help="overrides applied with --quick (toy "
                                                     "length: steps, batch, validation set)")
    eval_runs: bool = _f(False, help="after each run, megatron-entropy eval on its last "
                                      "checkpoint (the eval section) into runs/NAME/"
                                      "eval.json; the report's final numbers")
    tune: bool = _f(True, help="choose the arms' tune_key on the validation split; false: each "
                               "arm runs its first tune_values entry, no tuning runs")
    tuning_seed: int = _f(101, help="the seed of the tuning runs (tune_key); not one of seeds: "
                                    "the final runs never saw the choice")
    jobs: int = _f(1, ge=1, help="runs trained at once (--jobs); each run's process gets "
                                 "its share of the cores as OpenMP threads, and on the CPU "
                                 "the thread count changes a run's numbers (fp32 sums)")
    tuning_metric: str = _f("val/acc/mean", help="what the tuning rule maximises: its mean over "
                                                 "a tuning run's last `window` logged values")

    def validate(self) -> None:
        super().validate()
        names = [arm.name for arm in self.losses]
        for i, arm in enumerate(self.losses):
            if not arm.name or "/" in arm.name or arm.name != arm.name.strip():
                raise SettingError(f"losses[{i}].name", f"{arm.name!r} must be a non-empty name "
                                                        "without '/' or surrounding spaces")
            if names.count(arm.name) > 1:
                raise SettingError("losses", f"the name {arm.name!r} is used twice")
        if names and self.baseline not in names:
            raise SettingError("baseline", f"{self.baseline!r} is not one of study.losses "
                                           f"({', '.join(names)})")
        for part in ("entropy_bonus", "threshold_sweep"):
            sweep = getattr(self, part)
            if not sweep.values:
                continue
            if sweep.base not in names:
                raise SettingError(f"{part}.base", f"{sweep.base!r} is not one of study.losses "
                                                   f"({', '.join(names)})")
            if not sweep.key:
                raise SettingError(f"{part}.key", "set the config key the sweep varies")
            if len(set(sweep.values)) != len(sweep.values):
                raise SettingError(f"{part}.values", f"{sweep.values} repeats a value")
        if len(set(self.seeds)) != len(self.seeds):
            raise SettingError("seeds", f"{self.seeds} repeats a seed")
        for i, arm in enumerate(self.losses):
            if bool(arm.tune_key) != bool(arm.tune_values):
                raise SettingError(f"losses[{i}].tune_values", "set tune_key and tune_values "
                                   "together (the key the study chooses and its candidates)")
            if len(set(arm.tune_values)) != len(arm.tune_values):
                raise SettingError(f"losses[{i}].tune_values", f"{arm.tune_values} repeats a "
                                                               "value")
        if self.tune and any(arm.tune_key for arm in self.losses) and \
                self.tuning_seed in self.seeds:
            raise SettingError("tuning_seed", f"{self.tuning_seed} is one of seeds "
                               f"({self.seeds}): the runs that choose would be reported")
