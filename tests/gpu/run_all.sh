#!/usr/bin/env bash
# Every GPU check in one pass, for a machine with one CUDA GPU (run from the repository root):
#
#   bash tests/gpu/run_all.sh            # logs and a summary in $OUT (default /tmp/gpu_checks)
#
# 1. entropy ops on CUDA: float64 equivalence, bf16 time/memory at T=8192, V=151936
# 2. the in-process engine on CUDA: log-probs vs a transformers forward, batch independence
# 3. the HF <-> Megatron bridge with the Transformer-Engine spec (local spec without TE)
# 4. `megatron-entropy plan`'s static memory estimate against CUDA's allocator
# 5. the RL loop on the GPU: NCCL, bf16 Megatron actor (fp32 master weights), engine on CUDA
# 6. packed micro-batches through TE's THD attention against padded rows; with 2+ GPUs,
#    context parallelism (TE's CP attention) at CP=2 against CP=1
# A machine without network takes megatron-core and math-verify as wheels from .whl/ if present.
set -u
OUT=${OUT:-/tmp/gpu_checks}
mkdir -p "$OUT"
# The checks import the package (the repository root: the GPU box may not have it pip-installed)
# and the tests' helpers (tests/helpers, as pytest.ini's pythonpath gives them to the tests); run
# one check alone the same way: PYTHONPATH=.:tests/helpers python3 tests/gpu/<check>.py
export PYTHONPATH="$PWD:$PWD/tests/helpers${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"

run() {  # run NAME SECONDS CMD...: the log in $OUT/NAME.log, one summary line
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
  grep -v -i "warn" "$OUT/$name.log" | tail -n 12
}

run entropy_ops 150 python3 tests/gpu/check_entropy_ops.py
run inprocess_engine 90 python3 tests/gpu/check_inprocess_engine.py
run convert_te 120 python3 tests/gpu/check_convert_te.py
run plan_memory 120 python3 tests/gpu/check_plan_memory.py
run long_sequences 300 python3 tests/gpu/check_long_sequences.py
if [ "$(python3 -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
  run long_sequences_cp2 300 torchrun --nproc-per-node 2 tests/gpu/check_long_sequences.py
fi
run rl_loop 180 python3 -m megatron_entropy.cli train examples/quickstart.yaml \
  parallel.tensor=1 model.dtype=bf16 trainer.steps=8 trainer.val_interval=4 \
  trainer.save_interval=8 logging.progress_bar=false logging.runs_dir="$OUT/runs" \
  logging.name=gpu_quickstart
cp "$OUT/runs/gpu_quickstart/metrics.jsonl" "$OUT/rl_metrics.jsonl" 2>/dev/null
cat "$OUT/summary.txt"
