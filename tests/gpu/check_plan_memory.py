"""GPU check of `megatron-entropy plan`'s memory estimate against what CUDA really allocates (run by
hand on a machine with CUDA; not collected by pytest).

    python tests/gpu/check_plan_memory.py [--tokens 8192] [--layers 28]

Builds a random Qwen2.5-1.5B-shaped model (bf16, full recompute, one GPU, the trainer's own
build_trainable_model / build_optimizer), runs one forward/backward of a micro-batch of --tokens
tokens through Megatron's cross-entropy head and one optimizer step, and compares:
- static memory (weights, fp32 grad buffer, fp32 main weights, Adam moments) with the plan's
  items: must agree within 5% (exit code 1 otherwise);
- the forward/backward peak above static with the plan's activations + LM head (chunked head:
  Megatron's CE keeps the logits) - printed as a ratio, for calibrating the estimate.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]

QWEN25_15B = dict(architectures=["Qwen2ForCausalLM"], vocab_size=151936, hidden_size=1536,
                  intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=28)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2

    from megatron_entropy.config import load_config
    from megatron_entropy.models.arch import arch_from_hf_config
    from megatron_entropy.launch.plan import GiB, make_plan
    from megatron_entropy.runtime import init_distributed, set_seed
    from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    os.environ.setdefault("MASTER_PORT", "29517")
    arch = arch_from_hf_config({**QWEN25_15B, "num_hidden_layers": args.layers})
    init_distributed(1, 1)
    set_seed(0)
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="bf16", seq_length=args.tokens, recompute_activations=True),
        ParallelConfig())
    optimizer, _ = build_optimizer(chunks, TrainerConfig(steps=1, weight_decay=0.0), dtype="bf16")
    model = chunks[0]
    model.train()

    tokens = torch.randint(0, arch.vocab_size, (1, args.tokens), device="cuda")
    positions = torch.arange(args.tokens, device="cuda")[None]
    labels = torch.roll(tokens, -1, dims=1)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = model(tokens, positions, None, labels=labels).float().mean()
    loss.backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    optimizer.step()  # creates the fp32 Adam moments
    torch.cuda.synchronize()
    static = torch.cuda.memory_allocated()

    cfg = load_config(overrides=[
        "model.dtype=bf16", "model.recompute_activations=true",
        f"model.seq_length={args.tokens}", f"trainer.micro_batch_tokens={args.tokens}",
        "rollout.max_prompt_tokens=16", "rollout.max_new_tokens=16",
        "algorithm.logprob_impl=chunked", "rollout.engine=vllm", "rollout.server.urls=[http://x]",
        "cluster.gpus_per_node=1"])
    items = dict(make_plan(cfg, arch, nodes=1).trainer)
    est_static = sum(v for k, v in items.items()
                     if k.startswith(("weights", "grad buffer", "fp32 main", "Adam")))
    est_dynamic = sum(v for k, v in items.items() if k.startswith(("activations", "LM head")))
    result = {
        "tokens": args.tokens, "layers": args.layers,
        "static_gib": round(static / GiB, 3), "plan_static_gib": round(est_static / GiB, 3),
        "static_ratio": round(static / est_static, 4),
        "fwd_bwd_peak_above_static_gib": round((peak - before) / GiB, 3),
        "plan_activations_and_head_gib": round(est_dynamic / GiB, 3),
        "dynamic_ratio": round((peak - before) / est_dynamic, 4),
    }
    print(json.dumps(result))
    return 0 if abs(result["static_ratio"] - 1) <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
