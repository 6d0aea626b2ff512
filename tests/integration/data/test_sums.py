"""The study task (data.task = sums): problems, worked solutions and their forks, the splits, and
how a run's config selects it."""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from megatron_entropy.config import ConfigError, DataConfig, SumsConfig, load_config
from megatron_entropy.data import (generate_sum_problems, load_prompt_dataset, load_tokenizer,
                                   sums_rows, train_val_sum_problems, worked_solution)
from megatron_entropy.rewards import math_rewards

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
QUICKSTART = EXAMPLES / "quickstart_model"
STUDY_MODEL = EXAMPLES / "study_model"
LINE = re.compile(r"(-?\d+(?:[+-]\d+)+)=(-?\d+)")  # "7+15-4=18"
LAST_LINE = re.compile(r"(-?\d+(?:[+-]\d+)+)=\\boxed\{(-?\d+)\}")  # "-3+9=\boxed{6}"


def parse_solution(text: str) -> tuple[list[list[int]], list[int]]:
    """Numbers added on each line and each line's result (the last one boxed)."""
    lines = text.split("\n")
    added, results = [], []
    for i, line in enumerate(lines):
        m = (LAST_LINE if i == len(lines) - 1 else LINE).fullmatch(line)
        assert m, f"not line {i} of a worked solution: {line!r}"
        added.append([int(x) for x in re.findall(r"-?\d+", m.group(1).replace("+", " "))])
        results.append(int(m.group(2)))
    return added, results


@pytest.mark.parametrize("subtract_prob", [0.0, 0.3])
def test_problems_have_the_sum_as_answer(subtract_prob):
    problems = generate_sum_problems(300, 3, 5, 50, seed=1, subtract_prob=subtract_prob)
    assert {len(p.terms) for p in problems} == {3, 4, 5}
    assert len({p.question for p in problems}) == 300
    for p in problems:
        expr = re.fullmatch(r"What is (.*)\?", p.question).group(1)
        assert int(p.answer) == eval(expr) == sum(p.terms)
        assert p.terms[0] > 0 and all(1 <= abs(t) <= 50 for t in p.terms)
        assert p.source == f"sums_{len(p.terms)}terms"
    later = [t for p in problems for t in p.terms[1:]]
    negative = sum(t < 0 for t in later)
    # Each later term is subtracted with probability subtract_prob: within 5 standard deviations.
    assert abs(negative - subtract_prob * len(later)) <= 5 * (
        len(later) * subtract_prob * (1 - subtract_prob)) ** 0.5


@pytest.mark.parametrize("more_prob, max_numbers", [(0.0, 4), (0.5, 4), (1.0, 3), (1.0, 4)])
def test_every_worked_solution_is_correct_and_uses_each_term_once(more_prob, max_numbers):
    rng = random.Random(0)
    for p in generate_sum_problems(200, 2, 6, 99, seed=2, subtract_prob=0.3):
        added, results = parse_solution(worked_solution(p.terms, rng, more_prob, max_numbers))
        assert results[-1] == sum(p.terms)
        new_terms = added[0] + [x for line in added[1:] for x in line[1:]]
        assert Counter(new_terms) == Counter(p.terms)
        for i, (numbers, result) in enumerate(zip(added, results)):
            assert sum(numbers) == result and 2 <= len(numbers) <= max_numbers
            if i > 0:  # a later line starts from the running total
                assert numbers[0] == results[i - 1]
        if more_prob == 0.0:
            assert all(len(n) == 2 for n in added)
        if more_prob == 1.0:  # every line but the last is as wide as allowed
            assert all(len(n) == max_numbers for n in added[:-1])
    with pytest.raises(ValueError, match="max_numbers=1"):
        worked_solution((1, 2), rng, 0.5, 1)


def test_solutions_fork_over_orders_and_line_lengths():
    """Drawn often enough, one problem's solutions cover every order of its terms and every line
    width, in the shares the arguments say: the forks the policy learns."""
    rng = random.Random(3)
    terms = (11, 22, 33, 44)
    firsts, widths = Counter(), Counter()
    n = 4000
    for _ in range(n):
        added, _ = parse_solution(worked_solution(terms, rng, 0.5, 4))
        firsts[tuple(added[0][:2])] += 1
        widths[len(added[0])] += 1
    assert set(firsts) == {(a, b) for a in terms for b in terms if a != b}

    def near(count: int, p: float) -> bool:  # within 5 standard deviations of n draws
        return abs(count - n * p) < 5 * (n * p * (1 - p)) ** 0.5

    assert all(near(c, 1 / 12) for c in firsts.values())
    assert near(widths[2], 0.5) and near(widths[3], 0.25) and near(widths[4], 0.25)


def test_splits_are_deterministic_disjoint_and_prefix_stable():
    a = train_val_sum_problems(2000, 100, 3, 4, 50, seed=5)
    assert a == train_val_sum_problems(2000, 100, 3, 4, 50, seed=5)
    train, val = a
    assert not {p.question for p in train} & {p.question for p in val}
    # A smaller validation set is a prefix of a larger one, so the study model's pretraining can
    # hold out the first 1024 for any data.sums.num_val <= 1024.
    assert train_val_sum_problems(10, 40, 3, 4, 50, seed=5)[1] == val[:40]
    assert train_val_sum_problems(2000, 100, 3, 4, 50, seed=6)[0] != train


def test_bad_sizes_are_errors():
    with pytest.raises(ValueError, match="min_terms"):
        generate_sum_problems(1, 1, 3, 10, seed=0)
    with pytest.raises(ValueError, match="max_operand"):
        generate_sum_problems(1, 2, 3, 0, seed=0)
    with pytest.raises(ValueError, match="subtract_prob must be in"):
        generate_sum_problems(1, 2, 3, 9, seed=0, subtract_prob=1.5)
    with pytest.raises(ValueError, match="cannot draw 10 distinct problems"):
        generate_sum_problems(10, 2, 2, 2, seed=0)  # only 4 exist
    with pytest.raises(ConfigError, match=r"^data\.sums\.min_terms: 6 must be <= max_terms "
                                          r"\(5\)"):
        load_config(data={"data": {"task": "sums", "sums": {"min_terms": 6}}})
    with pytest.raises(ConfigError, match="data.task: 'sum' is not allowed.*did you mean 'sums'"):
        load_config(data={"data": {"task": "sum"}})


def test_config_selects_the_task_and_answers_check_as_math():
    cfg = SumsConfig(num_train=40, num_val=6, min_terms=3, max_terms=3, max_operand=9, seed=1)
    train, val = sums_rows(cfg, "train"), sums_rows(cfg, "val")
    assert len(train) == 40 and len(val) == 6 and {r.source for r in train} == {"sums_3terms"}
    tokenizer = load_tokenizer(QUICKSTART)
    data = DataConfig(task="sums", sums=cfg)
    ds = load_prompt_dataset(data, tokenizer, max_prompt_tokens=128, split="val")
    assert [it.answer for it in ds] == [r.answer for r in val]
    assert all(r.prompt in it.text for r, it in zip(val, ds))
    # The reward of a worked solution is 1, of a wrong total 0.
    rng = random.Random(0)
    p = train_val_sum_problems(40, 6, 3, 3, 9, 1)[1][0]
    assert math_rewards([worked_solution(p.terms, rng), "\\boxed{-1}"], [p.answer] * 2) == [1, 0]
    # The default stays the arithmetic task.
    arith = load_prompt_dataset(DataConfig(), tokenizer, max_prompt_tokens=128, split="val")
    assert arith.sources[0].startswith("arithmetic_")


def test_the_study_model_held_out_the_default_validation_set():
    """examples/study_model never saw the problems a default data.sums run validates on: its
    training summary names the held-out questions by digest, and the default validation set is a
    prefix of them."""
    summary = json.loads((STUDY_MODEL / "training_summary.json").read_text())
    cfg = SumsConfig()
    _, held_out = train_val_sum_problems(0, summary["held_out"], cfg.min_terms, cfg.max_terms,
                                         cfg.max_operand, cfg.seed, cfg.subtract_prob)
    digest = hashlib.sha256("\n".join(p.question for p in held_out).encode()).hexdigest()
    assert digest == summary["held_out_sha256"]
    assert cfg.num_val <= summary["held_out"]
    assert [r.answer for r in sums_rows(cfg, "val")] == [p.answer for p in held_out[:cfg.num_val]]
