"""Entropy-aware branching after tool results (the adaptive rollout of ARPO, Dong et al. 2025).

With ``rollout.tools.branching.enabled`` a prompt's ``rollout.n_samples`` are not all rolled out
from the prompt: ``initial_samples`` are (half by default); the rest of the budget goes to
branches. When a trajectory's turn after a tool result starts with a mean entropy over its first
``window`` tokens more than ``threshold`` nats above the trajectory's own start (the first
``window`` tokens of its first turn), ``branches`` new samples are rolled out from that point:
the prompt, the trajectory up to and including the tool result, then each branch's own turn
(while the prompt's budget lasts). Engines that report no entropies (vLLM, SGLang) are measured
by the tokens' surprisal, -log p of the sampled token, whose mean estimates the entropy. What
the budget still holds when no trajectory is going is rolled out from the prompt, so every
prompt ends with exactly ``n_samples`` samples.

Groups: every sample of a prompt, branched or not, is a member of the prompt's group, and the
advantage (GRPO's group mean and standard deviation, RLOO's leave-one-out, ...) is computed over
the group as for independent samples. A branch repeats its parent's prefix, so the prefix's
generated tokens are trained on once per sample that carries them, each time with that sample's
advantage (as ARPO does); its tool calls count in each sample's statistics.
"""

from __future__ import annotations

from typing import Callable, Sequence

from megatron_entropy.config.tools import BranchingSettings


class Branching:
    def __init__(self, settings: BranchingSettings) -> None:
        self.settings = settings

    def initial(self, n: int) -> int:
        """Samples of each prompt rolled out from the prompt first."""
        return min(n, self.settings.initial_samples or max(1, n // 2))

    def window_mean(self, entropies: Sequence[float]) -> float:
        head = list(entropies[:self.settings.window])
        return sum(head) / len(head) if head else 0.0

    def branches(self, t, start: int, turns: int, trajectories: list[list], n: int,
                 entropies: Sequence[float]) -> list:
        """New samples branched from ``t`` before its turn that began at token ``start`` (after
        ``turns`` turns, a tool result last), if that turn's first tokens' entropy rose enough
        and the prompt's budget allows; they are added to the prompt's trajectories."""
        group = trajectories[t.prompt]
        room = n - len(group)
        if room <= 0 or t.start_entropy is None or not entropies:
            return []
        if self.window_mean(entropies) - t.start_entropy <= self.settings.threshold:
            return []
        new = [t.copy_before(start, turns) for _ in range(min(self.settings.branches, room))]
        group.extend(new)
        return new

    def fill(self, trajectories: list[list], n: int, make: Callable[..., object]) -> list:
        """New samples from the prompt for what each prompt's budget still holds."""
        new = []
        for i, group in enumerate(trajectories):
            for _ in range(n - len(group)):
                t = make(prompt=i)
                group.append(t)
                new.append(t)
        return new
