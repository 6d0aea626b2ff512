"""The two-mode study task: sums that come with a guess, solved by trusting the guess or by
working the sum out.

A problem is a sum of ``min_terms``..``max_terms`` positive integers with a guess of its total,
e.g. ``What is 13 + 7 + 18? Guess: 38``. The guess is right with probability ``guess_right``;
a wrong guess is off (``guess_error``) by 10 up or down, so that its last digit always matches
and the guess cannot be told wrong at a glance, or by a random 1 to 10 up or down, so that
setting it right takes the exact total, not a coarse estimate of it. A response solves it in
one of two modes:

- ``direct``: ``\\boxed{38}``, the guess taken as it is. Short, and right exactly when the guess
  is: its ceiling is ``guess_right`` whatever the policy learns, short of adding up first.
- ``worked``: ``13+7=20`` / ``20+18=\\boxed{38}``, two numbers a line in a random order (as the
  sums task, megatron_entropy/data/sums.py). Longer and, for a small model, right less often at
  first; with practice it can be right nearly always.

- ``tool``: ``<call>calculator: 13+7+18</call>``, answered by the calculator
  (``rollout.tools``, ``<result>38</result>``), then ``\\boxed{38}``: right whenever the call is
  well formed (examples/tool_study.yaml).

The first token of the response chooses the mode. A policy that starts with the direct mode
paying more (``guess_right`` above the worked mode's accuracy) collapses onto it under a
reward-greedy update, and then never samples the mode whose ceiling is higher: the mechanism by
which entropy collapse caps performance (Cui et al., 2025). Problems are drawn for three
disjoint splits: train, validation (model selection, tuning) and test (``megatron-entropy
eval`` only).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_entropy.data.sums import (check_sizes, draw_distinct, make_problem,
                                        worked_solution)
from megatron_entropy.runtime.seeds import task_split_seeds

MODES = ("direct", "worked", "tool", "other")
Split = Literal["train", "val", "test"]
GuessError = Literal["ten", "random"]
_DIRECT = re.compile(r"\s*\\boxed\{-?\d+\}\s*")
# A line that adds numbers; a chains line starts with the count of additions left.
_LINE = re.compile(r"(?:\d+: )?-?\d+(?:[+-]\d+)+=")


@dataclass(frozen=True)
class HintedProblem:
    terms: tuple[int, ...]
    guess: int

    @property
    def total(self) -> int:
        return sum(self.terms)

    @property
    def question(self) -> str:
        return f"What is {' + '.join(map(str, self.terms))}? Guess: {self.guess}"

    @property
    def answer(self) -> str:
        return str(self.total)

    @property
    def guess_is_right(self) -> bool:
        return self.guess == self.total

    @property
    def source(self) -> str:
        return f"hinted_{len(self.terms)}terms"


def direct_solution(problem) -> str:
    """The direct mode: the guess, boxed (of a hinted problem or a chains one with a guess)."""
    return f"\\boxed{{{problem.guess}}}"


def hinted_worked_solution(problem: HintedProblem, rng: random.Random) -> str:
    """The worked mode: the terms added two at a time in a random order."""
    return worked_solution(problem.terms, rng, more_prob=0.0, max_numbers=2)


def solution_mode(text: str) -> str:
    """Which mode a response is in: ``direct`` (nothing but a boxed number), ``worked`` (it
    starts with a line that adds numbers), ``tool`` (it starts with a tool call), or
    ``other``."""
    if text.lstrip().startswith(("<call>", "<tool_call>")):
        return "tool"
    if _DIRECT.fullmatch(text):
        return "direct"
    if _LINE.match(text.lstrip()):
        return "worked"
    return "other"


def make_hinted_problem(rng: random.Random, min_terms: int, max_terms: int, max_operand: int,
                        guess_right: float, guess_error: GuessError = "random") -> HintedProblem:
    terms = make_problem(rng, min_terms, max_terms, max_operand).terms
    return HintedProblem(terms, draw_guess(rng, sum(terms), guess_right, guess_error))


def draw_guess(rng: random.Random, total: int, guess_right: float,
               guess_error: GuessError = "random") -> int:
    """A guess of ``total``: right with probability ``guess_right``, else off as
    ``guess_error`` says (module docstring)."""
    if rng.random() < guess_right:
        return total
    off = 10 if guess_error == "ten" else rng.randint(1, 10)
    # Down only where that stays positive.
    down = total > off and rng.random() < 0.5
    return total - off if down else total + off


def check_guess(guess_right: float, guess_error: str) -> None:
    if not 0.0 <= guess_right <= 1.0:
        raise ValueError(f"guess_right must be in [0, 1], got {guess_right}")
    if guess_error not in ("ten", "random"):
        raise ValueError(f"guess_error must be 'ten' or 'random', got {guess_error!r}")


def generate_hinted_problems(num: int, min_terms: int, max_terms: int, max_operand: int,
                             guess_right: float, seed: int,
                             exclude: frozenset[str] = frozenset(),
                             guess_error: GuessError = "random") -> list[HintedProblem]:
    """``num`` problems whose sums (the terms, in order) are distinct and not in ``exclude``
    (sums, not questions: a problem does not reappear in another split with another guess)."""
    check_sizes(min_terms, max_terms, max_operand)
    check_guess(guess_right, guess_error)
    rng = random.Random(seed)
    return draw_distinct(num, lambda: make_hinted_problem(rng, min_terms, max_terms, max_operand,
                                                          guess_right, guess_error),
                         lambda p: sum_key(p.terms), exclude,
                         f"max_terms={max_terms}, max_operand={max_operand}")


def sum_key(terms: tuple[int, ...]) -> str:
    return "+".join(map(str, terms))


def hinted_splits(num_train: int, num_val: int, num_test: int, min_terms: int, max_terms: int,
                  max_operand: int, guess_right: float, seed: int,
                  guess_error: GuessError = "random") -> dict[str, list[HintedProblem]]:
    """Disjoint train, validation and test problems; each depends only on the arguments, and a
    smaller validation or test set is a prefix of a larger one."""
    train_seed, val_seed = task_split_seeds(seed)
    sizes = (min_terms, max_terms, max_operand, guess_right)
    val = generate_hinted_problems(num_val, *sizes, seed=val_seed, guess_error=guess_error)
    # The test set avoids every possible validation problem of up to 4096 (a prefix), so that
    # growing num_val never moves a test problem into validation.
    val_pool = frozenset(sum_key(p.terms) for p in generate_hinted_problems(
        max(num_val, 4096), *sizes, seed=val_seed, guess_error=guess_error)
    ) if num_test else frozenset()
    test = generate_hinted_problems(num_test, *sizes, seed=test_seed(seed), exclude=val_pool,
                                    guess_error=guess_error)
    held = frozenset(sum_key(p.terms) for p in val + test)
    train = generate_hinted_problems(num_train, *sizes, seed=train_seed, exclude=held,
                                     guess_error=guess_error)
    return {"train": train, "val": val, "test": test}


def test_seed(task_seed: int) -> int:
    """The test split's own stream, apart from train (2s) and validation (2s + 1)."""
    return 1_000_003 + task_seed


def mode_accuracy(texts: list[str], rewards: list[float]) -> dict[str, tuple[int, Optional[float]]]:
    """Per mode: (responses in it, their accuracy or None when there are none)."""
    out: dict[str, tuple[int, Optional[float]]] = {}
    for mode in MODES:
        rs = [r for t, r in zip(texts, rewards) if solution_mode(t) == mode]
        out[mode] = (len(rs), sum(r > 0 for r in rs) / len(rs) if rs else None)
    return out
