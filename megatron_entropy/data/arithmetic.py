"""A synthetic multi-step integer arithmetic task whose answers are checked like math answers.

A problem is an expression of ``+``, ``-`` and ``*`` over small positive integers, e.g.
``7 + 3 * 5 - 2``; its answer is the integer value under the usual precedence. Every problem also
carries a step-by-step worked solution ending in ``\\boxed{answer}`` (one binary operation per
line), which is what the quickstart model is pretrained on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from megatron_entropy.runtime.seeds import task_split_seeds

OPS = ("+", "-", "*")


@dataclass(frozen=True)
class ArithmeticProblem:
    question: str
    answer: str
    solution: str
    num_ops: int

    @property
    def source(self) -> str:
        return f"arithmetic_{self.num_ops}op"


def _apply(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b if op == "-" else a * b


def solve(operands: list[int], ops: list[str]) -> tuple[int, list[str]]:
    """Value of the expression and its steps: products first, then sums left to right."""
    nums, rest = list(operands), list(ops)
    steps = []
    for level in (("*",), ("+", "-")):
        i = 0
        while i < len(rest):
            if rest[i] in level:
                value = _apply(nums[i], rest[i], nums[i + 1])
                steps.append(f"{nums[i]} {rest[i]} {nums[i + 1]} = {value}")
                nums[i:i + 2] = [value]
                del rest[i]
            else:
                i += 1
    return nums[0], steps


def make_problem(rng: random.Random, min_ops: int, max_ops: int,
                 max_operand: int) -> ArithmeticProblem:
    num_ops = rng.randint(min_ops, max_ops)
    operands = [rng.randint(1, max_operand) for _ in range(num_ops + 1)]
    ops = [rng.choice(OPS) for _ in range(num_ops)]
    expr = " ".join(f"{x} {op}" for x, op in zip(operands, ops)) + f" {operands[-1]}"
    value, steps = solve(operands, ops)
    solution = "\n".join(steps) + f"\n\\boxed{{{value}}}"
    return ArithmeticProblem(question=f"What is {expr}?", answer=str(value), solution=solution,
                             num_ops=num_ops)


def generate_problems(num: int, min_ops: int, max_ops: int, max_operand: int, seed: int,
                      exclude: frozenset[str] = frozenset()) -> list[ArithmeticProblem]:
    """``num`` problems from a generator seeded by ``seed``; questions in ``exclude`` are skipped
    (so that a validation set stays out of the training set)."""
    if not 1 <= min_ops <= max_ops:
        raise ValueError(f"need 1 <= min_ops <= max_ops, got min_ops={min_ops}, max_ops={max_ops}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    rng = random.Random(seed)
    out: list[ArithmeticProblem] = []
    attempts = 0
    while len(out) < num:
        attempts += 1
        if attempts > 100 * num + 1000:
            raise ValueError(f"cannot draw {num} problems outside the {len(exclude)} excluded ones "
                             f"with max_ops={max_ops}, max_operand={max_operand}")
        p = make_problem(rng, min_ops, max_ops, max_operand)
        if p.question not in exclude:
            out.append(p)
    return out


def train_val_problems(num_train: int, num_val: int, min_ops: int, max_ops: int, max_operand: int,
                       seed: int) -> tuple[list[ArithmeticProblem], list[ArithmeticProblem]]:
    """Disjoint train and validation problems; both depend only on the arguments."""
    train_seed, val_seed = task_split_seeds(seed)
    val = generate_problems(num_val, min_ops, max_ops, max_operand, seed=val_seed)
    train = generate_problems(num_train, min_ops, max_ops, max_operand, seed=train_seed,
                              exclude=frozenset(p.question for p in val))
    return train, val
