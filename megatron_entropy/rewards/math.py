"""Rule-based math reward: the last ``\\boxed{...}`` of a response against the ground truth.

1.0 if the boxed answer is mathematically equal to the ground truth (``math-verify``: fractions,
decimals, LaTeX forms, sets, intervals...), else 0.0 — also for a response without a boxed
answer, for unparsable text, and when checking takes longer than the time limit. No response
makes it raise; only a checker that cannot start at all does (CheckerUnavailable).
"""

from __future__ import annotations

import atexit
import logging
import re
import threading
from typing import Callable, Optional, Sequence

from megatron_entropy.rewards.registry import register_reward
from megatron_entropy.rewards.workers import (STARTUP_TIMEOUT_S, TIMED_OUT, ChildExited,
                                              ChildUnavailable, LineProcess)

# Deferred import: math-verify (and sympy, ~0.8 s and their memory) loads only in the checker
# process (_checker_handler), not in the trainer's ranks.
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_INT = re.compile(r"[+-]?\d+")
MAX_ANSWER_CHARS = 512  # longer "answers" are not math answers
TIMEOUT_S = 5.0


class _DropTimeoutNotices(logging.Filter):
    # math-verify warns on every call that its own (SIGALRM) timeout is off; ours kills a process.
    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutNotices())


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` (nested braces balanced) or ``\\boxed x``; None if
    there is none or its braces never close."""
    matches = list(_BOXED.finditer(text))
    if not matches:
        return None
    closing: dict[int, int] = {}  # index of "{" -> index of its "}", one pass
    stack: list[int] = []
    for i, ch in enumerate(text):
        if ch == "{":
            stack.append(i)
        elif ch == "}" and stack:
            closing[stack.pop()] = i
    for m in reversed(matches):
        start = m.end()
        if start < len(text) and text[start] == "{":
            if start in closing:
                return text[start + 1:closing[start]].strip()
            continue  # unbalanced: an earlier \boxed may still be complete
        if m.group().endswith((" ", "\t")):  # "\boxed 5": one token up to whitespace or "$"
            word = re.match(r"[^\s$]+", text[start:])
            if word:
                return word.group()
    return None


class CheckerUnavailable(RuntimeError):
    """The answer checker cannot run at all (an environment problem, not a bad answer)."""


class _Checker:
    """math-verify in a separate, long-lived process that is killed when a check overruns:
    sympy can spend unbounded time inside C code (``9^{9^{9^9}}``), where neither a signal nor a
    thread can stop it (rewards/workers.py: a plain subprocess that dies with this one). Started
    on first use."""

    def __init__(self) -> None:
        self._child = LineProcess("megatron_entropy.rewards.math:_checker_handler")
        self._lock = threading.Lock()

    def check(self, gold: str, answer: str, timeout_s: float) -> bool:
        with self._lock:
            if not self._child.running:
                try:
                    self._child.start(STARTUP_TIMEOUT_S)
                except ChildUnavailable as e:
                    raise CheckerUnavailable(
                        f"the math-verify checker process did not start:\n{e}") from None
            self._child.send([gold, answer])
            try:
                verdict = self._child.read(timeout_s)
            except ChildExited:
                verdict = TIMED_OUT
            if verdict is TIMED_OUT:
                self.close()  # overran (or died): the next check starts a fresh one
                return False
            return verdict is True

    def close(self) -> None:
        self._child.kill()


_checker = _Checker()
atexit.register(_checker.close)


def _plain_int(s: str) -> Optional[int]:
    s = s.strip().strip("$").strip().rstrip(".").strip()
    return int(s) if _INT.fullmatch(s) else None


def _verify(gold: str, answer: str) -> bool:
    from math_verify import LatexExtractionConfig, parse, verify

    gold_parsed = parse(gold if "\\boxed" in gold else f"${gold}$", parsing_timeout=None)
    pred_parsed = parse(f"\\boxed{{{answer}}}", extraction_config=[LatexExtractionConfig()],
                        parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


@register_reward("math", self_timed=True)
def math_reward(response: str, ground_truth: str, timeout_s: float = TIMEOUT_S) -> float:
    """1.0 if the last boxed answer of ``response`` equals ``ground_truth``, else 0.0."""
    try:
        answer = last_boxed(response)
        if answer is None or not answer or len(answer) > MAX_ANSWER_CHARS:
            return 0.0
        gold = str(ground_truth).strip()
        gold_int, answer_int = _plain_int(gold), _plain_int(answer)
        if gold_int is not None and answer_int is not None:  # the common case, no sympy
            return float(gold_int == answer_int)
        return float(_checker.check(gold, answer, timeout_s))
    except BaseException as e:  # noqa: BLE001 - a bad answer must never stop training
        if isinstance(e, (KeyboardInterrupt, SystemExit, CheckerUnavailable)):
            raise
        return 0.0


def math_rewards(responses: Sequence[str], ground_truths: Sequence[str]) -> list[float]:
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    return [math_reward(r, g) for r, g in zip(responses, ground_truths)]


def _checker_handler() -> Callable[[list[str]], bool]:
    """In the checker process: import math-verify and sympy (before the process says it is
    ready), then judge one [gold, answer] per request."""
    _verify("1", "1")

    def judge(request: list[str]) -> bool:
        try:
            return _verify(*request)
        except Exception:  # noqa: BLE001 - unparsable answers are wrong answers
            return False
    return judge
