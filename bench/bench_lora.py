"""LoRA against full fine-tuning: training state memory and update time, and weight-sync bytes
and seconds into a real vLLM server (adapters alone against merged weights), in one run.

    PYTHONPATH=. python bench/bench_lora.py             # quickstart + Qwen2.5-0.5B shapes, sync
    PYTHONPATH=. python bench/bench_lora.py --quick     # quickstart shape only, no server

Memory: one gloo rank builds the policy as the trainer does (``build_trainable_model``,
``build_optimizer``; fp32, the plain optimizer) with every weight trained or with LoRA adapters
of rank 8 and 32 on every linear layer, takes one optimizer step, and sums the bytes of what it
allocated: the weights, the DDP grad buffers and the optimizer's state (Adam's moments; fp32, so
the weights are their own main weights). Update time: forward, backward and optimizer step of
one micro-batch of 4 x 128 tokens, best of 3 (process CPU time, one thread). Shapes: the
quickstart's model (examples/quickstart_model) and Qwen2.5-0.5B's config (hidden 896, 24 layers,
vocabulary 151936, tied embeddings) with random weights.

Sync: one rank holds the Qwen2.5-0.5B-shaped policy with random rank-8 adapters and one vLLM CPU
server (``.venv-vllm``, bf16, LoRA serving on) serves its base; each repeat syncs both ways,
alternating which goes first: ``merged`` (weight_sync/disk.py: the HF folder with the adapters
merged, then the server reloads it) and ``adapters`` (weight_sync/adapters.py: the PEFT folder,
then the server loads it in place). Bytes and seconds are the strategies' own
``weight_sync/bytes`` and ``weight_sync/seconds`` (write and the server's answer). Prints
Markdown tables; JSON to runs/bench_lora.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_entropy.config import (ModelConfig, ParallelConfig, RolloutConfig, ServerConfig,
                                     TrainerConfig, WeightSyncConfig)
from megatron_entropy.models.arch import arch_from_hf_config, load_arch
from megatron_entropy.models.lora_settings import LoraSettings
# The forked gloo ranks and tiny models of the tests, shared on purpose: the bench measures what
# the tests prove correct.
from megatron_entropy.testing.ranks import init_megatron, run_distributed
from megatron_entropy.testing.toy_models import save_tiny_hf_model, save_tokenizer

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CPU_ENV = ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "HF_HUB_OFFLINE=1"]
QWEN25_05B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936,
                  hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)
RANKS = (8, 32)


def memory_worker(hf_config: dict, rank: int) -> dict:
    """Inside a rank: the policy with every weight trained (``rank`` 0) or LoRA adapters of
    ``rank``; bytes of its weights, grad buffers and optimizer state after one step, and the
    fastest of 3 updates of one micro-batch."""
    from megatron_entropy.trainer.model_setup import (build_optimizer, build_trainable_model,
                                                      optimizer_step)

    torch.set_num_threads(1)
    init_megatron()
    arch = arch_from_hf_config(hf_config)
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=256,
                          lora=LoraSettings(rank=rank)), ParallelConfig())
    optimizer, scheduler = build_optimizer(chunks, TrainerConfig(lr=1e-4, steps=10))
    model = chunks[0]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, arch.vocab_size, (4, 128), generator=g)
    pos = torch.arange(128).expand_as(tokens)
    times = []
    for _ in range(3):
        start = time.process_time()
        model(tokens, pos, None, labels=torch.roll(tokens, -1, 1)).mean().backward()
        optimizer_step(optimizer, scheduler, chunks)
        times.append(time.process_time() - start)
    state = sum(t.numel() * t.element_size()
                for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                for s in opt.optimizer.state.values() for t in s.values()
                if torch.is_tensor(t) and t.dim() > 0)
    params = list(model.parameters())
    return {"params": sum(p.numel() for p in params),
            "trained": sum(p.numel() for p in params if p.requires_grad),
            "weights": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(b.grad_data.numel() * b.grad_data.element_size()
                         for b in model.buffers),
            "optimizer": state, "update_s": min(times)}


def memory_table(shapes: dict[str, dict]) -> list[dict]:
    rows = []
    print("\n| shape | trained | params trained | weights MiB | grad buffer MiB | optimizer "
          "state MiB | grads + optimizer MiB | vs full | update CPU s | vs full |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, hf_config in shapes.items():
        full = None
        for rank in (0, *RANKS):
            (r,) = run_distributed(memory_worker, 1, hf_config, rank, timeout=1800)
            r.update(shape=name, rank=rank)
            rows.append(r)
            state = r["grads"] + r["optimizer"]
            full = full or r
            full_state = full["grads"] + full["optimizer"]
            print(f"| {name} | {'every weight' if rank == 0 else f'LoRA rank {rank}'} | "
                  f"{r['trained']:,} of {r['params']:,} | {r['weights'] / 2**20:.1f} | "
                  f"{r['grads'] / 2**20:.2f} | {r['optimizer'] / 2**20:.2f} | "
                  f"{state / 2**20:.2f} | {state / full_state:.4f}x | {r['update_s']:.3f} | "
                  f"{r['update_s'] / full['update_s']:.2f}x |", flush=True)
    return rows


def sync_worker(hf_dir: Path, run_dir: Path, repeats: int) -> list[dict]:
    """Inside one rank: the policy with random rank-8 adapters and a vLLM server with LoRA
    serving; each repeat syncs merged and adapters (alternating order)."""
    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.models.lora import adapters
    from megatron_entropy.rollout.server.vllm import VLLMEngine, lora_serving
    from megatron_entropy.trainer.model_setup import build_trainable_model
    from megatron_entropy.weight_sync import build_weight_sync

    init_megatron()
    arch = load_arch(hf_dir)
    lora = LoraSettings(rank=RANKS[0])
    chunks = build_trainable_model(arch, ModelConfig(dtype="fp32", transformer_impl="local",
                                                     seq_length=256, lora=lora),
                                   ParallelConfig())
    load_hf_weights(chunks[0], hf_dir, arch)
    server = lora_serving(ServerConfig(launch=1, server_python=str(VENV_PYTHON),
                                       base_port=33600, max_model_len=128,
                                       extra_args=["--enforce-eager"], extra_env=CPU_ENV,
                                       startup_timeout_s=1200, request_timeout_s=1200),
                          lora.rank)
    engine = VLLMEngine(server, str(hf_dir), str(run_dir))
    syncs = {sync: build_weight_sync(
        RolloutConfig(engine="vllm", server=server, weight_sync=WeightSyncConfig(strategy=name)),
        engine, hf_dir, run_dir / sync, lora)
        for sync, name in (("merged", "disk"), ("adapters", "adapters"))}
    rows, version = [], 0
    try:
        for repeat in range(repeats):
            for sync in ("merged", "adapters")[::1 if repeat % 2 == 0 else -1]:
                version += 1
                with torch.no_grad():  # new adapters each time, as after a training step
                    for a in adapters(chunks[0]):
                        a.b.normal_(std=1e-3)
                stats = syncs[sync].sync(chunks[0], arch, version)
                rows.append({"sync": sync, "repeat": repeat, "load1": os.getloadavg()[0],
                             "bytes": stats["weight_sync/bytes"],
                             "seconds": stats["weight_sync/seconds"]})
    finally:
        engine.shutdown()
    return rows


def sync_table(rows: list[dict]) -> None:
    print("\n| sync | bytes per sync | seconds per sync (each repeat) | fastest | vs merged |")
    print("|---|---|---|---|---|")
    fastest = {s: min(r["seconds"] for r in rows if r["sync"] == s) for s in ("merged",
                                                                               "adapters")}
    for sync in ("merged", "adapters"):
        mine = [r for r in rows if r["sync"] == sync]
        each = ", ".join(f"{r['seconds']:.2f}" for r in mine)
        print(f"| {sync} | {mine[0]['bytes'] / 2**20:.2f} MiB | {each} | {fastest[sync]:.2f} | "
              f"{fastest[sync] / fastest['merged']:.2f}x |")
    print(f"\nload average {min(r['load1'] for r in rows):.1f}-"
          f"{max(r['load1'] for r in rows):.1f} on {os.cpu_count()} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="quickstart shape only, no server")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    quickstart = json.loads((REPO / "examples" / "quickstart_model" / "config.json").read_text())
    shapes = {"quickstart (0.83M)": quickstart}
    if not args.quick:
        shapes["Qwen2.5-0.5B shape"] = QWEN25_05B
    print(f"LoRA adapters on every linear layer, ranks {RANKS}; fp32, one process", flush=True)
    out = {"memory": memory_table(shapes)}
    if not args.quick:
        if not VENV_PYTHON.exists():
            sys.exit(f"no {VENV_PYTHON}: the sync part needs the vLLM CPU venv")
        with tempfile.TemporaryDirectory() as tmp:
            hf_dir = save_tiny_hf_model("qwen2", Path(tmp) / "model",
                                        **{k: v for k, v in QWEN25_05B.items()
                                           if k not in ("architectures", "model_type")})
            save_tokenizer(hf_dir, 512)
            print(f"\nweight sync into one vLLM CPU server: Qwen2.5-0.5B shape "
                  f"({sum(p.stat().st_size for p in hf_dir.glob('*.safetensors')) / 2**20:.0f} "
                  f"MiB fp32), LoRA rank {RANKS[0]}", flush=True)
            (out["sync"],) = run_distributed(sync_worker, 1, hf_dir, Path(tmp) / "run",
                                             args.repeats, timeout=3600)
        sync_table(out["sync"])
    (REPO / "runs").mkdir(exist_ok=True)
    (REPO / "runs" / "bench_lora.json").write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
