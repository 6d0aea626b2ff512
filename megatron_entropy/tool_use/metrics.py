"""The step's metrics of multi-turn rollouts with tools.

From the rollouts (every rank holds every group's statistics, so every rank gets the same): turns
and tool calls per response, the calls that failed or ran out of time, the tools' seconds, the
share of response tokens that were inserted, the share of branched samples, and the reward by
the number of tool calls a response made.

From the recompute's entropies of this step's samples (summed over the DP group): the entropy of
the generated tokens of each turn, and of the first ``rollout.tools.after_tool_tokens`` generated
tokens after each tool result against every other generated token (the rise ARPO branches on).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from megatron_entropy.runtime.distributed import means_over_group

# Responses with at least this many calls share one reward bucket.
CALL_BUCKETS = 3


def trajectory_metrics(groups: Sequence[tuple[Sequence, Sequence[float], Sequence[int]]],
                       prefix: str = "") -> dict[str, float]:
    """From (trajectory statistics, rewards, response lengths) of each group; {} without
    tools."""
    stats = [(t, r, n) for trajectories, rewards, lengths in groups
             for t, r, n in zip(trajectories, rewards, lengths)]
    if not stats:
        return {}
    count = len(stats)
    calls = sum(t.calls for t, _, _ in stats)
    out = {f"{prefix}tools/turns_mean": sum(t.turns for t, _, _ in stats) / count,
           f"{prefix}tools/calls_mean": calls / count,
           f"{prefix}tools/call_frac": sum(t.calls > 0 for t, _, _ in stats) / count,
           f"{prefix}tools/errors": float(sum(t.errors for t, _, _ in stats)),
           f"{prefix}tools/timeouts": float(sum(t.timeouts for t, _, _ in stats)),
           f"{prefix}tools/seconds": sum(t.tool_seconds for t, _, _ in stats),
           f"{prefix}tools/token_frac": sum(t.tool_tokens for t, _, _ in stats)
           / max(1, sum(n for _, _, n in stats)),
           f"{prefix}tools/branched_frac": sum(t.branched for t, _, _ in stats) / count}
    by_calls: dict[str, list[float]] = defaultdict(list)
    for t, r, _ in stats:
        by_calls[str(t.calls) if t.calls < CALL_BUCKETS else f"{CALL_BUCKETS}+"].append(r)
    for bucket, rewards in sorted(by_calls.items()):
        out[f"{prefix}reward/by_tool_calls/{bucket}"] = sum(rewards) / len(rewards)
    return out


def turn_runs(loss_mask: Sequence[int]) -> list[tuple[int, int]]:
    """(start, end) of each turn: each run of generated tokens."""
    runs, start = [], None
    for i, m in enumerate(list(loss_mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def turn_entropy_metrics(samples: Sequence, group, after_tool_tokens: int,
                         max_turns: int) -> dict[str, float]:
    """``entropy/turn_<k>`` (k = 1 .. max_turns), ``entropy/after_tool`` and
    ``entropy/not_after_tool``: token means over this rank's samples (``entropy`` filled, with a
    ``loss_mask``) and the DP ``group``; every rank of the group calls it."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in samples:
        if s.loss_mask is None or s.entropy is None:
            continue
        ent = s.entropy.double()
        for k, (start, end) in enumerate(turn_runs(s.loss_mask), start=1):
            part = ent[start:end]
            key = f"entropy/turn_{min(k, max_turns)}"
            sums[key][0] += float(part.sum())
            sums[key][1] += part.numel()
            head = part[:after_tool_tokens] if k > 1 else part[:0]
            for name, values in (("entropy/after_tool", head),
                                 ("entropy/not_after_tool", part[head.numel():])):
                sums[name][0] += float(values.sum())
                sums[name][1] += values.numel()
    return means_over_group(sums, group)
