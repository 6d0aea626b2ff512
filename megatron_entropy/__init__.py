"""megatron-entropy: RL for reasoning LLMs on Megatron-Core with entropy-preserving losses."""

__version__ = "0.1.0"
