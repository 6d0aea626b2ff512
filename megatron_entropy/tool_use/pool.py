"""Tool calls run in worker processes, in parallel across trajectories.

``rollout.tools.workers`` plain child processes (rewards/workers.py: a JSON line per call, their
own process group, dead with the trainer) each load the tools and answer one call at a time.
Inside a worker a call's wall time is bounded by a timer (``rollout.tools.timeout_s``; the code
tool also kills its sandbox then); a call that does not return soon after, stuck in C code or
killing its own worker, has its worker killed and restarted. Either way the call's result is an
error the policy reads, counted in the step's metrics, and the run goes on.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

from megatron_entropy.rewards.workers import (ChildExited, ChildUnavailable, LineProcess,
                                               run_requests, start_stopped)
from megatron_entropy.tool_use.sandbox import remove_stale_cgroups
from megatron_entropy.config.tools import BranchingSettings, SandboxSettings, ToolSettings
from megatron_entropy.tool_use.tools import ToolError, ToolOutput, load_tools

# Past the timeout, what a worker gets to answer on its own before it is killed.
GRACE_S = 5.0


@dataclass(frozen=True)
class ToolCall:
    """A call as the policy wrote it: a tool's name and its arguments, or why it could not be
    read (``error``: the call is answered with it, no tool runs)."""

    name: str
    arguments: dict
    error: str = ""


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the policy reads
    status: str = "ok"  # "ok", "error", "timeout"
    detail: str = ""  # why it failed
    seconds: float = 0.0


class _Overrun(BaseException):
    """The timer inside a worker (a BaseException: a tool's ``except Exception`` must not take
    it)."""


def settings_json(settings: ToolSettings) -> str:
    return json.dumps(asdict(settings))


def settings_from_json(text: str) -> ToolSettings:
    raw = json.loads(text)
    return ToolSettings(**{**raw, "sandbox": SandboxSettings(**raw["sandbox"]),
                           "branching": BranchingSettings(**raw["branching"])})


def call_tool(tools: dict, call: dict, timeout_s: float) -> dict:
    """One call (``{"name", "arguments"}``) with a timer: the ToolResult's fields."""
    started = time.monotonic()
    tool = tools.get(call["name"])
    if tool is None:
        return asdict(ToolResult(f"error: no tool named {call['name']!r}", "error", "unknown tool"))

    def overrun(signum, frame):
        raise _Overrun()

    previous = signal.signal(signal.SIGALRM, overrun)
    # The code tool keeps its own time (it kills its sandbox): a little more for it to answer.
    signal.setitimer(signal.ITIMER_REAL, timeout_s + 1.0)
    try:
        output = tool(**call["arguments"])
        if not isinstance(output, ToolOutput):
            output = ToolOutput(str(output))
    except _Overrun:
        output = ToolOutput(f"error: timed out after {timeout_s:g} s", "timeout",
                            f"timed out after {timeout_s:g} s")
    except ToolError as e:
        output = ToolOutput(f"error: {e}", "error", "bad call")
    except Exception as e:  # noqa: BLE001 - the tool failed on this call: the policy reads why
        output = ToolOutput(f"error: {type(e).__name__}: {e}", "error", type(e).__name__)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return asdict(ToolResult(output.text, output.status, output.detail,
                             time.monotonic() - started))


def worker_handler(settings: str) -> Callable[[dict], dict]:
    """In a worker (rewards/workers.py): the tools, then one call per request."""
    s = settings_from_json(settings)
    tools = {t.name: t for t in load_tools(s)}
    return lambda call: call_tool(tools, call, s.timeout_s)


class ToolPool:
    """``run(calls)`` on the workers; started on first use, ended by ``close``."""

    def __init__(self, settings: ToolSettings) -> None:
        self.settings = settings
        self._json = settings_json(settings)
        self._workers: list[LineProcess] = []

    def _start(self) -> None:
        if not self._workers:
            self._workers = [LineProcess("megatron_entropy.tool_use.pool:worker_handler",
                                         self._json) for _ in range(self.settings.workers)]
        try:
            start_stopped(self._workers)
        except (ChildUnavailable, ChildExited) as e:
            self.close()
            raise RuntimeError(f"a tool worker did not start: {e}") from None

    def run(self, calls: list[ToolCall]) -> list[ToolResult]:
        """Each call's result, in order; calls with an ``error`` are answered with it."""
        results: list[Optional[ToolResult]] = [
            ToolResult(f"error: {c.error}", "error", "bad call") if c.error else None
            for c in calls]
        todo = [i for i, r in enumerate(results) if r is None]
        if not todo:
            return results  # type: ignore[return-value]
        self._start()
        timeout = self.settings.timeout_s

        def answered(i: int, answer: Any) -> ToolResult:
            if "died" in answer:
                return ToolResult(f"error: the tool's process died ({answer['died'][:200]})",
                                  "error", "worker died")
            return ToolResult(**answer)

        def overran(i: int) -> ToolResult:
            return ToolResult(f"error: timed out after {timeout:g} s", "timeout",
                              f"timed out after {timeout:g} s (worker killed)",
                              timeout + GRACE_S)

        done = run_requests(self._workers, [{"name": calls[i].name,
                                             "arguments": calls[i].arguments} for i in todo],
                            timeout + 1.0 + GRACE_S, self._start,
                            lambda k, answer: answered(todo[k], answer),
                            lambda k: overran(todo[k]))
        for i, result in zip(todo, done):
            results[i] = result
        return results  # type: ignore[return-value]

    def close(self) -> None:
        for worker in self._workers:
            worker.kill()
        self._workers = []
        remove_stale_cgroups()
