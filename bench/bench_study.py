"""Runs per hour of the methods comparison (examples/study_methods.yaml) at ``study.jobs`` 1 and 2.

    python bench/bench_study.py                                  # 4 arms, 1 seed, 24 steps
    python bench/bench_study.py --steps 40 --arms grpo,kl_cov,siren,lp_reg --jobs 1,2,3

The same runs twice in this one run, as two studies one after the other: the comparison's
settings with ``trainer.steps=N`` (the study's own start-up, validation every 4 steps and
checkpoint at the end), one seed, no tuning (each arm at its first candidate), and each run's
``megatron-entropy eval`` on a test split cut by the same factor as the steps (512 x N / 160
problems at the config's 64 samples), so that training and eval keep the full study's
proportions; a run's start-up weighs more in a short run than in the study's 160 steps. With no
OpenMP variable set, the study gives each run its share of the cores as threads: at jobs 1 a run
has them all, at jobs 2 half. Prints, for each jobs value, the study's wall time, runs per hour,
the CPU seconds of its processes and the speed-up over the first; the load average before and
after (other work on the machine takes cores the runs cannot use). JSON goes to
runs/bench_study.json.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "examples" / "study_methods.yaml"
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")  # the study decides them per run


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _study(jobs: int, arms: str, steps: int, out: Path) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env["PYTHONPATH"] = str(REPO)
    cmd = [sys.executable, "-m", "megatron_entropy.cli", "study", str(CONFIG), "--out", str(out),
           "--losses", arms, "--jobs", str(jobs), "study.seeds=[1]", "study.tune=false",
           f"trainer.steps={steps}", f"trainer.save_interval={steps}",
           f"data.hinted.num_test={max(1, round(512 * steps / 160))}"]
    cpu, start = _children_cpu_s(), time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"study at jobs {jobs} failed (exit code {done.returncode}):\n"
                 f"{(done.stdout + done.stderr)[-3000:]}")
    runs = len(arms.split(","))
    return {"jobs": jobs, "runs": runs, "wall_s": round(wall, 1),
            "runs_per_hour": round(runs * 3600 / wall, 2),
            "cpu_s": round(_children_cpu_s() - cpu, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arms", default="grpo,kl_cov,siren,aer",
                   help="study.losses names of examples/study_methods.yaml")
    p.add_argument("--steps", type=int, default=24, help="trainer.steps of each run")
    p.add_argument("--jobs", default="1,2", help="comma-separated study.jobs values, in order")
    args = p.parse_args()
    load_before = os.getloadavg()
    rows = []
    for jobs in (int(j) for j in args.jobs.split(",")):
        rows.append(_study(jobs, args.arms, args.steps,
                           REPO / "runs" / "bench_study" / f"jobs{jobs}"))
        row = rows[-1]
        row["speedup"] = round(rows[0]["wall_s"] / row["wall_s"], 3)
        print(f"jobs {jobs}: {row['runs']} runs in {row['wall_s']:.0f} s = "
              f"{row['runs_per_hour']:.1f} runs/hour, {row['cpu_s']:.0f} CPU s; "
              f"{row['speedup']:.2f}x the first", flush=True)
    result = {"arms": args.arms, "steps": args.steps, "cpus": len(os.sched_getaffinity(0)),
              "load_before": [round(x, 2) for x in load_before],
              "load_after": [round(x, 2) for x in os.getloadavg()], "rows": rows}
    print(f"load average (1, 5, 15 min) before {result['load_before']}, after "
          f"{result['load_after']}")
    out = REPO / "runs" / "bench_study.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
