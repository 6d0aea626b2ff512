"""Turn a per-token loss matrix into the loss of one micro-batch.

The denominator (``normalizer``) belongs to the whole optimizer step: valid tokens (token-mean)
or non-empty sequences (seq-mean-*) summed over every micro-batch and data-parallel rank. Each
micro-batch's loss is then its share of the step's mean, the schedule must not divide by the
number of micro-batches and DDP must sum, not average (trainer/model_setup.py) — so the gradient
does not depend on how the step's tokens are split.
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
    """This micro-batch's share of the normalizer: valid tokens, or sequences with any."""
    check_mode(mode)
    valid = mask.bool()
    return int(valid.sum()) if mode == "token-mean" else int(valid.any(dim=-1).sum())


def step_normalizer(masks: Sequence[Tensor], mode: str,
                    group: Optional[dist.ProcessGroup] = None) -> float:
    """The aggregation denominator of one optimizer step: this rank's micro-batch masks summed,
    then summed over the data-parallel ``group``. Call it once per step on every DP rank."""
    return sum_over_group(float(sum(local_count(m, mode) for m in masks)), group)


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
    NaN), and an all-masked micro-batch gives an exact 0 that is still part of the graph."""
    check_mode(mode)
    valid = mask.bool()
    masked = torch.where(valid, loss_mat, 0)
    if mode == "token-mean":
        return masked.sum() / normalizer
    per_seq = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / valid.sum(dim=-1).clamp(min=1)
    return per_seq.sum() / normalizer
