"""The architecture of a supported Hugging Face decoder, read from its ``config.json``.

``ModelArch`` is the one neutral description the model builder, the HF <-> Megatron bridge and the
checkpoint tools share. It is read from the raw JSON (not through transformers) so that configs
written by any transformers release parse the same way.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Union

# HF architecture name -> family. Each family's differences are the flags of ModelArch.
SUPPORTED_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}

# The padded vocabulary is a multiple of this, independent of TP, so that a checkpoint converted at
# one TP size reshards to any power-of-two TP size up to 128 without changing its global shape.
VOCAB_PAD_MULTIPLE = 128


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    family: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_layernorm: bool
    init_std: float = 0.02
    rope_scaling_factor: Optional[float] = None  # Llama-3 style scaling; None = no scaling
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[Union[int, list]] = None
    # Mixture of experts (num_experts 0: a dense model). Every layer's MLP is a routed MoE block
    # of num_experts SwiGLU experts of size moe_ffn_hidden_size, moe_topk of them per token.
    num_experts: int = 0
    moe_ffn_hidden_size: int = 0
    moe_topk: int = 0
    norm_topk_prob: bool = False  # renormalise the top-k probabilities to sum to 1
    router_aux_loss_coef: float = 0.0  # HF's load-balancing coefficient (a training default)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_pairs_per_token(self) -> float:
        """A token's multiply-adds through a layer's linear layers (QKV, output, SwiGLU MLP) in
        units of one (query, key) pair of its attention (QK^T and PV over every head)."""
        q, kv = self.num_attention_heads * self.head_dim, self.num_query_groups * self.head_dim
        h = self.hidden_size
        return (h * (q + 2 * kv) + q * h + 3 * h * self.ffn_hidden_size) / (2 * q)

    @property
    def padded_vocab_size(self) -> int:
        return int(math.ceil(self.vocab_size / VOCAB_PAD_MULTIPLE) * VOCAB_PAD_MULTIPLE)

    def check_parallel(self, tensor: int, pipeline: int, expert: int = 1) -> None:
        """Raise naming the config key if this model cannot be split TP x PP x EP."""
        if expert > 1 and not self.is_moe:
            raise UnsupportedModelError(
                f"parallel.expert={expert} needs a mixture-of-experts model; {self.architecture} "
                "is dense (set parallel.expert=1)")
        if self.is_moe and self.num_experts % expert:
            raise UnsupportedModelError(
                f"parallel.expert={expert} does not divide the model's {self.num_experts} experts")
        problems = []
        if self.num_attention_heads % tensor:
            problems.append(f"{self.num_attention_heads} attention heads")
        if self.num_query_groups % tensor:
            problems.append(f"{self.num_query_groups} query groups (KV heads)")
        if self.ffn_hidden_size % tensor:
            problems.append(f"FFN size {self.ffn_hidden_size}")
        if self.is_moe and self.moe_ffn_hidden_size % tensor:
            problems.append(f"expert FFN size {self.moe_ffn_hidden_size}")
        if self.padded_vocab_size % tensor:
            problems.append(f"padded vocab {self.padded_vocab_size}")
        if problems:
            raise UnsupportedModelError(
                f"parallel.tensor={tensor} does not divide the model's " + ", ".join(problems))
        if self.num_layers % pipeline:
            raise UnsupportedModelError(
                f"parallel.pipeline={pipeline} does not divide the model's {self.num_layers} layers")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelArch":
        return cls(**d)


def _rope(cfg: dict, where: str) -> tuple[float, Optional[float]]:
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or (params if params.get("rope_type", "default") != "default"
                                          else None)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise UnsupportedModelError(f"{where}: rope scaling type {kind!r} is not supported "
                                    "(supported: none, 'llama3')")
    # Megatron-Core's Llama-3 scaling fixes these three constants; other values would silently differ.
    expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
    for key, value in expected.items():
        if key in scaling and float(scaling[key]) != value:
            raise UnsupportedModelError(
                f"{where}: llama3 rope scaling with {key}={scaling[key]} is not supported by "
                f"Megatron-Core (it fixes {key}={value})")
    return theta, float(scaling.get("factor", 8.0))


def arch_from_hf_config(cfg: dict, where: str = "config.json") -> ModelArch:
    """Parse an HF config dict; an unsupported architecture raises listing the supported ones."""
    archs = cfg.get("architectures") or []
    name = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if name is None:
        raise UnsupportedModelError(
            f"{where}: architecture {archs or cfg.get('model_type')!r} is not supported; supported: "
            + ", ".join(SUPPORTED_ARCHITECTURES))
    family = SUPPORTED_ARCHITECTURES[name]
    if cfg.get("use_sliding_window") or (family == "mistral" and cfg.get("sliding_window")
                                         and cfg["sliding_window"] < cfg.get("max_position_embeddings", 0)):
        raise UnsupportedModelError(
            f"{where}: sliding-window attention (sliding_window={cfg.get('sliding_window')}) is not "
            "supported; use a checkpoint with full attention (e.g. Mistral v0.2+)")
    heads = cfg["num_attention_heads"]
    theta, scaling = _rope(cfg, where)
    if family == "qwen2":
        qkv_bias = True
    else:
        qkv_bias = bool(cfg.get("attention_bias", False))
    if cfg.get("mlp_bias"):
        raise UnsupportedModelError(f"{where}: mlp_bias=true is not supported")
    eos = cfg.get("eos_token_id")
    moe = _moe(cfg, where) if family == "qwen3_moe" else {}
    return ModelArch(
        architecture=name,
        family=family,
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_attention_heads=heads,
        num_query_groups=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        qk_layernorm=family in ("qwen3", "qwen3_moe"),
        init_std=float(cfg.get("initializer_range", 0.02)),
        rope_scaling_factor=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos,
        **moe,
    )


def _moe(cfg: dict, where: str) -> dict[str, Any]:
    """The MoE fields of a Qwen3-MoE config; what Megatron's MoE layer cannot express raises
    naming the key."""
    if cfg.get("mlp_only_layers"):
        raise UnsupportedModelError(
            f"{where}: mlp_only_layers={cfg['mlp_only_layers']} (dense layers between MoE layers) "
            "is not supported: every layer must be an MoE layer")
    if int(cfg.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError(
            f"{where}: decoder_sparse_step={cfg['decoder_sparse_step']} is not supported (only 1: "
            "every layer an MoE layer)")
    if cfg.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act={cfg['hidden_act']!r} is not supported "
                                    "(only 'silu')")
    for key in ("shared_expert_intermediate_size", "n_shared_experts"):
        if cfg.get(key):
            raise UnsupportedModelError(
                f"{where}: {key}={cfg[key]} (shared experts) is not supported for Qwen3-MoE")
    # transformers 5 writes num_local_experts (its attribute map), Qwen's checkpoints num_experts.
    experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    if not experts:
        raise UnsupportedModelError(f"{where}: num_experts is missing or 0")
    topk = int(cfg.get("num_experts_per_tok", 0))
    if not 0 < topk <= experts:
        raise UnsupportedModelError(f"{where}: num_experts_per_tok={topk} must be in [1, "
                                    f"num_experts={experts}]")
    return dict(num_experts=int(experts), moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]),
                moe_topk=topk, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                router_aux_loss_coef=float(cfg.get("router_aux_loss_coef", 0.0)))


def load_arch(hf_dir: Union[str, Path]) -> ModelArch:
    """The architecture of the Hugging Face model folder ``hf_dir`` (its config.json); the
    errors name the folder, the caller the setting that gave it."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise FileNotFoundError(f"{str(hf_dir)!r} does not exist" if not Path(hf_dir).exists()
                                else f"{str(hf_dir)!r} is a file, not a model folder")
    if not path.is_file():
        raise FileNotFoundError(f"no config.json in {str(hf_dir)!r}: not a Hugging Face model "
                                "folder")
    return arch_from_hf_config(json.loads(path.read_text()), where=str(path))
