#!/usr/bin/env bash
# The whole test suite on a fresh CPU machine, nothing skipped but the GPU checks (tests/gpu/):
#
#   bash tests/run.sh [pytest args]
#
# Installs what the tests need, each part idempotent and timed: the package with its test extras
# (into the current Python, as the README's install does), the vLLM CPU serving stack in its own
# venv (.ci/setup-vllm.sh), Debian's Slurm and munge (.ci/setup-slurm.sh, needs root and apt) and
# the SmolLM2-135M test model (.ci/setup-smollm2.sh). The vLLM venv (minutes on a fresh machine,
# mostly download and unpacking) builds in the background. The tests then run as two pytest
# processes at once, because much of the suite waits (process start-up, which is single-threaded
# imports, Slurm scheduling, servers coming up) rather than computes: the Slurm jobs and the
# study, followed by the tests marked `vllm` (once the venv is there), beside everything else.
# Each test's own ranks run one thread each, and no test of one stream looks at the other's
# processes, ports or files.
# pytest runs with MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1, under which a test whose prerequisite is
# missing fails with the reason instead of being skipped (tests/helpers/require_all.py). Plain
# `python -m pytest tests` may still skip such tests, for quick local runs.
set -euo pipefail
cd "$(dirname "$0")/.."
total=$SECONDS
machine_busy() {  # CPU seconds the whole machine has been busy since boot (every process)
  awk -v hz="$(getconf CLK_TCK)" '/^cpu /{print ($2 + $3 + $4 + $7 + $8 + $9) / hz}' /proc/stat
}
busy_at_start=$(machine_busy)

part() {  # part NAME COMMAND...: run one part, say how long it took and the CPU it used
  local name=$1 rc=0 TIMEFORMAT
  shift
  echo "== $name"
  # wall against CPU (user + sys of the part's processes) shows whether it computed or waited
  TIMEFORMAT="== $name: %1R s (CPU %1U s user + %1S s sys)"
  time "$@" || rc=$?  # kept, not lost to the echo (set -e is off under a caller's ||)
  return "$rc"
}

vllm_log=$(mktemp)
vllm_rc=$(mktemp)  # its exit code, once it is done (the stream that waits for it is no parent)
servers_log=$(mktemp)
stop_tree() {  # stop_tree PID: a background part and everything it started (no test outlives us)
  local status
  for status in $(grep -l "^PPid:[[:space:]]*$1\$" /proc/[0-9]*/status 2>/dev/null); do
    stop_tree "$(basename "$(dirname "$status")")"
  done
  kill "$1" 2>/dev/null || true
}
cleanup() {
  local job
  for job in $(jobs -p); do stop_tree "$job"; done
  rm -f "$vllm_log" "$vllm_rc" "$servers_log"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
echo "== vLLM CPU venv (.ci/setup-vllm.sh): in the background"
vllm_start=$SECONDS
(rc=0; bash .ci/setup-vllm.sh >"$vllm_log" 2>&1 || rc=$?; echo "$rc" >"$vllm_rc") &

part "package + test extras (pip install -c constraints-cpu.txt -e .[test])" \
  python -m pip install -q -c constraints-cpu.txt -e ".[test]"
part "Slurm + munge (.ci/setup-slurm.sh)" bash .ci/setup-slurm.sh
part "SmolLM2-135M test model (.ci/setup-smollm2.sh)" bash .ci/setup-smollm2.sh

export MEGATRON_ENTROPY_REQUIRE_ALL_TESTS=1
tests() {  # tests SELECTION... : one pytest run; "no test selected" (5) is no failure
  local rc=0
  # the slowest tests in every log, wall against CPU (tests/helpers/cpu_time.py), to keep the
  # suite's time in view and to tell the tests that wait from those that compute
  part "python -m pytest -q $(printf '%q ' "$@")" python -m pytest -q --cpu-durations=20 "$@" \
    || rc=$?
  if [ "$rc" -eq 5 ]; then rc=0; fi
  return "$rc"
}

# The second stream: the Slurm jobs and the study, then, once the venv is there, the vLLM tests.
# Split by measured time (2 cores, quiet: everything else 473 s; Slurm jobs and study 317 s, then
# the vLLM tests 191 s; both cores loaded by other work: 817 s; 361 s, then 307 s).
SECOND=(tests/slurm/test_slurm_jobs.py tests/integration/analysis/test_study.py)
servers() {
  local rc=0
  tests "${SECOND[@]}" -m "not vllm" "$@" || rc=$?
  while [ ! -s "$vllm_rc" ]; do sleep 2; done
  cat "$vllm_log"
  echo "== vLLM CPU venv: ready $((SECONDS - vllm_start)) s after it started (exit code $(cat "$vllm_rc"))"
  tests tests -m vllm "$@" || rc=$?
  return "$rc"
}

echo "== the Slurm jobs, the study and the vLLM tests: in the background (their log follows the rest's)"
servers "$@" >"$servers_log" 2>&1 &
servers_pid=$!
status=0
tests tests -m "not vllm" "${SECOND[@]/#/--ignore=}" "$@" || status=$?
servers_status=0
wait "$servers_pid" || servers_status=$?
cat "$servers_log"
if [ "$status" -eq 0 ]; then status=$servers_status; fi
times >"$servers_log"  # user and sys of every process this script waited for (not in a $(...))
cpu=$(tail -n 1 "$servers_log")
# The machine as a whole, this suite and anything else on it (Slurm jobs, which the count below
# misses, and other work): how busy it was says whether a slow run was a loaded machine.
awk -v a="$busy_at_start" -v b="$(machine_busy)" -v t="$((SECONDS - total))" -v n="$(nproc)" \
  'BEGIN {printf "== the machine: %.0f s of CPU busy over the run, %.0f%% of its %d cores\n",
          b - a, t ? 100 * (b - a) / (t * n) : 0, n}'
echo "== tests/run.sh: $((SECONDS - total)) s in all (CPU ${cpu% *} user + ${cpu#* } sys on" \
  "$(nproc) cores); exit code $status"

exit $status
