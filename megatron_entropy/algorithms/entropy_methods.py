"""The entropy methods of one run, through the optimizer steps: the state that outlives a step
(EntroPIC's integral, the adaptive coefficients, SIREN's anchor) and what each optimizer step
decides before its training forwards (``StepPlan``).

The methods themselves are in loss_weighting.py (EntroPIC, positive-advantage reweighting),
entropy_regularizers.py (SIREN, Skywork-OR1's adaptive coefficient, AER), lp_reg.py and
clipping.py (Entropy Ratio Clipping; the clip schedules act through the loss knobs). Their
populations are the optimizer step's valid tokens over the DP group, so no result depends on
how the step is split into micro-batches or ranks:

- ``EntropyMethods.step_inputs`` runs on EVERY rank (every PP stage and TP rank of a replica
  holds the same samples and their recompute statistics): the controllers measure the step's
  token-mean entropy of the policy that sampled (the recompute's, reduced over DP) and every
  rank moves them the same way, so their state is the same everywhere (rank 0 checkpoints it);
- ``StepPlan`` is built on the last PP stage (where the loss runs) from the log-probs, entropies
  and vocab statistics that select (``global_selection_logprobs``: the recompute's or a fresh
  forward-only pass, both per micro-batch [B_i, S_i]), and gives each micro-batch its
  ``TokenAdjustments`` and its extra loss terms.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.algorithms import entropy_regularizers as reg
from megatron_entropy.algorithms import loss_weighting as weighting
from megatron_entropy.algorithms.aggregation import step_normalizer
from megatron_entropy.algorithms.clipping import entropy_ratio_outside
from megatron_entropy.algorithms.lp_reg import lp_reg_term, select_lp_reg
from megatron_entropy.algorithms.metrics import mean_metric
from megatron_entropy.algorithms.policy_loss import TokenAdjustments

STATE_VERSION = 1
TOP_P_ENTROPY = "top_p_entropy"  # SIREN: the nucleus entropy of each response token
PROXY_SHIFT = "proxy_shift"      # Lp-Reg: log pi_proxy - log pi of each response token


class EntropyMethods:
    """The enabled methods of ``algorithm`` (the algorithm section: PolicyLossSettings with the
    sections of method_settings.py) and their run state."""

    def __init__(self, algorithm: Any) -> None:
        a = algorithm
        self.algorithm = a
        self.entropic = weighting.EntroPICController(a.entropic) if a.entropic.enabled else None
        self.adaptive = reg.AdaptiveEntropyCoef(a.adaptive_entropy) \
            if a.adaptive_entropy.enabled else None
        self.aer = reg.AERCoef(a.aer) if a.aer.enabled else None
        self.siren_anchor: Optional[float] = None
        self._step_metrics: list[dict[str, float]] = []

    # -------------------------------------------------------------------- what they need

    @property
    def controllers(self) -> bool:
        return any(c is not None for c in (self.entropic, self.adaptive, self.aer))

    @property
    def active(self) -> bool:
        """Whether any method acts inside the update."""
        a = self.algorithm
        return self.controllers or a.siren.enabled or a.lp_reg.enabled or \
            a.entropy_ratio_clip.enabled or a.positive_reweight.enabled

    @property
    def selects(self) -> bool:
        """Whether a population of the step chooses before the training forwards."""
        a = self.algorithm
        return a.entropic.enabled or a.siren.enabled or a.lp_reg.enabled

    def token_stat_names(self) -> tuple[str, ...]:
        """Vocab statistics the forward-only passes compute per response token."""
        a = self.algorithm
        return tuple(n for n, on in ((TOP_P_ENTROPY, a.siren.enabled),
                                     (PROXY_SHIFT, a.lp_reg.enabled)) if on)

    # -------------------------------------------------------------------- per RL step

    def begin_step(self, top_p_entropies: Sequence[Tensor],
                   group: Optional[dist.ProcessGroup]) -> None:
        """SIREN's anchor, once: the masked top-p entropy of the run's first step (every sample
        of it on every DP rank, the recompute's; a [T_i] tensor per sample)."""
        if not self.algorithm.siren.enabled or self.siren_anchor is not None:
            return
        rows = [h.reshape(1, -1) for h in top_p_entropies]
        masks = [torch.ones_like(r, dtype=torch.bool) for r in rows]
        peaks = [reg.peak_mask(r, m, self.algorithm.siren.peak_quantile)
                 for r, m in zip(rows, masks)]
        self.siren_anchor, _ = reg.masked_sequence_mean(rows, peaks, group)

    def step_inputs(self, entropies: Sequence[Tensor], masks: Sequence[Tensor],
                    group: Optional[dist.ProcessGroup]) -> dict[str, float]:
        """Move the controllers with one optimizer step's measured entropy (every rank; the
        recompute's [B_i, S_i] entropies of this rank's micro-batches). Returns the step's
        coefficients: entropic alpha, the adaptive and AER bonus coefficients."""
        out: dict[str, float] = {}
        if not self.controllers:
            return out
        entropy = reg.step_token_mean(entropies, masks, group)
        metrics: dict[str, float] = {}
        for name, controller in (("entropic", self.entropic), ("adaptive", self.adaptive),
                                 ("aer", self.aer)):
            if controller is not None:
                out[name] = controller.step(entropy)
                metrics.update(controller.last)
        self._step_metrics.append(metrics)
        return out

    def metrics(self) -> dict[str, float]:
        """The controllers' values averaged over the optimizer steps since the last call, and
        SIREN's anchor (the same on every rank)."""
        out: dict[str, float] = {}
        for name in sorted({k for m in self._step_metrics for k in m}):
            values = [m[name] for m in self._step_metrics if name in m]
            out[name] = sum(values) / len(values)
        self._step_metrics = []
        if self.siren_anchor is not None:
            out["siren/anchor"] = self.siren_anchor
        return out

    # -------------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "siren_anchor": self.siren_anchor,
                **{name: c.state_dict() for name, c in (("entropic", self.entropic),
                                                        ("adaptive", self.adaptive),
                                                        ("aer", self.aer)) if c is not None}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"entropy methods state version {state.get('version')}, this code "
                             f"reads {STATE_VERSION}")
        self.siren_anchor = state["siren_anchor"]
        for name, c in (("entropic", self.entropic), ("adaptive", self.adaptive),
                        ("aer", self.aer)):
            if c is not None:
                if name not in state:
                    raise ValueError(f"the checkpoint was written without the {name} method's "
                                     "state")
                c.load_state_dict(state[name])


class StepPlan:
    """What one optimizer step decides before its training forwards, on the last PP stage.

    masks, advantages: this rank's micro-batches [B_i, S_i]; select_logps / select_entropies /
    select_stats: the selecting pass's log-probs, entropies and vocab statistics (by name) of the
    same micro-batches; row_weights: [B_i] AER's difficulty weight of each row (None: AER off);
    coefficients: ``EntropyMethods.step_inputs``'s.
    """

    def __init__(self, methods: EntropyMethods, masks: Sequence[Tensor],
                 advantages: Sequence[Tensor], select_logps: Optional[Sequence[Tensor]],
                 select_stats: dict[str, Sequence[Tensor]], row_weights: Optional[list],
                 coefficients: dict[str, float], group: Optional[dist.ProcessGroup]) -> None:
        a = methods.algorithm
        self.a, self.methods, self.coefficients = a, methods, coefficients
        self.row_weights = row_weights
        mode, scale = a.loss_agg_mode, a.loss_scale_factor
        self.high: Optional[list[Tensor]] = None
        self.high_normalizer: Optional[float] = None
        if a.entropic.enabled:
            self.high = [weighting.high_prob_tokens(a.entropic, lp, m)
                         for lp, m in zip(select_logps, masks)]
            count = step_normalizer(self.high, mode, group, scale)  # every rank calls it
            self.high_normalizer = count if count > 0 else None
        self.peaks: Optional[list[Tensor]] = None
        if a.siren.enabled:
            self.peaks = [reg.peak_mask(h, m, a.siren.peak_quantile)
                          for h, m in zip(select_stats[TOP_P_ENTROPY], masks)]
            self.h_bar, self.peak_rows = reg.masked_sequence_mean(
                select_stats[TOP_P_ENTROPY], self.peaks, group)
        self.lp_selected: Optional[list[Tensor]] = None
        if a.lp_reg.enabled:
            self.lp_selected = select_lp_reg(a.lp_reg, select_logps, select_stats[PROXY_SHIFT],
                                             advantages, masks, group)

    def adjustments(self, index: int, advantages: Tensor, mask: Tensor, entropy: Tensor,
                    old_entropy: Tensor) -> tuple[Optional[TokenAdjustments], dict]:
        """Micro-batch ``index``'s token adjustments (None: none) and metrics, from its training
        forward's entropy and the old policy's at the same tokens."""
        a, parts, metrics = self.a, {}, {}
        if a.positive_reweight.enabled:
            parts["weight"] = weighting.positive_weight(a.positive_reweight, advantages)
        if a.entropy_ratio_clip.enabled:
            outside = entropy_ratio_outside(a.entropy_ratio_clip, entropy, old_entropy, mask)
            parts["detach"] = outside
            metrics["erc/clipped_frac"] = mean_metric(outside.double(), mask)
        coef = self._entropy_coef(index, mask)
        if coef is not None:
            parts["entropy_coef"] = coef
        return (TokenAdjustments(**parts) if parts else None), metrics

    def _entropy_coef(self, index: int, mask: Tensor) -> Optional[Tensor]:
        if "adaptive" in self.coefficients:
            return torch.full_like(mask, self.coefficients["adaptive"], dtype=torch.float64)
        if "aer" in self.coefficients:
            w = torch.as_tensor(self.row_weights[index], dtype=torch.float64,
                                device=mask.device)
            return self.coefficients["aer"] * w[:, None].expand(mask.shape).clone()
        return None

    def extra_loss(self, index: int, logp: Tensor, old_logp: Tensor, advantages: Tensor,
                   mask: Tensor, normalizer: float, top_p_entropy: Optional[Tensor],
                   proxy_shift: Optional[Tensor]) -> tuple[Optional[Tensor], dict]:
        """The sum of micro-batch ``index``'s method terms (None: none), with its metrics.
        ``top_p_entropy`` is the training forward's (with gradient; SIREN), ``proxy_shift`` the
        recompute's log pi_proxy - log pi (Lp-Reg: the proxy is old_logp + it)."""
        a, total, metrics = self.a, None, {}
        mode = a.loss_agg_mode

        def add(term: Tensor) -> None:
            nonlocal total
            total = term if total is None else total + term

        if self.high is not None:
            term, m = weighting.entropic_term(self.coefficients["entropic"], logp, old_logp,
                                              advantages, self.high[index], mask, mode,
                                              self.high_normalizer)
            add(term)
            metrics.update(m)
        if self.peaks is not None:
            add(reg.siren_term(a.siren.coef, self.h_bar, self.methods.siren_anchor,
                               top_p_entropy, self.peaks[index], self.peak_rows))
            metrics["siren/masked_frac"] = mean_metric(self.peaks[index].double(), mask)
            metrics["siren/entropy"] = torch.tensor([self.h_bar, 1.0], dtype=torch.float64)
        if self.lp_selected is not None:
            term, m = lp_reg_term(a.lp_reg, logp, old_logp + proxy_shift,
                                  self.lp_selected[index], mask, mode, normalizer)
            add(term)
            metrics.update(m)
        return total, metrics
