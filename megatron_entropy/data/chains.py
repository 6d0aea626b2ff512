"""The long-response task: chains of additions whose length follows a chosen distribution.

A problem: ``Start at 17 and add 4, 30 times. What do you get?``; its answer is 17 + 30 x 4. Its
worked solution takes one addition a line, counting down the additions still to do, and boxes
the last result::

    29: 17+4=21
    28: 21+4=25
    ...
    0: 129+4=\\boxed{133}

A line depends only on the line before it (and the first on the prompt), so a tiny model that
learned the rule on short chains and on the first lines of long ones follows it over chains of
any length, and a response's length is set by the problem: ~12.5 tokens a line with digits as
tokens, so 8 to 160 additions give responses of ~100 to ~2,000 tokens. One slip (a wrong digit, a count skipped) and the answer is
wrong: the longer the chain, the more a sampled response errs, which RL can act on.

How long the chains are is the task's parameter: the number of additions is drawn from a mixture
of log-normal modes (``data.chains.length_modes``: median, spread, weight), clipped to [min_steps, max_steps].
One mode (the default: median 32 additions, sigma 0.55) gives the long-tailed lengths of
reasoning responses: a median near 420 tokens, 90% under ~900, a tail to ~2,000 (measured with
the chains model's tokenizer); two modes give a task whose responses come short or long, e.g.
``length_modes: [{median: 10, weight: 1}, {median: 80, weight: 1}]``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from megatron_entropy.config import ChainLengthMode
from megatron_entropy.data.sums import draw_distinct
from megatron_entropy.runtime.seeds import task_split_seeds


@dataclass(frozen=True)
class ChainProblem:
    start: int
    step: int
    steps: int  # additions

    @property
    def question(self) -> str:
        return f"Start at {self.start} and add {self.step}, {self.steps} times. What do you get?"

    @property
    def answer(self) -> str:
        return str(self.start + self.step * self.steps)

    @property
    def source(self) -> str:
        """The chain's length class: short (< 20 additions), medium (< 60) or long."""
        return "chains_" + ("short" if self.steps < 20 else "medium" if self.steps < 60
                            else "long")

    def solution(self, lines: int | None = None) -> str:
        """The worked solution; its first ``lines`` lines only, when given (a prefix)."""
        out, total = [], self.start
        for i in range(self.steps if lines is None else min(lines, self.steps)):
            left = self.steps - 1 - i
            new = total + self.step
            result = f"\\boxed{{{new}}}" if left == 0 else str(new)
            out.append(f"{left}: {total}+{self.step}={result}")
            total = new
        return "\n".join(out)


def draw_steps(rng: random.Random, modes: Sequence[ChainLengthMode], min_steps: int,
               max_steps: int) -> int:
    """A number of additions from the mixture ``modes``, clipped to [min_steps, max_steps]."""
    mode = rng.choices(list(modes), weights=[m.weight for m in modes])[0]
    n = round(math.exp(rng.gauss(math.log(mode.median), mode.sigma)))
    return min(max(n, min_steps), max_steps)


def generate_chain_problems(num: int, modes: Sequence[ChainLengthMode], min_steps: int,
                            max_steps: int, max_start: int, max_step: int, seed: int,
                            exclude: frozenset[str] = frozenset()) -> list[ChainProblem]:
    """``num`` distinct problems from a generator seeded by ``seed`` (questions in ``exclude``
    skipped)."""
    if not modes:
        raise ValueError("data.chains.length_modes is empty: give at least one mode")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    rng = random.Random(seed)

    def draw() -> ChainProblem:
        steps = draw_steps(rng, modes, min_steps, max_steps)
        return ChainProblem(rng.randint(1, max_start), rng.randint(1, max_step), steps)

    return draw_distinct(num, draw, lambda p: p.question, exclude,
                         f"max_start={max_start}, max_step={max_step}")


def train_val_chain_problems(num_train: int, num_val: int, modes: Sequence[ChainLengthMode],
                             min_steps: int, max_steps: int, max_start: int, max_step: int,
                             seed: int) -> tuple[list[ChainProblem], list[ChainProblem]]:
    """Disjoint train and validation problems; both depend only on the arguments."""
    train_seed, val_seed = task_split_seeds(seed)
    val = generate_chain_problems(num_val, modes, min_steps, max_steps, max_start, max_step,
                                  val_seed)
    train = generate_chain_problems(num_train, modes, min_steps, max_steps, max_start, max_step,
                                    train_seed, exclude=frozenset(p.question for p in val))
    return train, val
