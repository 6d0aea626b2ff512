"""A custom reward: the answer's format only, as an example of writing one.

Select it with ``reward.function=examples/rewards_format.py:format_reward`` (a file, resolved
against the working directory) or, with ``examples`` importable, as
``examples.rewards_format:format_reward``. The trainer calls it once per response with the
response's text and the row's ground truth; it returns a float.
"""

from __future__ import annotations

import re

from megatron_entropy.rewards import last_boxed

_AFTER_ANSWER = re.compile(r"[\s.$}\\\]]*")  # what may follow the last box: closing math, a period


def format_reward(response: str, ground_truth: str) -> float:
    """1.0 for one ``\\boxed{}`` answer that ends the response, 0.0 for boxed answers otherwise
    (several, or text after the box), -1.0 without a boxed answer. The ground truth is not used:
    this rewards the form, not the answer (add it to a correctness reward to get both)."""
    answer = last_boxed(response)
    if not answer:
        return -1.0
    after = response[response.rfind(answer) + len(answer):]  # from the box's closing brace on
    return 1.0 if response.count("\\boxed") == 1 and _AFTER_ANSWER.fullmatch(after) else 0.0
