"""The step's metrics that need every rank: sums and gathers over the job or the DP group, and
the names the actor's loss metrics are logged under."""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

from megatron_entropy.runtime.distributed import means_over_group


def device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def summed_over_ranks(value: float) -> float:
    total = torch.tensor([float(value)], dtype=torch.float64, device=device())
    dist.all_reduce(total)
    return float(total)


def every_engines_tokens(engine_metrics: dict[str, float]) -> dict[str, float]:
    """``rollout/response_tokens`` and ``rollout/tokens_per_s`` of the job, from this rank's
    engine's (none: zeros): tokens summed over the engines (one per DP replica in-process),
    the rate over the longest engine's generating time, as the engines run side by side.
    A collective: every rank calls it."""
    tokens = engine_metrics.get("rollout/response_tokens", 0.0)
    rate = engine_metrics.get("rollout/tokens_per_s", 0.0)
    mine = torch.tensor([tokens, tokens / rate if rate > 0 else 0.0], dtype=torch.float64,
                        device=device())
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    total = float(sum(t[0] for t in every))
    seconds = float(max(t[1] for t in every))
    if "rollout/response_tokens" not in engine_metrics:
        return {}  # no engine on this rank (rank 0 always has one: its numbers are logged)
    out = {"rollout/response_tokens": total}
    if seconds > 0:
        out["rollout/tokens_per_s"] = total / seconds
    return out


def reduce_token_metrics(samples: list, group) -> dict[str, float]:
    """Entropy (token mean, mean of per-sequence means, per source) of the generated response
    tokens, summed over this DP rank's samples and the DP group."""
    sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in samples:
        ent = s.generated(s.entropy).double()
        n = ent.numel()
        if n == 0:
            continue
        seq_mean = float(ent.mean())
        for key, value, count in (("entropy/token_mean", float(ent.sum()), n),
                                  ("entropy/seq_mean", seq_mean, 1),
                                  (f"entropy/{s.source}/seq_mean", seq_mean, 1)):
            sums[key][0] += value
            sums[key][1] += count
    return means_over_group(sums, group)


LOSS_METRIC_NAMES = {"cov_mean": "cov/mean", "cov_max": "cov/max",
                      "cov_selected_mean": "cov/selected_mean", "cov_selected_max": "cov/selected_max",
                      "selected_frac": "loss/selected_frac", "pg_clipfrac": "loss/clip_frac",
                      "pg_clipfrac_lower": "loss/clip_frac_lower", "ppo_kl": "loss/ppo_kl",
                      "ppo_kl_abs": "loss/ppo_kl_abs", "pg_loss": "loss/pg", "kl_ref": "loss/kl_ref",
                      "entropy": "entropy/train_token_mean",
                      "entropy_seq_mean": "entropy/train_seq_mean",
                      "update_skipped": "loss/update_skipped"}
