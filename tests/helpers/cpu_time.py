"""pytest plugin: `--cpu-durations=N` lists the N slowest tests, and the N slowest test files,
with the CPU they used.

Per test (setup, call and teardown together; a module fixture's start-up counts to the module's
first test): wall seconds, and CPU seconds (user + sys) of the pytest process and of every
process it waited for (forked ranks, CLI runs, servers stopped by a fixture; not a Slurm job's
processes, which are slurmd's children). CPU far below wall means the test waits (server
start, Slurm scheduling, a timeout) and could run beside another; CPU near wall means it
computes. tests/run.sh lists both in every log, to keep the suite's time in view and to choose
how its streams are split.
"""

from __future__ import annotations

import resource
import time

import pytest

_measured: dict[str, tuple[float, float]] = {}  # node id -> (wall s, CPU s)


def _cpu_seconds() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-durations", type=int, default=0, metavar="N",
                     help="list the N slowest tests with their CPU seconds (0: none)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    wall, cpu = time.monotonic(), _cpu_seconds()
    yield
    _measured[item.nodeid] = (time.monotonic() - wall, _cpu_seconds() - cpu)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    n = config.getoption("--cpu-durations")
    if not n or not _measured:
        return
    wall = sum(w for w, _ in _measured.values())
    cpu = sum(c for _, c in _measured.values())
    terminalreporter.section(f"slowest {n} tests: wall and CPU seconds (setup + call + teardown)")
    for node, (w, c) in sorted(_measured.items(), key=lambda kv: -kv[1][0])[:n]:
        terminalreporter.write_line(f"{w:8.1f} s wall {c:8.1f} s CPU  {node}")
    terminalreporter.write_line(f"{wall:8.1f} s wall {cpu:8.1f} s CPU  all {len(_measured)} tests")
    files: dict[str, list[float]] = {}
    for node, (w, c) in _measured.items():
        total = files.setdefault(node.split("::")[0], [0.0, 0.0, 0])
        total[0], total[1], total[2] = total[0] + w, total[1] + c, total[2] + 1
    terminalreporter.section(f"slowest {n} files: wall and CPU seconds of their tests")
    for name, (w, c, count) in sorted(files.items(), key=lambda kv: -kv[1][0])[:n]:
        terminalreporter.write_line(f"{w:8.1f} s wall {c:8.1f} s CPU  {name} ({count} tests)")
