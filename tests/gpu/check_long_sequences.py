"""GPU check of packed micro-batches and context parallelism with the Transformer-Engine layer
spec (run by hand on a machine with CUDA; not collected by pytest).

    python tests/gpu/check_long_sequences.py               # one GPU: packed (THD) against padded
    torchrun --nproc-per-node 2 tests/gpu/check_long_sequences.py   # 2+ GPUs: CP=2 too

On one GPU: a tiny Qwen2 policy (fp32, the TE spec; the local spec if transformer_engine does not
import) recomputes the log-probs and entropies of long-tailed samples in padded rows and in packed
rows (Megatron's PackedSeqParams into TE's THD attention): they must agree to 1e-4. With two or
more ranks (one GPU each) the same samples at CP=2 (TE's CP attention, padded and packed) against
CP=1 on rank 0, and one update step's weights. Prints one line per check and exits non-zero on
any failure.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

TOL = 1e-4  # fp32 through TE's kernels (another order of the same sums)


def _samples():
    from megatron_entropy.trainer.batch import Sample

    g = torch.Generator().manual_seed(0)
    out = []
    for i, n in enumerate((40, 300, 64, 1000, 120, 90, 500, 33)):
        ids = torch.randint(3, 1000, (n,), generator=g).tolist()
        out.append(Sample(prompt_ids=ids[:16], response_ids=ids[16:],
                          engine_logprobs=[0.0] * (n - 16), reward=float(i % 2), group=i // 2,
                          source="s", advantage=float(torch.randn(1, generator=g))))
    return out


def _actor(layout: str, context: int, impl: str, initial):
    from megatron_entropy.config import (AlgorithmConfig, ModelConfig, ParallelConfig,
                                         TrainerConfig)
    from megatron_entropy.models.arch import arch_from_hf_config
    from megatron_entropy.models.sharding import full_state_dict, load_full_state_dict
    from megatron_entropy.runtime import init_distributed, set_seed
    from megatron_entropy.testing.toy_models import tiny_hf_config
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    init_distributed(1, 1, context=context)
    set_seed(0)
    arch = arch_from_hf_config(tiny_hf_config("qwen2", max_position_embeddings=4096))
    chunks = build_trainable_model(arch, ModelConfig(dtype="fp32", transformer_impl=impl,
                                                     seq_length=2048),
                                   ParallelConfig(context=context))
    if initial is None:
        initial = {k: v.cpu() for k, v in full_state_dict(chunks[0]).items()}
    load_full_state_dict(chunks[0], initial)
    trainer = TrainerConfig(lr=1e-3, micro_batch_tokens=2048, micro_batch_layout=layout,
                            steps=1, adam_eps=1.0, grad_clip=0.0, weight_decay=0.0)
    optimizer, scheduler = build_optimizer(chunks, trainer)
    actor = Actor(arch, chunks, optimizer, scheduler,
                  AlgorithmConfig(loss="kl_cov", logprob_impl="fused"), trainer, 1.0)
    return actor, initial


def _stats(layout: str, context: int, impl: str, initial):
    actor, initial = _actor(layout, context, impl, initial)
    out = actor.compute_logprobs(_samples())
    return [(lp.double(), h.double()) for lp, h in out], initial


def _compare(name: str, got, want) -> int:
    worst = max(max(float((a - b).abs().max()) for a, b in zip(g, w))
                for g, w in zip(got, want))
    ok = worst <= TOL
    print(f"{'ok  ' if ok else 'FAIL'} {name}: max |difference| {worst:.2e} (tolerance {TOL})")
    return 0 if ok else 1


def main() -> int:
    from megatron_entropy.models.builder import transformer_engine_available

    assert torch.cuda.is_available(), "this check needs a GPU"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29519")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    world = int(os.environ["WORLD_SIZE"])
    impl = "transformer_engine" if transformer_engine_available() else "local"
    print(f"layer spec: {impl}; ranks: {world}")
    failures = 0
    padded, initial = _stats("padded", 1, impl, None)
    packed, _ = _stats("packed", 1, impl, initial)
    failures += _compare("packed (THD) against padded rows, CP=1", packed, padded)
    if world >= 2 and world % 2 == 0:
        for layout in ("padded", "packed"):
            got, _ = _stats(layout, 2, impl, initial)
            if dist.get_rank() == 0:
                failures += _compare(f"CP=2 {layout} against CP=1 padded", got, padded)
    elif world == 1:
        print("skip CP=2: run under torchrun --nproc-per-node 2 (two GPUs)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
