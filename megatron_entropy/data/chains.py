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

With ``data.chains.guess_right`` set, each question ends with a guess of its answer, drawn as the
hinted task draws one (megatron_entropy/data/hinted.py: right with that chance, else off by
``guess_error``), and a response solves it in one of the hinted task's two modes: ``direct``, the
guess boxed (a few tokens, right exactly when the guess is), or ``worked``, the whole chain (~400
tokens, right as often as no line slips, which practice improves): the long two-mode task
(docs/study/long.md). Its data sources are ``hinted_chains_<length class>``, so the hinted task's
mode metrics classify its responses.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_entropy.config import ChainLengthMode, ChainsConfig
from megatron_entropy.data.hinted import GuessError, check_guess, draw_guess, test_seed
from megatron_entropy.data.sums import draw_distinct
from megatron_entropy.runtime.seeds import task_split_seeds


@dataclass(frozen=True)
class ChainProblem:
    start: int
    step: int
    steps: int  # additions
    guess: Optional[int] = None  # of the answer, shown after the question

    @property
    def chain(self) -> str:
        """The question without its guess: what tells problems apart across splits."""
        return f"Start at {self.start} and add {self.step}, {self.steps} times. What do you get?"

    @property
    def question(self) -> str:
        return self.chain if self.guess is None else f"{self.chain} Guess: {self.guess}"

    @property
    def answer(self) -> str:
        return str(self.start + self.step * self.steps)

    @property
    def source(self) -> str:
        """The chain's length class: short (< 20 additions), medium (< 60) or long; with a
        guess, ``hinted_`` before it (the hinted task's modes)."""
        length = "short" if self.steps < 20 else "medium" if self.steps < 60 else "long"
        return ("chains_" if self.guess is None else "hinted_chains_") + length

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
                            exclude: frozenset[str] = frozenset(),
                            guess_right: Optional[float] = None,
                            guess_error: GuessError = "random") -> list[ChainProblem]:
    """``num`` distinct problems from a generator seeded by ``seed`` (chains in ``exclude``
    skipped); each with a guess of its answer when ``guess_right`` is given."""
    if not modes:
        raise ValueError("data.chains.length_modes is empty: give at least one mode")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if guess_right is not None:
        check_guess(guess_right, guess_error)
    rng = random.Random(seed)

    def draw() -> ChainProblem:
        steps = draw_steps(rng, modes, min_steps, max_steps)
        p = ChainProblem(rng.randint(1, max_start), rng.randint(1, max_step), steps)
        if guess_right is None:
            return p
        return ChainProblem(p.start, p.step, steps,
                            draw_guess(rng, int(p.answer), guess_right, guess_error))

    return draw_distinct(num, draw, lambda p: p.chain, exclude,
                         f"max_start={max_start}, max_step={max_step}")


def chain_splits(cfg: ChainsConfig, num_train: int, num_test: int
                 ) -> dict[str, list[ChainProblem]]:
    """Disjoint train (``num_train``), validation (``cfg.num_val``) and test (``num_test``)
    problems of ``cfg``; each depends only on the arguments, and a smaller validation or test set
    is a prefix of a larger one (as the hinted task's splits)."""
    train_seed, val_seed = task_split_seeds(cfg.seed)

    def problems(num: int, seed: int, exclude: frozenset[str] = frozenset()):
        return generate_chain_problems(num, cfg.length_modes, cfg.min_steps, cfg.max_steps,
                                       cfg.max_start, cfg.max_step, seed, exclude,
                                       cfg.guess_right, cfg.guess_error)

    val = problems(cfg.num_val, val_seed)
    # The test set avoids every validation problem of up to 4096 (a prefix), so that growing
    # num_val never moves a test problem into validation.
    test = problems(num_test, test_seed(cfg.seed), frozenset(
        p.chain for p in problems(max(cfg.num_val, 4096), val_seed))) if num_test else []
    train = problems(num_train, train_seed, frozenset(p.chain for p in val + test))
    return {"train": train, "val": val, "test": test}
