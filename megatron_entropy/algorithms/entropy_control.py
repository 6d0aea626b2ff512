"""A target-entropy controller: a PI loop on log H that sets one knob of the loss each step.

The paper's Fig. 7 shows that Clip-Cov's / KL-Cov's strength sets the level entropy settles at;
this closes the loop. Every optimizer step, after the step's metrics are reduced over the DP
group (so every rank passes the same number), ``update(H_t)`` with H_t the measured entropy
(the mean per-sequence entropy of the step's rollouts, the paper's figure) returns the knob for
the next step. The maths, in log space for both the entropy and the knob (ratios span orders of
magnitude and entropy errors are relative):

    H* = target (nats), or target * H_0 with H_0 the first step's entropy (target_type)
    e_t = log H* - log H_t                   (> 0: entropy below target)
    d_t = kp (e_t - e_{t-1}) + ki e_t        (velocity form of PI; e_{-1} = e_0)
    d_t = clamp(d_t, -log r, log r)          (rate limit: at most x r or / r per step)
    knob_t = clamp(knob_{t-1} exp(d_t), knob_min, knob_max),  knob_0 = the initial value

Sign: every knob (kl_cov_ratio, clip_cov_ratio, kl_cov_coef, entropy_coef) restrains entropy
loss when raised: more tokens penalised or detached, a stronger penalty, a larger bonus. So a
positive error (too little entropy) raises the knob. Anti-windup: the state is the applied,
clamped knob itself (velocity form), so nothing accumulates while the knob sits at a bound or at
the rate limit, and the loop leaves a bound as soon as the error changes sign. Warm-up: for the
first ``warmup_steps`` updates the knob stays at its initial value (the early entropy transient
is not the policy's settled level); errors are still recorded, so the first active step's
proportional term sees the last change.

Deterministic: Python floats only, the same operations on every rank. ``state_dict()`` is a
plain JSON-serialisable dict (Python's float repr round-trips exactly); a resumed controller
continues bit for bit. ``metrics()`` reports ``control/*``.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Any, Literal, Optional

from megatron_entropy.algorithms.settings import LossName
from megatron_entropy.settings import SettingError, Settings, setting

# The knobs the controller may drive, with the Cov rules (``PolicyLossSettings.cov_rule``: the
# Cov loss or the Cov modifier) that have them; the entropy bonus is every loss's.
KNOBS = {"kl_cov_ratio": ("kl_cov",), "kl_cov_coef": ("kl_cov",),
         "clip_cov_ratio": ("clip_cov",), "entropy_coef": typing.get_args(LossName)}
RATIO_KNOBS = ("kl_cov_ratio", "clip_cov_ratio")  # fractions of tokens: at most 1
STATE_VERSION = 1


@dataclass
class EntropyControlSettings(Settings):
    """The controller's settings; the knob starts at its value in the loss settings."""

    target: float = setting(0.5, gt=0, help="nats, or a fraction of the first step's entropy")
    target_type: Literal["nats", "fraction_of_first"] = setting(
        "nats", help="nats: target is the entropy itself; fraction_of_first: target x the first "
                     "step's entropy")
    knob: Literal["kl_cov_ratio", "clip_cov_ratio", "kl_cov_coef", "entropy_coef"] = setting(
        "kl_cov_ratio", help="the algorithm setting it drives (the loss must have it)")
    knob_min: float = setting(1e-4, gt=0, help="the knob's lower bound")
    knob_max: float = setting(5e-2, gt=0, help="the knob's upper bound (ratios: at most 1)")
    kp: float = setting(1.0, ge=0, help="proportional gain on the log-entropy error")
    ki: float = setting(0.3, ge=0, help="integral gain")
    max_step_factor: float = setting(1.5, gt=1, help="the knob changes at most x/÷ this per "
                                                     "step")
    warmup_steps: int = setting(5, ge=0, help="steps the knob stays at its initial value")

    def validate(self) -> None:
        super().validate()
        for name in ("target", "kp", "ki"):
            if not math.isfinite(getattr(self, name)):
                raise SettingError(name, f"must be a finite number; got {getattr(self, name)}")
        if not self.knob_min < self.knob_max:
            raise SettingError("knob_min", f"need 0 < knob_min < knob_max; got {self.knob_min}, "
                               f"{self.knob_max}")
        if self.knob in RATIO_KNOBS and self.knob_max > 1:
            raise SettingError("knob_max", f"{self.knob} is a fraction of tokens: at most 1; got "
                               f"{self.knob_max}")
        if self.kp == 0 and self.ki == 0:
            raise SettingError("ki", "kp and ki are both 0: the controller would never act")

    def check(self, loss: str, vocab_size: Optional[int]) -> None:
        """The checks that need the rest of the run: the loss has the knob, and an absolute
        target is below the largest entropy, log V (the uniform distribution; skipped for
        ``vocab_size`` None, before the model is known)."""
        if loss not in KNOBS[self.knob]:
            raise SettingError("knob", f"{self.knob} is not a knob of the {loss} loss; it has "
                               f"{', '.join(k for k, losses in KNOBS.items() if loss in losses)}")
        if vocab_size is not None and self.target_type == "nats" and \
                not self.target < math.log(vocab_size):
            raise SettingError("target", f"{self.target} nats is not below log V = "
                               f"log({vocab_size}) = {math.log(vocab_size):.4f}, the largest "
                               "entropy there is")


class EntropyController:
    """The PI loop; ``initial`` is the knob's value in the loss settings at the first step."""

    def __init__(self, settings: EntropyControlSettings, initial: float,
                 vocab_size: Optional[int] = None) -> None:
        if not settings.knob_min <= initial <= settings.knob_max:
            raise SettingError("knob_min", f"the starting value of {settings.knob} ({initial}) "
                               f"lies outside [knob_min, knob_max] = [{settings.knob_min}, "
                               f"{settings.knob_max}]")
        self.settings = settings
        self.vocab_size = vocab_size
        self.steps = 0                        # updates done
        self.knob = float(initial)            # exactly the initial value until it acts
        self.prev_error: Optional[float] = None
        self.first_entropy: Optional[float] = None
        self._last: dict[str, float] = {}

    @property
    def value(self) -> float:
        """The knob for the coming step."""
        return self.knob

    def target(self) -> Optional[float]:
        """H* in nats (None before the first step when it is a fraction of that step's)."""
        s = self.settings
        if s.target_type == "nats":
            return s.target
        return None if self.first_entropy is None else s.target * self.first_entropy

    def update(self, entropy: float) -> float:
        """Feed step t's measured entropy (nats); returns the knob for step t + 1."""
        if not (isinstance(entropy, (int, float)) and math.isfinite(entropy) and entropy > 0):
            raise ValueError(f"the measured entropy must be a positive finite number (nats); "
                             f"got {entropy!r}")
        s = self.settings
        entropy = float(entropy)
        if self.first_entropy is None:
            self.first_entropy = entropy
            target = self.target()
            if self.vocab_size is not None and not target < math.log(self.vocab_size):
                raise SettingError("target", f"{s.target} x the first step's entropy "
                                   f"({entropy:.4f}) = {target:.4f} nats is not below log V = "
                                   f"{math.log(self.vocab_size):.4f}")
        target = self.target()
        error = math.log(target) - math.log(entropy)
        prev = error if self.prev_error is None else self.prev_error
        used = self.value
        active = self.steps >= s.warmup_steps
        if active:
            step = s.kp * (error - prev) + s.ki * error
            limit = math.log(s.max_step_factor)
            step = min(max(step, -limit), limit)
            self.knob = min(max(math.exp(math.log(self.knob) + step), s.knob_min), s.knob_max)
        self.prev_error = error
        self.steps += 1
        at_bound = self.knob in (s.knob_min, s.knob_max)
        self._last = {"control/target": target, "control/measured": entropy,
                      "control/error": error, "control/knob": used,
                      "control/knob_next": self.value, "control/active": float(active),
                      "control/at_bound": float(active and at_bound)}
        return self.value

    def metrics(self) -> dict[str, float]:
        """``control/*`` of the last update: target and measured entropy (nats), the log error,
        the knob used in that step and the one for the next, whether it acted / sits at a bound."""
        return dict(self._last)

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "knob": self.settings.knob, "steps": self.steps,
                "value": self.knob, "prev_error": self.prev_error,
                "first_entropy": self.first_entropy, "last": dict(self._last)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output (e.g. after a JSON round trip) exactly."""
        expected = {"version", "knob", "steps", "value", "prev_error", "first_entropy", "last"}
        if set(state) != expected:
            raise ValueError(f"entropy controller state has keys {sorted(state)}, expected "
                             f"{sorted(expected)}")
        if state["version"] != STATE_VERSION:
            raise ValueError(f"entropy controller state version {state['version']}, this code "
                             f"reads {STATE_VERSION}")
        if state["knob"] != self.settings.knob:
            raise SettingError("knob", f"the checkpoint's controller drives {state['knob']}, "
                               f"the settings say {self.settings.knob}")
        for name in ("value", "prev_error", "first_entropy"):
            v = state[name]
            if not (v is None and name != "value" or isinstance(v, float) and math.isfinite(v)):
                raise ValueError(f"entropy controller state {name} = {v!r} is not a finite float")
        if not (isinstance(state["steps"], int) and state["steps"] >= 0):
            raise ValueError(f"entropy controller state steps = {state['steps']!r}")
        self.steps = state["steps"]
        self.knob = state["value"]
        self.prev_error = state["prev_error"]
        self.first_entropy = state["first_entropy"]
        self._last = {k: float(v) for k, v in state["last"].items()}
