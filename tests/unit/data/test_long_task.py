"""The long two-mode task (data.task = chains with data.chains.guess_right): chains problems
with a guess of their answer, answered by boxing the guess (direct) or by working the chain
(worked); the guesses, the splits (train, validation and test, disjoint), the reward and mode of
hand-written responses, and the config keys."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from megatron_entropy.config import ChainsConfig, ConfigError, load_config
from megatron_entropy.data.chains import ChainProblem, chain_splits
from megatron_entropy.data.dataset import chains_rows
from megatron_entropy.data.hinted import direct_solution, mode_accuracy, solution_mode
from megatron_entropy.data.task_metrics import response_modes
from megatron_entropy.rewards import math_rewards

GUESSED = ChainsConfig(guess_right=0.6, num_val=100)


def test_a_guess_follows_the_question_and_each_mode_is_scored_and_detected():
    right, wrong = ChainProblem(17, 4, 3, guess=29), ChainProblem(17, 4, 3, guess=33)
    assert right.question == "Start at 17 and add 4, 3 times. What do you get? Guess: 29"
    assert right.chain == ChainProblem(17, 4, 3).question
    assert (right.source, ChainProblem(1, 1, 90, guess=91).source) == \
        ("hinted_chains_short", "hinted_chains_long")
    texts = [direct_solution(right), direct_solution(wrong), right.solution(),
             "2: 17+4=21\n1: 21+4=25\n0: 25+4=\\boxed{30}",  # one slip in the last line
             right.solution(2),  # stopped early: worked, no answer
             "The answer is 29"]
    assert texts[:3] == ["\\boxed{29}", "\\boxed{33}",
                         "2: 17+4=21\n1: 21+4=25\n0: 25+4=\\boxed{29}"]
    rewards = math_rewards(texts, ["29"] * len(texts))
    assert rewards == [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]
    modes = ["direct", "direct", "worked", "worked", "worked", "other"]
    assert [solution_mode(t) for t in texts] == modes
    assert response_modes(right.source, texts) == tuple(modes)
    assert response_modes(ChainProblem(17, 4, 3).source, texts) == ()  # no guess: no modes
    assert mode_accuracy(texts, rewards)["worked"] == (3, 1 / 3)


def test_guesses_are_right_at_the_set_rate_and_wrong_ones_off_as_configured():
    n = 3000
    for error, offs_allowed in (("random", set(range(1, 11))), ("ten", {10})):
        problems = chain_splits(ChainsConfig(guess_right=0.6, guess_error=error, num_val=1),
                                n, 0)["train"]
        right = sum(p.guess == int(p.answer) for p in problems)
        assert abs(right - 0.6 * n) <= 5 * (n * 0.6 * 0.4) ** 0.5
        offs = {abs(p.guess - int(p.answer)) for p in problems if p.guess != int(p.answer)}
        assert offs == offs_allowed and all(p.guess > 0 for p in problems)
        assert all(p.question.endswith(f" Guess: {p.guess}") for p in problems)
    assert all(p.guess is None for p in chain_splits(ChainsConfig(num_val=5), 50, 0)["train"])


def test_splits_are_disjoint_deterministic_and_prefix_stable():
    a = chain_splits(GUESSED, 2000, 200)
    assert a == chain_splits(GUESSED, 2000, 200)
    chains = {s: {p.chain for p in ps} for s, ps in a.items()}
    assert (len(chains["train"]), len(chains["val"]), len(chains["test"])) == (2000, 100, 200)
    assert not chains["train"] & chains["val"] and not chains["train"] & chains["test"]
    assert not chains["val"] & chains["test"]
    b = chain_splits(ChainsConfig(guess_right=0.6, num_val=300), 10, 50)
    assert b["val"][:100] == a["val"] and b["test"] == a["test"][:50]


def test_a_runs_training_rows_leave_out_its_test_chains():
    """20,000 training chains of ~136k possible: about 9 would be test chains if training did
    not skip them."""
    cfg = ChainsConfig(guess_right=0.6, num_train=20_000, num_val=8, num_test=64)
    test = {r.prompt.split(" Guess:")[0] for r in chains_rows(cfg, "test")}
    train = {r.prompt.split(" Guess:")[0] for r in chains_rows(cfg, "train")}
    assert len(test) == 64 and len(train) == 20_000 and not train & test


def test_the_config_keys_select_the_task_and_its_test_split():
    cfg = load_config(overrides=["data.task=chains", "data.chains.guess_right=0.6",
                                 "data.chains.num_test=16", "data.chains.num_val=8"])
    assert cfg.data.split_problem("test") is None
    rows = chains_rows(cfg.data.chains, "test")
    assert len(rows) == 16 and all(" Guess: " in r.prompt for r in rows)
    assert {r.source for r in rows} <= {"hinted_chains_short", "hinted_chains_medium",
                                        "hinted_chains_long"}
    plain = load_config(overrides=["data.task=chains"])
    assert "data.chains.num_test=0 has no test split" in plain.data.split_problem("test")
    with pytest.raises(ConfigError, match=r"data\.chains\.guess_right"):
        load_config(overrides=["data.chains.guess_right=1.5"])
    with pytest.raises(ConfigError, match=r"data\.chains\.guess_error"):
        load_config(overrides=["data.chains.guess_error=five"])


def test_the_long_model_held_out_the_study_validation_and_test_sets():
    """examples/long_model never saw the problems examples/study_long.yaml validates or is
    evaluated on: its training summary names the held-out chains by digest, and the study's
    splits are prefixes of them."""
    repo = Path(__file__).resolve().parents[3]
    summary = json.loads((repo / "examples" / "long_model" / "training_summary.json").read_text())
    n = summary["held_out"]
    study = load_config(repo / "examples" / "study_long.yaml").data.chains
    held = chain_splits(dataclasses.replace(study, num_val=n), 0, n)
    chains = [p.chain for p in held["val"] + held["test"]]
    assert hashlib.sha256("\n".join(chains).encode()).hexdigest() == summary["held_out_sha256"]
    ours = chain_splits(study, 0, study.num_test)
    assert ours["val"] == held["val"][:study.num_val]
    assert ours["test"] == held["test"][:study.num_test]
