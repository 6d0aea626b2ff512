"""The study task: sums of several numbers whose worked solutions fork.

A problem is a sum of ``min_terms``..``max_terms`` positive integers, e.g. ``What is 23 + 7 + 15 +
4?``; its answer is the total. Its worked solutions are many: the terms may be added in any order,
and each line adds two to four numbers (a later line starts from the running total; the last
line's result is the boxed answer), e.g.

    15+4=19                7+23+4+15=\\boxed{49}    23+15=38
    19+23+7=\\boxed{49}                             38+4=42
                                                  42+7=\\boxed{49}

All of them are equally valid, so a model trained on them has forking tokens: which term comes
next, and whether a line ends (``=``) or takes one more number (``+``). They are not equally
reliable for a small model: a line that adds three or four numbers at once is harder to get right
than one that adds two, and carries make some orders harder than others on a given problem. That
is what lets RL trade entropy for reward here: concentrating on the reliable choices raises
accuracy and lowers entropy, the mechanism dH ~ -eta Cov(log p, A) of Cui et al. (2025).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable, TypeVar

from megatron_entropy.runtime.seeds import task_split_seeds

T = TypeVar("T")


def _signed(x: int) -> str:
    return f"+{x}" if x >= 0 else str(x)


@dataclass(frozen=True)
class SumProblem:
    terms: tuple[int, ...]  # signed; the first is positive

    @property
    def question(self) -> str:
        rest = "".join(f" {'-' if t < 0 else '+'} {abs(t)}" for t in self.terms[1:])
        return f"What is {self.terms[0]}{rest}?"

    @property
    def answer(self) -> str:
        return str(sum(self.terms))

    @property
    def source(self) -> str:
        return f"sums_{len(self.terms)}terms"


def worked_solution(terms: tuple[int, ...], rng: random.Random, more_prob: float = 0.5,
                    max_numbers: int = 4) -> str:
    """One worked solution drawn at random: a uniform order of the terms; a line that has two
    numbers takes one more with probability ``more_prob`` (again at three, up to ``max_numbers``)
    while terms are left."""
    if max_numbers < 2:
        raise ValueError(f"a line adds at least two numbers, got max_numbers={max_numbers}")
    order = list(terms)
    rng.shuffle(order)
    lines = []
    total = None
    while order:
        numbers = [order.pop(0)] if total is None else [total]
        numbers.append(order.pop(0))
        while order and len(numbers) < max_numbers and rng.random() < more_prob:
            numbers.append(order.pop(0))
        total = sum(numbers)
        result = f"\\boxed{{{total}}}" if not order else str(total)
        lines.append(str(numbers[0]) + "".join(_signed(x) for x in numbers[1:]) + f"={result}")
    return "\n".join(lines)


def make_problem(rng: random.Random, min_terms: int, max_terms: int, max_operand: int,
                 subtract_prob: float = 0.0) -> SumProblem:
    n = rng.randint(min_terms, max_terms)
    terms = [rng.randint(1, max_operand) for _ in range(n)]
    if subtract_prob > 0:  # no draws otherwise: the stream of plain sums stays what it was
        terms[1:] = [-t if rng.random() < subtract_prob else t for t in terms[1:]]
    return SumProblem(tuple(terms))


def generate_sum_problems(num: int, min_terms: int, max_terms: int, max_operand: int, seed: int,
                          exclude: frozenset[str] = frozenset(),
                          subtract_prob: float = 0.0) -> list[SumProblem]:
    """``num`` distinct problems from a generator seeded by ``seed``, each term after the first
    subtracted with probability ``subtract_prob``; questions in ``exclude`` are skipped (so that a
    validation set stays out of the training set)."""
    check_sizes(min_terms, max_terms, max_operand)
    if not 0.0 <= subtract_prob <= 1.0:
        raise ValueError(f"subtract_prob must be in [0, 1], got {subtract_prob}")
    rng = random.Random(seed)
    return draw_distinct(num, lambda: make_problem(rng, min_terms, max_terms, max_operand,
                                                   subtract_prob),
                         lambda p: p.question, exclude, f"max_terms={max_terms}, "
                                                        f"max_operand={max_operand}")


def check_sizes(min_terms: int, max_terms: int, max_operand: int) -> None:
    if not 2 <= min_terms <= max_terms:
        raise ValueError(f"need 2 <= min_terms <= max_terms, got min_terms={min_terms}, "
                         f"max_terms={max_terms}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")


def draw_distinct(num: int, draw: Callable[[], T], key: Callable[[T], str],
                  exclude: frozenset[str], sizes: str) -> list[T]:
    """``num`` draws whose keys are distinct and not in ``exclude``; ValueError (naming
    ``sizes``) when the space looks too small for that."""
    out: list[T] = []
    seen = set(exclude)
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise ValueError(f"cannot draw {num} distinct problems outside the {len(exclude)} "
                             f"excluded ones with {sizes}")
        p = draw()
        if key(p) not in seen:
            seen.add(key(p))
            out.append(p)
    return out


def train_val_sum_problems(num_train: int, num_val: int, min_terms: int, max_terms: int,
                           max_operand: int, seed: int, subtract_prob: float = 0.0
                           ) -> tuple[list[SumProblem], list[SumProblem]]:
    """Disjoint train and validation problems; both depend only on the arguments."""
    train_seed, val_seed = task_split_seeds(seed)
    val = generate_sum_problems(num_val, min_terms, max_terms, max_operand, seed=val_seed,
                                subtract_prob=subtract_prob)
    train = generate_sum_problems(num_train, min_terms, max_terms, max_operand, seed=train_seed,
                                  exclude=frozenset(p.question for p in val),
                                  subtract_prob=subtract_prob)
    return train, val
