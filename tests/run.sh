#!/usr/bin/env bash
# The whole test suite on a fresh CPU machine, nothing skipped but the GPU checks (tests/gpu/):
#
#   bash tests/run.sh [pytest args]
#
# Installs what the tests need, each part idempotent and timed: the package with its test extras
# (into the current Python, as the README's install does), the vLLM CPU serving stack in its own
# venv (.ci/setup-vllm.sh), Debian's Slurm and munge (.ci/setup-slurm.sh, needs root and apt) and
# the SmolLM2-135M test model (.ci/setup-smollm2.sh). Then runs pytest with
# MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1, under which a test whose prerequisite is missing fails with
# the reason instead of being skipped (tests/require_all.py). Plain `python -m pytest tests` may
# still skip such tests, for quick local runs.
set -euo pipefail
cd "$(dirname "$0")/.."
total=$SECONDS

part() {  # part NAME COMMAND...: run one part, say how long it took
  local name=$1 start=$SECONDS
  shift
  echo "== $name"
  "$@"
  echo "== $name: $((SECONDS - start)) s"
}

part "package + test extras (pip install -c constraints-cpu.txt -e .[test])" \
  python -m pip install -q -c constraints-cpu.txt -e ".[test]"
part "vLLM CPU venv (.ci/setup-vllm.sh)" bash .ci/setup-vllm.sh
part "Slurm + munge (.ci/setup-slurm.sh)" bash .ci/setup-slurm.sh
part "SmolLM2-135M test model (.ci/setup-smollm2.sh)" bash .ci/setup-smollm2.sh
status=0
MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1 part "test suite (python -m pytest -q tests)" \
  python -m pytest -q tests "$@" || status=$?
echo "== tests/run.sh: $((SECONDS - total)) s in all, pytest exit code $status"
exit $status
