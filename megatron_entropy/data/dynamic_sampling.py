"""Dynamic sampling (DAPO): keep only prompt groups whose rewards differ, refill the batch.

A group whose n responses all got the same reward has zero GRPO advantage everywhere, so it adds
no gradient but still dilutes the token-mean. The trainer generates, scores, hands the groups to
``GroupFilter.add`` and asks ``prompts_needed()`` how many more prompts to roll out, until the batch
is full or ``max_refill_rounds`` extra rounds have been spent.
"""

from __future__ import annotations

import math
from typing import Generic, Sequence, TypeVar

T = TypeVar("T")


def has_reward_variance(rewards: Sequence[float]) -> bool:
    return len(rewards) > 1 and any(r != rewards[0] for r in rewards[1:])


class GroupFilter(Generic[T]):
    """Collects groups for one step. ``enabled=False`` keeps every group (no refill)."""

    def __init__(self, target_groups: int, max_refill_rounds: int, enabled: bool = True):
        if target_groups < 1:
            raise ValueError("target_groups must be >= 1")
        self.target_groups = target_groups
        self.max_refill_rounds = max_refill_rounds
        self.enabled = enabled
        self.kept: list[T] = []
        self.rounds = 0
        self.seen_groups = 0

    def add(self, groups: Sequence[T], rewards: Sequence[Sequence[float]]) -> None:
        """One round of rolled-out groups with the rewards of each group's responses."""
        if len(groups) != len(rewards):
            raise ValueError(f"{len(groups)} groups but {len(rewards)} reward lists")
        self.rounds += 1
        self.seen_groups += len(groups)
        self.kept += [g for g, r in zip(groups, rewards) if not self.enabled
                      or has_reward_variance(r)]

    @property
    def done(self) -> bool:
        return self.rounds > 0 and (len(self.kept) >= self.target_groups or not self.enabled
                                    or self.rounds > self.max_refill_rounds)

    def prompts_needed(self) -> int:
        """Prompts to roll out next: the whole target first, then the deficit scaled up by the
        keep rate seen so far (at most the target); 0 when done."""
        if self.rounds == 0:
            return self.target_groups
        if self.done:
            return 0
        deficit = self.target_groups - len(self.kept)
        keep_rate = len(self.kept) / self.seen_groups
        if keep_rate == 0:
            return self.target_groups
        return min(self.target_groups, math.ceil(deficit / keep_rate))

    def take(self) -> list[T]:
        """At most ``target_groups`` kept groups, in the order they came (may be fewer, or none,
        when the refill rounds ran out; the trainer then trains on fewer or skips the update)."""
        return self.kept[:self.target_groups]

    def metrics(self) -> dict[str, float]:
        return {"data/kept_group_frac": len(self.kept) / max(self.seen_groups, 1),
                "data/sampling_rounds": float(self.rounds),
                "data/groups": float(min(len(self.kept), self.target_groups))}
