"""DAPO's overlong reward shaping (Yu et al., "DAPO", arXiv 2503.14476, Eq. 13): a response that
runs into the last ``buffer`` tokens before the length limit L (``rollout.max_new_tokens``) loses
reward in proportion to how far in it went, up to ``penalty`` at the limit:

    R_length(y) = 0                                   if |y| <= L - buffer
                = -penalty (|y| - (L - buffer)) / buffer   if L - buffer < |y| <= L

added to the reward of the training rollouts (validation keeps the plain reward). A response cut
at the limit is thus a little worse than a long one that ends, and much worse than a short one,
without the cliff of a flat penalty for truncation.
"""

from __future__ import annotations

from typing import Any, Sequence


def overlong_penalty(length: int, limit: int, buffer: int, penalty: float) -> float:
    """R_length of a response of ``length`` tokens (module docstring); 0 without a buffer."""
    if buffer <= 0 or length <= limit - buffer:
        return 0.0
    return -penalty * min(length - (limit - buffer), buffer) / buffer


class OverlongShaping:
    """The scorer ``reward`` (called as it is) with ``shape``: rewards plus each response's
    overlong penalty, given the responses' token lengths."""

    def __init__(self, reward: Any, limit: int, buffer: int, penalty: float) -> None:
        self.reward, self.limit, self.buffer, self.penalty = reward, limit, buffer, penalty

    def __call__(self, *args: Any, **kwargs: Any) -> list[float]:
        return self.reward(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # the scorer's own (take_failures, close, ...)
        return getattr(self.reward, name)

    def shape(self, rewards: Sequence[float], lengths: Sequence[int]) -> list[float]:
        return [r + overlong_penalty(n, self.limit, self.buffer, self.penalty)
                for r, n in zip(rewards, lengths)]
