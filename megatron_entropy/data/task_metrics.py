"""Per-response metrics of a task, reported by training (trainer/rollouts.py: every step's
rollouts and validation) and ``eval`` alike: a task whose responses fall into solution modes (the
hinted task's direct and worked answers, data/hinted.py) gives each mode's share of the
responses and their accuracy. A task without modes gives none, and nothing is computed for its
responses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron_entropy.data.hinted import MODES, solution_mode


@dataclass(frozen=True)
class ResponseModes:
    """The solution modes of a task's responses: their names, and the mode of one response."""

    modes: tuple[str, ...]
    mode_of: Callable[[str], str]


# The tasks with modes, by the prefix of their data source.
TASK_MODES = {"hinted_": ResponseModes(MODES, solution_mode)}
# Every task's modes, in order (the metrics' keys).
ALL_MODES = tuple(dict.fromkeys(m for task in TASK_MODES.values() for m in task.modes))


def response_modes(source: str, texts: Sequence[str]) -> tuple[str, ...]:
    """The mode of each response to a problem from data source ``source``; () for a task
    without modes."""
    task = next((t for prefix, t in TASK_MODES.items() if source.startswith(prefix)), None)
    return () if task is None else tuple(task.mode_of(t) for t in texts)


def mode_shares(modes: Sequence[str], rewards: Sequence[float]
                ) -> dict[str, tuple[float, Optional[float]]]:
    """Per mode: (its share of the responses ``modes`` holds, the accuracy of those in it, or
    None where none is); {} when no response has a mode. ``rewards`` are the responses' own."""
    if not modes:
        return {}
    out = {}
    for mode in ALL_MODES:
        rs = [r for m, r in zip(modes, rewards) if m == mode]
        out[mode] = (len(rs) / len(modes), sum(r > 0 for r in rs) / len(rs) if rs else None)
    return out
