"""Our RL step against Hugging Face TRL's GRPOTrainer on the same work, side by side.

    python bench/bench_vs_trl.py                        # every setting, 3 interleaved repeats
    python bench/bench_vs_trl.py --settings 1t,2t --repeats 5 --steps 5
    python bench/bench_vs_trl.py --no-trl --settings default,dp2,tp2   # ours only

TRL is optional; install it in its own venv beside the repo (torch pinned to the CPU build this
project uses, so pip does not pull another torch):

    python -m venv --system-site-packages .venv-trl
    .venv-trl/bin/pip install torch==2.13.0 trl==1.16.0

The work is the same on both sides: the quickstart model (examples/quickstart_model), the
quickstart arithmetic prompts in its chat template with the same suffix, the same math reward
(megatron_entropy.rewards.math), 16 prompts x 8 samples a step at temperature 1, at most 96 new
tokens, 2 optimizer updates of 64 samples each per step, PPO-clip with clip-higher (0.2 / 0.28),
token-mean loss, fp32, no reference model, lr 2e-5. Ours is examples/quickstart_grpo.yaml with
those overrides (no dynamic sampling, no validation, no weight check); TRL is GRPOTrainer with
generation_batch_size 128 and steps_per_generation 2, so one of our steps is two of TRL's.
Both recompute the old policy's log-probs with a forward-only pass before the updates (TRL
does when an optimizer step is not the generation's only one); the ``-engine`` settings run ours
with ``algorithm.old_logprobs=engine``, which takes the in-process engine's own instead (the
same numbers up to rounding, one forward less a step). Ours packs each prompt's samples into
shared-prompt rows (``trainer.micro_batch_layout`` auto: the prompt's forward once for its 8
samples, the same function up to rounding); the ``-padded`` settings run ours with a row per
sample, as TRL's batches are.

Each run is its own process tree, started by this script; runs alternate between ours and TRL
(which goes first alternates too), so both see the same load. A step's time is the wall time
between the lines a run writes at the end of consecutive steps (metrics.jsonl; TRL: a callback),
its CPU seconds the process tree's CPU time over the same interval, both medians over the steps
after the first (the first carries one-off warm-up). "start-up" is launch to the end of step 1.
The 1-minute load average (/proc/loadavg) is read before each run. On a machine shared with
other work the wall times follow the load; the CPU seconds hardly move, so the CPU ratio is the
one to compare across machines. ``--baseline DIR`` runs another checkout of this project (e.g.
the last release) beside ours in each setting, for start-up and step before and after a change.
Prints Markdown tables; JSON goes to runs/bench_vs_trl/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import psutil

REPO = Path(__file__).resolve().parents[1]
MODEL = REPO / "examples" / "quickstart_model"
TRL_PYTHON = REPO / ".venv-trl" / "bin" / "python"
PROMPTS, SAMPLES, NEW_TOKENS, UPDATES, LR = 16, 8, 96, 2, 2.0e-5
THREAD_VARS = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")

# name -> (what it is, our ranks, our tensor-parallel size, env of ours, env of TRL, overrides
# of ours). An env of None leaves the thread variables unset: the launcher's defaults (ours),
# torch's (TRL).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
TWO_PASSIVE = {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"}
ENGINE_OLD_LOGPROBS = ("algorithm.old_logprobs=engine",)
PADDED = ("trainer.micro_batch_layout=padded",)
SETTINGS: dict[str, tuple[str, int, int, Optional[dict], Optional[dict], tuple[str, ...]]] = {
    "default": ("defaults of each (no thread variable set)", 1, 1, None, None, ()),
    "1t": ("both 1 thread", 1, 1, ONE_THREAD, ONE_THREAD, ()),
    "2t": ("both 2 threads, OpenMP's default wait policy", 1, 1, {"OMP_NUM_THREADS": "2"},
           {"OMP_NUM_THREADS": "2"}, ()),
    "2tp": ("both 2 threads, OMP_WAIT_POLICY=PASSIVE", 1, 1, TWO_PASSIVE, TWO_PASSIVE, ()),
    "dp2": ("ours DP=2 (launcher defaults) vs TRL 1 thread", 2, 1, None, ONE_THREAD, ()),
    "tp2": ("ours TP=2 (launcher defaults) vs TRL 1 thread", 2, 2, None, ONE_THREAD, ()),
    # The engine's log-probs as the old policy: no recompute forward (TRL recomputes its own).
    "1t-engine": ("both 1 thread, ours algorithm.old_logprobs=engine", 1, 1, ONE_THREAD,
                  ONE_THREAD, ENGINE_OLD_LOGPROBS),
    "2tp-engine": ("both 2 threads PASSIVE, ours algorithm.old_logprobs=engine", 1, 1,
                   TWO_PASSIVE, TWO_PASSIVE, ENGINE_OLD_LOGPROBS),
    "default-engine": ("defaults of each, ours algorithm.old_logprobs=engine", 1, 1, None, None,
                       ENGINE_OLD_LOGPROBS),
    "dp2-engine": ("ours DP=2, algorithm.old_logprobs=engine vs TRL 1 thread", 2, 1, None,
                   ONE_THREAD, ENGINE_OLD_LOGPROBS),
    # A row per sample (the layout before shared-prompt rows; TRL's too).
    "1t-padded": ("both 1 thread, ours trainer.micro_batch_layout=padded", 1, 1, ONE_THREAD,
                  ONE_THREAD, PADDED),
    "2tp-padded": ("both 2 threads PASSIVE, ours trainer.micro_batch_layout=padded", 1, 1,
                   TWO_PASSIVE, TWO_PASSIVE, PADDED),
}


def _env(threads: Optional[dict], repo: Path = REPO) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update(threads or {})
    env["PYTHONPATH"] = str(repo)
    env["PYTHONUNBUFFERED"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _tree_cpu(proc: psutil.Process) -> float:
    total = 0.0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def _watch(cmd: list[str], env: dict, lines: Path, steps: int, log: Path,
           timeout: float, cwd: Path = REPO) -> list[tuple[float, float, dict]]:
    """Run ``cmd``; return (seconds since launch, tree CPU seconds, record) at each step line of
    ``lines`` (a JSON object per line with "step" >= 1)."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    ps_proc = psutil.Process(proc.pid)
    seen: list[tuple[float, float, dict]] = []
    try:
        while len(seen) < steps:
            if proc.poll() is not None and not _new_records(lines, len(seen)):
                raise RuntimeError(f"{cmd[:4]} exited with {proc.returncode} after "
                                   f"{len(seen)} steps; log: {log}")
            if time.perf_counter() - start > timeout:
                raise RuntimeError(f"{cmd[:4]} took over {timeout} s; log: {log}")
            now, cpu = time.perf_counter() - start, _tree_cpu(ps_proc)
            for record in _new_records(lines, len(seen)):
                seen.append((now, cpu, record))
            time.sleep(0.05)
    finally:
        try:
            left = [*ps_proc.children(recursive=True), ps_proc]
        except psutil.NoSuchProcess:  # the run had already finished
            left = []
        for p in left:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        proc.wait()
    return seen[:steps]


def _new_records(path: Path, have: int) -> list[dict]:
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            break  # a line being written
        if r.get("step", 0) >= 1:
            records.append(r)
    return records[have:]


def _summary(marks: list[tuple[float, float, dict]], per_step: int) -> dict:
    """Our steps from the marks of every ``per_step``-th line (TRL: 2 lines a step)."""
    ends = marks[per_step - 1::per_step]
    wall = [b[0] - a[0] for a, b in zip(ends, ends[1:])]
    cpu = [b[1] - a[1] for a, b in zip(ends, ends[1:])]
    return {"step_s": statistics.median(wall), "cpu_s": statistics.median(cpu),
            "startup_s": ends[0][0], "startup_cpu_s": ends[0][1], "steps": wall}


def run_ours(threads: Optional[dict], nproc: int, tensor: int, steps: int, work: Path,
             repo: Path = REPO, overrides: tuple[str, ...] = ()) -> dict:
    """Our quickstart_grpo on the matched work, from the checkout ``repo``, with ``overrides``."""
    name = f"ours_{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "megatron_entropy.cli", "train",
           str(repo / "examples" / "quickstart_grpo.yaml"), "--nproc", str(nproc),
           f"parallel.tensor={tensor}", f"trainer.steps={steps + 1}",
           f"data.prompts_per_step={PROMPTS}", f"rollout.n_samples={SAMPLES}",
           f"rollout.max_new_tokens={NEW_TOKENS}", f"trainer.mini_batches_per_step={UPDATES}",
           f"trainer.lr={LR}", "data.dynamic_sampling=false", "trainer.val_before_train=false",
           "trainer.val_interval=0", "trainer.save_interval=0", "rollout.weight_check.enabled=false",
           f"logging.runs_dir={work}", f"logging.name={name}", "logging.progress_bar=false",
           *overrides]
    marks = _watch(cmd, _env(threads, repo), work / name / "metrics.jsonl", steps,
                   work / f"{name}.log", timeout=900, cwd=repo)
    out = _summary(marks, 1)
    out["response_tokens"] = statistics.median(m[2]["rollout/response_tokens"] for m in marks)
    return out


def run_trl(threads: Optional[dict], steps: int, work: Path) -> dict:
    name = f"trl_{time.monotonic_ns()}"
    lines = work / f"{name}.jsonl"
    cmd = [str(TRL_PYTHON), str(Path(__file__).resolve()), "--trl-worker", str(lines),
           "--steps", str(steps), "--work", str(work / name)]
    marks = _watch(cmd, _env(threads), lines, steps * UPDATES, work / f"{name}.log",
                   timeout=1800)
    out = _summary(marks, UPDATES)
    out["response_tokens"] = statistics.median(
        m[2]["completions/mean_length"] * PROMPTS * SAMPLES for m in marks[::UPDATES])
    return out


def _prompts() -> tuple[list[list[dict]], list[str]]:
    """The quickstart's training prompts in order, as conversations, with their answers."""
    from megatron_entropy.config import ArithmeticConfig
    from megatron_entropy.data.dataset import DEFAULT_PROMPT_SUFFIX, arithmetic_rows

    rows = arithmetic_rows(ArithmeticConfig(), "train")
    return ([[{"role": "user", "content": f"{r.prompt} {DEFAULT_PROMPT_SUFFIX}"}] for r in rows],
            [r.answer for r in rows])


def trl_worker(lines: Path, steps: int, work: Path) -> None:
    """Inside .venv-trl: GRPOTrainer on the quickstart's work, a line per optimizer step."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_entropy.rewards.math import math_rewards

    prompts, answers = _prompts()
    n = PROMPTS * steps * 2
    data = Dataset.from_dict({"prompt": prompts[:n], "answer": answers[:n]})

    def reward(completions, answer, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return math_rewards(texts, answer)

    class Lines(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **_):
            if logs and "loss" in logs:  # an optimizer step (not the run's summary)
                with lines.open("a") as f:
                    f.write(json.dumps({"step": state.global_step, **logs}) + "\n")

    config = GRPOConfig(
        output_dir=str(work), use_cpu=True, bf16=False, fp16=False, seed=1,
        learning_rate=LR, weight_decay=0.0, lr_scheduler_type="constant", warmup_steps=0,
        max_steps=steps * UPDATES, per_device_train_batch_size=PROMPTS * SAMPLES // UPDATES,
        gradient_accumulation_steps=1, num_generations=SAMPLES,
        steps_per_generation=UPDATES,  # generation batch: 2 x 64 = 16 prompts x 8
        max_completion_length=NEW_TOKENS, temperature=1.0, top_p=1.0, beta=0.0,
        num_iterations=1, epsilon=0.2, epsilon_high=0.28, loss_type="dapo",
        scale_rewards="group", logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0, shuffle_dataset=False)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data,
                          processing_class=AutoTokenizer.from_pretrained(MODEL),
                          callbacks=[Lines()])
    trainer.train()


def _load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs) if runs else float("nan")


def _row(label: str, ours: list[dict], trl: list[dict]) -> str:
    med = _median
    o, t = med(ours, "step_s"), med(trl, "step_s")
    loads = [r["load"] for r in ours + trl]
    oc, tc = med(ours, "cpu_s"), med(trl, "cpu_s")
    return (f"| {label} | {o:.2f} | {oc:.2f} | {t:.2f} | {tc:.2f} | {o / t:.2f} | {oc / tc:.2f} "
            f"| {med(ours, 'startup_s'):.1f} | {med(trl, 'startup_s'):.1f} "
            f"| {med(ours, 'response_tokens'):.0f} / {med(trl, 'response_tokens'):.0f} "
            f"| {min(loads):.1f}-{max(loads):.1f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma-separated, of: {', '.join(SETTINGS)}")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps a run (after step 1)")
    p.add_argument("--no-trl", action="store_true", help="ours only")
    p.add_argument("--baseline", type=Path,
                   help="another checkout of this project (e.g. the last release), run beside "
                        "ours in each setting: its start-up and step in the table")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "bench_vs_trl")
    p.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker, args.steps + 1, args.work)
        return
    with_trl = not args.no_trl
    if with_trl and not TRL_PYTHON.is_file():
        sys.exit(f"{TRL_PYTHON} not found: install TRL as this script's docstring says, or "
                 "pass --no-trl")
    names = args.settings.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        sys.exit(f"--settings: unknown {unknown}; known: {', '.join(SETTINGS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, list[dict]]] = {n: {"ours": [], "trl": [], "base": []}
                                                 for n in names}
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl_") as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            for name in names:
                _, nproc, tensor, ours_env, trl_env, overrides = SETTINGS[name]
                sides = [("ours", lambda: run_ours(ours_env, nproc, tensor, args.steps, work,
                                                   overrides=overrides))]
                if with_trl:
                    sides.append(("trl", lambda: run_trl(trl_env, args.steps, work)))
                if args.baseline:
                    sides.append(("base", lambda: run_ours(ours_env, nproc, tensor, args.steps,
                                                           work, args.baseline.resolve(),
                                                           overrides)))
                if repeat % 2:
                    sides.reverse()
                for side, run in sides:
                    load = _load()
                    r = {**run(), "load": load}
                    results[name][side].append(r)
                    print(f"[{time.strftime('%H:%M:%S')}] {name} {side}: step "
                          f"{r['step_s']:.2f} s, cpu {r['cpu_s']:.2f} s, start-up to step 1 "
                          f"{r['startup_s']:.1f} s (cpu {r['startup_cpu_s']:.1f} s), load "
                          f"{load:.2f}", flush=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    (args.out / f"{stamp}.json").write_text(json.dumps(results, indent=1))
    print("\n| setting | ours step s | ours CPU s/step | TRL step s | TRL CPU s/step | ours/TRL "
          "step | ours/TRL CPU | ours start-up s | TRL start-up s | response tokens/step ours / "
          "TRL | load (1 min) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        print(_row(SETTINGS[name][0], results[name]["ours"], results[name]["trl"]))
    if args.baseline:
        base = args.baseline
        print(f"\n| setting | start-up s ours / {base} | start-up CPU s ours / {base} "
              f"| step s ours / {base} | step CPU s ours / {base} | load (1 min) |\n"
              "|---|---|---|---|---|---|")
        for name in names:
            o, b = results[name]["ours"], results[name]["base"]
            loads = [r["load"] for r in o + b]
            print(f"| {SETTINGS[name][0]} "
                  + "".join(f"| {_median(o, k):.{d}f} / {_median(b, k):.{d}f} "
                            for k, d in (("startup_s", 1), ("startup_cpu_s", 1),
                                         ("step_s", 2), ("cpu_s", 2)))
                  + f"| {min(loads):.1f}-{max(loads):.1f} |")


if __name__ == "__main__":
    main()
