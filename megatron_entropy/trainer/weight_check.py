"""Does the rollout engine serve the weights the trainer holds? Checked at the first contact and
after every weight sync, because a server can answer a sync with success and still hold wrong
weights (SGLang's CPU build after a distributed sync: log-probs 6-13 nats off), and a connected
server may hold anything.

The probe: the first ``rollout.weight_check_prompts`` training prompts, each continued by
``weight_check_tokens`` tokens that every serving replica (each server of a pool) samples at the
rollout temperature with a fixed seed, over the full vocabulary (no top-p/top-k); the actor then
scores the same tokens with its recompute path. Both are log-softmax(logits / T), so on correct
weights they differ only by rounding; the check fails when a replica's mean |difference| exceeds
the tolerance (``probe_tolerance``), with one error that names the replica.
"""

from __future__ import annotations

import time
from typing import Optional

import torch
import torch.distributed as dist

from megatron_entropy.rollout.base import RolloutEngine, SamplingParams
from megatron_entropy.runtime.dtypes import DTYPES
from megatron_entropy.trainer.batch import Sample

# Tolerance in units of the coarser dtype's roundoff, with a floor for two fp32 paths.
ROUNDOFFS_TOLERATED = 25
FP32_FLOOR = 1e-3


class WeightCheckError(RuntimeError):
    """An engine replica's log-probs disagree with the trainer's: it holds other weights."""


def probe_tolerance(engine_dtype: str, actor_dtype: str) -> float:
    """Largest mean |engine - actor| log-prob (nats) over the probe's tokens on correct weights.

    Each log-prob is log-softmax of logits computed in the coarser of the two dtypes; rounding
    the hidden states and logits in that dtype moves a log-prob by a few unit roundoffs of the
    logit scale per token, and the mean over the probe averages the signs out. Measured on
    correct weights: 1.2-1.4e-3 (real SGLang, bf16), 1.1-1.5e-3 (vLLM bf16, quickstart model),
    <= 7.3e-3 (vLLM bf16 on the test model with a sharpened head), per token at most 0.04. 25
    roundoffs of bf16 (0.098) is 13x the worst measured mean and 16x below the smallest
    wrong-weights drift measured (1.57 nats; the real SGLang failure was 6-13). fp16: 0.012;
    fp32 on both sides: the 1e-3 floor (two fp32 implementations differ by ~1e-6)."""
    coarse = max(DTYPES[engine_dtype].unit_roundoff, DTYPES[actor_dtype].unit_roundoff)
    return max(ROUNDOFFS_TOLERATED * coarse, FP32_FLOOR)


def engine_dtype(rollout_cfg) -> str:
    """The dtype the configured engine computes log-probs in (a key of runtime.dtypes.DTYPES);
    a server's ``auto`` (the checkpoint's dtype) counts as bf16, the coarsest it can be."""
    if rollout_cfg.engine == "inprocess":
        return rollout_cfg.dtype
    return "bf16" if rollout_cfg.server.dtype == "auto" else rollout_cfg.server.dtype


def probe_sampling(temperature: float, tokens: int) -> SamplingParams:
    return SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=-1,
                          max_new_tokens=tokens, seed=0)


def check_engine_weights(engine: Optional[RolloutEngine], actor, prompts: list[list[int]],
                         sampling: SamplingParams, tolerance: float, when: str
                         ) -> dict[str, float]:
    """Collective over all ranks: the ranks that talk to an engine generate the probe on each
    replica; every rank scores every replica's probe with ``actor`` (each DP replica computes the
    same, so every rank decides the same). Returns ``weight_check/*`` metrics; raises
    ``WeightCheckError`` naming each replica beyond ``tolerance``. ``when`` says which sync (or
    the first contact) in the error."""
    t0 = time.perf_counter()
    local: list[tuple[str, list[int], list[int], list[float]]] = []
    if engine is not None:
        for where, outputs in engine.generate_on_each_replica(prompts, sampling).items():
            if not engine.shared:  # one engine per DP leader
                where = f"{where} on rank {dist.get_rank()}"
            local += [(where, prompt, c.token_ids, c.logprobs)
                      for prompt, row in zip(prompts, outputs) for c in row if c.token_ids]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    probes = [p for part in gathered for p in part]
    samples = [Sample(prompt_ids=list(prompt), response_ids=list(ids),
                      engine_logprobs=list(lps), reward=0.0, group=0, source="weight_check")
               for _, prompt, ids, lps in probes]
    scored = actor.compute_logprobs(samples) if samples else []
    per_replica: dict[str, list[torch.Tensor]] = {}
    for (where, *_), s, (logp, _) in zip(probes, samples, scored):
        diff = (logp.double() - torch.tensor(s.engine_logprobs, dtype=torch.float64)).abs()
        per_replica.setdefault(where, []).append(diff)
    # Every rank holds the same probes in the same order; agree on the results exactly (GPU
    # kernels need not be bitwise deterministic across replicas), so all ranks decide the same.
    stats = torch.tensor([[float(torch.cat(d).mean()), float(torch.cat(d).max())]
                          for d in per_replica.values()] or [[0.0, 0.0]],
                         dtype=torch.float64, device=actor.device)
    dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    means = dict(zip(per_replica, stats[:, 0].tolist()))
    worst_token = float(stats[:, 1].max())
    bad = {w: m for w, m in means.items() if not m <= tolerance}  # NaN fails too
    if bad:
        raise WeightCheckError(
            f"weight check {when}: the rollout engine's log-probs disagree with the trainer's "
            f"on a fixed probe ({len(prompts)} prompts x {sampling.max_new_tokens} tokens), so it "
            f"does not hold the trained weights: "
            + "; ".join(f"{w}: mean |engine - trainer| {m:.3g} nats" for w, m in bad.items())
            + f" (tolerance {tolerance:.3g}). Training on its rollouts would be training on "
              "another policy's samples.")
    return {"weight_check/drift_mean": max(means.values(), default=0.0),
            "weight_check/drift_max": worst_token,
            "weight_check/replicas": float(len(means)),
            "weight_check/seconds": time.perf_counter() - t0}
