"""Turn a per-token loss matrix into the loss of one micro-batch.

The denominator (``normalizer``) belongs to the whole optimizer step: valid tokens (token-mean)
or non-empty sequences (seq-mean-*) summed over every micro-batch and data-parallel rank, and for
``seq-mean-token-sum-norm`` that count of sequences times a constant L. Each micro-batch's loss is
then its share of the step's mean, the schedule must not divide by the number of micro-batches
and DDP must sum, not average (trainer/model_setup.py) — so the gradient does not depend on how
the step's tokens are split.

The modes, per optimizer step with l_it the loss of valid token t of sequence i, |y_i| its valid
tokens and N the step's non-empty sequences:
- token-mean: sum_i sum_t l_it / sum_i |y_i|;
- seq-mean-token-mean: sum_i (sum_t l_it / |y_i|) / N;
- seq-mean-token-sum: sum_i sum_t l_it / N;
- seq-mean-token-sum-norm: sum_i sum_t l_it / (N L), L a constant (``loss_scale_factor``; the
  trainer's default is ``rollout.max_new_tokens``, the longest response). Dr. GRPO's fixed
  normaliser (Liu et al., "Understanding R1-Zero-Like Training", arXiv 2503.20783), as verl's
  ``agg_loss`` defines the mode (verl/trainer/ppo/core_algos.py: the seq-mean-token-sum loss
  divided by ``loss_scale_factor``, by default the padded response length, i.e. the maximum
  response length): a response's weight no longer depends on its own length or on the step's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.algorithms.settings import AGG_MODES


def check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(AGG_MODES)}")


def local_count(mask: Tensor, mode: str) -> int:
    """This micro-batch's share of the step's count: valid tokens, or sequences with any."""
    check_mode(mode)
    valid = mask.bool()
    return int(valid.sum()) if mode == "token-mean" else int(valid.any(dim=-1).sum())


def step_normalizer(masks: Sequence[Tensor], mode: str,
                    group: Optional[dist.ProcessGroup] = None,
                    loss_scale_factor: Optional[float] = None) -> float:
    """The aggregation denominator of one optimizer step: this rank's micro-batch masks counted,
    summed over the data-parallel ``group``, times ``loss_scale_factor`` (the constant L) for
    seq-mean-token-sum-norm, which needs it; the other modes ignore it. Call it once per step on
    every DP rank."""
    count = sum_over_group(float(sum(local_count(m, mode) for m in masks)), group)
    if mode != "seq-mean-token-sum-norm":
        return count
    if loss_scale_factor is None or not loss_scale_factor > 0:
        raise ValueError(f"loss_agg_mode seq-mean-token-sum-norm divides by the step's sequences "
                         f"times a constant loss_scale_factor > 0; got {loss_scale_factor}")
    return count * float(loss_scale_factor)


def sum_over_group(value: float, group: Optional[dist.ProcessGroup] = None) -> float:
    """``value`` summed over the ``group`` (float64, one all-reduce; itself without a group)."""
    total = torch.tensor([value], dtype=torch.float64)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        if dist.get_backend(group) == "nccl":
            total = total.cuda()
        dist.all_reduce(total, group=group)
    return float(total.item())


def aggregate(loss_mat: Tensor, mask: Tensor, mode: str, normalizer: float | Tensor) -> Tensor:
    """This micro-batch's part of the step loss. Masked positions never contribute (not even
    NaN), and an all-masked micro-batch gives an exact 0 that is still part of the graph. The
    seq-mean-token-sum(-norm) modes differ only in ``normalizer`` (``step_normalizer``)."""
    check_mode(mode)
    valid = mask.bool()
    masked = torch.where(valid, loss_mat, 0)
    if mode == "token-mean":
        return masked.sum() / normalizer
    per_seq = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / valid.sum(dim=-1).clamp(min=1)
    return per_seq.sum() / normalizer
