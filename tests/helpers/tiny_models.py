"""Tiny Hugging Face configs and models of each supported family, for tests (the models
themselves are megatron_entropy/testing/toy_models.py, which the benchmarks share)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Optional

# Re-exported: the tests import the tiny models from here, beside the helpers below.
from megatron_entropy.testing.toy_models import (FAMILIES, save_tiny_hf_model,  # noqa: F401
                                                 tiny_hf_config)


def write_config(family: str, out_dir: Path, **overrides) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(tiny_hf_config(family, **overrides)))
    return out_dir


def random_samples(seed: int, groups: int = 4, per_group: int = 2,
                   prompt_len: tuple[int, int] = (4, 9), response_len: tuple[int, int] = (6, 12),
                   adv_scale: float = 2.0, source: Callable[[int], str] = lambda group: "s",
                   vocab_size: int = 1000, shared_prompts: bool = False,
                   inserted: bool = False) -> list:
    """Rollout samples for actor tests: random token ids in [3, vocab_size), lengths drawn from
    [low, high), a random advantage each; the first sample of a group has reward 1. With
    ``shared_prompts`` the samples of a group share its first sample's prompt (as the samples of
    one prompt do). With ``inserted`` a response of 6 tokens or more has tokens 2 to 4 (at
    most) inserted, as a tool's result is (``loss_mask`` 0 there), between generated ones."""
    import torch

    from megatron_entropy.trainer.batch import Sample

    g = torch.Generator().manual_seed(seed)
    out = []
    for group in range(groups):
        for j in range(per_group):
            prompt = torch.randint(3, vocab_size, (int(torch.randint(*prompt_len, (1,),
                                                                     generator=g)),),
                                   generator=g).tolist()
            resp = torch.randint(3, vocab_size, (int(torch.randint(*response_len, (1,),
                                                                   generator=g)),),
                                 generator=g).tolist()
            if shared_prompts and j > 0:
                prompt = out[-1].prompt_ids
            out.append(Sample(prompt_ids=prompt, response_ids=resp,
                              engine_logprobs=[0.0] * len(resp), reward=1.0 if j == 0 else 0.0,
                              group=group, source=source(group),
                              advantage=float(torch.randn(1, generator=g)) * adv_scale))
    if inserted:
        for smp in out:
            n = len(smp.response_ids)
            if n >= 6:
                smp.loss_mask = [0 if 2 <= t < 2 + min(3, n - 4) else 1 for t in range(n)]
    return out


def initial_weights_worker() -> dict:
    """Inside a rank of ``run_distributed``: the full initial weights of the tiny qwen2 policy
    as one process builds them (for ``tiny_actor``'s ``initial`` at other layouts)."""
    from megatron_entropy.models.arch import arch_from_hf_config
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.sharding import full_state_dict
    from megatron_entropy.testing.ranks import init_megatron

    init_megatron()
    return full_state_dict(build_gpt_model(arch_from_hf_config(tiny_hf_config("qwen2")),
                                           dtype="fp32", transformer_impl="local", seq_length=64))


def tiny_actor(tensor: int, pipeline: int, algorithm, trainer, temperature: float = 1.0,
               initial: Optional[dict] = None, context: int = 1,
               distributed_optimizer: bool = False, **model_options):
    """Inside a rank of ``run_distributed``: Megatron's parallel state at TP x PP x CP, the tiny
    qwen2 policy (fp32, local spec, ``model_options`` other ModelConfig fields; from the full
    weights ``initial`` when given, since a PP=2 build draws other initial weights than PP=1)
    and its Actor with a fresh optimizer (Megatron's distributed one if asked)."""
    from megatron_entropy.config import ModelConfig, ParallelConfig
    from megatron_entropy.models.arch import arch_from_hf_config
    from megatron_entropy.models.sharding import load_full_state_dict
    from megatron_entropy.testing.ranks import init_megatron
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    init_megatron(tensor, pipeline, context=context)
    arch = arch_from_hf_config(tiny_hf_config("qwen2"))
    model = ModelConfig(**{"dtype": "fp32", "transformer_impl": "local", "seq_length": 64,
                           **model_options})
    chunks = build_trainable_model(arch, model, ParallelConfig(tensor=tensor, pipeline=pipeline,
                                                               context=context),
                                   distributed_optimizer=distributed_optimizer)
    if initial is not None:  # LoRA adapters keep their own (seeded) initialisation
        load_full_state_dict(chunks[0], initial, strict=not model.lora.enabled)
    optimizer, scheduler = build_optimizer(chunks, trainer, model.dtype, distributed_optimizer)
    return Actor(arch, chunks, optimizer, scheduler, algorithm, trainer, temperature)


def hf_weights(actor) -> dict:
    """The actor's full weights by HF name (collective over its model-parallel group; on the
    replica's leader, every other rank gets {})."""
    from megatron_entropy.models.bridge import export_hf_weights

    return {n: t.clone() for n, t in export_hf_weights(actor.model[0], actor.arch)
            if t is not None}
