"""Peak memory and time of checkpoint conversion against the checkpoint's size.

Makes a many-layer Llama-style model in bf16 (random weights, written tensor by tensor, never whole
in memory), converts it HF -> Megatron dist checkpoint -> HF with the two tools, each in its own
process, and reports each process's peak RSS (as the tools print it) against the
checkpoint size, next to the RSS of a process that only imports what the tools import. Peak RSS
is VmHWM of the tool's own address space (ru_maxrss of a child would include this parent's memory
at the fork). The round trip is checked tensor by tensor.

    python bench/bench_convert.py                  # ~3.2 GB model, 32 layers
    python bench/bench_convert.py --layers 8 --hidden 1024 --ffn 2816   # quick
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from megatron_entropy.models.arch import arch_from_hf_config
from megatron_entropy.models.bridge import hf_tensor_specs
from megatron_entropy.models.hf_io import (hf_weight_files, open_hf_slices,
                                           save_hf_weights)

REPO = Path(__file__).resolve().parents[1]


def make_model(out: Path, layers: int, hidden: int, ffn: int, heads: int, groups: int,
               vocab: int) -> int:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=vocab,
               hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=groups,
               max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0,
               tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
               bos_token_id=1, eos_token_id=2, dtype="bfloat16")
    specs = hf_tensor_specs(arch_from_hf_config(cfg), torch.bfloat16)
    gen = torch.Generator().manual_seed(0)

    def tensors():
        for name, shape, dtype in specs:
            yield name, (torch.randn(shape, generator=gen) * 0.02).to(dtype)

    stats = save_hf_weights(tensors(), out, max_shard_bytes=2 * 1024**3, specs=specs)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return int(stats["bytes"])


def run(cmd: list[str]) -> tuple[float, float, str]:
    """(peak RSS bytes as the tool reports it, wall seconds, stdout)."""
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    m = re.search(r"peak RSS ([0-9.]+) GiB", done.stdout)
    return float(m.group(1)) * 2**30, wall, done.stdout.strip()


def import_baseline() -> float:
    """Peak RSS of a process that imports what the tools import and starts Megatron, no data."""
    code = ("import os; os.environ['CUDA_VISIBLE_DEVICES']=''\n"
            "from megatron_entropy.models import conversion as m\n"
            "with m.single_process_megatron(): pass\n"
            "print(m.peak_rss_bytes())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                         check=True).stdout
    return float(out.strip().splitlines()[-1])


def same_weights(a: Path, b: Path) -> bool:
    fa, fb = hf_weight_files(a), hf_weight_files(b)
    if fa.keys() != fb.keys():
        return False
    for name in fa:
        with open_hf_slices(fa, [name]) as (x,), open_hf_slices(fb, [name]) as (y,):
            if not torch.equal(x[:], y[:]):
                return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=5632)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--workdir", type=Path, default=None, help="default: a temp folder")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args()

    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench_convert_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        hf, ckpt, back = work / "hf", work / "mcore", work / "hf_back"
        if (hf / "config.json").is_file():  # a --workdir from an earlier run: same model
            size = sum(p.stat().st_size for p in hf.glob("*.safetensors"))
        else:
            size = make_model(hf, args.layers, args.hidden, args.ffn, args.heads, args.groups,
                              args.vocab)
        base = import_baseline()
        tools = REPO / "tools"
        to_mcore = run([sys.executable, str(tools / "convert_hf_to_mcore.py"), "--hf-dir", str(hf),
                        "--out", str(ckpt), "--tp", "4", "--quiet", "--overwrite"])
        to_hf = run([sys.executable, str(tools / "convert_mcore_to_hf.py"), "--ckpt", str(ckpt),
                     "--out", str(back), "--max-shard-size", "2GiB", "--quiet", "--overwrite"])
        identical = same_weights(hf, back)
        results = {
            "model": f"Llama-style, {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, "
                     f"vocab {args.vocab}, bf16",
            "checkpoint_bytes": size,
            "import_baseline_rss_bytes": base,
            "hf_to_mcore": {"peak_rss_bytes": to_mcore[0], "seconds": to_mcore[1],
                            "rss_ratio": to_mcore[0] / size,
                            "rss_above_baseline_ratio": (to_mcore[0] - base) / size},
            "mcore_to_hf": {"peak_rss_bytes": to_hf[0], "seconds": to_hf[1],
                            "rss_ratio": to_hf[0] / size,
                            "rss_above_baseline_ratio": (to_hf[0] - base) / size},
            "round_trip_bit_identical": identical,
        }
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    gib = 2**30
    print(f"model: {results['model']}, checkpoint {size / gib:.2f} GiB")
    print(f"process that only imports the tools: peak RSS {base / gib:.2f} GiB")
    for key in ("hf_to_mcore", "mcore_to_hf"):
        r = results[key]
        print(f"{key:12s} peak RSS {r['peak_rss_bytes'] / gib:.2f} GiB = {r['rss_ratio']:.2f}x "
              f"checkpoint ({r['rss_above_baseline_ratio']:.2f}x above imports), "
              f"{r['seconds']:.0f} s ({size / r['seconds'] / 2**20:.0f} MiB/s)")
    print(f"round trip bit-identical: {identical}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
