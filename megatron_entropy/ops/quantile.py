"""Order statistics of a per-token score (entropy) over a population of valid tokens.

Populations: one response (a row), one micro-batch ([B, S]), or the whole optimizer step over
the data-parallel group (lists of this rank's [B_i, S_i] micro-batches; the ``global_*``
functions). A global result equals the one-process function on the concatenation of every
rank's micro-batches in the order (DP rank, micro-batch, row, column), exactly: values are
compared in float64 (exact for fp32/bf16/fp64 inputs) and every rank computes from all-gathered
numbers, so ranks holding the same tokens (TP peers) agree bit for bit.

Two kinds of rule sit on them:
- a top fraction: exactly k = ``top_fraction_count(N, rho)`` tokens, ties to the first in the
  order above (``covariance.top_k_mask`` / ``covariance.global_top_k``);
- "above the q-quantile": tokens strictly above the order statistic x_(i), i = floor(q (n - 1))
  counted from 0 in ascending order. That is ``value > torch.quantile(values, q)`` (linear
  interpolation lies in [x_(i), x_(i+1)), and no value lies strictly between the two), except
  where the interpolation rounds up onto x_(i+1). A threshold needs no tie rule: all tokens equal
  to x_(i) are below it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from megatron_entropy.ops import covariance as cov_ops


def top_fraction_count(num_valid: int, fraction: float) -> int:
    """k = max(1, int(N * fraction + 0.9999)), as the 80/20 paper's code: a ceiling whose 1e-4
    slack keeps float rounding (15 * 0.2 = 3.0000000000000004) from adding a token; 0 for N = 0."""
    return 0 if num_valid == 0 else max(1, int(num_valid * fraction + 0.9999))


def quantile_kth_largest(num_valid: int, q: float) -> int:
    """k such that x_(floor(q (n - 1))) (ascending, from 0) is the k-th largest:
    n - floor(q (n - 1))."""
    return num_valid - math.floor(q * (num_valid - 1))


def row_quantiles(values: Tensor, mask: Tensor, q: float) -> Tensor:
    """[B]: x_(floor(q (n_r - 1))) of each row's valid values (+inf for a row with none)."""
    valid = mask.bool()
    ascending = torch.sort(torch.where(valid, values.detach(), math.inf), dim=-1).values
    n = valid.sum(dim=-1)
    index = torch.floor(q * (n - 1).double()).long().clamp(min=0)
    return ascending.gather(-1, index[:, None]).squeeze(-1)


def micro_batch_quantile(values: Tensor, mask: Tensor, q: float) -> Optional[Tensor]:
    """x_(floor(q (n - 1))) over the micro-batch's valid values; None when it has none."""
    valid = mask.bool()
    n = int(valid.sum())
    if n == 0:
        return None
    return cov_ops.kth_largest(values.detach()[valid], quantile_kth_largest(n, q))


def global_quantile(values: Sequence[Tensor], masks: Sequence[Tensor], q: float,
                    group: Optional[dist.ProcessGroup]) -> tuple[Tensor, int]:
    """(x_(floor(q (n - 1))) over every rank's valid values as a float64 scalar, n).

    Two all-gathers: the valid count, then each rank's own top k values (k = n - floor(q (n-1))).
    """
    n = cov_ops.global_valid_count(masks, group)
    if n == 0:
        raise ValueError("the optimizer step has no valid (mask = 1) token on any data-parallel "
                         "rank: no entropy quantile")
    device = masks[0].device if masks else torch.device("cpu")
    flat = cov_ops.flat_valid(values, masks).to(device)
    return cov_ops.global_kth_largest(flat, quantile_kth_largest(n, q), group), n
