"""Benchmark: log-prob + entropy + policy loss, forward and backward, on one CPU machine.

Methods (each computes per-token log-prob and entropy, then the same KL-Cov policy loss with an
entropy bonus from ``megatron_entropy.algorithms``, so the entropy's backward runs too):
  ours-chunked  ops.vocab_parallel_logprob_entropy on the logits
  ours-fused    ops.fused_linear_logprob_entropy on hidden states + output weight (no logits)
  torch         plain torch: full log_softmax in float32, entropy = -sum p log p
  verl          verl 0.9's Megatron path: logits.clone(), verl.utils.megatron.tensor_parallel.
                vocab_parallel_entropy, vocab_parallel_log_probs_from_logits (Megatron's
                vocab_parallel_cross_entropy) — what its Megatron engine runs without its Triton
                (GPU-only) fused kernel.
Scenarios: "logits" starts from logits [T, V/tp] (the peak excludes the input logits); "hidden"
starts from hidden [T, H] and the weight [V/tp, H] (the logits' GEMM is part of every method).

Peak memory: each case runs in its own forked process; after a warm-up call the kernel's RSS
high-water mark is reset (/proc/self/clear_refs = 5) and the peak is VmHWM - VmRSS before the timed
calls (inputs excluded), with glibc's mmap threshold fixed at 64 KiB so that RSS follows the
live tensors. Time: CPU time of the process (user + system, all its threads; the dev
machine is shared, so wall time mostly measures the neighbours), best of ``--reps`` calls; wall
time is printed too. Every process runs one thread (OpenMP spin-waits on a shared machine would
otherwise be billed as CPU time); under TP=2 each rank is a process, the slowest rank counts.
Collectives: torch.distributed calls counted in the forward and in the backward.

The verl rows need verl in the interpreter; set it up once in a git-ignored venv of its own (verl
without its dependencies, which would pull a GPU stack, plus the few its imports need):
  python -m venv .venv-bench
  .venv-bench/bin/pip install -c constraints-cpu.txt -e .
  .venv-bench/bin/pip install --no-deps "verl==0.9.*" tensordict ray pyvers
  .venv-bench/bin/pip install -c constraints-cpu.txt omegaconf codetiming msgpack protobuf \
      requests jsonschema cloudpickle orjson
  .venv-bench/bin/python bench/bench_entropy_ops.py [--quick]
Without verl its rows say "unavailable" and the first line says why (the import error). It also
checks verl's compute_policy_loss_clip_cov / _kl_cov against ours number for number on the same
inputs.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time
import traceback
import warnings
from types import SimpleNamespace
from typing import Optional

import torch
import torch.distributed as dist
# Imported once here (~5 s), not in every forked case that needs its parallel state.
from megatron.core import parallel_state as ps

from megatron_entropy.algorithms.policy_loss import PolicyLossSettings, policy_loss
from megatron_entropy.ops.logprob_entropy import (fused_linear_logprob_entropy,
                                                  vocab_parallel_logprob_entropy)
from megatron_entropy.testing.memory import follow_live_tensors, reset_peak, status_kb
from megatron_entropy.testing.ranks import free_port

COLLECTIVES = ["all_gather", "all_gather_into_tensor", "all_reduce", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "reduce",
               "gather", "scatter", "send", "recv", "isend", "irecv", "barrier"]
SEQ = 512  # tokens per sequence when the loss views [T] as [T / SEQ, SEQ]
LOSS = PolicyLossSettings(loss="kl_cov", kl_cov_ratio=2e-3, entropy_coef=1e-3)

# Deferred imports: verl is optional (its rows say "unavailable" without it), imported where used.


def verl_import_error() -> Optional[str]:
    """Why verl cannot be used here (None when it can): the error of importing what we call."""
    try:
        import verl.utils.megatron.tensor_parallel  # noqa: F401
        import verl.trainer.ppo.core_algos  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure makes its rows unavailable
        return f"{type(e).__name__}: {e}"
    return None


# ----------------------------------------------------------------------------- measurement


def _available_gb() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2 ** 20
    return float("inf")


class _Counter:
    def __init__(self) -> None:
        self.n = 0
        for name in COLLECTIVES:
            original = getattr(dist, name)

            def counted(*args, _original=original, **kwargs):
                self.n += 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)


# ----------------------------------------------------------------------------- the methods


def _torch_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int):
    logsm = torch.log_softmax(logits[:, :vocab].float(), dim=-1)
    logp = logsm.gather(1, targets[:, None]).squeeze(1)
    entropy = -(logsm.exp() * logsm).sum(-1)
    return logp, entropy


def _verl_logprob_entropy(logits: torch.Tensor, targets: torch.Tensor, vocab: int):
    from verl.utils.megatron.tensor_parallel import (vocab_parallel_entropy,
                                                     vocab_parallel_log_probs_from_logits)

    # As verl's Megatron engine: entropy consumes a clone, log-probs the original.
    logits_bak = logits
    logits = logits.clone()
    entropy = vocab_parallel_entropy(logits)
    logp = vocab_parallel_log_probs_from_logits(logits_bak, targets)
    return logp, entropy.float()


def _stats(method: str, x: dict, group, vocab: int, chunk: int):
    if method == "ours-fused":
        return fused_linear_logprob_entropy(x["hidden"], x["weight"], x["targets"],
                                            vocab_size=vocab, group=group, chunk_tokens=chunk)
    logits = x["logits"] if "logits" in x else x["hidden"] @ x["weight"].t()
    if method == "ours-chunked":
        return vocab_parallel_logprob_entropy(logits, x["targets"], vocab_size=vocab,
                                              group=group, chunk_tokens=chunk)
    if method == "torch":
        return _torch_logprob_entropy(logits, x["targets"], vocab)
    return _verl_logprob_entropy(logits, x["targets"], vocab)


def _loss(logp: torch.Tensor, entropy: torch.Tensor, x: dict) -> torch.Tensor:
    rows = logp.shape[0] // SEQ
    shape = (rows, SEQ)
    loss, _ = policy_loss(LOSS, logp.view(shape), x["old_logp"].view(shape),
                          x["advantages"].view(shape), x["mask"].view(shape),
                          normalizer=float(logp.shape[0]), entropy=entropy.view(shape))
    return loss


def _inputs(scenario: str, tokens: int, vocab: int, hidden: int, dtype: torch.dtype,
            rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    local = vocab // world
    x: dict = {"targets": torch.randint(0, vocab, (tokens,), generator=g)}
    if scenario == "logits":
        x["logits"] = (torch.randn(tokens, local, generator=g) * 2).to(dtype).requires_grad_()
    else:
        x["hidden"] = torch.randn(tokens, hidden, generator=g).to(dtype).requires_grad_()
        x["weight"] = (torch.randn(local, hidden, generator=g) / hidden ** 0.5).to(dtype) \
            .requires_grad_()
    # A plausible previous policy and GRPO-like advantages (one per sequence).
    x["old_logp"] = -torch.rand(tokens, generator=g) * 12
    x["advantages"] = torch.randn(tokens // SEQ, 1, generator=g).expand(-1, SEQ).reshape(-1)
    x["mask"] = torch.ones(tokens)
    return x


def _case_worker(rank: int, world: int, port: int, spec: dict, queue) -> None:
    try:
        # One thread per process: on a shared machine OpenMP's spin-waiting at every barrier
        # would be billed as CPU time and swamp the comparison.
        torch.set_num_threads(1)
        group, counter = None, None
        if world > 1 or spec["method"] == "verl":
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=world)
            ps.initialize_model_parallel(tensor_model_parallel_size=world)
            group = ps.get_tensor_model_parallel_group() if world > 1 else None
            counter = _Counter()
        x = _inputs(spec["scenario"], spec["tokens"], spec["vocab"], spec["hidden"],
                    spec["dtype"], rank, world)
        leaves = [v for v in x.values() if isinstance(v, torch.Tensor) and v.requires_grad]

        def once() -> tuple[float, float, float, int, int]:
            for leaf in leaves:
                leaf.grad = None
            c0 = counter.n if counter else 0
            w0, t0 = time.perf_counter(), time.process_time()
            logp, entropy = _stats(spec["method"], x, group, spec["vocab"], spec["chunk"])
            loss = _loss(logp, entropy, x)
            t1 = time.process_time()
            c1 = counter.n if counter else 0
            loss.backward()
            w2, t2 = time.perf_counter(), time.process_time()
            c2 = counter.n if counter else 0
            del logp, entropy, loss
            return t1 - t0, t2 - t0, w2 - w0, c1 - c0, c2 - c1

        once()  # warm-up (verl's torch.compile, allocator)
        for leaf in leaves:
            leaf.grad = None  # the peak below then includes the gradients' own memory
        base_kb = reset_peak()
        runs = [once() for _ in range(spec["reps"])]
        peak_kb = status_kb("VmHWM") - base_kb
        best = min(runs, key=lambda r: r[1])
        queue.put((rank, {"fwd_s": best[0], "total_s": best[1],
                          "wall_s": min(r[2] for r in runs), "coll_fwd": best[3],
                          "coll_bwd": best[4], "peak_gb": peak_kb / 2 ** 20}))
    except BaseException:  # noqa: BLE001 - reported in the table
        queue.put((rank, {"error": traceback.format_exc(limit=3).strip().splitlines()[-1]}))


def run_case(spec: dict, world: int) -> dict:
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_case_worker, args=(r, world, port, spec, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(world):
            rank, res = queue.get(timeout=3600)
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    errors = [r["error"] for r in results.values() if "error" in r]
    if errors:
        return {"error": errors[0]}
    out = dict(results[0])
    for key in ("peak_gb", "total_s", "fwd_s", "wall_s"):  # the slowest / largest rank
        out[key] = max(r[key] for r in results.values())
    return out


# Peak per method in bytes per logit (T * V_local), measured with bf16 logits, for the budget:
# plain torch ~20 (float32 log-softmax, softmax, product and their gradients), verl ~10 (clone,
# bf16 softmax, float32 cross-entropy buffers), ours the gradient only.
EST_BYTES_PER_ELEMENT = {"ours-chunked": 2.0, "ours-fused": 0.0, "torch": 20.0, "verl": 10.5}


def estimate_gb(method: str, scenario: str, tokens: int, local_vocab: int,
                chunk: int, dtype: torch.dtype) -> float:
    elem = tokens * local_vocab
    size = torch.finfo(dtype).bits // 8
    est = EST_BYTES_PER_ELEMENT[method] * elem + 8 * chunk * local_vocab
    if scenario == "hidden" and method != "ours-fused":
        est += 2 * size * elem  # the logits and their gradient
    return est / 2 ** 30


# ----------------------------------------------------------------------------- verl check


class _Config(SimpleNamespace):
    """verl reads some knobs by attribute and some with .get()."""

    def get(self, key, default=None):
        return getattr(self, key, default)


def check_losses_against_verl() -> list[str]:
    """Our micro-batch-scope Clip-Cov / KL-Cov / PPO losses vs verl 0.9 core_algos, same inputs."""
    from verl.trainer.ppo import core_algos

    lines = []
    g = torch.Generator().manual_seed(0)
    rows, cols = 16, 64
    mask = (torch.arange(cols)[None] < torch.randint(8, cols + 1, (rows, 1), generator=g)).float()
    logp = (-torch.rand(rows, cols, generator=g) * 4).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(rows, cols, generator=g)
    adv = (torch.randn(rows, 1, generator=g) * 1.5).expand(rows, cols).contiguous()
    n_valid = float(mask.sum())
    for name, ours, fn in [
        ("clip_cov", PolicyLossSettings(loss="clip_cov", clip_cov_ratio=0.02),
         core_algos.compute_policy_loss_clip_cov),
        ("kl_cov", PolicyLossSettings(loss="kl_cov", kl_cov_ratio=0.02),
         core_algos.compute_policy_loss_kl_cov),
        ("ppo_clip", PolicyLossSettings(loss="ppo_clip", dual_clip_c=3.0),
         core_algos.compute_policy_loss_vanilla),
    ]:
        config = _Config(
            clip_ratio=0.2, clip_ratio_low=ours.clip_ratio_low,
            clip_ratio_high=ours.clip_ratio_high,
            clip_ratio_c=ours.dual_clip_c or 3.0, global_batch_info={},
            policy_loss=SimpleNamespace(clip_cov_ratio=ours.clip_cov_ratio, clip_cov_lb=1.0,
                                        clip_cov_ub=5.0, kl_cov_ratio=ours.kl_cov_ratio,
                                        ppo_kl_coef=1.0))
        torch.manual_seed(123)  # verl draws Clip-Cov's tokens from the global RNG
        verl_loss, _ = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                          loss_agg_mode="token-mean", config=config)
        verl_grad, = torch.autograd.grad(verl_loss, logp)
        torch.manual_seed(123)
        our_loss, _ = policy_loss(ours, logp, old, adv, mask, normalizer=n_valid,
                                  generator=torch.default_generator)
        our_grad, = torch.autograd.grad(our_loss, logp)
        our_loss, verl_loss = float(our_loss.detach()), float(verl_loss.detach())
        lines.append(f"{name:9s} loss ours {our_loss:+.9f} verl {verl_loss:+.9f}  "
                     f"|loss diff| {abs(our_loss - verl_loss):.1e}  "
                     f"max |grad diff| {float((our_grad - verl_grad).abs().max()):.1e}")
    return lines


# ----------------------------------------------------------------------------- main


def _fmt(res: dict) -> tuple[str, str, str, str, str]:
    if "skipped" in res or "error" in res:
        return res.get("skipped") or res.get("error"), "", "", "", ""
    return (f"{res['total_s']:.3f}", f"{res['fwd_s']:.3f}", f"{res['wall_s']:.3f}",
            f"{res['peak_gb']:.2f}", f"{res['coll_fwd']}/{res['coll_bwd']}")


def main() -> None:
    follow_live_tensors()
    warnings.filterwarnings("ignore")
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one rep (smoke test)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-gb", type=float, default=13.0,
                    help="skip a case whose estimated peak exceeds this or the free memory - 2 GiB")
    ap.add_argument("--chunk", type=int, default=1024)
    args = ap.parse_args()

    verl_error = verl_import_error()
    have_verl = verl_error is None
    bf16 = torch.bfloat16
    if args.quick:
        grid = [("logits", 1, 512, 4096, 0, bf16), ("hidden", 1, 512, 4096, 64, bf16),
                ("logits", 2, 512, 4096, 0, bf16), ("hidden", 2, 512, 4096, 64, bf16)]
        reps = 1
    else:
        grid = [("logits", 1, 2048, 32768, 0, bf16), ("logits", 1, 2048, 151936, 0, bf16),
                ("logits", 1, 2048, 151936, 0, torch.float32),
                ("logits", 1, 4096, 151936, 0, bf16), ("logits", 1, 8192, 151936, 0, bf16),
                ("hidden", 1, 2048, 151936, 256, bf16), ("hidden", 1, 8192, 151936, 256, bf16),
                ("logits", 2, 2048, 151936, 0, bf16), ("logits", 2, 8192, 151936, 0, bf16),
                ("hidden", 2, 2048, 151936, 256, bf16), ("hidden", 2, 8192, 151936, 256, bf16)]
        reps = args.reps
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, verl "
          f"{'available' if have_verl else f'unavailable ({verl_error})'}; "
          f"loss = {LOSS.loss} + entropy bonus, "
          f"chunk_tokens = {args.chunk}")
    print("| scenario | TP | T | V | dtype | method | fwd+bwd CPU s | fwd CPU s | fwd+bwd wall s | "
          "peak GiB | coll fwd/bwd | CPU time vs verl | peak vs verl |")
    print("|" + "---|" * 13)
    for scenario, world, tokens, vocab, hidden, dtype in grid:
        methods = ["ours-fused", "ours-chunked", "torch", "verl"] if scenario == "hidden" \
            else ["ours-chunked", "torch", "verl"]
        if world > 1:  # plain torch has no vocab-parallel form
            methods.remove("torch")
        rows = {}
        for method in methods:
            if method == "verl" and not have_verl:
                rows[method] = {"skipped": "unavailable"}
                continue
            est = estimate_gb(method, scenario, tokens, vocab // world, args.chunk, dtype) * world
            if est > min(args.budget_gb, _available_gb() - 2.0):  # others share the machine
                rows[method] = {"skipped": f"skipped (est. {est:.0f} GiB)"}
                continue
            spec = dict(method=method, scenario=scenario, tokens=tokens, vocab=vocab,
                        hidden=hidden, dtype=dtype, chunk=args.chunk, reps=reps)
            rows[method] = run_case(spec, world)
        ref = rows.get("verl")
        for method, res in rows.items():
            t, f, w, p, c = _fmt(res)
            ratio_t = ratio_p = ""
            if ref and "total_s" in ref and "total_s" in res and method != "verl":
                ratio_t = f"{res['total_s'] / ref['total_s']:.2f}x"
                ratio_p = f"{res['peak_gb'] / ref['peak_gb']:.2f}x"
            dname = "bf16" if dtype == bf16 else "fp32"
            scen = f"hidden H={hidden}" if scenario == "hidden" else "logits"
            print(f"| {scen} | {world} | {tokens} | {vocab} | {dname} | {method} | {t} | {f} | "
                  f"{w} | {p} | {c} | {ratio_t} | {ratio_p} |", flush=True)
    if have_verl:
        print("\nverl 0.9 core_algos vs ours (micro_batch scope, float32, same inputs and seed):")
        for line in check_losses_against_verl():
            print("  " + line)


if __name__ == "__main__":
    main()
