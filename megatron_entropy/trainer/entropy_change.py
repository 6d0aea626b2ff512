"""The exact entropy change of one RL step, beside the step's covariance statistic.

The paper's mechanism: under a (natural) policy-gradient step of size eta on a softmax policy,
dH ~ -eta * Cov(log pi, A). Here both sides are measured (``analysis.entropy_change: true``).

The step is one RL step: the samples of one rollout batch that the actor trained on (the groups
dynamic sampling kept), over every data-parallel rank. Per valid response token t:

- H_before(t): its entropy in the recompute before the step's first update (the logged
  ``entropy/token_mean``), H_after(t): its entropy under the weights after the step's LAST update
  (all ``ppo_epochs x mini_batches_per_step`` optimizer steps), scored again forward-only through
  the same actor path and at the same temperature, on the same positions.
- ``entropy/delta`` = token mean over the step of H_after - H_before;
  ``entropy/delta_seq_mean`` = mean over sequences of their per-sequence token means (the paper's
  entropy figure is per-sequence means).
- ``cov/step`` = token mean over the step of (logp - mean logp)(A - mean A), logp the recompute's
  (old, pre-update) log-prob, A the token's advantage, both means over the whole step.

Per data source (``entropy/<source>/delta``, ``cov/<source>/step``) the population is the
source's own tokens: token means, and the covariance's means, within the source. So a source's
value is what ``cov/step`` would be on a step made of that source alone, whatever else the step
holds; with global means a source's value would also carry a between-source term
(mean_s logp - mean logp)(mean_s A - mean A) that reflects how hard the sources are relative to
each other, not how confidence and advantage trade inside one. The parts add up exactly: cov/step
= sum_s w_s (cov/<s>/step + (mean_s logp - mean logp)(mean_s A - mean A)), w_s the token shares.

Partial moments are float64 and merged across ranks in rank order (pairwise co-moment update,
no E[xy] - E[x]E[y] cancellation), so every rank gets the same numbers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.ops.covariance import gather_in_rank_order


@dataclass
class _Moments:
    """Sufficient statistics of one population of tokens."""

    tokens: int = 0
    mean_logp: float = 0.0
    mean_adv: float = 0.0
    co_moment: float = 0.0  # sum over tokens of (logp - mean logp)(A - mean A)
    delta_sum: float = 0.0  # sum over tokens of H_after - H_before
    sequences: int = 0
    seq_delta_sum: float = 0.0  # sum over sequences of their mean H_after - H_before

    def merge(self, other: "_Moments") -> "_Moments":
        n = self.tokens + other.tokens
        if n == 0:
            return _Moments()
        d_logp = other.mean_logp - self.mean_logp
        d_adv = other.mean_adv - self.mean_adv
        return _Moments(
            tokens=n, mean_logp=self.mean_logp + d_logp * other.tokens / n,
            mean_adv=self.mean_adv + d_adv * other.tokens / n,
            co_moment=(self.co_moment + other.co_moment
                       + d_logp * d_adv * self.tokens * other.tokens / n),
            delta_sum=self.delta_sum + other.delta_sum,
            sequences=self.sequences + other.sequences,
            seq_delta_sum=self.seq_delta_sum + other.seq_delta_sum)


def _local_moments(delta: Tensor, logp: Tensor, adv: Tensor, seq_means: Tensor) -> _Moments:
    if delta.numel() == 0:
        return _Moments()
    mean_logp, mean_adv = logp.mean(), adv.mean()
    return _Moments(tokens=delta.numel(), mean_logp=float(mean_logp), mean_adv=float(mean_adv),
                    co_moment=float(((logp - mean_logp) * (adv - mean_adv)).sum()),
                    delta_sum=float(delta.sum()), sequences=seq_means.numel(),
                    seq_delta_sum=float(seq_means.sum()))


def entropy_change_metrics(entropy_before: Sequence[Tensor], entropy_after: Sequence[Tensor],
                           old_logprobs: Sequence[Tensor], advantages: Sequence[float],
                           sources: Sequence[str],
                           group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """``entropy/delta``, ``entropy/delta_seq_mean``, ``cov/step`` and their per-source values
    (module docstring) of this rank's sequences merged with every rank of ``group`` (the DP
    group; None or an uninitialised process group: this process alone). One [T_i] tensor per
    sequence in each list; sequences without response tokens are skipped."""
    # (None,) = the whole step, ("source", name) = one data source
    parts: dict[tuple, list[list[Tensor]]] = defaultdict(lambda: [[], [], [], []])
    for before, after, logp, adv, source in zip(entropy_before, entropy_after, old_logprobs,
                                                advantages, sources, strict=True):
        if before.shape != after.shape or before.shape != logp.shape:
            raise ValueError(f"entropies before {tuple(before.shape)}, after "
                             f"{tuple(after.shape)} and log-probs {tuple(logp.shape)} of one "
                             "sequence must cover the same tokens")
        if before.numel() == 0:
            continue
        delta = after.double() - before.double()
        for key in ((None,), ("source", source)):
            d, lp, a, s = parts[key]
            d.append(delta)
            lp.append(logp.double())
            a.append(torch.full_like(delta, float(adv)))
            s.append(delta.mean().reshape(1))
    local = {key: _local_moments(*(torch.cat(t) for t in ts)) for key, ts in parts.items()}
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, local, group=group)
    else:
        gathered = [local]
    total: dict[tuple, _Moments] = defaultdict(_Moments)
    for part in gathered:  # rank order: the same sums on every rank
        for key, m in part.items():
            total[key] = total[key].merge(m)
    out: dict[str, float] = {}
    step = total.pop((None,), _Moments())
    if step.tokens:
        out["entropy/delta"] = step.delta_sum / step.tokens
        out["entropy/delta_seq_mean"] = step.seq_delta_sum / step.sequences
        out["cov/step"] = step.co_moment / step.tokens
    for (_, source), m in sorted(total.items()):
        out[f"entropy/{source}/delta"] = m.delta_sum / m.tokens
        out[f"cov/{source}/step"] = m.co_moment / m.tokens
    return out


# --------------------------------------------------------------------- the lemma per token


def _corr_slope(sums: Tensor) -> tuple[float, float]:
    """(Pearson correlation of y on x, least-squares slope of y on x) from [n, sx, sy, sxx, syy,
    sxy] (float64); NaN where a variance is 0."""
    n, sx, sy, sxx, syy, sxy = (float(v) for v in sums)
    if n < 2:
        return float("nan"), float("nan")
    vx, vy, cxy = sxx - sx * sx / n, syy - sy * sy / n, sxy - sx * sy / n
    corr = cxy / (vx * vy) ** 0.5 if vx > 0 and vy > 0 else float("nan")
    return corr, (cxy / vx if vx > 0 else float("nan"))


def _pair_sums(x: Tensor, y: Tensor) -> Tensor:
    x, y = x.double(), y.double()
    return torch.stack([torch.tensor(float(x.numel()), dtype=torch.float64), x.sum(), y.sum(),
                        (x * x).sum(), (y * y).sum(), (x * y).sum()])


def lemma_metrics(h_before: Tensor, h_after: Tensor, prediction: Tensor, old_logp: Tensor,
                  advantages: Tensor, group: Optional[dist.ProcessGroup] = None
                  ) -> dict[str, float]:
    """The lemma per token over one optimizer step, from this rank's [N] tensors of one
    mini-batch's response tokens, merged over ``group`` (the DP group):

    - ``lemma/corr``, ``lemma/slope``: correlation and least-squares slope of the measured
      change dH_t = H_after(t) - H_before(t) on the prediction -Cov_{a~pi(.|s_t)}(log pi, dz);
    - ``lemma/pg_corr``, ``lemma/pg_slope``: the same against the policy-gradient form
      -(log pi(a_t) - mean log pi)(A_t - mean A), the token's share of -Cov(log pi, A) across
      the mini-batch's positions (means over the mini-batch, every rank);
    - ``lemma/delta_mean``, ``lemma/prediction_mean``, ``lemma/tokens``.
    """
    delta = (h_after - h_before).double()
    local = torch.stack([old_logp.double().sum(), advantages.double().sum(),
                         torch.tensor(float(old_logp.numel()), dtype=torch.float64)])
    means = gather_in_rank_order(local, group).sum(dim=0)
    count = max(float(means[2]), 1.0)
    pg = -(old_logp.double() - means[0] / count) * (advantages.double() - means[1] / count)
    sums = gather_in_rank_order(torch.cat([_pair_sums(prediction, delta), _pair_sums(pg, delta)]),
                                group).sum(dim=0)
    corr, slope = _corr_slope(sums[:6])
    pg_corr, pg_slope = _corr_slope(sums[6:])
    n = max(float(sums[0]), 1.0)
    return {"lemma/corr": corr, "lemma/slope": slope, "lemma/pg_corr": pg_corr,
            "lemma/pg_slope": pg_slope, "lemma/delta_mean": float(sums[2]) / n,
            "lemma/prediction_mean": float(sums[1]) / n, "lemma/tokens": float(sums[0])}
