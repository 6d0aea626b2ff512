"""The names and shapes of a model's Hugging Face tensors and their Megatron parameters, and the
checks of an HF folder's safetensors files against config.json, from the files' headers.

Torch-free: the CLI checks the model a run will train (cli._check_model) before any rank
starts, and `--nproc`'s launcher, which trains nothing itself, then never loads torch. The
tensors themselves are read and converted in bridge.py and hf_io.py.
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Union

from megatron_entropy.models.arch import ModelArch

Kind = Literal["copy", "qkv", "glu", "vocab"]


@dataclass(frozen=True)
class WeightMap:
    """One Megatron parameter and the HF tensors it is made of (in the order ``kind`` uses)."""

    megatron: str
    hf: tuple[str, ...]
    kind: Kind


_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_HF_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")
_HF_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")

# Layer-relative Megatron name -> (layer-relative HF names, kind). Local and TE names both appear.
_LAYER_RULES: dict[str, tuple[tuple[str, ...], Kind]] = {
    "input_layernorm.weight": (("input_layernorm.weight",), "copy"),
    "self_attention.linear_qkv.layer_norm_weight": (("input_layernorm.weight",), "copy"),
    "self_attention.linear_qkv.weight": (tuple(f"{p}.weight" for p in _QKV), "qkv"),
    "self_attention.linear_qkv.bias": (tuple(f"{p}.bias" for p in _QKV), "qkv"),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), "copy"),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), "copy"),
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), "copy"),
    "pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), "copy"),
    "mlp.linear_fc1.layer_norm_weight": (("post_attention_layernorm.weight",), "copy"),
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), "glu"),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), "copy"),
    "mlp.router.weight": (("mlp.gate.weight",), "copy"),
}

# Transformer-Engine name -> local-spec name of the same parameter.
_TE_TO_LOCAL = {"self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
                "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight"}

# HF tensors that are not weights (older checkpoints store the rotary table).
_IGNORED_HF = re.compile(r".*\.rotary_emb\.inv_freq$")


def weight_map(name: str, arch: ModelArch) -> WeightMap:
    """The HF tensors of one global Megatron parameter name (local or TE spec)."""
    if name == "embedding.word_embeddings.weight":
        return WeightMap(name, ("model.embed_tokens.weight",), "vocab")
    if name == "output_layer.weight":
        hf = "model.embed_tokens.weight" if arch.tie_word_embeddings else "lm_head.weight"
        return WeightMap(name, (hf,), "vocab")
    if name == "decoder.final_layernorm.weight":
        return WeightMap(name, ("model.norm.weight",), "copy")
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_RULES:
        hf, kind = _LAYER_RULES[m.group(2)]
        return WeightMap(name, tuple(f"model.layers.{m.group(1)}.{h}" for h in hf), kind)
    e = _EXPERT_RE.match(m.group(2)) if m and arch.is_moe else None
    if e:
        prefix = f"model.layers.{m.group(1)}.mlp.experts.{e.group(1)}"
        if e.group(2) == "linear_fc1":
            return WeightMap(name, (f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight"),
                             "glu")
        return WeightMap(name, (f"{prefix}.down_proj.weight",), "copy")
    raise KeyError(f"Megatron parameter {name!r} has no Hugging Face counterpart "
                   f"({arch.architecture} mapping)")


def layer_param_names(arch: ModelArch, te_names: bool = False) -> list[str]:
    """Layer-relative Megatron parameter names of one transformer layer, in Megatron's order."""
    names = ["self_attention.linear_qkv.layer_norm_weight" if te_names
             else "input_layernorm.weight",
             "self_attention.linear_proj.weight", "self_attention.linear_qkv.weight"]
    if arch.qkv_bias:
        names.append("self_attention.linear_qkv.bias")
    if arch.qk_layernorm:
        names += ["self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"]
    if arch.is_moe:
        # An MoE layer's norm is a module of its own under both specs; dist checkpoints of the
        # local spec store it under the fused name all the same (its keys map).
        names += ["mlp.linear_fc1.layer_norm_weight" if te_names else "pre_mlp_layernorm.weight",
                  "mlp.router.weight"]
        names += [f"mlp.experts.local_experts.{e}.{fc}.weight"
                  for e in range(arch.num_experts) for fc in ("linear_fc1", "linear_fc2")]
        return names
    names += ["mlp.linear_fc1.layer_norm_weight" if te_names else "pre_mlp_layernorm.weight",
              "mlp.linear_fc1.weight", "mlp.linear_fc2.weight"]
    return names


def local_spec_name(name: str) -> str:
    """The local-spec name of a global Megatron parameter name (TE's fused norm names mapped)."""
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _TE_TO_LOCAL:
        return f"decoder.layers.{m.group(1)}.{_TE_TO_LOCAL[m.group(2)]}"
    return name


def megatron_param_names(arch: ModelArch, te_names: bool = False) -> list[str]:
    """Every parameter of the full (TP=1, PP=1) model, global names, in Megatron's order."""
    names = ["embedding.word_embeddings.weight"]
    layer = layer_param_names(arch, te_names)
    for i in range(arch.num_layers):
        names += [f"decoder.layers.{i}.{n}" for n in layer]
    names.append("decoder.final_layernorm.weight")
    if not arch.tie_word_embeddings:
        names.append("output_layer.weight")
    return names


def hf_shape(name: str, arch: ModelArch) -> tuple[int, ...]:
    """The shape the HF checkpoint must have for ``name`` (from config.json)."""
    h, hd = arch.hidden_size, arch.head_dim
    q_rows, kv_rows = arch.num_attention_heads * hd, arch.num_query_groups * hd
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (arch.vocab_size, h)
    if name == "model.norm.weight":
        return (h,)
    m = _HF_LAYER_RE.match(name)
    rel = m.group(2) if m else ""
    e = _HF_EXPERT_RE.match(rel) if arch.is_moe else None
    if e and int(e.group(1)) < arch.num_experts:
        i = arch.moe_ffn_hidden_size
        return (h, i) if e.group(2) == "down_proj" else (i, h)
    if arch.is_moe and rel == "mlp.gate.weight":
        return (arch.num_experts, h)
    if arch.is_moe and rel.startswith("mlp."):
        raise KeyError(f"{name!r} is not a tensor of a {arch.architecture} model")
    shapes = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q_rows, h), "self_attn.q_proj.bias": (q_rows,),
        "self_attn.k_proj.weight": (kv_rows, h), "self_attn.k_proj.bias": (kv_rows,),
        "self_attn.v_proj.weight": (kv_rows, h), "self_attn.v_proj.bias": (kv_rows,),
        "self_attn.o_proj.weight": (h, q_rows),
        "self_attn.q_norm.weight": (hd,), "self_attn.k_norm.weight": (hd,),
        "mlp.gate_proj.weight": (arch.ffn_hidden_size, h),
        "mlp.up_proj.weight": (arch.ffn_hidden_size, h),
        "mlp.down_proj.weight": (h, arch.ffn_hidden_size),
    }
    if rel not in shapes:
        raise KeyError(f"{name!r} is not a tensor of a {arch.architecture} model")
    return shapes[rel]


def check_hf_checkpoint(files: dict[str, Path], arch: ModelArch, where: Union[str, Path]) -> None:
    """Raise if the HF checkpoint (tensor name -> safetensors file) lacks tensors the model needs,
    has tensors it cannot place, or has a tensor whose shape config.json contradicts. Reads only
    the files' headers."""
    expected = {n for name in megatron_param_names(arch) for n in weight_map(name, arch).hf}
    present = set(files)
    missing = sorted(expected - present, key=_natural)
    if missing:
        raise KeyError(f"{where}: {len(missing)} tensors of the {arch.architecture} model are "
                       f"missing from the checkpoint, e.g. {missing[:3]} (partial or mismatched "
                       "shards?)")
    allowed_extra = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    extra = sorted((n for n in present - expected - allowed_extra if not _IGNORED_HF.match(n)),
                   key=_natural)
    if extra:
        raise KeyError(f"{where}: {len(extra)} tensors have no place in the Megatron model, e.g. "
                       f"{extra[:3]} (an unsupported variant of {arch.architecture}?)")
    headers = {path: safetensors_header(path) for path in sorted(set(files.values()))}
    for name in sorted(expected, key=_natural):
        check_shape(name, tuple(headers[files[name]][name]["shape"]), arch)


def check_shape(name: str, shape: tuple[int, ...], arch: ModelArch) -> None:
    """Raise if HF tensor ``name`` has another ``shape`` than config.json implies."""
    want = hf_shape(name, arch)
    if shape != want:
        raise ValueError(f"{name} has shape {shape}, but config.json implies {want}")


def _natural(name: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def hf_weight_files(hf_dir: Union[str, Path]) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index or the single file; clear error if absent."""
    hf_dir = Path(hf_dir)
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = {name: hf_dir / f for name, f in weight_map.items()}
        missing = sorted({str(p) for p in files.values() if not p.is_file()})
        if missing:
            raise FileNotFoundError(f"{index} lists shards that do not exist: {missing[:3]}")
        for path in sorted(set(files.values())):
            safetensors_header(path)  # a truncated shard raises here
        return files
    single = hf_dir / "model.safetensors"
    if single.is_file():
        return {name: single for name in safetensors_header(single)}
    shards = sorted(p.name for p in hf_dir.glob("*.safetensors"))
    if shards:
        raise FileNotFoundError(f"{str(hf_dir)!r} has {len(shards)} safetensors shards "
                                f"({shards[0]}, ...) but no model.safetensors.index.json")
    raise FileNotFoundError(f"no safetensors weights in {str(hf_dir)!r} (expected "
                            "model.safetensors or model.safetensors.index.json)")


def safetensors_header(path: Path) -> dict[str, dict]:
    """Tensor name -> {"dtype", "shape", "data_offsets"} of one safetensors file, from its header
    (an 8-byte little-endian length, then that much JSON); ValueError naming the file when the
    header or the data it describes does not fit the file (a truncated or corrupt shard)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            size = Path(path).stat().st_size
            if length > size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        header.pop("__metadata__", None)
        end = max((t["data_offsets"][1] for t in header.values()), default=0)
        if 8 + length + end != size:
            raise ValueError(f"its tensors end at byte {8 + length + end} of {size}")
    except PermissionError:
        raise  # the file is whole, this user may not read it: said as such (cli._check_model)
    except (OSError, struct.error, ValueError, KeyError, TypeError, IndexError,
            AttributeError) as e:
        raise ValueError(f"{path} is not a complete safetensors file ({e}); the shard is "
                         "truncated or corrupt") from None
    return header
