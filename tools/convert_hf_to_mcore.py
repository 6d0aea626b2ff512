#!/usr/bin/env python
"""Convert a Hugging Face model folder (safetensors) into a Megatron-Core dist checkpoint.

    python tools/convert_hf_to_mcore.py --hf-dir Qwen2.5-7B --out ckpt/qwen2.5-7b --tp 4 --pp 2

The checkpoint (torch_dist) stores whole tensors, so the trainer loads it at any TP/PP layout;
--tp/--pp check that the model splits that way. arch.json and hf/ (config, tokenizer) are written
beside it, so training and export need no architecture flags. Tensors are read one at a time and
written as they are read: peak memory is about one layer, not the model.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hf-dir", required=True, type=Path,
                        help="HF model folder: config.json, *.safetensors, tokenizer files")
    parser.add_argument("--out", required=True, type=Path, help="checkpoint folder to create")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check (1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check (1)")
    parser.add_argument("--dtype", choices=["auto", "bf16", "fp16", "fp32"], default="auto",
                        help="stored dtype; auto = config.json's (bf16 if none)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)

    # Conversion is CPU work; with GPUs hidden the model is described on the meta device only.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from megatron_entropy.models.megatron_checkpoint import (convert_hf_to_checkpoint,
                                                             run_conversion)

    return run_conversion(
        lambda: convert_hf_to_checkpoint(args.hf_dir, args.out, dtype=args.dtype, tensor=args.tp,
                                         pipeline=args.pp, overwrite=args.overwrite,
                                         progress=not args.quiet),
        lambda stats: f"wrote {int(stats['tensors'])} tensors, {stats['bytes'] / 2**20:.1f} MiB "
                      f"in {stats['seconds']:.1f} s (peak RSS "
                      f"{stats['peak_rss_bytes'] / 2**30:.2f} GiB) to {args.out}")


if __name__ == "__main__":  # dist_checkpointing starts a spawn Manager: keep this guard
    sys.exit(main())
