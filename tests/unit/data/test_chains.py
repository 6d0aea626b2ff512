"""The long-response task (data/chains.py): a worked solution is one addition a line counting
down to the boxed answer, which the math reward accepts; the number of additions follows the
configured mixture of modes; train and validation problems are disjoint and reproducible."""

from __future__ import annotations

import statistics

import pytest

from megatron_entropy.config import ChainLengthMode, ChainsConfig, DataConfig, load_config
from megatron_entropy.data.chains import ChainProblem, chain_splits
from megatron_entropy.rewards import math_rewards


def test_a_worked_solution_counts_down_to_the_boxed_answer():
    p = ChainProblem(start=17, step=4, steps=3)
    assert p.question == "Start at 17 and add 4, 3 times. What do you get?"
    assert p.answer == "29"
    assert p.solution() == "2: 17+4=21\n1: 21+4=25\n0: 25+4=\\boxed{29}"
    assert p.solution(2) == "2: 17+4=21\n1: 21+4=25"  # a prefix: no answer yet
    assert math_rewards([p.solution(), p.solution(2)], [p.answer] * 2) == [1.0, 0.0]
    assert (p.source, ChainProblem(1, 1, 30).source, ChainProblem(1, 1, 90).source) == \
        ("chains_short", "chains_medium", "chains_long")


def _steps(modes, n=4000, **kw):
    train = chain_splits(ChainsConfig(length_modes=modes, num_val=1, **kw), n, 0)["train"]
    return [p.steps for p in train]


def test_the_number_of_additions_follows_the_modes():
    steps = _steps([ChainLengthMode()])
    assert 28 <= statistics.median(steps) <= 36  # the default mode's median, 32
    assert min(steps) >= 8 and max(steps) <= 160 and max(steps) > 100  # a long tail
    two = _steps([ChainLengthMode(median=10, sigma=0.2), ChainLengthMode(median=80, sigma=0.2)],
                 min_steps=2)
    short = sum(s < 30 for s in two) / len(two)
    # half each (distinct questions: a few repeats of short chains are drawn again), almost
    # none between the modes
    assert 0.4 < short < 0.6 and sum(20 < s < 40 for s in two) < 0.01 * len(two)
    clipped = _steps([ChainLengthMode(median=500)], n=300, min_steps=2, max_steps=50)
    assert set(clipped) == {50}


def test_train_and_validation_are_disjoint_and_reproducible():
    cfg = ChainsConfig(num_val=50)
    splits = chain_splits(cfg, 200, 0)
    train, val = splits["train"], splits["val"]
    assert not {p.question for p in train} & {p.question for p in val}
    assert splits == chain_splits(cfg, 200, 0) and splits["test"] == []


def test_the_modes_are_configured_by_yaml_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("data:\n  task: chains\n  chains:\n    length_modes:\n"
                    "      - {median: 10, weight: 1}\n      - {median: 80, sigma: 0.3}\n")
    cfg = load_config(path)
    assert cfg.data.task == "chains"
    assert [(m.median, m.sigma, m.weight) for m in cfg.data.chains.length_modes] == \
        [(10.0, 0.55, 1.0), (80.0, 0.3, 1.0)]
    with pytest.raises(Exception, match="min_steps"):
        DataConfig(chains=ChainsConfig(min_steps=9, max_steps=8)).validate()
