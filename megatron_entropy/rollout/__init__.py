"""Rollout engines behind one interface (base.py): in-process transformers (inprocess.py), vLLM
and SGLang servers (server/)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from megatron_entropy.models.lora_settings import LoraSettings
from megatron_entropy.rollout.base import Completion, RolloutEngine, SamplingParams

__all__ = ["Completion", "RolloutEngine", "SamplingParams", "build_engine", "engine_is_shared"]


def engine_is_shared(engine_name: str) -> bool:
    """Server engines serve the whole job (driven by rank 0); in-process ones live on each DP
    leader."""
    return engine_name != "inprocess"


def build_engine(rollout_cfg, hf_dir: Union[str, Path], run_dir: Union[str, Path],
                 lora: Optional[LoraSettings] = None) -> RolloutEngine:
    """The engine ``rollout.engine`` names, serving the model in ``hf_dir``; vLLM and SGLang
    servers serve LoRA adapters of ``lora``'s shape too when the weight sync sends the adapters
    alone."""
    # Only the chosen engine's module loads: transformers for one, aiohttp for the others.
    if rollout_cfg.engine == "inprocess":
        import torch

        from megatron_entropy.rollout.inprocess import InProcessEngine

        # Colocated: the engine shares this rank's GPU (set by the runtime) with the actor.
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return InProcessEngine(hf_dir, dtype=rollout_cfg.dtype, batch_size=rollout_cfg.batch_size,
                               device=device, kv_cache_gb=rollout_cfg.kv_cache_gb)
    if rollout_cfg.engine == "vllm":
        from megatron_entropy.rollout.server.vllm import VLLMEngine, lora_serving

        server = rollout_cfg.server
        if rollout_cfg.weight_sync.strategy == "adapters":
            server = lora_serving(server, lora.rank)
        return VLLMEngine(server, str(hf_dir), str(run_dir))
    if rollout_cfg.engine == "sglang":
        from megatron_entropy.rollout.server.sglang import SGLangEngine, lora_serving

        server = rollout_cfg.server
        if rollout_cfg.weight_sync.strategy == "adapters":
            server = lora_serving(server, lora)
        return SGLangEngine(server, str(hf_dir), str(run_dir), rollout_cfg.weight_sync)
    raise ValueError(f"rollout.engine={rollout_cfg.engine!r}: choose inprocess, vllm or sglang")
