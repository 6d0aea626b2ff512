"""``megatron-entropy eval``'s math: the unbiased pass@k estimator, avg@k and maj@k, checked
against values computed by hand on fixed samples."""

from __future__ import annotations

import math

import pytest

from megatron_entropy.config import RewardConfig
from megatron_entropy.evaluation.command import render_table, score_problems, summarize
from megatron_entropy.evaluation.passk import (avg_at_k, ks_up_to, maj_at_k, majority_answer,
                                               pass_at_k)
from megatron_entropy.rewards import RewardScorer


@pytest.mark.parametrize("n, c, k, want", [
    (4, 2, 2, 1 - 1 / 6),       # 1 - C(2,2)/C(4,2)
    (5, 1, 2, 1 - 6 / 10),      # 1 - C(4,2)/C(5,2)
    (10, 3, 4, 1 - 35 / 210),   # 1 - C(7,4)/C(10,4)
    (8, 1, 1, 1 / 8),           # pass@1 = c/n
    (16, 0, 16, 0.0),
    (16, 16, 1, 1.0),
    (4, 2, 3, 1.0),             # n - c < k: every k-subset holds a right sample
])
def test_pass_at_k_by_hand(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_pass_at_k_is_the_binomial_ratio_where_that_can_be_computed():
    """The product form equals 1 - C(n-c, k)/C(n, k) in exact integers, also where the binomials
    are too large for floats (n = 2000)."""
    for n, c, k in [(64, 5, 16), (200, 17, 64), (2000, 3, 1000)]:
        exact = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(exact, rel=1e-9)
    with pytest.raises(ValueError, match="k=9"):
        pass_at_k(8, 1, 9)


def test_ks_avg_and_majority():
    assert ks_up_to(16) == [1, 2, 4, 8, 16] and ks_up_to(6) == [1, 2, 4, 6] and ks_up_to(1) == [1]
    assert avg_at_k([1.0, 0.0, 1.0, 1.0], 2) == 0.5
    assert majority_answer(["3", "5", "5", None, "3"]) == "3"  # tie: the answer seen first
    assert majority_answer([None, None]) is None
    assert maj_at_k(["5", "3", "3"], 3, lambda a: a == "5") == 0.0
    assert maj_at_k(["5", "3", "3"], 1, lambda a: a == "5") == 1.0


def test_fixed_samples_score_as_computed_by_hand():
    """Two problems, four samples each, scored by the math reward as training scores them."""
    scorer = RewardScorer(RewardConfig())
    sampled = [["\\boxed{5}", "\\boxed{3}", "\\boxed{3}", "no answer"],
               ["\\boxed{7}", "\\boxed{7}", "7+0=\\boxed{7}", "\\boxed{2}"]]
    problems = score_problems(["5", "7"], ["a", "b"], sampled, ["\\boxed{4}", "\\boxed{7}"],
                              scorer, [1, 2, 4])
    first, second = problems
    assert first["rewards"] == [1.0, 0.0, 0.0, 0.0]
    assert first["pass"] == pytest.approx({1: 0.25, 2: 0.5, 4: 1.0})  # 1 - C(3,2)/C(4,2) = 0.5
    assert first["avg"] == {1: 1.0, 2: 0.5, 4: 0.25}
    assert first["maj"] == {1: 1.0, 2: 1.0, 4: 0.0}  # 5 wins the 1-1 tie; 3 wins 2-1
    assert second["pass"] == pytest.approx({1: 0.75, 2: 1.0, 4: 1.0})
    assert second["maj"] == {1: 1.0, 2: 1.0, 4: 1.0}
    assert (first["greedy"], second["greedy"]) == (0.0, 1.0)
    summary = summarize(problems, [1, 2, 4])
    assert summary["overall"]["pass@1"] == pytest.approx(0.5)
    assert summary["overall"]["pass@1_greedy"] == 0.5
    assert summary["overall"]["maj@4"] == 0.5
    assert summary["by_source"]["a"]["pass@2"] == pytest.approx(0.5)
    table = render_table({"ks": [1, 2, 4], "settings": {"greedy": True, "n_samples": 4,
                                                        "temperature": 0.6, "top_p": 0.95},
                          "split": "test", "model": "m", **summary})
    assert len(table.splitlines()) == 5 and "pass@4" in table and "maj@4" in table
