#!/usr/bin/env python
"""Convert a Megatron-Core dist checkpoint (converted or saved by the trainer) to Hugging Face.

    python tools/convert_mcore_to_hf.py --ckpt runs/qwen-kl-cov/checkpoints --out qwen-kl-cov-hf

Writes safetensors (sharded with model.safetensors.index.json past --max-shard-size),
config.json and the tokenizer files, with the padded vocab rows removed; the folder loads in
transformers and serves in vLLM/SGLang. --ckpt may be a trainer's checkpoints/ folder (its
``latest`` is used). Config and tokenizer come from the checkpoint's hf/ unless --hf-config-from
names the source HF folder. Reads one layer at a time: peak memory is about one layer.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt", required=True, type=Path,
                        help="dist checkpoint folder, or a trainer's checkpoints/ folder")
    parser.add_argument("--out", required=True, type=Path, help="HF folder to create")
    parser.add_argument("--hf-config-from", type=Path, default=None,
                        help="HF folder to take config.json and the tokenizer from "
                             "(default: the checkpoint's hf/)")
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default=None,
                        help="output dtype (default: the checkpoint's weight dtype)")
    parser.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                        help="largest safetensors file (default 5GB)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # conversion is CPU work
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatron_entropy.models.megatron_checkpoint import (convert_checkpoint_to_hf,
                                                             run_conversion)

    return run_conversion(
        lambda: convert_checkpoint_to_hf(args.ckpt, args.out, hf_config_from=args.hf_config_from,
                                         dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                                         overwrite=args.overwrite, progress=not args.quiet),
        lambda stats: f"wrote {int(stats['tensors'])} tensors, {stats['bytes'] / 2**20:.1f} MiB "
                      f"in {int(stats['shards'])} shard(s), {stats['seconds']:.1f} s (peak RSS "
                      f"{stats['peak_rss_bytes'] / 2**30:.2f} GiB) to {args.out}")


if __name__ == "__main__":  # dist_checkpointing starts a spawn Manager: keep this guard
    sys.exit(main())
