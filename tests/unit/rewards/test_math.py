"""The math reward: last \\boxed{} extraction, equivalence via math-verify, robustness."""

from __future__ import annotations

import random
import time

import pytest

from megatron_entropy.data import generate_problems
from megatron_entropy.rewards import last_boxed, math_reward, math_rewards


@pytest.mark.parametrize("text, expected", [
    ("so the answer is \\boxed{42}.", "42"),
    ("\\boxed{1} first, finally \\boxed{2}", "2"),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("\\boxed{\\{1, 2\\}} and \\boxed{ {a}{b} }", "{a}{b}"),
    ("\\boxed{7} then an unclosed \\boxed{\\frac{1}{2}", "7"),
    ("$\\boxed 5$", "5"),
    ("\\fbox{3}", "3"),
    ("no box at all", None),
    ("\\boxed{", None),
    ("", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("response, truth, reward", [
    ("\\boxed{23}", "23", 1.0),
    ("steps...\n\\boxed{-6}", "-6", 1.0),
    ("\\boxed{ 23 }", "23", 1.0),
    ("\\boxed{6}", "-6", 0.0),
    ("\\boxed{24}", "23", 0.0),
    ("\\boxed{23} no wait \\boxed{24}", "23", 0.0),  # the last box counts
    ("the answer is 23", "23", 0.0),  # no box, no reward
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "1/2", 1.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{\\pi}", "3.14159", 0.0),
    ("\\boxed{1,000}", "1000", 1.0),
    ("\\boxed{}", "1", 0.0),
])
def test_math_reward(response, truth, reward):
    assert math_reward(response, truth) == reward


def test_reward_of_arithmetic_solutions():
    problems = generate_problems(200, 1, 3, 20, seed=0)
    assert math_rewards([p.solution for p in problems], [p.answer for p in problems]) == [1.0] * 200
    wrong = [p.solution.replace(f"\\boxed{{{p.answer}}}", f"\\boxed{{{int(p.answer) + 1}}}")
             for p in problems]
    assert math_rewards(wrong, [p.answer for p in problems]) == [0.0] * 200
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        math_rewards(["a", "b"], ["1"])


def test_garbage_never_raises():
    rng = random.Random(0)
    alphabet = "\\{}$^_0123456789abcx+-*/()[],.= \n\x00é∑"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 80)))
        truth = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 10)))
        assert math_reward("\\boxed{" + text + "}", truth) in (0.0, 1.0)
        assert math_reward(text, truth) in (0.0, 1.0)
    assert math_reward("\\boxed{" * 5000, "1") == 0.0
    assert math_reward("\\boxed{" + "1" * 10_000 + "}", "1") == 0.0  # too long to be an answer
    assert math_reward(None, "1") == 0.0  # type: ignore[arg-type]


@pytest.mark.slow
def test_runaway_check_is_killed_and_the_checker_recovers():
    start = time.monotonic()
    # sympy would compute this tower for ever inside C code.
    assert math_reward("\\boxed{9^{9^{9^{9}}}}", "3", timeout_s=1.0) == 0.0
    assert time.monotonic() - start < 30
    assert math_reward("\\boxed{0.25}", "\\frac{1}{4}") == 1.0  # a fresh checker answers


def test_a_checker_that_cannot_start_is_an_error_not_a_zero(monkeypatch):
    import shutil
    import sys

    from megatron_entropy.rewards import math as reward_math

    monkeypatch.setattr(sys, "executable", shutil.which("false"))
    monkeypatch.setattr(reward_math, "_checker", reward_math._Checker())
    assert math_reward("\\boxed{7}", "7") == 1.0  # integers never need the checker
    with pytest.raises(reward_math.CheckerUnavailable, match="did not start"):
        math_reward("\\boxed{0.5}", "\\frac{1}{2}")
