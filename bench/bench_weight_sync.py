"""Weight sync at PP=2 into a real vLLM server: the per-stage disk strategy (weight_sync/disk.py)
against the full-gather path it replaced, in the same run, on the same model and server.

    python bench/bench_weight_sync.py                       # qwen2 h1024 x 8 layers (~0.5 GB fp32)
    python bench/bench_weight_sync.py --hidden 512 --layers 4 --repeats 3

Two gloo ranks (PP=2, TP=1) hold a random Qwen2-shaped model in fp32; rank 0 starts one vLLM
server (``.venv-vllm``, bf16, VLLM_CPU_KVCACHE_SPACE=1) and holds the engine, as the trainer's
rank 0 does. Each repeat runs both paths (alternating which goes first), each a whole sync:
write the HF folder, the server reloads it.

- ``full_gather`` (the reference, kept here only): ``export_hf_weights`` sends every stage-1
  tensor to rank 0, which writes the whole folder (``save_exported_weights``) and tells the
  server to reload it: what ``VLLMEngine.update_weights`` did before weight_sync/.
- ``per_stage``: ``DiskSync``: each stage's leader writes its own stage's files, rank 0 adds the
  index and tells the server to reload.

Per rank: bytes sent to another rank (``torch.distributed.send`` counted), bytes written
(safetensors tensor data counted as it is written) and peak memory during the sync: the growth
of the process's resident set size over its value just before the sync, sampled every 2 ms by a
thread (so tensors that live shorter than that can be missed; the allocator may also keep freed
pages). Seconds are rank 0's, from the start of the sync to the server's answer, for each
repeat; s/GB divides the fastest by the model's HF bytes (fp32). Prints a Markdown table; JSON to runs/bench_weight_sync.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_entropy.config import ServerConfig
from megatron_entropy.models import hf_io
from megatron_entropy.models.arch import load_arch
from megatron_entropy.models.bridge import (export_hf_weights, load_hf_weights,
                                            save_exported_weights)
from megatron_entropy.models.builder import build_gpt_model
from megatron_entropy.rollout.server.vllm import VLLMEngine
# The forked gloo ranks and tiny models of the tests, shared on purpose: the bench measures what
# the tests prove correct.
from megatron_entropy.testing.ranks import init_megatron, run_distributed
from megatron_entropy.testing.toy_models import save_tiny_hf_model, save_tokenizer
from megatron_entropy.weight_sync import DiskSync

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
CPU_ENV = ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "HF_HUB_OFFLINE=1"]
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


class PeakRSS:
    """Peak resident-set growth over the value at entry, sampled by a thread."""

    def __enter__(self) -> PeakRSS:
        self.base = self.peak = rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.base


class Counters:
    """Bytes this rank sends to other ranks and writes into safetensors files."""

    def __init__(self) -> None:
        self.sent = self.written = 0
        send, write = dist.send, hf_io.SafetensorsStream.write

        def counted_send(tensor, *args, **kwargs):
            self.sent += tensor.numel() * tensor.element_size()
            return send(tensor, *args, **kwargs)

        def counted_write(stream, name, tensor):
            self.written += tensor.numel() * tensor.element_size()
            return write(stream, name, tensor)

        dist.send = counted_send
        hf_io.SafetensorsStream.write = counted_write

    def take(self) -> tuple[int, int]:
        out = (self.sent, self.written)
        self.sent = self.written = 0
        return out


def full_gather_sync(model, arch, engine, sync_root: Path, hf_dir: Path, version: int,
                     previous: list) -> None:
    """The path before weight_sync/ (reference): every tensor through rank 0, which writes the
    folder alone, then the server reloads it."""
    stream = export_hf_weights(model, arch)
    if engine is None:
        for _ in stream:
            pass
        return
    folder = sync_root / f"weights-v{version}"
    save_exported_weights(stream, folder, hf_dir)
    engine.reload_from_folder(folder, version)
    for old in previous:
        shutil.rmtree(old, ignore_errors=True)
    previous[:] = [folder]


def worker(hf_dir: Path, run_dir: Path, repeats: int) -> list[dict]:
    init_megatron(pipeline=2)
    rank = dist.get_rank()
    arch = load_arch(hf_dir)
    model = build_gpt_model(arch, 1, 2, dtype="fp32", transformer_impl="local", seq_length=64)
    load_hf_weights(model, hf_dir, arch)
    stage_param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    engine = None
    if rank == 0:
        cfg = ServerConfig(launch=1, server_python=str(VENV_PYTHON), base_port=33400,
                           max_model_len=128, extra_args=["--enforce-eager"], extra_env=CPU_ENV,
                           startup_timeout_s=900, request_timeout_s=1200)
        engine = VLLMEngine(cfg, str(hf_dir), str(run_dir))
    dist.barrier()
    counters = Counters()
    per_stage = DiskSync(engine, run_dir / "per_stage", hf_dir)
    previous: list = []
    rows = []
    version = 0
    try:
        for repeat in range(repeats):
            order = ["full_gather", "per_stage"][::1 if repeat % 2 == 0 else -1]
            for path in order:
                version += 1
                with torch.no_grad():  # new weights each time, as after a training step
                    for p in model.parameters():
                        p.add_(1e-4)
                dist.barrier()
                load = os.getloadavg()[0]
                start = time.perf_counter()
                with PeakRSS() as mem:
                    if path == "per_stage":
                        per_stage.sync(model, arch, version)
                    else:
                        full_gather_sync(model, arch, engine, run_dir / "full_gather", hf_dir,
                                         version, previous)
                seconds = time.perf_counter() - start
                dist.barrier()
                sent, written = counters.take()
                rows.append({"rank": rank, "repeat": repeat, "path": path, "seconds": seconds,
                             "sent": sent, "written": written, "rss_growth": mem.growth,
                             "stage_param_bytes": stage_param_bytes, "load1": load})
    finally:
        if engine is not None:
            engine.shutdown()
    return rows


def print_table(rows: list[dict], model_bytes: int, model: str, repeats: int) -> list[dict]:
    """The Markdown table of one run; returns its rows."""
    cores = os.cpu_count()
    print(f"\n{model}: {model_bytes / 1e9:.3f} GB fp32; PP=2 gloo, one vLLM CPU server "
          f"(bf16); {repeats} repeats; load average {min(r['load1'] for r in rows):.1f}-"
          f"{max(r['load1'] for r in rows):.1f} on {cores} cores\n")
    print("| path | rank (stage) | stage params MB | sent MB | written MB | peak RSS growth MB | "
          "sync s (rank 0, each repeat) | s/GB (fastest) |")
    print("|---|---|---|---|---|---|---|---|")
    summary = []
    for path in ("full_gather", "per_stage"):
        secs = [r["seconds"] for r in rows if r["path"] == path and r["rank"] == 0]
        for rank in (0, 1):
            mine = [r for r in rows if r["path"] == path and r["rank"] == rank]
            row = {"path": path, "rank": rank,
                   "stage_param_MB": mine[0]["stage_param_bytes"] / 2**20,
                   "sent_MB": max(r["sent"] for r in mine) / 2**20,
                   "written_MB": max(r["written"] for r in mine) / 2**20,
                   "rss_growth_MB": max(r["rss_growth"] for r in mine) / 2**20,
                   "seconds": secs, "s_per_GB": min(secs) / (model_bytes / 1e9)}
            summary.append(row)
            print(f"| {path} | {rank} | {row['stage_param_MB']:.0f} | {row['sent_MB']:.0f} | "
                  f"{row['written_MB']:.0f} | {row['rss_growth_MB']:.0f} | "
                  + (" / ".join(f"{x:.2f}" for x in secs) + f" | {row['s_per_GB']:.1f} |"
                     if rank == 0 else "| |"))
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sync-dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None,
                    help="where the sync folders go (default /dev/shm, as "
                         "docs/rollout_servers.md advises)")
    ap.add_argument("--out", default=str(REPO / "runs" / "bench_weight_sync.json"))
    args = ap.parse_args()
    if not VENV_PYTHON.exists():
        sys.exit(f"{VENV_PYTHON} is missing: run .ci/setup-vllm.sh first")
    with tempfile.TemporaryDirectory() as tmp, \
            tempfile.TemporaryDirectory(dir=args.sync_dir, prefix="bench_weight_sync_") as runs:
        hf_dir = save_tiny_hf_model("qwen2", Path(tmp) / "model", hidden_size=args.hidden,
                                    intermediate_size=4 * args.hidden,
                                    num_hidden_layers=args.layers,
                                    num_attention_heads=args.hidden // 64, num_key_value_heads=1,
                                    vocab_size=args.vocab, max_position_embeddings=512)
        save_tokenizer(hf_dir, args.vocab)
        model_bytes = sum(t.numel() * t.element_size() for _, t in hf_io.iter_hf_tensors(hf_dir))
        results = run_distributed(worker, 2, hf_dir, Path(runs), args.repeats, timeout=3000)
    rows = [r for by_rank in results for r in by_rank]
    summary = print_table(rows, model_bytes, f"qwen2 h{args.hidden} x {args.layers} layers, "
                          f"vocab {args.vocab}", args.repeats)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"model_bytes": model_bytes, "rows": rows,
                                          "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
