"""Synchronous vs bounded-staleness asynchronous RL steps (rollout.max_staleness 0 vs 1) with a
real vLLM CPU server and the trainer on separate cores, so that they behave like separate nodes.

    python bench/bench_async.py                          # quickstart model, 8 steps per arm
    python bench/bench_async.py --prompts 16 --max-new-tokens 64 --steps 8 --warmup 2

Three arms: staleness 0; staleness 1 with requests in flight at a weight push finishing on the old
weights (``rollout.inflight_at_sync: finish``: the push waits for them); staleness 1 with those
requests aborted and resumed on the new weights (``abort``: the push waits for nothing).

Needs .venv-vllm (.ci/setup-vllm.sh) and two cores: the trainer runs under ``taskset -c 1`` (one
rank, gloo), the vLLM server it launches under ``taskset -c 0`` (bf16). Both arms train the
quickstart model on the arithmetic task with the same samples per step (dynamic sampling off),
no weight check (its probe would hold the rollout thread) and no validation or checkpoints. Per
arm, over the steps after the first ``--warmup`` and before the last (which has no next step to
generate beside it): mean time/step, samples/s, the trainer's idle fraction (time/trainer_idle /
time/step: waiting for a step's rollouts, and for requests in flight at a weight push) and the
servers' (time/engine_idle / time/step), and the rollout / training split (time/rollout vs
recompute + update + sync). Prints a Markdown table; the runs stay in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SERVER_ENV = ["VLLM_CPU_KVCACHE_SPACE=1", "VLLM_CPU_OMP_THREADS_BIND=nobind", "HF_HUB_OFFLINE=1",
              "OMP_NUM_THREADS=1"]


def server_command(max_model_len: int) -> list[str]:
    """vLLM's command as rollout/server/vllm.py builds it (processed log-probs, the served name),
    pinned to core 0."""
    return ["taskset", "-c", "0", "{python}", "-m", "vllm.entrypoints.openai.api_server",
            "--model", "{model}", "--served-model-name", "policy", "--host", "{host}",
            "--port", "{port}", "--dtype", "bfloat16", "--logprobs-mode", "processed_logprobs",
            "--seed", "0", "--max-model-len", str(max_model_len), "--enforce-eager",
            "--max-num-batched-tokens", "8192"]


def config(args: argparse.Namespace, staleness: int, inflight: str, name: str, out: Path,
           port: int) -> dict:
    return {
        "model": {"hf_path": str(REPO / "examples" / "quickstart_model"), "dtype": "fp32",
                  "seq_length": 512},
        "parallel": {"tensor": 1, "backend": "gloo"},
        "rollout": {"engine": "vllm", "max_staleness": staleness, "inflight_at_sync": inflight,
                    "n_samples": args.n,
                    "max_new_tokens": args.max_new_tokens, "max_prompt_tokens": 128,
                    "temperature": 1.0, "weight_check": {"enabled": False},
                    "server": {"launch": 1, "base_port": port, "server_python": str(VENV_PYTHON),
                               "startup_timeout_s": 600, "request_timeout_s": 600,
                               "max_concurrency": args.max_concurrency,
                               "launch_command": server_command(256), "extra_env": SERVER_ENV}},
        "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.002},
        "data": {"prompts_per_step": args.prompts, "dynamic_sampling": False},
        "trainer": {"steps": args.steps, "lr": 2e-5, "weight_decay": 0.0,
                    "micro_batch_tokens": 8192, "mini_batches_per_step": args.mini_batches,
                    "ppo_epochs": args.ppo_epochs, "val_interval": 0,
                    "val_before_train": False, "save_interval": 0},
        "logging": {"name": name, "runs_dir": str(out),
                    "progress_bar": False},
    }


def run_arm(args: argparse.Namespace, staleness: int, inflight: str, out: Path, port: int
            ) -> list[dict]:
    name = f"staleness{staleness}-{inflight}"
    cfg_path = out / f"{name}.yaml"
    cfg_path.write_text(yaml.safe_dump(config(args, staleness, inflight, name, out, port)))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    log = out / f"{name}.log"
    t0 = time.monotonic()
    with log.open("w") as f:
        rc = subprocess.call(["taskset", "-c", "1", sys.executable, "-m", "megatron_entropy.cli",
                              "train", str(cfg_path)], env=env, stdout=f,
                             stderr=subprocess.STDOUT, cwd=REPO)
    if rc != 0:
        sys.exit(f"{name}: exit {rc}; see {log}")
    print(f"{name}: {time.monotonic() - t0:.0f} s with start-up", flush=True)
    rows = [json.loads(line) for line in (out / name / "metrics.jsonl")
            .read_text().splitlines()]
    # The last step has no next step to generate beside it: left out of both arms.
    return [r for r in rows if args.warmup < r.get("step", 0) < args.steps]


def summary(rows: list[dict], samples_per_step: int) -> dict[str, float]:
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    step = mean("time/step")
    train = mean("time/recompute") + mean("time/update") + mean("time/sync")
    return {"step_s": step, "samples_per_s": samples_per_step / step,
            "trainer_idle": mean("time/trainer_idle") / step,
            "engine_idle": mean("time/engine_idle") / step, "rollout_s": mean("time/rollout"),
            "train_s": train, "staleness_mean": mean("async/staleness_mean"),
            "dropped": sum(r.get("async/dropped_samples", 0.0) for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-concurrency", type=int, default=256)
    ap.add_argument("--mini-batches", type=int, default=2)
    ap.add_argument("--ppo-epochs", type=int, default=1)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps left out of the means")
    ap.add_argument("--port", type=int, default=32700)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if not VENV_PYTHON.is_file():
        sys.exit(f"{VENV_PYTHON} not found: run bash .ci/setup-vllm.sh")
    out = args.out or Path(tempfile.mkdtemp(prefix="bench_async_"))
    out.mkdir(parents=True, exist_ok=True)
    samples = args.prompts * args.n
    arms = [(0, "finish"), (1, "finish"), (1, "abort")]
    results = {arm: summary(run_arm(args, *arm, out, args.port), samples) for arm in arms}
    print(f"\n{args.prompts} prompts x {args.n} samples of <= {args.max_new_tokens} tokens per "
          f"step, steps {args.warmup + 1}-{args.steps - 1}; runs in {out}\n")
    print("| max_staleness | in flight at a push | step s | samples/s | speed-up | trainer idle "
          "| engine idle | rollout s | train s | staleness mean | dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    base = results[arms[0]]["samples_per_s"]
    for (k, inflight), r in results.items():
        print(f"| {k} | {inflight if k else '-'} | {r['step_s']:.2f} | {r['samples_per_s']:.1f} "
              f"| {r['samples_per_s'] / base:.2f}x | {r['trainer_idle']:.0%} "
              f"| {r['engine_idle']:.0%} | {r['rollout_s']:.2f} | {r['train_s']:.2f} "
              f"| {r['staleness_mean']:.2f} | {r['dropped']:.0f} |")
    (out / "bench_async.json").write_text(json.dumps(
        {f"staleness{k}-{inflight}": r for (k, inflight), r in results.items()}, indent=1))


if __name__ == "__main__":
    main()
