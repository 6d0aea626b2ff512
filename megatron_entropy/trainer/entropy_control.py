"""The target-entropy controller in the loop: built from the config, it gives each step's update
its knob's value (a runtime value beside the configured loss settings, which stay as they are)
and is fed the step's reduced entropy after it.

Every rank runs the same Python float arithmetic on ``entropy/seq_mean``, which is reduced over
the DP group (and equal on every TP/PP rank of a replica), so every rank holds the same knob
without a collective. Its state goes into the checkpoint's trainer state.
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_entropy.algorithms.clipping import clip_schedule_knobs
from megatron_entropy.algorithms.entropy_control import EntropyController, EntropyControlSettings
from megatron_entropy.algorithms.entropy_methods import EntropyMethods
from megatron_entropy.config import AlgorithmConfig
from megatron_entropy.settings import ConfigError, SettingError

STATE_KEY = "entropy_control"
METHODS_KEY = "entropy_methods"  # the entropy methods' controllers and SIREN's anchor
MEASURED = "entropy/seq_mean"  # the mean per-sequence entropy of the step's rollouts


def entropy_control_settings(a: AlgorithmConfig, vocab_size: Optional[int] = None
                             ) -> Optional[EntropyControlSettings]:
    """The controller's settings (None when off), checked against the loss, the knob's starting
    value in ``a`` and, given ``vocab_size``, an absolute target against log V."""
    if not a.entropy_control.enabled:
        return None
    try:
        a.check_entropy_control(vocab_size)
    except SettingError as e:
        raise ConfigError(f"algorithm.{e}") from None
    return a.entropy_control


def build_controller(algorithm: AlgorithmConfig, vocab_size: int
                     ) -> Optional[EntropyController]:
    """None unless ``algorithm.entropy_control.enabled``; the knob starts at its config value."""
    settings = entropy_control_settings(algorithm, vocab_size)
    if settings is None:
        return None
    return EntropyController(settings, getattr(algorithm, settings.knob), vocab_size)


def loss_knobs(controller: Optional[EntropyController], algorithm: AlgorithmConfig, step: int,
               steps: int) -> dict[str, float]:
    """The coming step's values of the loss settings that move while the run goes, for
    ``Actor.update`` ({} when none): the controller's knob (it holds the value, the config keeps
    the starting one) and the clip schedule's clip_ratio_high."""
    knobs = clip_schedule_knobs(algorithm.clip_schedule, algorithm.clip_ratio_high, step, steps)
    if controller is not None:
        knobs[controller.settings.knob] = controller.value
    return knobs


def update_controller(controller: Optional[EntropyController], metrics: dict[str, float]
                      ) -> dict[str, float]:
    """Feed the step's measured entropy; returns the ``control/*`` metrics (none when off)."""
    if controller is None:
        return {}
    controller.update(metrics[MEASURED])
    return controller.metrics()


def controller_state(controller: Optional[EntropyController]) -> dict[str, Any]:
    """The trainer-state entry of the checkpoint ({} when off)."""
    return {} if controller is None else {STATE_KEY: controller.state_dict()}


def restore_controller(controller: Optional[EntropyController], saved: dict[str, Any]) -> None:
    """Resume the controller from a checkpoint's trainer state, exactly."""
    if controller is None:
        return
    if STATE_KEY not in saved:
        raise ConfigError("algorithm.entropy_control.enabled: the checkpoint being resumed was "
                          "written without the entropy controller; its state is not there")
    controller.load_state_dict(saved[STATE_KEY])


def methods_state(methods: EntropyMethods) -> dict[str, Any]:
    """The trainer-state entry of the entropy methods' run state ({} when they keep none)."""
    state = methods.state_dict()
    keeps = methods.controllers or methods.algorithm.siren.enabled
    return {METHODS_KEY: state} if keeps else {}


def restore_methods(methods: EntropyMethods, saved: dict[str, Any]) -> None:
    """Resume the entropy methods' state from a checkpoint's trainer state, exactly."""
    if not (methods.controllers or methods.algorithm.siren.enabled):
        return
    if METHODS_KEY not in saved:
        raise ConfigError("algorithm: the checkpoint being resumed was written without the "
                          "entropy methods' state (EntroPIC, SIREN, adaptive_entropy, aer); "
                          "resume it with the settings it was written with")
    methods.load_state_dict(saved[METHODS_KEY])
