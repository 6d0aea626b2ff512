"""bf16 (fp32 main weights, Megatron's mixed-precision optimizer) against fp32 on the quickstart.

    PYTHONPATH=. python bench/bench_bf16.py            # 20 steps of examples/quickstart.yaml each

Runs `megatron-entropy train examples/quickstart.yaml` twice, model.dtype=fp32 then bf16, at
DP=2 (2 ranks, parallel.tensor=1) with the distributed optimizer in both (so only the precision
differs), 20 steps, no validation, same seeds; the in-process engine samples in fp32 from the
synced weights. Writes the loss, entropy and reward curves side by side
(docs/bf16_vs_fp32.png), a per-step table (docs/bf16_vs_fp32.md) of both values, |bf16 - fp32|
and the fp32 run's own step-to-step change |fp32[t] - fp32[t-1]|, and the raw rows as JSON
(runs/bench_bf16.json).

What "within bf16 tolerance" can mean here: step 1 samples the same responses in both runs (the
engine starts from the same fp32 weights), so its difference is bf16's rounding of the recompute
alone. From step 2 the engines hold different weights (bf16 updates round to 8 significant bits)
and sample different responses, so the runs are two draws of one process: bf16 tracks fp32 when
|bf16 - fp32| stays of the size of the curve's own step-to-step change, without a trend.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from matplotlib.figure import Figure

REPO = Path(__file__).resolve().parents[1]
KEYS = ("loss/pg", "entropy/seq_mean", "reward/mean")
DTYPES = ("fp32", "bf16")


def run(dtype: str, steps: int, runs_dir: Path) -> list[dict]:
    name = f"bench_bf16_{dtype}"
    subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "train",
                    str(REPO / "examples" / "quickstart.yaml"), "--nproc", "2",
                    f"model.dtype={dtype}", "parallel.tensor=1",
                    "trainer.distributed_optimizer=true",
                    f"model.hf_path={REPO / 'examples' / 'quickstart_model'}",
                    f"trainer.steps={steps}", "trainer.val_interval=0",
                    "trainer.val_before_train=false", "trainer.resume=none",
                    "trainer.save_interval=0", "logging.progress_bar=false",
                    f"logging.name={name}", f"logging.runs_dir={runs_dir}"],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = (runs_dir / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("step", 0) >= 1 and "loss/pg" in r]


def table(rows: dict[str, list[dict]]) -> str:
    """Markdown: per step and key, fp32 / bf16, |bf16 - fp32|, |fp32 step-to-step change|;
    then per key the means of both differences and their ratio."""
    fp32, bf16 = rows["fp32"], rows["bf16"]
    head = "| step | " + " | ".join(f"{k} fp32 / bf16 | diff | change" for k in KEYS) + " |"
    lines = [head, "|---" * (1 + 3 * len(KEYS)) + "|"]
    diffs: dict[str, list[float]] = {k: [] for k in KEYS}
    changes: dict[str, list[float]] = {k: [] for k in KEYS}
    for i, (a, b) in enumerate(zip(fp32, bf16)):
        cells = []
        for k in KEYS:
            diff = abs(b[k] - a[k])
            diffs[k].append(diff)
            change = abs(a[k] - fp32[i - 1][k]) if i else None
            if change is not None:
                changes[k].append(change)
            cells.append(f"{a[k]:.4f} / {b[k]:.4f} | {diff:.4f} | "
                         + ("-" if change is None else f"{change:.4f}"))
        lines.append(f"| {a['step']} | " + " | ".join(cells) + " |")
    lines.append("")
    for k in KEYS:
        mean_diff = sum(diffs[k]) / len(diffs[k])
        mean_change = sum(changes[k]) / max(len(changes[k]), 1)
        lines.append(f"- {k}: mean |bf16 - fp32| {mean_diff:.4g}, mean fp32 step-to-step change "
                     f"{mean_change:.4g}, ratio {mean_diff / mean_change:.2f}; step 1 "
                     f"(same samples) {diffs[k][0]:.3g}")
    seconds = {d: sum(r["time/step"] for r in rs) for d, rs in rows.items()}
    lines.append(f"- seconds for {len(fp32)} steps: fp32 {seconds['fp32']:.0f}, "
                 f"bf16 {seconds['bf16']:.0f}")
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, list[dict]], path: Path) -> None:
    fig = Figure(figsize=(4.2 * len(KEYS), 3.4))  # no pyplot: savefig draws it with Agg
    axes = fig.subplots(1, len(KEYS))
    for ax, key in zip(axes, KEYS):
        for dtype in DTYPES:
            ax.plot([r["step"] for r in rows[dtype]], [r[key] for r in rows[dtype]],
                    marker="o", markersize=3, label=dtype)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("quickstart, DP=2, distributed optimizer: fp32 vs bf16 (fp32 main weights)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=REPO / "docs", help="folder of the PNG and table")
    args = p.parse_args()
    runs_dir = REPO / "runs"
    rows = {dtype: run(dtype, args.steps, runs_dir) for dtype in DTYPES}
    (runs_dir / "bench_bf16.json").write_text(json.dumps(rows, indent=1))
    args.out.mkdir(parents=True, exist_ok=True)
    text = table(rows)
    (args.out / "bf16_vs_fp32.md").write_text(text)
    plot(rows, args.out / "bf16_vs_fp32.png")
    print(text)


if __name__ == "__main__":
    main()
