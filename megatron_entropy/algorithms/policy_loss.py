"""Policy losses by name — ``ppo_clip`` (GRPO), ``clip_cov``, ``kl_cov`` here, and the family
of algorithms/loss_family.py (gspo, gmpo, cispo, sapo, ce_gppo, dppo_tv, dppo_kl, gpg) — with the
entropy bonus and KL-to-reference regularisers, on one micro-batch of [B, S] tensors.

Per valid token (ratio = exp(logp - old_logp), L1 = -A ratio, L2 = -A clamp(ratio, 1 - eps_low,
1 + eps_high)):
- ppo_clip: max(L1, L2) (log-ratio clamped to +-20 as verl); with ``dual_clip_c`` = c, tokens with
  A < 0 take min(max(L1, L2), -A c).
- clip_cov: max(L1, L2), times 0 for the drawn tokens (no gradient; they stay in the denominator).
  Candidates: valid, not (L2 > L1), clip_cov_lb < Cov < clip_cov_ub; n = min(max(int(r N), 1),
  n_candidates) drawn uniformly.
- kl_cov: L1 (no clipping), plus kl_cov_coef |logp - old_logp| on the top k = max(1, int(N r))
  tokens by Cov.
Cov_i = (A_i - mean A)(logp_i - mean logp) over the scope's valid tokens, logp detached.
``cov_modifier`` runs Clip-Cov's detach or KL-Cov's penalty on top of a token-level loss of the
family (or ppo_clip): the same selection, Clip-Cov's candidates leaving out the tokens the loss
already passes no gradient (``loss_family.frozen_tokens``).

Scopes (``selection``):
- None (``micro_batch``): the micro-batch is the population and its own ``logp.detach()`` selects,
  exactly as the paper's code and verl 0.9 ``compute_policy_loss_clip_cov``/``_kl_cov``.
- a ``TokenSelection`` from ``select_tokens_global`` (``global``): the population is the whole
  optimizer step over the DP group. Which log-probs select is the caller's choice
  (``global_selection_logprobs``): ``recompute`` passes the old-logprob recompute (free; equal to
  the training forward's log-probs on the first update of an on-policy step, when the weights
  have not moved yet — later mini-batches/epochs select with the old policy's log-probs);
  ``fresh`` passes a forward-only pass of the current weights before each optimizer step (exact
  for every update: all micro-batches of one step see the same weights; costs one extra forward).

Per-token adjustments (``adjust=TokenAdjustments(...)``), computed by ``algorithms.token_rules``
and ``algorithms.rollout_correction``: a detached weight on each token's policy-gradient term
(truncated IS), a mask and normalizer of its own for the policy-gradient term (the 80/20 rule),
per-token clip ranges (ppo_clip only: entropy-dependent clipping) and a per-token coefficient of
the KL-to-reference term. Shaped advantages need no hook: pass them as ``advantages``.

Metrics are reducible: name -> float64 tensor [sum, count] (a mean), or, for names ending in
``_max``, [max]. ``reduce_metrics`` sums/maxes them over micro-batches and DP ranks.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, fields
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.algorithms.aggregation import aggregate
from megatron_entropy.algorithms.loss_family import FAMILY_LOSSES, frozen_tokens
from megatron_entropy.algorithms.loss_family import LossBatch as _Batch
from megatron_entropy.algorithms.loss_family import ppo_surrogates as _ppo_surrogates
from megatron_entropy.algorithms.metrics import max_metric as _max
from megatron_entropy.algorithms.metrics import mean_metric as _mean
from megatron_entropy.algorithms.regularizers import kl_penalty
from megatron_entropy.algorithms.settings import LossName, PolicyLossSettings
from megatron_entropy.ops import covariance as cov_ops


@dataclass
class TokenSelection:
    """A precomputed (``global`` scope) choice of tokens for one micro-batch."""

    selected: Tensor  # bool [B, S]: Clip-Cov's detached tokens / KL-Cov's penalised tokens
    cov: Tensor       # [B, S] Cov_i over the step's population (0 where masked)


@dataclass
class TokenAdjustments:
    """Per-token changes to one micro-batch's loss; None leaves that part as it is. [B, S].

    weight: detached factor on each token's policy-gradient term, after clipping and Cov.
    pg_mask, pg_normalizer: the policy-gradient term counts only where ``pg_mask`` is set and is
        divided by ``pg_normalizer`` (the step's count over the pg masks; None: the loss's
        ``normalizer``); the regularisers keep ``mask`` and ``normalizer``.
    clip_low, clip_high: per-token eps_low / eps_high in place of the settings' (ppo_clip only).
    kl_coef: per-token coefficient of the KL-to-reference term in place of ``settings.kl_coef``.
    detach: bool; the policy-gradient term of these tokens keeps its value but passes no
        gradient (entropy ratio clipping).
    entropy_coef: per-token coefficient of the entropy bonus in place of ``settings.entropy_coef``
        (the adaptive coefficients).
    """

    weight: Optional[Tensor] = None
    pg_mask: Optional[Tensor] = None
    pg_normalizer: Optional[float] = None
    clip_low: Optional[Tensor] = None
    clip_high: Optional[Tensor] = None
    kl_coef: Optional[Tensor] = None
    detach: Optional[Tensor] = None
    entropy_coef: Optional[Tensor] = None

    def merged(self, other: "TokenAdjustments") -> "TokenAdjustments":
        """Both adjustments at once: weights multiply; any other part may come from one only."""
        out = {}
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine is not None and theirs is not None:
                if f.name != "weight":
                    raise ValueError(f"two token adjustments both set {f.name}")
                out[f.name] = mine * theirs
            else:
                out[f.name] = theirs if mine is None else mine
        return TokenAdjustments(**out)


# ------------------------------------------------------------------------------ metrics


def reduce_metrics(metrics: Sequence[dict[str, Tensor]],
                   group: Optional[dist.ProcessGroup] = None) -> dict[str, float]:
    """Combine per-micro-batch metrics over the list and the data-parallel ``group``.

    Every rank of the group must call it (a rank with no micro-batch passes []). Means with no
    element and maxima of nothing come out as NaN.
    """
    names: set[str] = set()
    for m in metrics:
        names.update(m)
    distributed = group is not None and dist.is_initialized() and dist.get_world_size(group) > 1
    if distributed:  # a rank may lack a metric (no micro-batch): agree on the names first
        gathered: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, sorted(names), group=group)
        names = set().union(*map(set, gathered))
    mean_names = sorted(n for n in names if not n.endswith("_max"))
    max_names = sorted(n for n in names if n.endswith("_max"))
    sums = torch.zeros(len(mean_names), 2, dtype=torch.float64)
    maxes = torch.full((len(max_names),), -float("inf"), dtype=torch.float64)
    for m in metrics:
        for i, n in enumerate(mean_names):
            if n in m:
                sums[i] += m[n].detach().cpu()
        for i, n in enumerate(max_names):
            if n in m:
                maxes[i] = torch.maximum(maxes[i], m[n].detach().cpu().reshape(()))
    if distributed:
        device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
        sums, maxes = sums.to(device), maxes.to(device)
        dist.all_reduce(sums, group=group)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group)
        sums, maxes = sums.cpu(), maxes.cpu()
    out = {n: float(s / c) if c > 0 else float("nan") for n, (s, c) in zip(mean_names, sums)}
    out.update({n: float(v) if torch.isfinite(v) else float("nan")
                for n, v in zip(max_names, maxes)})
    return out


# ------------------------------------------------------------------------------ the losses


def _ppo_clip(s: PolicyLossSettings, b: _Batch, selection: TokenSelection, metrics: dict
              ) -> Tensor:
    l1, l2, _ = _ppo_surrogates(s, b, torch.clamp(b.logp - b.old_logp, -20.0, 20.0))
    loss = torch.maximum(l1, l2)
    metrics["pg_clipfrac"] = _mean((l2 > l1).double(), b.valid)
    if s.dual_clip_c is not None:
        l3 = -b.advantages * s.dual_clip_c
        negative = b.advantages < 0
        metrics["pg_clipfrac_lower"] = _mean(((loss > l3) & negative).double(), b.valid)
        loss = torch.where(negative, torch.minimum(l3, loss), loss)
    return loss


def _clip_cov(s: PolicyLossSettings, b: _Batch, selection: TokenSelection, metrics: dict
              ) -> Tensor:
    l1, l2, _ = _ppo_surrogates(s, b, b.logp - b.old_logp)
    metrics["pg_clipfrac"] = _mean(((l2 > l1) & b.valid).double(), b.valid)
    # Drawn tokens keep their place in the denominator but pass no gradient.
    return torch.maximum(l1, l2) * (~selection.selected).to(l1.dtype)


def _kl_cov(s: PolicyLossSettings, b: _Batch, selection: TokenSelection, metrics: dict
            ) -> Tensor:
    l1, _, _ = _ppo_surrogates(s, b, b.logp - b.old_logp)
    return _kl_cov_penalty(s, b, selection, l1)


def _kl_cov_penalty(s: PolicyLossSettings, b: _Batch, selection: TokenSelection, loss: Tensor
                    ) -> Tensor:
    """KL-Cov: + kl_cov_coef |logp - old_logp| on the selected tokens."""
    return torch.where(selection.selected, loss + s.kl_cov_coef * (b.logp - b.old_logp).abs(),
                       loss)


def _cov_candidates_excluded(settings: PolicyLossSettings, b: _Batch) -> Tensor:
    """The tokens Clip-Cov never draws: those the loss already passes no gradient."""
    if settings.loss == "clip_cov":
        l1, l2, _ = _ppo_surrogates(settings, b, b.logp - b.old_logp)
        return (l2 > l1) & b.valid
    return frozen_tokens(settings, b)


def select_tokens_micro_batch(settings: PolicyLossSettings, logp: Tensor, old_logp: Tensor,
                              advantages: Tensor, mask: Tensor,
                              generator: Optional[torch.Generator] = None) -> TokenSelection:
    """The ``micro_batch`` scope: Cov and the chosen tokens inside this [B, S] micro-batch, from
    ``logp.detach()`` (the paper's code). A loss without a Cov rule (``cov_rule``) chooses
    nothing (Cov is kept for metrics)."""
    valid = mask.bool()
    logp, old_logp, advantages = logp.detach(), old_logp.detach(), advantages.detach()
    cov = cov_ops.token_covariance(logp, advantages, valid)
    num_valid = int(valid.sum())
    if settings.cov_rule == "clip_cov":
        b = _Batch(logp, old_logp, advantages, valid, num_valid)
        candidates = cov_ops.clip_cov_candidates(cov, valid,
                                                 _cov_candidates_excluded(settings, b),
                                                 settings.clip_cov_lb, settings.clip_cov_ub)
        n = cov_ops.clip_cov_count(settings.clip_cov_ratio, num_valid, int(candidates.sum()))
        selected = cov_ops.random_subset(candidates, n, generator)
    elif settings.cov_rule == "kl_cov":
        selected = cov_ops.top_k_mask(cov, valid,
                                      cov_ops.kl_cov_count(settings.kl_cov_ratio, num_valid))
    else:
        selected = torch.zeros_like(valid)
    return TokenSelection(selected, cov)


def _cov_metrics(metrics: dict, cov: Tensor, valid: Tensor, selected: Optional[Tensor]) -> None:
    metrics["cov_mean"] = _mean(cov, valid)
    metrics["cov_max"] = _max(cov, valid)
    if selected is not None:
        metrics["selected_frac"] = _mean(selected.double(), valid)
        metrics["cov_selected_mean"] = _mean(cov, selected & valid)
        metrics["cov_selected_max"] = _max(cov, selected & valid)


def _without_selection(fn: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """A loss of algorithms/loss_family.py (it takes no selection) under the registry's call."""
    return lambda s, b, selection, metrics: fn(s, b, metrics)


POLICY_LOSSES: dict[str, Callable[..., Tensor]] = {
    "ppo_clip": _ppo_clip,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    **{name: _without_selection(fn) for name, fn in FAMILY_LOSSES.items()},
}
assert tuple(POLICY_LOSSES) == typing.get_args(LossName)


def _check_inputs(settings: PolicyLossSettings, named: dict[str, Optional[Tensor]],
                  normalizer: float | Tensor, selection: Optional[TokenSelection],
                  adjust: TokenAdjustments) -> None:
    shape = named["logp"].shape
    if len(shape) != 2:
        raise ValueError(f"logp must be [B, S] (rows = sequences); got shape {tuple(shape)}")
    for name, t in named.items():
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)} but logp has {tuple(shape)}; "
                             "all per-token inputs must be [B, S]")
    if selection is not None and (selection.selected.shape != shape or
                                  selection.cov.shape != shape):
        raise ValueError(f"selection is for shape {tuple(selection.selected.shape)}, this "
                         f"micro-batch is {tuple(shape)}")
    if settings.entropy_coef > 0 and named["entropy"] is None:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    if settings.kl_coef > 0 and named["ref_logp"] is None:
        raise ValueError("kl_coef > 0 needs the reference log-probs (ref_logp)")
    if not float(normalizer) > 0:
        raise ValueError(f"normalizer must be > 0 (valid tokens or sequences of the whole "
                         f"optimizer step); got {float(normalizer)}: the step has nothing to train")
    if (adjust.clip_low is not None or adjust.clip_high is not None) and \
            settings.loss != "ppo_clip":
        raise ValueError(f"per-token clip ranges apply to ppo_clip only, not {settings.loss}")
    if adjust.kl_coef is not None and named["ref_logp"] is None:
        raise ValueError("a per-token kl_coef needs the reference log-probs (ref_logp)")
    if adjust.entropy_coef is not None and named["entropy"] is None:
        raise ValueError("a per-token entropy_coef needs the per-token entropy")
    if adjust.pg_normalizer is not None and not adjust.pg_normalizer > 0:
        raise ValueError(f"pg_normalizer must be > 0; got {adjust.pg_normalizer}")


def _check_values(named: dict[str, Optional[Tensor]], mask: Tensor) -> None:
    """One host sync for every value problem: a non-0/1 mask or NaN/inf at a valid token."""
    valid = mask.bool()
    flags = [((mask != 0) & (mask != 1)).any()]
    names = [n for n, t in named.items() if t is not None]
    flags += [(~torch.isfinite(named[n].detach()) & valid).any() for n in names]
    bad = torch.stack(flags).tolist()
    if bad[0]:
        raise ValueError("mask must hold only 0 and 1")
    wrong = [n for n, b in zip(names, bad[1:]) if b]
    if wrong:
        raise ValueError(f"{', '.join(wrong)} contain NaN or inf at valid (mask = 1) tokens")


def policy_loss(settings: PolicyLossSettings, logp: Tensor, old_logp: Tensor, advantages: Tensor,
                mask: Tensor, *, normalizer: float | Tensor, entropy: Optional[Tensor] = None,
                ref_logp: Optional[Tensor] = None, selection: Optional[TokenSelection] = None,
                generator: Optional[torch.Generator] = None,
                adjust: Optional[TokenAdjustments] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """This micro-batch's loss (already divided by the step's ``normalizer``) and its metrics.

    logp (with grad), old_logp, advantages (broadcast over each row's tokens), mask (float 0/1),
    entropy, ref_logp: [B, S]. ``selection`` (global scope) comes from ``select_tokens_global``;
    None selects inside this micro-batch. ``generator`` drives Clip-Cov's draw (None: torch's
    global RNG, as the paper's code); every TP rank must pass an identically seeded one. All
    cross-rank work is in the normalizer and in ``select_tokens_global``.
    ``adjust`` carries the token rules' and the rollout correction's per-token changes.

    An all-masked micro-batch gives a loss of exactly 0 that is still connected to ``logp`` (and
    ``entropy``), so backward runs and every rank joins the gradient collectives.
    """
    adjust = adjust or TokenAdjustments()
    named = {"logp": logp, "old_logp": old_logp, "advantages": advantages, "mask": mask,
             "entropy": entropy, "ref_logp": ref_logp}
    adjusted = {f"adjust.{f.name}": getattr(adjust, f.name) for f in fields(adjust)
                if f.name != "pg_normalizer"}
    _check_inputs(settings, {**named, **adjusted}, normalizer, selection, adjust)
    _check_values({k: v for k, v in {**named, **adjusted}.items()
                   if k not in ("mask", "adjust.pg_mask", "adjust.detach")}, mask)

    valid = mask.bool()
    # Whatever sits at masked positions (padding, NaN) must not reach values or gradients.
    logp, old_logp, advantages = (torch.where(valid, t, 0) for t in (logp, old_logp, advantages))
    entropy = None if entropy is None else torch.where(valid, entropy, 0)
    ref_logp = None if ref_logp is None else torch.where(valid, ref_logp, 0)
    batch = _Batch(logp, old_logp.detach(), advantages.detach(), valid, int(valid.sum()),
                   adjust.clip_low, adjust.clip_high)
    metrics: dict[str, Tensor] = {}
    if selection is None:
        selection = select_tokens_micro_batch(settings, logp, old_logp, advantages, mask,
                                              generator)
    pg = POLICY_LOSSES[settings.loss](settings, batch, selection, metrics)
    if settings.cov_modifier == "clip_cov":  # drawn tokens: no gradient, still counted
        pg = pg * (~selection.selected).to(pg.dtype)
    elif settings.cov_modifier == "kl_cov":
        pg = _kl_cov_penalty(settings, batch, selection, pg)
    _cov_metrics(metrics, selection.cov, valid,
                 None if settings.cov_rule is None else selection.selected)
    if adjust.weight is not None:
        pg = pg * adjust.weight.detach().to(pg.dtype)
    if adjust.detach is not None:
        pg = torch.where(adjust.detach.bool(), pg.detach(), pg)
    pg_valid = valid if adjust.pg_mask is None else valid & adjust.pg_mask.bool()
    mode = settings.loss_agg_mode
    loss = aggregate(pg, pg_valid, mode,
                     normalizer if adjust.pg_normalizer is None else adjust.pg_normalizer)
    metrics["pg_loss"] = _mean(pg, pg_valid)
    metrics["ppo_kl"] = _mean(batch.old_logp - logp, valid)
    metrics["ppo_kl_abs"] = _mean((logp - batch.old_logp).abs(), valid)
    if entropy is not None:
        metrics["entropy"] = _mean(entropy, valid)
        rows = valid.any(dim=-1)
        per_seq = torch.where(valid, entropy.detach().double(), 0).sum(-1) / \
            valid.sum(-1).clamp(min=1)
        metrics["entropy_seq_mean"] = torch.stack([per_seq[rows].sum(), rows.sum().double()])
        if adjust.entropy_coef is not None:
            coef = torch.where(valid, adjust.entropy_coef.detach(), 0).to(entropy.dtype)
            loss = loss - aggregate(coef * entropy, mask, mode, normalizer)
        elif settings.entropy_coef > 0:
            loss = loss - settings.entropy_coef * aggregate(entropy, mask, mode, normalizer)
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp.detach(), settings.kl_type)
        metrics["kl_ref"] = _mean(kl, valid)
        if adjust.kl_coef is not None:
            coef = torch.where(valid, adjust.kl_coef.detach(), 0).to(kl.dtype)
            loss = loss + aggregate(coef * kl, mask, mode, normalizer)
        elif settings.kl_coef > 0:
            loss = loss + settings.kl_coef * aggregate(kl, mask, mode, normalizer)
    return loss, metrics


# ------------------------------------------------------------------------------ global scope


def select_tokens_global(settings: PolicyLossSettings, select_logps: Sequence[Tensor],
                         old_logps: Sequence[Tensor], advantages: Sequence[Tensor],
                         masks: Sequence[Tensor], *, dp_group: Optional[dist.ProcessGroup],
                         seed: int, row_keys: Optional[Sequence[Tensor]] = None
                         ) -> list[TokenSelection]:
    """Clip-Cov/KL-Cov selections for the ``global`` scope, one per micro-batch of this rank.

    Call once per optimizer step on every DP rank with that rank's micro-batches ([B_i, S_i]
    tensors, in the order the loss will see them). ``select_logps`` are the log-probs that choose
    (see the module docstring: recompute or fresh). The result equals the micro-batch-scope rule
    applied by one process to the concatenation of all ranks' micro-batches (rank, micro-batch,
    row, column order; with ``row_keys``, an integer per row giving its place in the step, rows
    in key order, whatever rank and micro-batch hold them), with Clip-Cov's draw taken from
    ``torch.Generator().manual_seed(seed)``.
    Collectives: 2 all-gathers (Clip-Cov) or 3 (KL-Cov), tiny.
    """
    if not (len(select_logps) == len(old_logps) == len(advantages) == len(masks)):
        raise ValueError("select_logps, old_logps, advantages and masks must list the same "
                         "micro-batches")
    for i, (lp, old, adv, m) in enumerate(zip(select_logps, old_logps, advantages, masks)):
        if not lp.shape == old.shape == adv.shape == m.shape:
            raise ValueError(f"micro-batch {i}: select_logps {tuple(lp.shape)}, old_logps "
                             f"{tuple(old.shape)}, advantages {tuple(adv.shape)} and masks "
                             f"{tuple(m.shape)} must have one [B, S] shape")
    mean_lp, mean_adv, num_valid = cov_ops.global_population_means(select_logps, advantages,
                                                                   masks, dp_group)
    covs = [cov_ops.token_covariance(lp, adv, m, mean_lp, mean_adv)
            for lp, adv, m in zip(select_logps, advantages, masks)]
    if settings.cov_rule == "clip_cov":
        candidates = []
        for lp, old, adv, m, cov in zip(select_logps, old_logps, advantages, masks, covs):
            b = _Batch(lp.detach(), old.detach(), adv.detach(), m.bool(), 0)
            candidates.append(cov_ops.clip_cov_candidates(
                cov, m, _cov_candidates_excluded(settings, b), settings.clip_cov_lb,
                settings.clip_cov_ub))
        generator = torch.Generator().manual_seed(seed)
        selected = cov_ops.global_random_subset(candidates, settings.clip_cov_ratio, num_valid,
                                                generator, dp_group, row_keys)
    elif settings.cov_rule == "kl_cov":
        k = cov_ops.kl_cov_count(settings.kl_cov_ratio, num_valid)
        selected = cov_ops.global_top_k(covs, masks, k, dp_group)
    else:  # no Cov rule selects nothing; the global Cov still feeds its metrics
        selected = [torch.zeros_like(m, dtype=torch.bool) for m in masks]
    return [TokenSelection(sel, cov) for sel, cov in zip(selected, covs)]
