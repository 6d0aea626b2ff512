"""The two-mode study task (data.task = hinted): problems and their guesses, the splits, the
reward of each mode and the detection of modes."""

from __future__ import annotations

import hashlib
import json
import random
import re
from pathlib import Path

import pytest

from megatron_entropy.config import ConfigError, HintedConfig, load_config
from megatron_entropy.data.hinted import (HintedProblem, direct_solution, generate_hinted_problems,
                                          hinted_splits, hinted_worked_solution, mode_accuracy,
                                          solution_mode, sum_key)
from megatron_entropy.data.task_metrics import response_modes
from megatron_entropy.rewards import math_rewards
from megatron_entropy.trainer.rollouts import GroupStats, rollout_metrics

HINTED_MODEL = Path(__file__).resolve().parents[3] / "examples" / "hinted_model"


def test_guesses_are_right_at_the_set_rate_and_wrong_ones_off_by_ten():
    problems = generate_hinted_problems(4000, 3, 4, 20, 0.6, seed=1, guess_error="ten")
    right = sum(p.guess_is_right for p in problems)
    assert abs(right - 0.6 * 4000) <= 5 * (4000 * 0.6 * 0.4) ** 0.5
    for p in problems:
        assert re.fullmatch(r"What is \d+( \+ \d+){2,3}\? Guess: \d+", p.question)
        assert p.guess > 0 and p.guess % 10 == p.total % 10
        assert p.guess_is_right or abs(p.guess - p.total) == 10
    assert {p.source for p in problems} == {"hinted_3terms", "hinted_4terms"}


def test_a_random_guess_error_is_off_by_one_to_ten_with_any_last_digit():
    problems = generate_hinted_problems(4000, 3, 4, 20, 0.6, seed=1)
    right = sum(p.guess_is_right for p in problems)
    assert abs(right - 0.6 * 4000) <= 5 * (4000 * 0.6 * 0.4) ** 0.5
    offs = [p.guess - p.total for p in problems if not p.guess_is_right]
    assert all(p.guess > 0 for p in problems) and set(map(abs, offs)) == set(range(1, 11))
    # Either way and each size about equally often: no coarse rule sets a wrong guess right.
    assert abs(sum(o > 0 for o in offs) - len(offs) / 2) <= 5 * (len(offs) / 4) ** 0.5
    assert max(offs.count(o) + offs.count(-o) for o in range(1, 11)) <= 1.5 * len(offs) / 10
    with pytest.raises(ValueError, match="guess_error"):
        generate_hinted_problems(10, 3, 4, 20, 0.6, seed=1, guess_error="five")
    cfg = load_config(None, ["data.task=hinted", "data.hinted.guess_error=random"])
    assert cfg.data.hinted.guess_error == "random"
    with pytest.raises(ConfigError, match="guess_error"):
        load_config(None, ["data.task=hinted", "data.hinted.guess_error=five"])


def test_splits_are_disjoint_deterministic_and_prefix_stable():
    a = hinted_splits(3000, 100, 200, 3, 4, 20, 0.6, seed=5)
    assert a == hinted_splits(3000, 100, 200, 3, 4, 20, 0.6, seed=5)
    keys = {s: {sum_key(p.terms) for p in ps} for s, ps in a.items()}
    assert not keys["train"] & keys["val"] and not keys["train"] & keys["test"]
    assert not keys["val"] & keys["test"]
    b = hinted_splits(10, 300, 50, 3, 4, 20, 0.6, seed=5)
    assert b["val"][:100] == a["val"] and b["test"] == a["test"][:50]


def test_each_mode_is_scored_and_detected():
    rng = random.Random(0)
    right, wrong = HintedProblem((13, 7, 18), 38), HintedProblem((13, 7, 18), 48)
    responses = [direct_solution(right), direct_solution(wrong), hinted_worked_solution(wrong, rng),
                 "13+7=20\n20+18=\\boxed{39}", "The answer is \\boxed{38}", "",
                 "<call>calculator: 13+7+18</call><result>38</result>\\boxed{38}"]
    assert [solution_mode(t) for t in responses] == ["direct", "direct", "worked", "worked",
                                                     "other", "other", "tool"]
    rewards = math_rewards(responses, ["38"] * len(responses))
    assert rewards == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0]
    lines = responses[2].split("\n")
    assert len(lines) == 2 and lines[-1].endswith("=\\boxed{38}")
    assert mode_accuracy(responses, rewards) == {"direct": (2, 0.5), "worked": (2, 0.5),
                                                 "tool": (1, 1.0), "other": (2, 0.5)}
    assert response_modes("hinted_3terms", responses[:3]) == ("direct", "direct", "worked")
    assert response_modes("sums_3terms", responses[:3]) == ()


def test_mode_shares_are_logged_per_step():
    texts = ["\\boxed{38}", "13+7=20\n20+18=\\boxed{38}", "\\boxed{48}", "x"]
    groups = [GroupStats("hinted_3terms", [1.0, 1.0, 0.0, 0.0], 30, [4, 12, 4, 1], [False] * 4,
                         modes=tuple(solution_mode(t) for t in texts)),
              GroupStats("hinted_4terms", [0.0, 1.0], 30, [4, 4], [False] * 2,
                         modes=("direct", "direct"))]
    m = rollout_metrics(groups, prefix="val/")
    assert m["val/modes/direct_frac"] == pytest.approx(4 / 6)
    assert m["val/modes/direct_acc"] == pytest.approx(2 / 4)
    assert m["val/modes/worked_frac"] == pytest.approx(1 / 6) and m["val/modes/worked_acc"] == 1
    assert m["val/modes/other_frac"] == pytest.approx(1 / 6)
    plain = rollout_metrics([GroupStats("sums_3terms", [1.0], 30, [4], [False])])
    assert not [k for k in plain if k.startswith("modes/")]


def test_config_selects_the_task():
    cfg = load_config(overrides=["data.task=hinted", "data.hinted.num_test=8"])
    assert cfg.data.hinted.num_test == 8 and cfg.eval.temperature == 0.6
    with pytest.raises(ConfigError, match=r"data\.hinted\.min_terms: 5 must be <= max_terms"):
        load_config(overrides=["data.hinted.min_terms=5"])
    with pytest.raises(ConfigError, match=r"data\.hinted\.guess_right"):
        load_config(overrides=["data.hinted.guess_right=1.5"])


def test_the_hinted_model_held_out_the_default_validation_and_test_sets():
    """examples/hinted_model never saw the problems a default data.hinted run validates or is
    evaluated on: its training summary names the held-out questions by digest, and the default
    splits are prefixes of them."""
    summary = json.loads((HINTED_MODEL / "training_summary.json").read_text())
    cfg = HintedConfig()
    n = summary["held_out"]
    held = hinted_splits(0, n, n, cfg.min_terms, cfg.max_terms, cfg.max_operand,
                         cfg.guess_right, cfg.seed, cfg.guess_error)
    questions = [p.question for p in held["val"] + held["test"]]
    assert hashlib.sha256("\n".join(questions).encode()).hexdigest() == summary["held_out_sha256"]
    default = hinted_splits(0, cfg.num_val, cfg.num_test, cfg.min_terms, cfg.max_terms,
                            cfg.max_operand, cfg.guess_right, cfg.seed, cfg.guess_error)
    assert default["val"] == held["val"][:cfg.num_val]
    assert default["test"] == held["test"][:cfg.num_test]
