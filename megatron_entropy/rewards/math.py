"""Rule-based math reward: the last ``\\boxed{...}`` of a response against the ground truth.

1.0 if the boxed answer is mathematically equal to the ground truth (``math-verify``: fractions,
decimals, LaTeX forms, sets, intervals...), else 0.0 — also for a response without a boxed
answer, for unparsable text, and when checking takes longer than the time limit. No response
makes it raise; only a checker that cannot start at all does (CheckerUnavailable).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Optional, Sequence

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*")
_INT = re.compile(r"[+-]?\d+")
MAX_ANSWER_CHARS = 512  # longer "answers" are not math answers
TIMEOUT_S = 5.0
STARTUP_TIMEOUT_S = 120.0


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
    thread can stop it. A plain subprocess (not multiprocessing) so that it never forks torch's
    threads nor re-runs the caller's main module. Started on first use; it exits when its stdin
    closes."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._stderr = None
        self._lock = threading.Lock()

    def _read_line(self, timeout_s: float) -> Optional[str]:
        ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s)
        return self._proc.stdout.readline().strip() if ready else None

    def _start(self) -> None:
        # The child imports the same copy of the package as this process (a checkout or a
        # worktree, installed or not), not whichever copy happens to be installed.
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self._stderr = tempfile.TemporaryFile()  # a file, not a pipe: it can never fill up
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from megatron_entropy.rewards.math import _serve; _serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, text=True,
            bufsize=1, env=env)
        if self._read_line(STARTUP_TIMEOUT_S) != "ready":
            self._stderr.seek(0)
            log = self._stderr.read().decode(errors="replace")[-2000:]
            self.close()
            raise CheckerUnavailable(f"the math-verify checker process did not start:\n{log}")

    def check(self, gold: str, answer: str, timeout_s: float) -> bool:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            self._proc.stdin.write(json.dumps([gold, answer]) + "\n")
            self._proc.stdin.flush()
            line = self._read_line(timeout_s)
            if line is None:
                self.close()  # overran: kill it, the next check starts a fresh one
                return False
            return line == "1"

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            for f in (self._proc.stdin, self._proc.stdout, self._stderr):
                f.close()
            self._proc = self._stderr = None


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


def _serve() -> None:
    """The checker process: one JSON [gold, answer] per input line, "1" or "0" per output line."""
    _verify("1", "1")  # import math-verify and sympy before saying ready
    print("ready", flush=True)
    for line in sys.stdin:
        try:
            gold, answer = json.loads(line)
            ok = _verify(gold, answer)
        except Exception:  # noqa: BLE001 - unparsable answers are wrong answers
            ok = False
        print("1" if ok else "0", flush=True)
