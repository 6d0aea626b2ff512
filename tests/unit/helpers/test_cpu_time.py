"""helpers/cpu_time.py: a test that waits is listed with its wall time and next to no CPU; one
whose child process computes is listed with the child's CPU (the process was waited for)."""

import re
from pathlib import Path

HELPERS = Path(__file__).resolve().parents[2] / "helpers"

pytest_plugins = ["pytester"]


def test_cpu_durations_tell_waiting_from_computing(pytester, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(HELPERS))
    pytester.makepyfile(test_two="""
        import subprocess, sys, time

        def test_waits():
            time.sleep(0.6)

        def test_child_computes():
            subprocess.run([sys.executable, "-c",
                            "import time\\nt = time.process_time()\\n"
                            "while time.process_time() - t < 0.6: pass"], check=True)
    """)
    result = pytester.runpytest_subprocess("-p", "cpu_time", "--cpu-durations=5")
    result.assert_outcomes(passed=2)
    rows = {m[3]: (float(m[1]), float(m[2])) for m in re.finditer(
        r"^\s*([\d.]+) s wall\s+([\d.]+) s CPU  \S*::(\w+)$", result.stdout.str(), re.M)}
    assert set(rows) == {"test_waits", "test_child_computes"}, result.stdout.str()
    out = result.stdout.str()
    assert re.search(r"^\s*[\d.]+ s wall\s+[\d.]+ s CPU  test_two.py \(2 tests\)$", out, re.M), out
    wall, cpu = rows["test_waits"]
    assert wall >= 0.6 and cpu < 0.3, rows
    wall, cpu = rows["test_child_computes"]
    assert cpu >= 0.6 and wall >= cpu - 0.1, rows  # the child's 0.6 s are counted
