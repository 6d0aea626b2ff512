"""Per-token regularisers the paper compares Clip-Cov/KL-Cov against."""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_entropy.algorithms.settings import KL_TYPES


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs.

    k1: logp - ref;  abs: |logp - ref|;  k3 ("low_var_kl", Schulman): exp(ref - logp) - (ref -
    logp) - 1, with the log-ratio clamped to [-20, 20] and the result to [-10, 10] as verl does.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "abs":
        return (logp - ref_logp).abs()
    if kind == "k3":
        log_ratio = (ref_logp - logp).clamp(-20, 20)
        return (torch.exp(log_ratio) - log_ratio - 1).clamp(-10, 10)
    raise ValueError(f"unknown kl_type {kind!r}; choose one of {', '.join(KL_TYPES)}")
