"""Shared by every folder of tests/: megatron imported once in the pytest process, so that forked
ranks start in ~0.3 s (helpers/harness.py); the CPU compatibility layer applied; the require-all
plugin loaded (MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1, as tests/run.sh sets it: a skip fails);
`--cpu-durations=N` (helpers/cpu_time.py)."""

import megatron.core  # noqa: F401

from megatron_entropy.runtime import cpu_compat

cpu_compat.apply()

from require_all import pytest_runtest_makereport  # noqa: E402,F401

pytest_plugins = ["cpu_time"]
