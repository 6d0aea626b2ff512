"""Pluggable rewards: the registry, ``reward.function`` by name, module or file, the worker pool,
timeouts and failures, and that no worker outlives the scorer or its process."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_entropy.config import ConfigError, RewardConfig
from megatron_entropy.data import generate_problems
from megatron_entropy.rewards import (RewardScorer, get_reward, math_reward, math_rewards,
                                      register_reward, resolve_reward)
from rewards_under_test import length_reward

REPO = Path(__file__).resolve().parents[3]
FORMAT_REWARD = f"{REPO / 'examples' / 'rewards_format.py'}:format_reward"
HERE = "rewards_under_test"  # tests/helpers/rewards_under_test.py: workers import it (pytest's sys.path)


def _scorer(function: str, **settings) -> RewardScorer:
    return RewardScorer(RewardConfig(function=function, **settings))


# ------------------------------------------------------------------ resolution


def test_registry_and_paths_resolve_to_the_function():
    reward = resolve_reward("math")
    assert reward.fn is math_reward and get_reward("math") is math_reward
    assert reward.kind.self_timed and not reward.kind.batched and not reward.takes_sources
    assert reward.worker_spec == "megatron_entropy.rewards.math:math_reward"

    @register_reward("test-length")
    def shortest(response, ground_truth):
        return -float(len(response))
    assert resolve_reward("test-length").fn is shortest
    register_reward("test-length")(shortest)  # again, the same function: no error
    with pytest.raises(ValueError, match="'test-length' is registered already"):
        register_reward("test-length")(length_reward)
    with pytest.raises(KeyError, match="no reward is registered as 'nope'.*math"):
        get_reward("nope")

    by_module = resolve_reward(f"{HERE}:length_reward")
    assert by_module.fn is length_reward and by_module.takes_sources
    assert resolve_reward(f"{HERE}:batched_length").kind.batched
    by_file = resolve_reward(FORMAT_REWARD)
    assert by_file.fn("so \\boxed{3}.", "3") == 1.0
    assert by_file.fn("no box", "3") == -1.0


@pytest.mark.parametrize("spec, problem", [
    ("no_such_module_xyz:f", r"'no_such_module_xyz:f': module not found \(No module named"),
    (f"{HERE}:missing", rf"'{HERE}' has no attribute 'missing'"),
    (f"{HERE}:NOT_CALLABLE", r"is 3 \(int\), not a function"),
    (f"{HERE}:one_argument", r"takes \(response\); a reward is called as \(response, "
                             r"ground_truth\[, source=\]\)"),
    ("nonsense", r"'nonsense' is neither a registered reward \(registered: .*math.*\) nor"),
    ("nope/missing.py:f", r"the file 'nope/missing.py' does not exist"),
])
def test_a_bad_reward_function_is_one_clear_error(spec, problem):
    with pytest.raises(ConfigError, match=r"^reward\.function: .*" + problem):
        _scorer(spec)


def test_a_module_that_fails_to_import_is_named(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("import no_such_dependency_xyz\n")
    with pytest.raises(ConfigError, match=r"reward\.function: .*broken.py:f.*importing .* failed "
                                          r"\(ModuleNotFoundError: No module named"):
        _scorer(f"{broken}:f")


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("function, problem", [
    ("returns_text", r"returned 'yes' \(str\); a reward is a finite number"),
    ("returns_nan", r"returned nan \(float\); a reward is a finite number"),
    ("batched_one_short", r"returned (\d) rewards for (\d) responses"),
])
def test_a_result_that_is_no_reward_stops_with_the_key(function, problem, workers):
    scorer = _scorer(f"{HERE}:{function}", workers=workers)
    try:
        with pytest.raises(ConfigError, match=rf"^reward\.function='{HERE}:{function}' {problem}"):
            scorer(["a", "b", "c"], ["1", "2", "3"])
    finally:
        scorer.close()


# ------------------------------------------------------------------ scoring


def test_sources_reach_a_function_that_takes_them():
    scorer = _scorer(f"{HERE}:length_reward")
    assert scorer(["ab", "abc"], ["", ""], ["a", "b"]) == [2.0, 3.5]
    assert scorer(["ab"], [""]) == [2.0]


def _math_cases() -> tuple[list[str], list[str]]:
    """Integers (no checker), LaTeX forms (the checker process), wrong and garbage answers."""
    problems = generate_problems(60, 1, 3, 20, seed=0)
    responses = [p.solution for p in problems]
    truths = [p.answer for p in problems]
    responses[::7] = [r.replace("\\boxed{", "\\boxed{1") for r in responses[::7]]
    latex = [("\\boxed{0.5}", "\\frac{1}{2}"), ("\\boxed{\\dfrac{1}{2}}", "1/2"),
             ("\\boxed{(1, 2)}", "(1,2)"), ("\\boxed{\\pi}", "3.14159"), ("\\boxed{x = 5}", "5"),
             ("\\boxed{1,000}", "1000"), ("no box", "1"), ("\\boxed{\\frac{", "1")]
    return responses + [r for r, _ in latex], truths + [t for _, t in latex]


def test_a_pool_gives_the_rewards_of_this_process_on_the_math_reward_and_leaves_nothing():
    responses, truths = _math_cases()
    serial = _scorer("math", workers=1)(responses, truths)
    assert serial == math_rewards(responses, truths)
    assert 0 < sum(serial) < len(serial)
    before = _children(os.getpid())
    pool = _scorer("math", workers=2)
    try:
        assert pool(responses, truths) == serial
        assert pool.take_failures() == 0
        started = _children(os.getpid()) - before
        # the workers, and the math checkers they started for the LaTeX answers
        assert {w._proc.pid for w in pool._workers} < started
    finally:
        pool.close()
    assert _gone(started)
    assert _children(os.getpid()) == before


def test_a_batched_reward_gets_the_list_in_one_call_per_worker():
    responses = ["a" * k for k in range(7)]
    assert _scorer(f"{HERE}:batched_length")(responses, [""] * 7) == [float(k) for k in range(7)]
    pool = _scorer(f"{HERE}:batched_length", workers=3)
    try:
        assert pool(responses, [""] * 7) == [float(k) for k in range(7)]
        assert pool([], []) == []
    finally:
        pool.close()


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("function, bad, why", [
    ("hang_or_length", "hang", "timed out after 0.5 s"),
    ("raise_or_length", "raise", "ZeroDivisionError: division by zero"),
])
def test_a_call_that_hangs_or_raises_gets_the_failure_value(function, bad, why, workers, caplog):
    scorer = _scorer(f"{HERE}:{function}", workers=workers, timeout_s=0.5, failure_value=-7.0)
    # A timer someone else set (pytest-timeout's, when it runs) outlives the scorer's own.
    outer, handler = signal.getitimer(signal.ITIMER_REAL)[0], signal.getsignal(signal.SIGALRM)
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_entropy.rewards.scorer"):
            assert scorer(["ab", bad, "abcd", bad], ["", "", "", ""]) == [2.0, -7.0, 4.0, -7.0]
            assert scorer([bad, "a"], ["", ""]) == [-7.0, 1.0]
        assert scorer.take_failures() == 3
        assert scorer.take_failures() == 0
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1, warnings  # the first failure only
        assert why in warnings[0] and "reward.failure_value=-7" in warnings[0]
        left = signal.getitimer(signal.ITIMER_REAL)[0]
        assert signal.getsignal(signal.SIGALRM) is handler
        assert 0 < left <= outer if outer else left == 0
    finally:
        scorer.close()


def test_a_reward_that_keeps_failing_stops_the_run_naming_the_setting():
    scorer = _scorer(f"{HERE}:raise_or_length", max_consecutive_failures=5)
    assert scorer(["raise"] * 4 + ["ab"], [""] * 5) == [0.0] * 4 + [2.0]  # a success resets
    assert scorer(["raise"] * 4, [""] * 4) == [0.0] * 4
    with pytest.raises(ConfigError, match=r"raise_or_length' failed on each of the last 5 "
                                          r"responses \(the latest: ZeroDivisionError: division by "
                                          r"zero\); the run stops \(reward.max_consecutive_"
                                          r"failures=5; 0 never stops\)"):
        scorer(["raise"], [""])
    never = _scorer(f"{HERE}:raise_or_length", max_consecutive_failures=0)
    assert never(["raise"] * 50, [""] * 50) == [0.0] * 50


def test_defaults_bound_a_hanging_reward_to_about_a_minute_and_a_half():
    config = RewardConfig()
    assert (config.timeout_s, config.max_consecutive_timeouts) == (10.0, 10)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_reward_that_keeps_hanging_stops_the_run_naming_the_function_and_timeout(workers):
    """Every call hangs: the run stops at the limit's overrun, not after the round (64 x 0.3 s
    in one process), with one line; an answer in between starts the count again."""
    before = _children(os.getpid())
    scorer = _scorer(f"{HERE}:hang_or_length", workers=workers, timeout_s=0.3,
                     max_consecutive_timeouts=3)
    try:
        assert scorer(["hang", "hang", "ab", "hang", "hang"], [""] * 5) == [0.0, 0.0, 2.0, 0.0,
                                                                            0.0]
        scorer(["a"], [""])
        started = time.monotonic()
        with pytest.raises(ConfigError) as stop:
            scorer(["hang"] * 64, [""] * 64)
        assert time.monotonic() - started < 3 * 0.3 + 5  # + a fresh worker's start per overrun
        assert str(stop.value) == (
            f"reward.function='{HERE}:hang_or_length' overran reward.timeout_s=0.3 s on each of "
            "the last 3 calls; the run stops (reward.max_consecutive_timeouts=3; 0 never stops)")
        assert _children(os.getpid()) <= before  # no worker left in its hung call
    finally:
        scorer.close()
    never = _scorer(f"{HERE}:hang_or_length", timeout_s=0.05, max_consecutive_timeouts=0)
    assert never(["hang"] * 5, [""] * 5) == [0.0] * 5


# ------------------------------------------------------------------ processes


def _children(pid: int) -> set[int]:
    """Every live descendant of ``pid`` (from /proc)."""
    parent_of = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] != "Z":
                parent_of[int(entry.name)] = int(fields[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, parent in parent_of.items() if parent in frontier} - found
        found |= frontier
    return found


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def _gone(pids: set[int], within_s: float = 30.0) -> bool:
    """Whether every pid has exited (dead or a zombie), waiting for the kernel to deliver the
    kills at most ``within_s``."""
    deadline = time.monotonic() + within_s
    while not all(_state(p) in ("gone", "Z") for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_workers_die_with_their_process(tmp_path):
    """A trainer killed outright (SIGKILL: no close(), no atexit) while its workers are busy in a
    call (so they do not see their stdin close) takes them along."""
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = {sys.path!r}
        from megatron_entropy.config import RewardConfig
        from megatron_entropy.rewards import RewardScorer
        hang = RewardScorer(RewardConfig(function="{HERE}:mark_and_hang", workers=2,
                                         timeout_s=3600))
        hang(["busy0", "busy1"], ["", ""])
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not ((tmp_path / "busy0").exists() and (tmp_path / "busy1").exists()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) == 2
    finally:
        proc.kill()
        proc.wait()
    gone = _gone(workers)
    for pid in workers - {p for p in workers if _state(p) in ("gone", "Z")}:
        os.kill(pid, signal.SIGKILL)  # a failed check leaves nothing behind either
    assert gone


def test_a_worker_that_dies_in_a_call_fails_that_call_and_is_replaced(caplog):
    scorer = _scorer(f"{HERE}:die_or_pid", workers=2, failure_value=-1.0)
    try:
        with caplog.at_level(logging.WARNING, logger="megatron_entropy.rewards.scorer"):
            first = scorer(["a", "die", "b"], ["", "", ""])
        assert first[1] == -1.0 and first[0] > 0 and first[2] > 0
        assert scorer.take_failures() == 1
        assert "the reward worker died (exit code 3" in caplog.records[0].getMessage()
        again = scorer(["a", "b"], ["", ""])
        assert scorer.take_failures() == 0 and min(again) > 0
        assert {int(p) for p in again} == {w._proc.pid for w in scorer._workers}
    finally:
        scorer.close()
