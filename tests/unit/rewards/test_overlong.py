"""DAPO's overlong reward shaping (rewards/overlong.py) against its formula (DAPO, Eq. 13), and
applied to the training rollouts' rewards by the lengths the engine generated."""

from __future__ import annotations

import pytest

from megatron_entropy.rewards.overlong import OverlongShaping, overlong_penalty


@pytest.mark.parametrize("length,want", [
    (0, 0.0), (60, 0.0),        # up to L - buffer: nothing
    (61, -0.5 * 1 / 40),        # then linear in how far into the buffer
    (80, -0.5 * 20 / 40),
    (100, -0.5),                # the limit: the whole penalty
    (130, -0.5),                # (an engine that overran stays at it)
])
def test_penalty_is_linear_over_the_buffer_before_the_limit(length, want):
    assert overlong_penalty(length, limit=100, buffer=40, penalty=0.5) == pytest.approx(want)


def test_no_buffer_no_penalty():
    assert overlong_penalty(100, limit=100, buffer=0, penalty=1.0) == 0.0


def test_shaping_adds_the_penalty_and_keeps_the_scorer():
    calls = []

    class Scorer:
        def __call__(self, texts, answers, sources):
            calls.append(texts)
            return [1.0 for _ in texts]

        def take_failures(self):
            return 3

    shaped = OverlongShaping(Scorer(), limit=10, buffer=4, penalty=1.0)
    rewards = shaped(["a", "b", "c"], ["x"] * 3, ["s"] * 3)
    assert calls == [["a", "b", "c"]] and rewards == [1.0, 1.0, 1.0]
    assert shaped.shape(rewards, [3, 8, 10]) == pytest.approx([1.0, 0.5, 0.0])
    assert shaped.take_failures() == 3
