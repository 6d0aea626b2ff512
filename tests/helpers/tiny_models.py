"""Tiny Hugging Face configs and models of each supported family, for tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

BASE = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, initializer_range=0.02, tie_word_embeddings=False,
            bos_token_id=1, eos_token_id=2, torch_dtype="float32")

FAMILIES = {
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", rope_theta=1000000.0,
                  use_sliding_window=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", rope_theta=1000000.0,
                  head_dim=32, attention_bias=False, use_sliding_window=False),
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", rope_theta=500000.0,
                  attention_bias=False, mlp_bias=False,
                  rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                    high_freq_factor=4.0, original_max_position_embeddings=8192)),
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral",
                    rope_theta=1000000.0, sliding_window=None),
}


def tiny_hf_config(family: str, **overrides) -> dict:
    return {**BASE, **FAMILIES[family], **overrides}


def save_tiny_hf_model(family: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random transformers model of the family, saved as safetensors (no hub needed)."""
    import torch
    import transformers

    cfg_dict = tiny_hf_config(family, **overrides)
    config = transformers.AutoConfig.for_model(cfg_dict["model_type"], **{
        k: v for k, v in cfg_dict.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random norms and biases too, so that a swapped or dropped tensor shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def write_config(family: str, out_dir: Path, **overrides) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(tiny_hf_config(family, **overrides)))
    return out_dir


def random_samples(seed: int, groups: int = 4, per_group: int = 2,
                   prompt_len: tuple[int, int] = (4, 9), response_len: tuple[int, int] = (6, 12),
                   adv_scale: float = 2.0, source: Callable[[int], str] = lambda group: "s",
                   vocab_size: int = 1000) -> list:
    """Rollout samples for actor tests: random token ids in [3, vocab_size), lengths drawn from
    [low, high), a random advantage each; the first sample of a group has reward 1."""
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
            out.append(Sample(prompt_ids=prompt, response_ids=resp,
                              engine_logprobs=[0.0] * len(resp), reward=1.0 if j == 0 else 0.0,
                              group=group, source=source(group),
                              advantage=float(torch.randn(1, generator=g)) * adv_scale))
    return out
