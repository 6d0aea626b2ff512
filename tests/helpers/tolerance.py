"""Tolerances for results that equal a reference up to rounding, derived from the dtype and the
computation, never read off one machine.

Two computations of the same value that differ only in the order of their operations (another
TP/PP/DP split, another padding of the batch, another implementation of the same layer, another
CPU's kernels: AMD EPYC and Intel Xeon AVX-512/AMX GEMMs block their sums differently) agree to
within their rounding errors, not bit for bit. With eps = torch.finfo(dtype).eps (2**-23 in fp32)
and the unit roundoff u = eps / 2, n roundings (one sum of n terms, or a chain of reductions of n
terms along the path of one output) on values of magnitude |v| are off by at most

* n u |v|, deterministically (Higham, "Accuracy and Stability of Numerical Algorithms", ch. 3-4),
* LAMBDA sqrt(n) u |v|, except with probability below 2 n exp(-LAMBDA**2 / 2), when the rounding
  errors are independent and of mean zero (Higham & Mary, "A new approach to probabilistic
  rounding error analysis", SIAM J. Sci. Comput. 41(5), 2019). LAMBDA = 8: below 1e-9 for a
  path of 10**5 terms.

Two such results differ by at most twice that: ``rounding_tol`` takes the smaller of the two
bounds (the deterministic one for a few operations, the probabilistic one for long paths), with
|v| the largest |value| of the compared tensor (a normwise bound). The path of one output of a
transformer is counted by ``transformer_terms``. A real bug (a missing reduction, a wrong
normaliser, a misplaced shard) moves values by a fraction of their size, far above these bounds
as long as they are << 1 in relative terms.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

LAMBDA = 8.0


def eps(dtype: torch.dtype = torch.float32) -> float:
    return float(torch.finfo(dtype).eps)


def rounding_tol(values, terms: int, dtype: Optional[torch.dtype] = None) -> float:
    """Absolute tolerance between two results that went through ``terms`` roundings (summed terms
    along their path) each, on values as large as ``values`` (a tensor or a number): 2 x
    min(terms u, LAMBDA sqrt(terms) u) x max|values|. ``dtype`` defaults to that of ``values``
    (fp32 for Python numbers)."""
    t = torch.as_tensor(values)
    if dtype is None:
        dtype = t.dtype if t.is_floating_point() else torch.float32
    u = eps(dtype) / 2
    per_side = min(terms, LAMBDA * math.sqrt(terms)) * u
    return 2 * per_side * float(t.detach().abs().max())


def transformer_terms(arch, seq: int, log_softmax: bool = False) -> int:
    """Terms summed along the path of one logit through a pre-norm transformer (a ``ModelArch``)
    on ``seq`` tokens: per layer the attention RMSNorm (hidden), QKV (hidden), scores (head_dim),
    softmax and P.V (seq each), the output projection (hidden), the MLP RMSNorm (hidden), fc1
    (hidden) and fc2 (ffn; an MoE layer adds its router and the top-k sum); then the final norm
    and the LM head (hidden each), and with ``log_softmax`` the normaliser over the vocabulary (for a log-prob or a loss)."""
    h = arch.hidden_size
    ffn = arch.ffn_hidden_size
    if getattr(arch, "num_experts", 0):
        # An MoE layer: the router's logits (hidden) and softmax (experts), one expert's fc2
        # (its FFN) and the weighted sum of the top-k experts' outputs.
        ffn = h + arch.num_experts + arch.moe_ffn_hidden_size + arch.moe_topk
    per_layer = 5 * h + arch.head_dim + 2 * seq + ffn
    return arch.num_layers * per_layer + 2 * h + (arch.vocab_size if log_softmax else 0)


def logprob_tol(logits, logprobs, terms: int) -> float:
    """Log-probs computed twice up to rounding along ``terms``: log p = z - log sum exp z carries
    the error of the (tempered) logits z, so the scale is the larger of max|z| and max|log p|."""
    scale = max(float(torch.as_tensor(logits).abs().max()),
                float(torch.as_tensor(logprobs).abs().max()))
    return rounding_tol(scale, terms)


def grad_terms(forward_terms: int, tokens: int) -> int:
    """Terms along the path of one parameter's gradient: the forward's reductions, the same ones
    transposed in the backward, and the sum over every token of the step."""
    return 2 * forward_terms + tokens


def update_tol(after: torch.Tensor, before: torch.Tensor, steps: int, terms: int) -> float:
    """Weights after ``steps`` optimizer updates whose gradients differ only by rounding along
    ``terms``: each step rounds the decayed and the updated weight (2 roundings of |w| per step),
    and the update itself (``after - before``) carries the gradients' relative error. That holds
    when the update is proportional to the gradient: AdamW with adam_eps >> |g|
    (lr m / (sqrt(v) + adam_eps) ~ lr m / adam_eps). With a tiny adam_eps Adam turns gradient
    noise near g = 0 into steps of size lr that no rounding bound covers, so the tests that
    compare updates use adam_eps = 1."""
    return rounding_tol(after, 2 * steps) + rounding_tol(after - before, terms)
