"""The target-entropy controller in the loop: built from the config, it sets its knob in the
actor's loss settings before each step's update and is fed the step's reduced entropy after it.

Every rank runs the same Python float arithmetic on ``entropy/seq_mean``, which is reduced over
the DP group (and equal on every TP/PP rank of a replica), so every rank holds the same knob
without a collective. Its state goes into the checkpoint's trainer state.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from megatron_entropy.algorithms.entropy_control import EntropyController
from megatron_entropy.config import AlgorithmConfig, ConfigError, entropy_control_settings

STATE_KEY = "entropy_control"
MEASURED = "entropy/seq_mean"  # the mean per-sequence entropy of the step's rollouts


def build_controller(algorithm: AlgorithmConfig, vocab_size: int
                     ) -> Optional[EntropyController]:
    """None unless ``algorithm.entropy_control.enabled``; the knob starts at its config value."""
    settings = entropy_control_settings(algorithm, vocab_size)
    if settings is None:
        return None
    return EntropyController(settings, getattr(algorithm, settings.knob), vocab_size)


def apply_knob(controller: Optional[EntropyController], actor: Any) -> None:
    """Put the knob for the coming step into the actor's loss settings (its ``algorithm``)."""
    if controller is not None:
        actor.algorithm = replace(actor.algorithm, **{controller.settings.knob: controller.value})


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
