"""Rollout throughput of the in-process engine vs a vLLM server on the same model, and the seconds
a weight sync takes against model size.

    python bench/bench_rollout.py                       # tiny served model + SmolLM2-135M if cached
    python bench/bench_rollout.py --models smollm2 --prompts 32 --n 4 --max-new-tokens 128

Needs .venv-vllm (.ci/setup-vllm.sh). Each engine first generates a warm-up batch; then one timed
call generates ``prompts x n`` samples at temperature 1 (random token-id prompts of 16 tokens),
and tokens/s counts the response tokens generated. Weight sync: the server's own weights (every
value nudged) go through the trainer's sync strategies (weight_sync/: the disk strategy writes the
HF folder and the server reloads it; the in-process engine copies them in place). Prints a
Markdown table; JSON goes to runs/.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

from megatron_entropy.config import ServerConfig
from megatron_entropy.models.hf_io import iter_hf_tensors
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.inprocess import InProcessEngine
from megatron_entropy.rollout.server.vllm import VLLMEngine
# The tiny models the tests serve, shared on purpose: the bench measures what the tests prove
# correct.
from megatron_entropy.testing import smollm2
from megatron_entropy.testing.toy_models import (make_served_model, save_tiny_hf_model,
                                                 save_tokenizer)
from megatron_entropy.weight_sync import DiskSync, InPlaceSync

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CPU_ENV = ["VLLM_CPU_KVCACHE_SPACE=2", "VLLM_CPU_OMP_THREADS_BIND=nobind", "HF_HUB_OFFLINE=1"]


def build_models(names: list[str], root: Path) -> dict[str, Path]:
    out: dict[str, Path] = {}
    for name in names:
        if name == "tiny":
            out[name] = make_served_model(root / "tiny")
        elif name.startswith("qwen2-h"):  # qwen2-h512-l4: weight-sync size ladder
            hidden, layers = (int(x[1:]) for x in name.split("-")[1:])
            d = save_tiny_hf_model("qwen2", root / name, hidden_size=hidden,
                                   intermediate_size=4 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=hidden // 64, num_key_value_heads=1,
                                   vocab_size=4096, max_position_embeddings=512)
            save_tokenizer(d, 4096)
            out[name] = d
        elif name == "smollm2":
            if not smollm2.cache_dir().joinpath("model.safetensors").is_file():
                print("smollm2: not cached (run .ci/setup-smollm2.sh); skipped")
                continue
            out[name] = smollm2.hf_dir()
        else:
            out[name] = Path(name)
    return out


def timed_generate(engine, prompts: list[list[int]], sampling: SamplingParams) -> dict:
    engine.generate(prompts[:2], SamplingParams(n=1, max_new_tokens=4, temperature=1.0))
    t0 = time.perf_counter()
    out = engine.generate(prompts, sampling)
    seconds = time.perf_counter() - t0
    tokens = sum(len(c.token_ids) for row in out for c in row)
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def nudged(model_dir: Path) -> list[tuple[str, torch.Tensor]]:
    """The model's weights, every value moved a little; made before the clock starts."""
    return [(name, t + 1e-3 * torch.randn_like(t)) for name, t in iter_hf_tensors(model_dir)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+",
                    default=["tiny", "qwen2-h512-l4", "qwen2-h1024-l8", "smollm2"])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--inprocess-dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--sync-only", action="store_true", help="skip the throughput runs")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench_rollout.json"))
    args = ap.parse_args()
    if not VENV_PYTHON.exists():
        sys.exit(f"{VENV_PYTHON} is missing: run .ci/setup-vllm.sh first")
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for name, folder in build_models(args.models, tmp).items():
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
            rng = random.Random(0)
            prompts = [[rng.randrange(10, config.vocab_size) for _ in range(16)]
                       for _ in range(args.prompts)]
            sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens,
                                      seed=0)
            params = sum(t.numel() for _, t in iter_hf_tensors(folder))
            row = {"model": name, "params_M": params / 1e6}

            new_weights = nudged(folder)
            inproc = InProcessEngine(folder, dtype=args.inprocess_dtype, batch_size=64)
            if not args.sync_only:
                row["inprocess"] = timed_generate(inproc, prompts, sampling)
            t0 = time.perf_counter()
            InPlaceSync(inproc, 512 * 2**20).push(new_weights, version=1)
            row["inprocess_sync_s"] = time.perf_counter() - t0
            del inproc

            cfg = ServerConfig(launch=1, server_python=str(VENV_PYTHON), base_port=33000,
                               max_model_len=16 + args.max_new_tokens + 16, max_concurrency=64,
                               extra_args=["--enforce-eager"], extra_env=CPU_ENV,
                               startup_timeout_s=600, request_timeout_s=1200)
            t0 = time.perf_counter()
            vllm = VLLMEngine(cfg, str(folder), str(tmp / f"run-{name}"))
            row["vllm_startup_s"] = time.perf_counter() - t0
            try:
                if not args.sync_only:
                    row["vllm"] = timed_generate(vllm, prompts, sampling)
                stats = DiskSync(vllm, tmp / f"run-{name}" / "weight_sync",
                                 folder).push(new_weights, version=1)
                row["vllm_sync_s"] = stats["weight_sync/seconds"]
                row["vllm_sync_write_s"] = stats["weight_sync/write_seconds"]
                row["sync_bytes"] = stats["weight_sync/bytes"]
            finally:
                vllm.shutdown()
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(f"\n{args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} new tokens, "
          f"T=1; in-process {args.inprocess_dtype}, vLLM bf16\n")
    print("| model | params | in-process tok/s | vLLM tok/s | vLLM start | sync MB | "
          "vLLM sync s (write) | in-process sync s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        tps = {k: f"{r[k]['tokens_per_s']:.0f}" if k in r else "-" for k in ("inprocess", "vllm")}
        print(f"| {r['model']} | {r['params_M']:.1f}M | {tps['inprocess']} | "
              f"{tps['vllm']} | {r['vllm_startup_s']:.0f} s | "
              f"{r['sync_bytes'] / 2**20:.0f} | {r['vllm_sync_s']:.2f} "
              f"({r['vllm_sync_write_s']:.2f}) | {r['inprocess_sync_s']:.2f} |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
