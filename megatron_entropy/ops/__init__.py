"""Pure tensor math with torch.distributed: vocab-parallel log-prob/entropy and Cov selection."""

from megatron_entropy.ops.logprob_entropy import (fused_linear_logprob_entropy,
                                                  vocab_parallel_logprob_entropy)

__all__ = ["fused_linear_logprob_entropy", "vocab_parallel_logprob_entropy"]
