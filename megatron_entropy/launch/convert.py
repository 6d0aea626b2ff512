"""``megatron-entropy convert hf-to-mcore|mcore-to-hf``: checkpoint conversion (tools/convert_*.py
are wrappers of these commands).

    megatron-entropy convert hf-to-mcore --hf-dir Qwen2.5-7B --out ckpt/qwen2.5-7b --tp 4 --pp 2
    megatron-entropy convert mcore-to-hf --ckpt runs/qwen-kl-cov/checkpoints --out qwen-kl-cov-hf

hf-to-mcore writes a Megatron-Core dist checkpoint (torch_dist) from a Hugging Face folder
(safetensors). It stores whole tensors, so the trainer loads it at any TP/PP layout; --tp/--pp
check that the model splits that way. arch.json and hf/ (config, tokenizer) are written beside
it, so training and export need no architecture flags.

mcore-to-hf writes safetensors (sharded with model.safetensors.index.json past --max-shard-size),
config.json and the tokenizer files, with the padded vocab rows removed; the folder loads in
transformers and serves in vLLM/SGLang. --ckpt may be a trainer's checkpoints/ folder (its
``latest`` is used). Config and tokenizer come from the checkpoint's hf/ unless --hf-config-from
names the source HF folder. A LoRA run's checkpoint (adapters only) is merged into its base (the
one the run recorded, or --base), which is checked against the run's fingerprint of it.

mcore-to-peft writes a LoRA run's adapters as a PEFT adapter folder (adapter_config.json,
adapter_model.safetensors) that ``peft`` loads onto the HF base and vLLM serves as a LoRA.

Both read one tensor (one layer) at a time and write as they read: peak memory is about one
layer, not the model. Conversion is CPU work: the GPUs are hidden, the model is described on the
meta device only.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import sys
from pathlib import Path
from typing import Optional

from megatron_entropy.runtime.dtypes import DTYPES
from megatron_entropy.runtime.harmless import silence_harmless_warnings

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20,
          "gib": 2**30}

HF_TO_MCORE = "convert a Hugging Face model folder (safetensors) into a Megatron-Core dist " \
              "checkpoint"
MCORE_TO_HF = "convert a Megatron-Core dist checkpoint (converted or saved by the trainer) to " \
              "Hugging Face (a LoRA run's: merged into its base)"
MCORE_TO_PEFT = "export a LoRA run's adapters as a PEFT adapter folder"


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 5GB, 500MB or 2GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def add_hf_to_mcore_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hf-dir", required=True, type=Path,
                   help="HF model folder: config.json, *.safetensors, tokenizer files")
    p.add_argument("--out", required=True, type=Path, help="checkpoint folder to create")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check (1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check (1)")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                   help="stored dtype; auto = config.json's (bf16 if none)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_mcore_to_hf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, type=Path,
                   help="dist checkpoint folder, or a trainer's checkpoints/ folder")
    p.add_argument("--out", required=True, type=Path, help="HF folder to create")
    p.add_argument("--hf-config-from", type=Path, default=None,
                   help="HF folder to take config.json and the tokenizer from "
                        "(default: the checkpoint's hf/)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None,
                   help="output dtype (default: the checkpoint's weight dtype)")
    p.add_argument("--max-shard-size", type=parse_size, default=parse_size("5GB"),
                   help="largest safetensors file (default 5GB)")
    p.add_argument("--base", type=Path, default=None,
                   help="a LoRA checkpoint's base model (HF folder or dist checkpoint; default: "
                        "the one the run recorded)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def add_mcore_to_peft_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, type=Path,
                   help="a LoRA run's checkpoint folder, or its checkpoints/ folder")
    p.add_argument("--out", required=True, type=Path, help="adapter folder to create")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")


def add_convert_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="convert_command", required=True,
                           metavar="{hf-to-mcore,mcore-to-hf,mcore-to-peft}")
    add_hf_to_mcore_args(sub.add_parser("hf-to-mcore", help=HF_TO_MCORE, description=HF_TO_MCORE))
    add_mcore_to_hf_args(sub.add_parser("mcore-to-hf", help=MCORE_TO_HF, description=MCORE_TO_HF))
    add_mcore_to_peft_args(sub.add_parser("mcore-to-peft", help=MCORE_TO_PEFT,
                                          description=MCORE_TO_PEFT))


def run_convert(args: argparse.Namespace) -> int:
    """The exit code of run_conversion: 0, 2 for bad input, 130 when interrupted."""
    # Before torch loads: with no GPU visible the model is described on the meta device only.
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    missing = _missing_input(args)
    if missing:  # said before Megatron loads (~9 s of CPU for a typo)
        print(f"megatron-entropy convert: error: {missing}", file=sys.stderr)
        return 2
    silence_harmless_warnings()  # the megatron-core notes `train` hides
    # Here, not at the top: `megatron-entropy --help` and the other commands start without torch.
    from megatron_entropy.models.conversion import convert_hf_to_checkpoint, run_conversion
    from megatron_entropy.trainer.lora_run import export_adapters, export_hf

    if args.convert_command == "hf-to-mcore":
        convert = functools.partial(convert_hf_to_checkpoint, args.hf_dir, args.out,
                                    dtype=args.dtype, tensor=args.tp, pipeline=args.pp,
                                    overwrite=args.overwrite, progress=not args.quiet)
    elif args.convert_command == "mcore-to-peft":
        convert = functools.partial(export_adapters, args.ckpt, args.out, args.overwrite)
    else:
        convert = functools.partial(export_hf, args.ckpt, args.out,
                                    hf_config_from=args.hf_config_from, base=args.base,
                                    dtype=args.dtype, max_shard_bytes=args.max_shard_size,
                                    overwrite=args.overwrite, progress=not args.quiet)
    return run_conversion(convert, lambda stats: _summary(stats, args.out))


def _missing_input(args: argparse.Namespace) -> Optional[str]:
    """The line the conversion would refuse a missing input folder with, or None."""
    if args.convert_command == "hf-to-mcore":
        return None if args.hf_dir.exists() else f"--hf-dir: {str(args.hf_dir)!r} does not exist"
    return None if args.ckpt.exists() else f"{args.ckpt} does not exist"


def _summary(stats: dict[str, float], out: str) -> str:
    """The line a finished conversion prints (the shard count where the output has shards)."""
    shards = f"{int(stats['shards'])} shard(s), " if "shards" in stats else ""
    return (f"wrote {int(stats['tensors'])} tensors, {stats['bytes'] / 2**20:.1f} MiB in "
            f"{shards}{stats['seconds']:.1f} s (peak RSS {stats['peak_rss_bytes'] / 2**30:.2f} "
            f"GiB) to {out}")

CONVERT = ("checkpoint conversion: hf-to-mcore (HF folder -> Megatron dist checkpoint), "
           "mcore-to-hf (back to HF), mcore-to-peft (a LoRA run's adapters)", add_convert_args,
           run_convert)
