"""Benchmark: long responses on one CPU machine, three ratios measured in one run.

1. Packed against padded micro-batches: one optimizer step (forward and backward of every
   micro-batch, then the update) of a small Qwen2-shaped policy on the same samples, whose
   lengths follow a long tail (the quantiles of a log-normal of median 400 tokens, clipped to
   [64, 2000], one of 2000), both layouts with the same trainer.micro_batch_tokens. Time: process CPU time, one
   thread, best of --reps. Target: packed <= 0.6x padded.
2. Context parallelism: the activation memory of one rank in one update of a single long
   sequence, CP=2 against CP=1 (the same model, the same sample). Peak: the RSS high-water mark
   during the second update (the optimizer's state exists after the first) minus the RSS before
   it, glibc's mmap threshold fixed at 64 KiB so that RSS follows the live tensors
   (megatron_entropy/testing/memory.py); the larger rank counts. Target: CP=2 <= 0.55x CP=1.
3. The fused log-prob/entropy op (hidden states x output layer, chunked) at --op-tokens tokens x
   152k vocabulary, forward and backward: its peak memory beyond its inputs (hidden [T, H] and
   the weight [V, H]) against one chunk's logits plus those inputs, both in --op-dtype. Target:
   within 1.2x. float32 by default: this CPU has no native bf16 GEMM (torch emulates it, ~25x
   slower than fp32), so 32k tokens in bf16 would take about an hour; --op-dtype bfloat16 at a
   few thousand tokens shows what bf16 adds (the weight's gradient accumulates in fp32).

    PYTHONPATH=. python bench/bench_long_reasoning.py            # the full run (~10-30 min)
    PYTHONPATH=. python bench/bench_long_reasoning.py --quick    # small sizes (smoke test)
    PYTHONPATH=. python bench/bench_long_reasoning.py --only op  # one case (run them at once)
    PYTHONPATH=. python bench/bench_long_reasoning.py --only op --op-tokens 2048 \
        --op-dtype bfloat16                                     # the op in bf16
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time
import warnings

import torch
# Imported once here (~5 s), not in every forked case.
from megatron.core import parallel_state as ps  # noqa: F401

from megatron_entropy.ops.logprob_entropy import (FUSED_CPU_CHUNK_ELEMENTS,
                                                  fused_linear_logprob_entropy)
from megatron_entropy.testing.memory import follow_live_tensors, reset_peak, status_kb
from megatron_entropy.testing.ranks import run_distributed

CASES = ("update", "cp", "op")
CASE_LIMIT_S = 7200.0  # one case may take this long on a busy machine

VOCAB = 151936  # Qwen2.5's
MODEL = dict(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)


# ----------------------------------------------------------------------------- the policy


def long_tail_lengths(n: int, median: int, longest: int) -> list[int]:
    """``n`` sample lengths on the quantiles of a log-normal around ``median`` (sigma 0.6),
    clipped to [64, longest], the last one ``longest`` (a reproducible long tail), shuffled."""
    normal = statistics.NormalDist()
    lengths = [min(max(round(median * math.exp(0.6 * normal.inv_cdf((i + 0.5) / (n - 1)))),
                       64), longest) for i in range(n - 1)] + [longest]
    random.Random(0).shuffle(lengths)
    return lengths


def samples_of(lengths: list[int], prompt: int = 48, seed: int = 0) -> list:
    from megatron_entropy.trainer.batch import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, MODEL["vocab_size"], (n,), generator=g).tolist()
        response = ids[prompt:]
        out.append(Sample(prompt_ids=ids[:prompt], response_ids=response,
                          engine_logprobs=[0.0] * len(response), reward=float(i % 2), group=i,
                          source="s", advantage=float(torch.randn(1, generator=g))))
    return out


def actor_of(context: int, layout: str, budget: int, model: dict):
    """Megatron's parallel state (CP = ``context``) and a fresh policy with its Actor."""
    from megatron_entropy.config import (AlgorithmConfig, ModelConfig, ParallelConfig,
                                         TrainerConfig)
    from megatron_entropy.models.arch import arch_from_hf_config
    from megatron_entropy.runtime.distributed import init_distributed, set_seed
    from megatron_entropy.testing.toy_models import tiny_hf_config
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    init_distributed(backend="gloo", context=context)
    set_seed(1)
    arch = arch_from_hf_config(tiny_hf_config("qwen2", **model))
    chunks = build_trainable_model(arch, ModelConfig(dtype="fp32", transformer_impl="local",
                                                     seq_length=model["max_position_embeddings"]),
                                   ParallelConfig(context=context))
    trainer = TrainerConfig(lr=1e-4, micro_batch_tokens=budget, micro_batch_layout=layout,
                            steps=10)
    optimizer, scheduler = build_optimizer(chunks, trainer)
    algorithm = AlgorithmConfig(loss="kl_cov", logprob_impl="fused")
    return Actor(arch, chunks, optimizer, scheduler, algorithm, trainer, 1.0)


def _update_time(layout: str, lengths: list[int], budget: int, reps: int) -> dict:
    actor = actor_of(1, layout, budget, MODEL)
    samples = samples_of(lengths)
    actor.recompute(samples)
    times = []
    for step in range(reps):
        t0 = time.process_time()
        actor.update(samples, step=step + 1)
        times.append(time.process_time() - t0)
    mbs = actor._pack(samples)
    return {"cpu_s": min(times), "micro_batches": len(mbs),
            "tokens": sum(mb.tokens.numel() for mb in mbs)}


def _update_peak(context: int, length: int, model: dict) -> dict:
    actor = actor_of(context, "packed", 10 ** 7, model)
    samples = samples_of([length])
    actor.recompute(samples)
    actor.update(samples, step=1)  # the optimizer's state now exists
    base = reset_peak()
    actor.update(samples, step=2)
    return {"peak_mb": (status_kb("VmHWM") - base) / 1024}


def _op_peak(tokens: int, hidden: int, dtype_name: str) -> dict:
    dtype = getattr(torch, dtype_name)
    size = torch.finfo(dtype).bits // 8
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(tokens, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    w = (torch.randn(VOCAB, hidden, generator=g) * 0.05).to(dtype).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,), generator=g)
    inputs_mb = (h.numel() + w.numel()) * size / 2 ** 20
    base = reset_peak()
    t0 = time.process_time()
    logp, entropy = fused_linear_logprob_entropy(h, w, targets, vocab_size=VOCAB, group=None,
                                                 temperature=1.0, chunk_tokens=4096)
    (logp.sum() - 1e-3 * entropy.sum()).backward()
    peak_mb = (status_kb("VmHWM") - base) / 1024
    rows = max(64, FUSED_CPU_CHUNK_ELEMENTS // VOCAB)
    chunk_mb = rows * VOCAB * size / 2 ** 20  # the op's one logits buffer, in the input dtype
    return {"peak_mb": peak_mb, "bound_mb": chunk_mb + inputs_mb, "chunk_mb": chunk_mb,
            "inputs_mb": inputs_mb, "cpu_s": time.process_time() - t0}


# ----------------------------------------------------------------------------- the report


def _row(name: str, ours: str, base: str, ratio: float, target: float, what: str) -> str:
    verdict = "hit" if ratio <= target else "missed"
    return f"| {name} | {ours} | {base} | {ratio:.2f}x | <= {target}x: {verdict} | {what} |"


def main() -> None:
    follow_live_tensors()
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, one rep (smoke test)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--budget", type=int, default=4096, help="trainer.micro_batch_tokens")
    ap.add_argument("--cp-tokens", type=int, default=8192, help="the CP case's sequence")
    ap.add_argument("--op-tokens", type=int, default=32768)
    ap.add_argument("--op-hidden", type=int, default=128)
    ap.add_argument("--op-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="the op's inputs (bf16 GEMMs are emulated on CPU: ~25x slower)")
    ap.add_argument("--only", nargs="+", choices=CASES, default=list(CASES),
                    help="the cases to measure (each its own process: run them at once)")
    args = ap.parse_args()
    if args.quick:
        args.reps, args.samples, args.budget, args.cp_tokens = 1, 8, 1024, 512
        args.op_tokens, args.op_hidden = 1024, 32
    lengths = long_tail_lengths(args.samples, 100 if args.quick else 400,
                                500 if args.quick else 2000)
    print(f"samples: {len(lengths)}, lengths median {sorted(lengths)[len(lengths) // 2]}, "
          f"max {max(lengths)}, total {sum(lengths)}; micro_batch_tokens {args.budget}; "
          f"model {MODEL}", flush=True)
    print("| measure | ours | against | ratio | target | what |")
    print("| --- | --- | --- | --- | --- | --- |", flush=True)
    if "update" in args.only:
        padded, packed = (run_distributed(_update_time, 1, layout, lengths, args.budget,
                                          args.reps, timeout=CASE_LIMIT_S)[0]
                          for layout in ("padded", "packed"))
        print(_row("update, packed / padded", f"{packed['cpu_s']:.2f} s",
                   f"{padded['cpu_s']:.2f} s", packed["cpu_s"] / padded["cpu_s"], 0.6,
                   f"CPU time of one update of the same {len(lengths)} samples; micro-batches "
                   f"{packed['micro_batches']} / {padded['micro_batches']}, tokens with padding "
                   f"{packed['tokens']} / {padded['tokens']}"), flush=True)
    if "cp" in args.only:
        cp1 = run_distributed(_update_peak, 1, 1, args.cp_tokens, MODEL, timeout=CASE_LIMIT_S)
        cp2 = run_distributed(_update_peak, 2, 2, args.cp_tokens, MODEL, timeout=CASE_LIMIT_S)
        peak1, peak2 = max(r["peak_mb"] for r in cp1), max(r["peak_mb"] for r in cp2)
        print(_row("activation memory per rank, CP=2 / CP=1", f"{peak2:.0f} MB",
                   f"{peak1:.0f} MB", peak2 / peak1, 0.55, "peak beyond the weights and "
                   f"optimizer in one update of one {args.cp_tokens}-token sequence"), flush=True)
    if "op" in args.only:
        op = run_distributed(_op_peak, 1, args.op_tokens, args.op_hidden, args.op_dtype,
                             timeout=CASE_LIMIT_S)[0]
        dtype = {"float32": "fp32 on CPU, where bf16 GEMMs are emulated",
                 "bfloat16": "bf16 (emulated GEMMs on CPU)"}[args.op_dtype]
        print(_row(f"entropy op peak, {args.op_tokens} x {VOCAB}", f"{op['peak_mb']:.0f} MB",
                   f"{op['bound_mb']:.0f} MB", op["peak_mb"] / op["bound_mb"], 1.2,
                   f"fused op, {dtype}, H={args.op_hidden}, fwd+bwd ({op['cpu_s']:.0f} s CPU); "
                   f"against one chunk's logits in that dtype ({op['chunk_mb']:.0f} MB) + the "
                   f"inputs ({op['inputs_mb']:.0f} MB)"), flush=True)


if __name__ == "__main__":
    main()
