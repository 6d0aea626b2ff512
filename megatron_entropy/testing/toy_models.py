"""Tiny Hugging Face models of each supported family and a BPE tokenizer, made without a model
hub: random weights saved as safetensors, for tests and benchmarks."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

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

# Mixture-of-experts families (apart: the dense tests' TP=2 layouts do not apply to them).
MOE_FAMILIES = {
    # 4 experts of FFN 32, top-2; the dense intermediate_size is unused (every layer is MoE).
    "qwen3_moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                      rope_theta=1000000.0, head_dim=32, attention_bias=False,
                      use_sliding_window=False, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], router_aux_loss_coef=0.001),
}

# head_dim 64: a size every vLLM CPU attention backend takes.
SERVED_ARCH = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                   num_key_value_heads=1, vocab_size=512, max_position_embeddings=512)


def tiny_hf_config(family: str, **overrides) -> dict:
    """config.json of a tiny model of ``family`` (a key of FAMILIES or MOE_FAMILIES), with
    ``overrides``."""
    return {**BASE, **{**FAMILIES, **MOE_FAMILIES}[family], **overrides}


def save_tiny_hf_model(family: str, out_dir: Path, seed: int = 0, **overrides) -> Path:
    """A random transformers model of the family, saved as safetensors (no hub needed)."""
    cfg_dict = tiny_hf_config(family, **overrides)
    config = transformers.AutoConfig.for_model(cfg_dict["model_type"], **{
        k: v for k, v in cfg_dict.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    # Random norms and biases too, so that a swapped or dropped tensor shows in the logits; a
    # router with spread-out logits (HF initialises it to zero: every token would tie).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.5)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def save_tokenizer(out_dir: Path, vocab_size: int = 512, added: tuple[str, ...] = ()) -> None:
    """A byte-level BPE trained on arithmetic text; <pad>, <s>, </s> are ids 0, 1, 2; ``added``
    are whole tokens of their own (the last ids, within ``vocab_size``)."""
    rng = random.Random(0)
    corpus = [f"{rng.randint(0, 99)} + {rng.randint(0, 99)} = {rng.randint(0, 200)}. "
              f"The answer is \\boxed{{{rng.randint(0, 200)}}}" for _ in range(2000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=vocab_size - len(added), special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(list(added))
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                         pad_token="<pad>").save_pretrained(out_dir)


def make_served_model(out_dir: Path, seed: int = 0, logit_scale: float = 5.0) -> Path:
    """A tiny Qwen2 (SERVED_ARCH) with its own tokenizer, servable by vLLM and the fake SGLang
    server. ``logit_scale`` sharpens the LM head so that log-probs spread over nats: with the
    default init every token is ~log(1/V) and any two models would look alike. (Sharper heads
    raise the bf16 serving error: x5 gives ~6e-3 mean |dlogp| under vLLM bf16, x15 ~2e-2.)"""
    out_dir = save_tiny_hf_model("qwen2", Path(out_dir), seed=seed, **SERVED_ARCH)
    weights = load_file(str(out_dir / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * logit_scale
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    save_tokenizer(out_dir, SERVED_ARCH["vocab_size"])
    return out_dir
