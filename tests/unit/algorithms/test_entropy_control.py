"""The target-entropy controller (algorithms/entropy_control.py): each update equals its formula
(written again here), warm-up, rate limit, bounds and anti-windup behave as documented, it
regulates a simulated plant, its state survives a JSON round trip exactly, and bad settings
name the setting."""

from __future__ import annotations

import json
import math

import pytest

from megatron_entropy.algorithms.entropy_control import (EntropyControlSettings,
                                                         EntropyController)
from megatron_entropy.settings import SettingError
from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.trainer.entropy_control import entropy_control_settings

SETTINGS = EntropyControlSettings(target=0.3, knob="kl_cov_ratio", knob_min=1e-4, knob_max=5e-2,
                                  kp=1.0, ki=0.3, max_step_factor=1.5, warmup_steps=3)


def ref_knobs(s: EntropyControlSettings, initial: float, entropies: list[float]) -> list[float]:
    """The documented PI loop, written out: the knob after each update."""
    knob, prev, out, first = initial, None, [], None
    for t, h in enumerate(entropies):
        first = h if first is None else first
        target = s.target if s.target_type == "nats" else s.target * first
        e = math.log(target) - math.log(h)
        if t >= s.warmup_steps:
            d = s.kp * (e - (e if prev is None else prev)) + s.ki * e
            d = max(-math.log(s.max_step_factor), min(math.log(s.max_step_factor), d))
            knob = max(s.knob_min, min(s.knob_max, knob * math.exp(d)))
        prev = e
        out.append(knob)
    return out


ENTROPIES = [0.35, 0.31, 0.28, 0.25, 0.22, 0.21, 0.2, 0.26, 0.33, 0.4, 0.29, 0.05, 0.05, 0.05,
             0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 0.05, 2.0, 0.3]


@pytest.mark.parametrize("target_type,target", [("nats", 0.3), ("fraction_of_first", 0.8)])
def test_update_equals_its_formula(target_type, target):
    s = EntropyControlSettings(**{**SETTINGS.__dict__, "target_type": target_type,
                                  "target": target})
    ctl = EntropyController(s, initial=2e-3, vocab_size=1000)
    got = [ctl.update(h) for h in ENTROPIES]
    want = ref_knobs(s, 2e-3, ENTROPIES)
    assert got == pytest.approx(want, rel=1e-13, abs=0)
    assert got[:3] == [2e-3] * 3  # warm-up holds the knob
    steps = [math.log(b / a) for a, b in zip([2e-3] + got, got)]
    assert max(abs(x) for x in steps) == pytest.approx(math.log(1.5))  # the rate limit binds
    assert max(got) == 5e-2  # and the upper bound
    m = ctl.metrics()
    want_target = 0.3 if target_type == "nats" else 0.8 * ENTROPIES[0]
    assert m["control/target"] == pytest.approx(want_target)
    assert m["control/measured"] == 0.3 and m["control/knob"] == pytest.approx(want[-2])
    assert m["control/knob_next"] == pytest.approx(want[-1]) and m["control/active"] == 1.0
    assert m["control/error"] == pytest.approx(math.log(want_target) - math.log(0.3))


def test_sign_and_anti_windup():
    ctl = EntropyController(SETTINGS, initial=2e-3)
    for _ in range(3):  # warm-up
        ctl.update(0.3)
    assert ctl.update(0.2) > 2e-3  # too little entropy: more restraint
    for _ in range(30):
        ctl.update(0.05)  # far below target for long: the knob sits at its bound
    assert ctl.value == 5e-2 and ctl.metrics()["control/at_bound"] == 1.0
    # Nothing wound up while saturated: the first step above target lowers the knob at once.
    assert ctl.update(0.4) < 5e-2


def test_regulates_a_simulated_entropy_plant():
    """log H relaxes toward b + g log(knob) with lag a: a stand-in for how KL-Cov's ratio sets
    the entropy level (paper Fig. 7). Without control the entropy settles at 0.1 nats."""
    a, g = 0.3, 0.4
    b = math.log(0.1) - g * math.log(2e-3)  # the level the initial knob holds
    s = EntropyControlSettings(**{**SETTINGS.__dict__, "target": 0.25, "warmup_steps": 2})
    ctl = EntropyController(s, initial=2e-3)
    log_h, knob, history = math.log(0.35), 2e-3, []
    for _ in range(80):
        log_h += a * (b + g * math.log(knob) - log_h)
        history.append(math.exp(log_h))
        knob = ctl.update(history[-1])
    assert all(abs(h / 0.25 - 1) < 0.02 for h in history[40:])
    assert history[5] < 0.2 and knob > 2e-3  # it fell first, then the knob brought it back


def test_state_round_trips_exactly_through_json():
    s = EntropyControlSettings(**{**SETTINGS.__dict__, "target_type": "fraction_of_first",
                                  "target": 0.8})
    straight = EntropyController(s, initial=2e-3, vocab_size=1000)
    first = EntropyController(s, initial=2e-3, vocab_size=1000)
    for h in ENTROPIES[:12]:
        straight.update(h)
        first.update(h)
    saved = json.dumps(first.state_dict())
    resumed = EntropyController(s, initial=7e-3, vocab_size=1000)  # the config's value differs
    resumed.load_state_dict(json.loads(saved))
    assert resumed.state_dict() == first.state_dict()
    assert resumed.metrics() == straight.metrics()
    for h in ENTROPIES[12:]:
        assert resumed.update(h) == straight.update(h)  # bit for bit
        assert resumed.metrics() == straight.metrics()


def test_bad_state_is_refused():
    ctl = EntropyController(SETTINGS, initial=2e-3)
    ctl.update(0.3)
    state = ctl.state_dict()
    with pytest.raises(SettingError, match="^knob: the checkpoint's controller drives "
                                           "kl_cov_ratio"):
        EntropyController(EntropyControlSettings(knob="kl_cov_coef", knob_max=5.0),
                          initial=1.0).load_state_dict(state)
    with pytest.raises(ValueError, match="keys"):
        ctl.load_state_dict({k: v for k, v in state.items() if k != "steps"})
    with pytest.raises(ValueError, match="version 7"):
        ctl.load_state_dict({**state, "version": 7})
    with pytest.raises(ValueError, match="value = nan"):
        ctl.load_state_dict({**state, "value": float("nan")})


@pytest.mark.parametrize("kwargs,setting", [
    (dict(target=0.0), "target"), (dict(target=float("inf")), "target"),
    (dict(target_type="relative"), "target_type"), (dict(knob="lr"), "knob"),
    (dict(knob_min=0.0), "knob_min"), (dict(knob_min=0.1, knob_max=0.01), "knob_min"),
    (dict(knob_max=2.0), "knob_max"), (dict(kp=-1.0), "kp"), (dict(kp=0.0, ki=0.0), "ki"),
    (dict(max_step_factor=1.0), "max_step_factor"), (dict(warmup_steps=-1), "warmup_steps"),
])
def test_bad_settings_name_the_setting(kwargs, setting):
    with pytest.raises(SettingError, match=f"^{setting}: ") as err:
        EntropyControlSettings(**kwargs)
    assert err.value.setting == setting


def test_checks_against_the_run():
    with pytest.raises(SettingError, match=r"^target: 7.0 nats is not below log V = "
                                           r"log\(1000\) = 6.9078"):
        EntropyControlSettings(target=7.0).check("kl_cov", vocab_size=1000)
    with pytest.raises(SettingError, match="^knob: clip_cov_ratio is not a knob of the kl_cov "
                                           "loss; it has kl_cov_ratio, kl_cov_coef, entropy_coef"):
        EntropyControlSettings(knob="clip_cov_ratio").check("kl_cov", vocab_size=1000)
    with pytest.raises(SettingError, match="^knob: kl_cov_ratio is not a knob of the ppo_clip"):
        EntropyControlSettings().check("ppo_clip", vocab_size=1000)
    EntropyControlSettings(knob="entropy_coef", knob_max=0.1).check("ppo_clip", vocab_size=1000)
    with pytest.raises(SettingError, match=r"^knob_min: the starting value of entropy_coef \(0"):
        EntropyController(EntropyControlSettings(knob="entropy_coef", knob_max=0.1), initial=0.0)
    frac = EntropyController(EntropyControlSettings(target_type="fraction_of_first",
                                                    target=2.0), initial=2e-3, vocab_size=10)
    with pytest.raises(SettingError, match="^target: 2.0 x the first step's entropy"):
        frac.update(1.5)  # 3 nats > log 10
    ctl = EntropyController(SETTINGS, initial=2e-3)
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive finite"):
            ctl.update(bad)


def _algorithm(loss: str = "kl_cov", **control):
    return {"algorithm": {"loss": loss, "entropy_control": {"enabled": True, **control}}}


@pytest.mark.parametrize("data,message", [
    (_algorithm("ppo_clip"), r"algorithm\.entropy_control\.knob: kl_cov_ratio is not a knob of "
                             r"the ppo_clip loss; it has entropy_coef"),
    (_algorithm(knob="lr"), r"algorithm\.entropy_control\.knob: 'lr' is not allowed"),
    (_algorithm(knob_max=2.0), r"algorithm\.entropy_control\.knob_max: kl_cov_ratio is a "
                               r"fraction of tokens: at most 1"),
    (_algorithm(target=-0.1), r"algorithm\.entropy_control\.target: -0\.1 is out of range"),
    (_algorithm(knob_min=0.1, knob_max=0.01), r"algorithm\.entropy_control\.knob_min: need "
                                              r"0 < knob_min < knob_max"),
    ({"algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.3, "entropy_control": {"enabled": True}}},
     r"algorithm\.entropy_control\.knob_min: the starting value of kl_cov_ratio \(0\.3\) lies "
     r"outside \[knob_min, knob_max\]"),
    ({"algorithm": {"loss": "ppo_clip", "entropy_control": {"enabled": True,
                                                            "knob": "entropy_coef"}}},
     r"algorithm\.entropy_control\.knob_min: the starting value of entropy_coef \(0\.0\)"),
])
def test_config_refuses_bad_control_naming_the_key(data, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(data=data)


def test_config_target_against_the_models_vocabulary():
    cfg = load_config(data=_algorithm(target=7.0))  # the vocabulary is the model's: not known yet
    with pytest.raises(ConfigError, match=r"^algorithm\.entropy_control\.target: 7\.0 nats is "
                                          r"not below log V = log\(1000\)"):
        entropy_control_settings(cfg.algorithm, vocab_size=1000)
    assert entropy_control_settings(cfg.algorithm, vocab_size=5000).target == 7.0
    off = load_config(data={"algorithm": {"entropy_control": {"knob_min": 0.1,
                                                              "knob_max": 0.01}}})
    assert entropy_control_settings(off.algorithm) is None  # off: its settings are not used
