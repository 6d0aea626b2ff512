"""pytest plugin (loaded by conftest.py): with MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1 (tests/run.sh,
CI) a test that would be skipped fails instead, with the skip's reason, so that a missing
prerequisite (the vLLM venv, Slurm, the SmolLM2 model) cannot pass as a green run."""

from __future__ import annotations

import os

import pytest

REQUIRE_ALL = "MEGATRON_ENTROPY_REQUIRE_ALL_TESTS"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (report.skipped and os.environ.get(REQUIRE_ALL) == "1") or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = (f"{REQUIRE_ALL}=1 (tests/run.sh): this test may not be skipped, but it "
                       f"was: {reason}")
