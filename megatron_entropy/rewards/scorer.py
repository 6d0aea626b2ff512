"""The configured reward applied to a round's responses (the config's ``reward`` section).

Calls: a per-response function is called once per response, a batched one once with the whole
list (split into ``reward.workers`` chunks with a pool). With ``reward.workers`` > 1 the calls
run in that many worker processes (rewards/workers.py), started on first use and closed with
the scorer; a call that overruns ``reward.timeout_s`` kills its worker (the next call starts a
fresh one). In this process the timeout is a timer signal (main thread only), which interrupts
Python code but not C code that never returns to the interpreter: such rewards want workers. A
call that raises or overruns gives its responses ``reward.failure_value``, counts them in
``failures`` and warns once; a result that is no reward (a bug in the function) stops the run, and
so do too many failures or overruns in a row.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from megatron_entropy.config import ConfigError, RewardConfig
from megatron_entropy.rewards.registry import KEY, RewardResultError, resolve_reward
from megatron_entropy.rewards.workers import (ChildExited, ChildUnavailable, LineProcess,
                                               run_requests, start_stopped)

log = logging.getLogger(__name__)

_Result = Union[float, list[float]]  # what one call gives: a response's reward, or a list's
_Outcome = Union[_Result, str]  # or why the call failed


class _Overrun(BaseException):
    """Raised by the timer inside a reward function (a BaseException: the function's own
    ``except Exception`` must not take it for a bad response)."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signals reach the main thread only
        return

    def overrun(signum, frame):
        raise _Overrun()

    # A timer someone else set (pytest-timeout's) is kept: ours ends no later than it, and it is
    # set again afterwards with the time it had left.
    outer, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.signal(signal.SIGALRM, overrun)
    started = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, min(seconds, outer) if outer else seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.setitimer(signal.ITIMER_REAL,
                             max(outer - (time.monotonic() - started), 1e-6), outer_interval)


class RewardScorer:
    """``scorer(responses, ground_truths, sources) -> rewards`` with ``reward``'s settings."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        self.reward = resolve_reward(config.function)
        self._failures = 0
        self._in_a_row = 0  # responses that failed since the last that did not
        self._overruns = 0  # calls in a row that overran timeout_s
        self._warned = False
        self._workers: list[LineProcess] = []
        if config.workers > 1 and self.reward.worker_spec is None:
            raise ConfigError(f"{KEY}={config.function!r}: reward.workers={config.workers} needs "
                              "a function at the top level of an importable module or file")

    def __call__(self, responses: Sequence[str], ground_truths: Sequence[str],
                 sources: Optional[Sequence[str]] = None) -> list[float]:
        n = len(responses)
        sources = [""] * n if sources is None else list(sources)
        if len(ground_truths) != n or len(sources) != n:
            raise ValueError(f"{n} responses but {len(ground_truths)} ground truths and "
                             f"{len(sources)} sources")
        calls = self._calls(n)
        if self.config.workers > 1:
            outcomes = self._in_pool([(list(responses[lo:hi]), list(ground_truths[lo:hi]),
                                       sources[lo:hi]) for lo, hi in calls])
        elif self.reward.kind.batched:
            outcomes = [self._here(self.reward.batch, responses, ground_truths, sources)] if n \
                else []
        else:  # the common case (the math reward): one plain call per response
            outcomes = [self._here(self.reward.one, *args)
                        for args in zip(responses, ground_truths, sources)]
        rewards: list[float] = []
        for (lo, hi), outcome in zip(calls, outcomes):
            if isinstance(outcome, str):
                self._failed(outcome, hi - lo)
                rewards += [self.config.failure_value] * (hi - lo)
                continue
            self._in_a_row = 0
            if isinstance(outcome, list):
                rewards += outcome
            else:
                rewards.append(outcome)
        return rewards

    def take_failures(self) -> int:
        """Responses that got ``reward.failure_value`` since the last call of this."""
        count, self._failures = self._failures, 0
        return count

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []

    # ------------------------------------------------------------------ internals

    def _calls(self, n: int) -> list[tuple[int, int]]:
        if not self.reward.kind.batched:
            return [(i, i + 1) for i in range(n)]
        parts = min(max(self.config.workers, 1), n)
        bounds = [n * k // parts for k in range(parts + 1)] if parts else [0]
        return list(zip(bounds, bounds[1:]))

    def _bad_result(self, message: str) -> ConfigError:
        return ConfigError(f"{KEY}={self.config.function!r} {message}")

    def _here(self, call: Callable[..., _Result], *args: Any) -> _Outcome:
        """``call(*args)`` in this process, under the time limit unless the function keeps its
        own."""
        try:
            if self.reward.kind.self_timed:
                result = call(*args)
            else:
                with _time_limit(self.config.timeout_s):
                    result = call(*args)
        except RewardResultError as e:
            raise self._bad_result(str(e)) from None
        except _Overrun:
            return self._overran()
        except Exception as e:  # noqa: BLE001 - the user's reward failed on this call
            result = f"{type(e).__name__}: {e}"
        self._overruns = 0  # the call ended on its own, well or not
        return result

    def _start_workers(self) -> None:
        if not self._workers:
            self._workers = [LineProcess("megatron_entropy.rewards.scorer:worker_handler",
                                         self.reward.worker_spec)
                             for _ in range(self.config.workers)]
        try:
            start_stopped(self._workers)
        except (ChildUnavailable, ChildExited) as e:
            self.close()
            raise ConfigError(f"{KEY}={self.config.function!r}: a reward worker did not "
                              f"start: {e}") from None

    def _in_pool(self, args: list[tuple[list[str], list[str], list[str]]]) -> list[_Outcome]:
        """Every call on the first free worker; each call's clock starts when it is sent."""
        self._start_workers()
        invalid: list[str] = []

        def answered(call: int, answer: dict) -> _Outcome:
            self._overruns = 0
            if "invalid" in answer:
                invalid.append(answer["invalid"])
                return ""
            if "died" in answer:
                return f"the reward worker died ({answer['died']})"
            return answer["rewards"] if "rewards" in answer else answer["error"]

        outcomes = run_requests(self._workers, args, self.config.timeout_s, self._start_workers,
                                answered, lambda call: self._overran())
        if invalid:
            raise self._bad_result(invalid[0])
        return outcomes

    def _overran(self) -> str:
        """A call that ran past timeout_s: why it failed. Checked as each call ends, not once the
        round is scored: a reward that always hangs would cost timeout_s per response."""
        self._overruns += 1
        limit, timeout = self.config.max_consecutive_timeouts, self.config.timeout_s
        if limit and self._overruns >= limit:
            self.close()  # workers still in a hung call
            raise self._bad_result(
                f"overran reward.timeout_s={timeout:g} s on each of the last {self._overruns} "
                f"calls; the run stops (reward.max_consecutive_timeouts={limit}; 0 never stops)")
        return f"timed out after {timeout:g} s"

    def _failed(self, why: str, responses: int) -> None:
        self._failures += responses
        self._in_a_row += responses
        limit = self.config.max_consecutive_failures
        if limit and self._in_a_row >= limit:
            # A reward that never succeeds trains on failure_value alone: a bug to fix, not a
            # run to go on with.
            raise self._bad_result(
                f"failed on each of the last {self._in_a_row} responses (the latest: {why}); "
                "the run stops (reward.max_consecutive_failures="
                f"{limit}; 0 never stops)")
        if not self._warned:
            self._warned = True
            log.warning("%s=%r: a call failed (%s); its %d response(s) get reward.failure_value="
                        "%g; later failures are counted in reward/failures only", KEY,
                        self.config.function, why, responses, self.config.failure_value)


def worker_handler(spec: str) -> Callable[[list], dict]:
    """In a pool worker: resolve ``spec``, then score one call per request (rewards/workers.py).
    The answer is {"rewards": [...]}, {"error": why it failed} or {"invalid": a result that is no
    reward}."""
    reward = resolve_reward(spec)

    def score(request: list) -> dict:
        try:
            return {"rewards": reward(*request)}
        except RewardResultError as e:
            return {"invalid": str(e)}
        except Exception as e:  # noqa: BLE001 - the user's reward failed on this call
            return {"error": f"{type(e).__name__}: {e}"}
    return score
