"""bf16 (fp32 main weights, Megatron's mixed-precision optimizer) against fp32 on the quickstart.

    PYTHONPATH=. python bench/bench_bf16.py            # 20 steps of examples/quickstart.yaml each

Runs `megatron-entropy train examples/quickstart.yaml` twice (model.dtype=fp32, then bf16; the
in-process engine stays fp32), 20 steps, no validation, same seeds, TP=2 on this machine, and
prints the policy loss, entropy (mean of per-sequence means) and reward of both side by side
every 2 steps, with the mean |bf16 - fp32| over the steps. JSON goes to runs/.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STEPS = 20
KEYS = ("loss/pg", "entropy/seq_mean", "reward/mean")


def run(dtype: str, runs_dir: Path) -> list[dict]:
    name = f"bench_bf16_{dtype}"
    subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "train",
                    str(REPO / "examples" / "quickstart.yaml"), f"model.dtype={dtype}",
                    f"model.hf_path={REPO / 'examples' / 'quickstart_model'}",
                    f"trainer.steps={STEPS}", "trainer.val_interval=0",
                    "trainer.val_before_train=false", "trainer.resume=none",
                    "logging.progress_bar=false", f"logging.name={name}",
                    f"logging.runs_dir={runs_dir}"],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    lines = (runs_dir / name / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("step", 0) >= 1 and "loss/pg" in r]


def main() -> None:
    runs_dir = REPO / "runs"
    rows = {dtype: run(dtype, runs_dir) for dtype in ("fp32", "bf16")}
    print("| step | " + " | ".join(f"{k} fp32 | {k} bf16" for k in KEYS) + " |")
    print("|---" * (1 + 2 * len(KEYS)) + "|")
    for a, b in zip(rows["fp32"], rows["bf16"]):
        if a["step"] % 2 == 0:
            print(f"| {a['step']} | " + " | ".join(f"{a[k]:.4f} | {b[k]:.4f}" for k in KEYS)
                  + " |")
    for k in KEYS:
        diff = [abs(a[k] - b[k]) for a, b in zip(rows["fp32"], rows["bf16"])]
        print(f"mean |bf16 - fp32| of {k}: {sum(diff) / len(diff):.4g}")
    seconds = {d: sum(r["time/step"] for r in rs) for d, rs in rows.items()}
    print(f"seconds for {STEPS} steps: fp32 {seconds['fp32']:.0f}, bf16 {seconds['bf16']:.0f}")
    (runs_dir / "bench_bf16.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
