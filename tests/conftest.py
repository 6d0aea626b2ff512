import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

# Import megatron once in the pytest process so that forked ranks start in ~0.3 s (see harness.py).
import megatron.core  # noqa: E402,F401

from megatron_entropy.runtime import cpu_compat  # noqa: E402

cpu_compat.apply()

# MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1 (tests/run.sh): a skipped test fails instead.
from require_all import pytest_runtest_makereport  # noqa: E402,F401
