"""The metrics of sampled answers, per problem: the unbiased pass@k estimator, avg@k and maj@k.

Pure functions of rewards and extracted answers; they know nothing of models or engines.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional, Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are right:
    1 - C(n - c, k) / C(n, k) (Chen et al., 2021), as the product 1 - prod_{i=n-c+1}^{n} (1 - k/i),
    which neither overflows nor loses precision for large n."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def ks_up_to(n: int) -> list[int]:
    """k = 1, 2, 4, ... up to n (n itself last when it is no power of two)."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def avg_at_k(rewards: Sequence[float], k: int) -> float:
    """Mean accuracy of the first ``k`` samples."""
    if not 1 <= k <= len(rewards):
        raise ValueError(f"need 1 <= k <= {len(rewards)} samples, got k={k}")
    return sum(r > 0 for r in rewards[:k]) / k


def majority_answer(answers: Sequence[Optional[str]]) -> Optional[str]:
    """The most frequent extracted answer (None: no answer) among ``answers``; a tie goes to
    the answer seen first."""
    counts = Counter(a for a in answers if a is not None)
    return counts.most_common(1)[0][0] if counts else None


def maj_at_k(answers: Sequence[Optional[str]], k: int, is_right: Callable[[str], bool]) -> float:
    """1.0 when the majority answer of the first ``k`` samples is right, else 0.0."""
    if not 1 <= k <= len(answers):
        raise ValueError(f"need 1 <= k <= {len(answers)} samples, got k={k}")
    answer = majority_answer(answers[:k])
    return float(answer is not None and is_right(answer))
