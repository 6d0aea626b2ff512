"""Every seed a run derives, in one place.

From the config's seeds (``rollout.seed``, ``trainer.seed``, ``data.seed``, a synthetic task's
``seed``) a run derives the seeds of each rollout step, refill round, validation, sample, tool turn,
optimizer update, Clip-Cov draw, epoch order and task split. Each depends only on where it is
used (step, epoch, mini-batch, micro-batch, prompt, sample), never on the order work happens in,
so a resumed run and a run on another layout draw the same. Changing a formula changes every
run's numbers: tests/unit/config/test_loading.py::test_derived_seeds_are_pinned pins their values.
Standard library only.
"""

from __future__ import annotations

import hashlib
from typing import Optional


def rollout_step_seed(rollout_seed: int, step: int) -> int:
    """Sampling seed of step ``step``'s rollout (its first round of prompts)."""
    return rollout_seed + 7_919 * (step + 1)


def validation_seed(rollout_seed: int, step: int) -> int:
    """Sampling seed of the validation after step ``step`` (0: before training)."""
    return rollout_step_seed(rollout_seed, step) + 1


def refill_round_seed(step_seed: Optional[int], round_index: int) -> int:
    """Sampling seed of dynamic sampling's round ``round_index`` (0 = the first) of one step."""
    return (step_seed or 0) * 31 + round_index


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of sample j of prompt i of one request: the same in every process, engine and
    run, in [0, 2**31)."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}:{sample_index}".encode(),
                             digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**31 - 1)


def turn_seed(seed: Optional[int], round_index: int) -> Optional[int]:
    """Sampling seed of round ``round_index`` (1, 2, ...) of a multi-turn rollout that began with
    ``seed`` (its first round uses ``seed`` itself); None stays unseeded."""
    if seed is None:
        return None
    digest = hashlib.blake2b(f"turn:{seed}:{round_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % (2**62)


def update_seed(trainer_seed: int, step: int, epoch: int, mini_batch: int) -> int:
    """Seed of one optimizer update (the global-scope Clip-Cov draw of that update)."""
    return ((trainer_seed * 1_000_003 + step) * 1009 + epoch) * 101 + mini_batch


def micro_batch_draw_seed(update: int, micro_batch: int) -> int:
    """Seed of the micro-batch-scope Clip-Cov draw of micro-batch ``micro_batch`` of update
    ``update`` (an ``update_seed``)."""
    return update * 997 + micro_batch


def epoch_order_seed(data_seed: int, epoch: int) -> int:
    """Seed of the prompt order of one epoch over the training set."""
    return data_seed * 1_000_003 + epoch


def task_split_seeds(task_seed: int) -> tuple[int, int]:
    """(train, validation) seeds of a synthetic task's problems: two disjoint streams."""
    return 2 * task_seed, 2 * task_seed + 1
