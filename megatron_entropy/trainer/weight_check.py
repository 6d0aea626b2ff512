"""Does the rollout engine serve the weights the trainer holds? A server can answer a sync with
success and still hold wrong weights (SGLang's CPU build after a distributed sync: log-probs
6-13 nats off), and a connected server may hold anything.

Two checks, both |engine - actor| per token, where both are log-softmax(logits / T) of the same
tokens, so on correct weights they differ only by rounding:
- the probe (``check_engine_weights``), at the first contact and after every weight sync: the
  first ``rollout.weight_check.prompts`` training prompts, each continued by ``tokens`` tokens
  that every serving replica (each server of a pool) samples at the rollout temperature with a
  fixed seed over the full vocabulary; the actor scores the same tokens with its recompute path;
- the rollout (``check_rollout_weights``), each step, after the update and before the weight
  sync: the actor's old log-probs (the weights that sampled) of every rollout token generated
  on the weights the trainer held (all of them when rollouts are synchronous), per server.
Each fails when a replica's mean exceeds ``tolerance`` or its ``quantile`` (0.99) exceeds
``quantile_tolerance`` (``tolerances``), with one error that names the replica and the numbers.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from megatron_entropy.rollout.base import RolloutEngine, SamplingParams
from megatron_entropy.runtime.dtypes import DTYPES
from megatron_entropy.trainer.batch import Sample
from megatron_entropy.trainer.drift import _all_reduce, exact_quantiles

# Tolerances in unit roundoffs u of the coarser dtype (bf16: u = 2^-8 = 3.9e-3), with floors for
# two fp32 paths (which differ by ~1e-6). Measured mean |engine - actor| on correct weights, bf16
# servers: 1.2-7.3e-3 on the probe (real SGLang, vLLM; the test model's sharpened head the
# highest), 3.9-6.1e-3 over whole rollouts of the quickstart model (real SGLang); a single token
# up to 0.04. A copy with 0.5 x std noise on every tensor: 0.17 over a whole rollout (max 7.9),
# 3.7e-2 on a 4 x 8 probe. 8 u (0.031 for bf16) is 4x the worst correct mean and 5x below the
# noisy copy's rollout mean; the 0.99 quantile gets 32 u (0.125: 3x the largest correct token).
MEAN_ROUNDOFFS = 8
QUANTILE_ROUNDOFFS = 32
MEAN_FLOOR = 1e-3
QUANTILE_FLOOR = 1e-2


class WeightCheckError(RuntimeError):
    """An engine replica's log-probs disagree with the trainer's: it holds other weights."""


def tolerances(engine_dtype: str, actor_dtype: str, mean: Optional[float] = None,
               quantile: Optional[float] = None) -> tuple[float, float]:
    """(largest mean, largest high quantile) of |engine - actor| log-prob (nats) on correct
    weights, from the coarser dtype's unit roundoff (module constants) unless given."""
    coarse = max(DTYPES[engine_dtype].unit_roundoff, DTYPES[actor_dtype].unit_roundoff)
    return (mean or max(MEAN_ROUNDOFFS * coarse, MEAN_FLOOR),
            quantile or max(QUANTILE_ROUNDOFFS * coarse, QUANTILE_FLOOR))


def probe_sampling(temperature: float, tokens: int) -> SamplingParams:
    return SamplingParams(n=1, temperature=temperature, top_p=1.0, top_k=-1,
                          max_new_tokens=tokens, seed=0)


def _quantile_key(quantile: float) -> str:
    return f"p{quantile * 100:g}"


def _judge(per_replica: dict[str, list[torch.Tensor]], names: list[str], group, quantile: float,
           limits: tuple[float, float], device: torch.device
           ) -> tuple[dict[str, tuple[float, float, int]], float, dict[str, str]]:
    """Per replica (``names``, the same order on every rank): mean, ``quantile`` and count of
    the |diff| values the ranks of ``group`` hold (None: this rank holds them all), agreed
    exactly by every rank (the max over ranks: kernels need not be bitwise deterministic
    across replicas); the largest value; and why each failing replica fails."""
    values = [torch.cat(per_replica[n]) if per_replica.get(n) else
              torch.zeros(0, dtype=torch.float64) for n in names]
    sums = _all_reduce(torch.tensor([[float(v.sum()), v.numel()] for v in values],
                                    dtype=torch.float64).reshape(-1, 2), group)
    qs = exact_quantiles(values, (quantile,), group)[:, 0] if values else torch.zeros(0)
    peak = _all_reduce(torch.tensor([float(v.max()) if v.numel() else 0.0 for v in values],
                                    dtype=torch.float64), group, dist.ReduceOp.MAX)
    stats = torch.stack([sums[:, 0] / sums[:, 1].clamp(min=1), qs.double(), peak,
                         sums[:, 1]], 1) if values else torch.zeros(0, 4, dtype=torch.float64)
    stats = stats.to(device)
    if stats.numel():
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    stats = stats.cpu()
    out = {n: (float(m), float(q), int(c)) for n, (m, q, _, c) in zip(names, stats.tolist())
           if c > 0}
    worst = float(stats[:, 2].max()) if stats.numel() else 0.0
    mean_limit, q_limit = limits
    key = _quantile_key(quantile)
    why = {}
    for n, (m, q, c) in out.items():
        if not m <= mean_limit:  # NaN fails too
            why[n] = f"mean {m:.3g} nats > {mean_limit:.3g}"
        elif not q <= q_limit:
            why[n] = f"{key} {q:.3g} nats > {q_limit:.3g} (mean {m:.3g})"
    return out, worst, why


def _error(when: str, what: str, why: dict[str, str], counts: dict[str, tuple]) -> str:
    return (f"weight check {when}: the rollout engine's log-probs disagree with the trainer's "
            f"{what}, so it does not hold the trained weights: "
            + "; ".join(f"{w}: |engine - trainer| {reason} over {counts[w][2]} tokens"
                        for w, reason in why.items())
            + ". Training on its rollouts would be training on another policy's samples.")


def check_engine_weights(engine: Optional[RolloutEngine], actor, prompts: list[list[int]],
                         sampling: SamplingParams, limits: tuple[float, float], when: str,
                         quantile: float = 0.99) -> dict[str, float]:
    """Collective over all ranks: the ranks that talk to an engine generate the probe on each
    replica; every rank scores every replica's probe with ``actor`` (each DP replica computes the
    same, so every rank decides the same). Returns ``weight_check/*`` metrics; raises
    ``WeightCheckError`` naming each replica beyond ``limits`` (``tolerances``). ``when`` says
    which sync (or the first contact) in the error."""
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
    # Every rank holds the same probes in the same order.
    names = list(per_replica)
    stats, worst, why = _judge(per_replica, names, None, quantile, limits, actor.device)
    if why:
        raise WeightCheckError(_error(
            when, f"on a fixed probe ({len(prompts)} prompts x {sampling.max_new_tokens} "
                  "tokens)", why, stats))
    return {"weight_check/drift_mean": max((m for m, _, _ in stats.values()), default=0.0),
            f"weight_check/drift_{_quantile_key(quantile)}":
                max((q for _, q, _ in stats.values()), default=0.0),
            "weight_check/drift_max": worst,
            "weight_check/replicas": float(len(stats)),
            "weight_check/seconds": time.perf_counter() - t0}


def check_rollout_weights(samples: Sequence[Sample], group, limits: tuple[float, float],
                          quantile: float, version: Optional[str], when: str,
                          device: torch.device) -> dict[str, float]:
    """Collective over all ranks (``group``: the DP group, whose ranks hold disjoint samples):
    the recompute's ``old_logprobs`` of this step's rollout tokens against the engine's, per
    server, over the samples generated entirely on weight ``version`` (None: all) with exact
    engine log-probs. Raises ``WeightCheckError`` naming each server beyond ``limits``."""
    per_server: dict[str, list[torch.Tensor]] = defaultdict(list)
    for s in samples:
        if (s.response_ids and s.exact_logprobs and s.old_logprobs is not None
                and (version is None or s.weight_version == version)):
            where = "the in-process engine" if s.server is None else f"server {s.server}"
            engine = torch.tensor(s.engine_logprobs, dtype=torch.float64)
            per_server[where].append(s.generated((s.old_logprobs.double().cpu() - engine).abs()))
    names = sorted(per_server)
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, names)
        names = sorted(set().union(*map(set, gathered)))
    stats, _, why = _judge(per_server, names, group, quantile, limits, device)
    if why:
        raise WeightCheckError(_error(
            when, f"on this step's rollout tokens, scored by the actor before its update (version "
                  f"{version or 'any'})", why, stats))
    return {"weight_check/rollout_drift_mean": max((m for m, _, _ in stats.values()),
                                                   default=0.0),
            f"weight_check/rollout_drift_{_quantile_key(quantile)}":
                max((q for _, q, _ in stats.values()), default=0.0),
            "weight_check/rollout_tokens": float(sum(c for _, _, c in stats.values()))}
