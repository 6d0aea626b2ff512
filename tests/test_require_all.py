"""tests/run.sh's promise: under MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1 no test is skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from require_all import REQUIRE_ALL

TESTS = Path(__file__).resolve().parent


def test_a_skip_fails_with_its_reason_when_every_test_is_required(tmp_path):
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "def test_runs():\n    pass\n\n"
        "@pytest.mark.skipif(True, reason='needs the moon')\n"
        "def test_marked():\n    pass\n\n"
        "def test_skips_itself():\n    pytest.skip('no cheese')\n\n"
        "@pytest.mark.xfail(reason='known')\n"
        "def test_known_failure():\n    assert False\n")

    def run(required: bool) -> subprocess.CompletedProcess:
        env = {**os.environ, "PYTHONPATH": str(TESTS)}
        env.pop(REQUIRE_ALL, None)
        if required:
            env[REQUIRE_ALL] = "1"
        return subprocess.run([sys.executable, "-m", "pytest", "-p", "require_all", "-q", "-rA",
                               "-p", "no:cacheprovider", str(tmp_path)], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=120)

    plain = run(required=False)
    assert plain.returncode == 0 and "1 passed, 2 skipped, 1 xfailed" in plain.stdout, plain.stdout
    strict = run(required=True)
    assert strict.returncode == 1, strict.stdout
    # A skip at setup (a skipif mark) reports as an error, one in the test as a failure.
    assert "1 failed, 1 passed, 1 xfailed, 1 error" in strict.stdout, strict.stdout
    assert "may not be skipped, but it was: Skipped: needs the moon" in strict.stdout
    assert "may not be skipped, but it was: Skipped: no cheese" in strict.stdout
