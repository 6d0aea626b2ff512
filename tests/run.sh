#!/usr/bin/env bash
# The whole test suite on a fresh CPU machine, nothing skipped but the GPU checks (tests/gpu/):
#
#   bash tests/run.sh [pytest args]
#
# Installs what the tests need, each part idempotent and timed: the package with its test extras
# (into the current Python, as the README's install does), the vLLM CPU serving stack in its own
# venv (.ci/setup-vllm.sh), Debian's Slurm and munge (.ci/setup-slurm.sh, needs root and apt) and
# the SmolLM2-135M test model (.ci/setup-smollm2.sh). The vLLM venv (minutes on a fresh machine,
# mostly download and unpacking) builds in the background while the tests that do not need it
# run; the tests marked `vllm` run once it is there. pytest runs with
# MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1, under which a test whose prerequisite is missing fails
# with the reason instead of being skipped (tests/require_all.py). Plain `python -m pytest tests`
# may still skip such tests, for quick local runs.
set -euo pipefail
cd "$(dirname "$0")/.."
total=$SECONDS

part() {  # part NAME COMMAND...: run one part, say how long it took; its exit code
  local name=$1 start=$SECONDS rc=0
  shift
  echo "== $name"
  "$@" || rc=$?  # kept, not lost to the echo below (set -e is off under a caller's ||)
  echo "== $name: $((SECONDS - start)) s"
  return "$rc"
}

vllm_log=$(mktemp)
trap 'rm -f "$vllm_log"' EXIT
echo "== vLLM CPU venv (.ci/setup-vllm.sh): in the background"
vllm_start=$SECONDS
bash .ci/setup-vllm.sh >"$vllm_log" 2>&1 &
vllm_pid=$!

part "package + test extras (pip install -c constraints-cpu.txt -e .[test])" \
  python -m pip install -q -c constraints-cpu.txt -e ".[test]"
part "Slurm + munge (.ci/setup-slurm.sh)" bash .ci/setup-slurm.sh
part "SmolLM2-135M test model (.ci/setup-smollm2.sh)" bash .ci/setup-smollm2.sh

export MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1
status=0
tests() {  # tests MARKERS [pytest args]: one pytest run; "no test selected" (5) is no failure
  local markers=$1 rc=0
  shift
  # --durations: the slowest tests in every log, to keep the suite's time in view
  part "python -m pytest -q tests -m '$markers' $*" python -m pytest -q --durations=15 tests \
    -m "$markers" "$@" || rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then status=$rc; fi
}

tests "not vllm" "$@"
vllm_status=0
wait "$vllm_pid" || vllm_status=$?
cat "$vllm_log"
echo "== vLLM CPU venv: ready $((SECONDS - vllm_start)) s after it started (exit code $vllm_status)"
tests vllm "$@"
echo "== tests/run.sh: $((SECONDS - total)) s in all; exit code $status"
exit $status
