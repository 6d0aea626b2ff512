"""Per-micro-batch metrics in a reducible form: a mean is float64 [sum, count], a maximum (a name
ending in ``_max``) is [max]; ``policy_loss.reduce_metrics`` combines them over micro-batches and
the data-parallel group."""

from __future__ import annotations

import torch
from torch import Tensor


def mean_metric(values: Tensor, where: Tensor) -> Tensor:
    """[sum, count] of ``values`` where ``where`` is set (NaN elsewhere is ignored)."""
    where = where.bool()
    return torch.stack([torch.where(where, values.detach().double(), 0).sum(),
                        where.sum().double()])


def max_metric(values: Tensor, where: Tensor) -> Tensor:
    """[max] of ``values`` where ``where`` is set; -inf (reported as NaN) over nothing."""
    masked = torch.where(where.bool(), values.detach().double(), -float("inf"))
    return masked.max().reshape(1) if masked.numel() else masked.new_full((1,), -float("inf"))
