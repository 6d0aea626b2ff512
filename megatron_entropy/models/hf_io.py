"""Read and write Hugging Face model folders one tensor at a time (safetensors)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import torch

# Files that describe the model but are not weights; copied along with exported weights.
HF_METADATA_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                     "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
                     "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                     "chat_template.json")


def copy_hf_metadata(src_dir: Union[str, Path], out_dir: Union[str, Path]) -> list[str]:
    """Copy config, generation config and tokenizer files that exist in ``src_dir``."""
    copied = []
    for name in HF_METADATA_FILES:
        src = Path(src_dir) / name
        if src.is_file():
            shutil.copy2(src, Path(out_dir) / name)
            copied.append(name)
    return copied


def save_hf_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], out_dir: Union[str, Path],
                    metadata_from: Optional[Union[str, Path]] = None,
                    max_shard_bytes: int = 5 * 1024**3,
                    dtype: Optional[torch.dtype] = None) -> dict[str, float]:
    """Stream tensors into sharded ``model-0000i-of-0000n.safetensors`` files plus an index.

    At most one shard is held in memory. The folder appears complete or not at all: it is written
    under a temporary name and renamed. Returns {"tensors", "bytes", "shards"}.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = 0
    shard_names: list[list[str]] = []
    total_bytes = 0

    def flush() -> None:
        nonlocal shard, shard_bytes
        if shard:
            save_file(shard, str(tmp / f"shard-{len(shard_names):05d}.safetensors"),
                      metadata={"format": "pt"})
            shard_names.append(list(shard))
            shard, shard_bytes = {}, 0

    try:
        for name, tensor in named_tensors:
            t = tensor.detach().to("cpu", dtype=dtype or tensor.dtype).contiguous()
            size = t.numel() * t.element_size()
            if shard and shard_bytes + size > max_shard_bytes:
                flush()
            shard[name] = t
            shard_bytes += size
            total_bytes += size
        flush()
        n = len(shard_names)
        weight_map = {}
        for i, names in enumerate(shard_names):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp / f"shard-{i:05d}.safetensors", tmp / final)
            weight_map.update({name: final for name in names})
        if n > 1:
            (tmp / "model.safetensors.index.json").write_text(json.dumps(
                {"metadata": {"total_size": total_bytes}, "weight_map": weight_map}, indent=2))
        if metadata_from is not None:
            copy_hf_metadata(metadata_from, tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return {"tensors": float(len(weight_map)), "bytes": float(total_bytes), "shards": float(n)}


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
        return files
    single = hf_dir / "model.safetensors"
    if single.is_file():
        from safetensors import safe_open

        with safe_open(str(single), "pt") as f:
            return {name: single for name in f.keys()}
    raise FileNotFoundError(f"no safetensors weights in {str(hf_dir)!r} (expected model.safetensors "
                            "or model.safetensors.index.json)")


def iter_hf_tensors(hf_dir: Union[str, Path], names: Optional[Iterable[str]] = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) lazily, file by file, reading only the requested names."""
    from safetensors import safe_open

    files = hf_weight_files(hf_dir)
    wanted = list(files) if names is None else list(names)
    unknown = [n for n in wanted if n not in files]
    if unknown:
        raise KeyError(f"{hf_dir}: no tensor named {unknown[:3]}")
    by_file: dict[Path, list[str]] = {}
    for n in wanted:
        by_file.setdefault(files[n], []).append(n)
    for path, file_names in by_file.items():
        with safe_open(str(path), "pt") as f:
            for n in file_names:
                yield n, f.get_tensor(n)
