"""Tool calls through the worker pool, and where a multi-turn RL step's time goes.

1. Calls per second through ``ToolPool`` (tool_use/pool.py) with 1, 2 and 4 workers: the
   calculator (the pool's own cost: a JSON line to a worker process and back) and the ``python``
   code tool (each call a sandbox: a fresh Python process in its namespaces, with its limits and
   scratch folder), ``--calls`` calls at once, as one rollout round sends them.
2. A multi-turn RL step with the in-process engine on the scripted tool model
   (megatron_entropy/testing/tool_script.py: three turns, a calculator call and a code call per
   response): ``--steps`` steps of ``--prompts`` x ``--samples``, the step's time split into
   generation (``time/generate``), tools (``time/tools``), rewards and the rest of the rollout,
   the recompute and the update, as fractions of ``time/step`` (mean over the steps after the
   first).

    PYTHONPATH=. python bench/bench_tools.py            # both, ~3 min on 2 cores
    PYTHONPATH=. python bench/bench_tools.py --quick    # a smoke run
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from megatron_entropy.tool_use.pool import ToolCall, ToolPool
from megatron_entropy.config.tools import ToolSettings


def calls_per_second(tool: str, workers: int, calls: int) -> float:
    pool = ToolPool(ToolSettings(names=[tool], workers=workers, timeout_s=30))
    try:
        arguments = ({"expression": "13 + 7 * (2 - 5)"} if tool == "calculator"
                     else {"code": "print(sum(range(1000)))"})
        pool.run([ToolCall(tool, arguments)] * workers)  # workers started, warm
        started = time.perf_counter()
        results = pool.run([ToolCall(tool, arguments)] * calls)
        seconds = time.perf_counter() - started
    finally:
        pool.close()
    assert all(r.status == "ok" for r in results), results[0]
    return calls / seconds


def step_split(steps: int, prompts: int, samples: int) -> dict[str, float]:
    from megatron_entropy.config import load_config
    from megatron_entropy.testing import tool_script
    from megatron_entropy.testing.ranks import run_distributed
    from megatron_entropy.trainer.loop import train

    model = tool_script.hf_dir()
    with tempfile.TemporaryDirectory() as runs:
        cfg = load_config(data={
            "model": {"hf_path": str(model), "dtype": "fp32", "seq_length": 96},
            "rollout": {"n_samples": samples, "max_new_tokens": 48, "max_prompt_tokens": 32,
                        "tools": {"names": ["calculator", "python"], "format": "plain",
                                  "workers": 2}},
            "algorithm": {"loss": "kl_cov", "kl_cov_ratio": 0.02},
            "data": {"train_files": [str(model / "prompts.jsonl")],
                     "apply_chat_template": False, "prompt_suffix": "",
                     "prompts_per_step": prompts, "dynamic_sampling": False},
            "trainer": {"steps": steps, "lr": 1e-5, "micro_batch_tokens": 4096,
                        "save_interval": 0},
            "logging": {"name": "bench_tools", "runs_dir": runs, "progress_bar": False}})
        run_distributed(train, 1, cfg, timeout=3600)
        rows = [json.loads(line) for line in
                (Path(runs) / "bench_tools" / "metrics.jsonl").read_text().splitlines()]
    rows = rows[1:] or rows  # the first step warms up
    mean = lambda key: sum(r.get(key, 0.0) for r in rows) / len(rows)  # noqa: E731
    step = mean("time/step")
    rollout, generate, tools = mean("time/rollout"), mean("time/generate"), mean("time/tools")
    return {"step_s": step, "generation": generate / step, "tools": tools / step,
            "rollout_rest": (rollout - generate - tools) / step,
            "recompute": mean("time/recompute") / step, "update": mean("time/update") / step,
            "rest": (step - rollout - mean("time/recompute") - mean("time/update")) / step,
            "tool_calls_per_step": mean("tools/calls_mean") * prompts * samples,
            "tool_token_frac": mean("tools/token_frac")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=64)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=5)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.calls, args.steps, args.prompts, args.samples = 8, 2, 2, 2
    print("| tool | workers | calls/s |\n| --- | --- | --- |")
    for tool in ("calculator", "python"):
        for workers in (1, 2, 4):
            print(f"| {tool} | {workers} | {calls_per_second(tool, workers, args.calls):.1f} |",
                  flush=True)
    split = step_split(args.steps, args.prompts, args.samples)
    print(f"\nmulti-turn step: {split['step_s']:.2f} s, "
          f"{split['tool_calls_per_step']:.0f} tool calls, "
          f"{split['tool_token_frac']:.2f} of response tokens inserted")
    print("| generation | tools | rewards and rest of rollout | recompute | update | rest |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("| " + " | ".join(f"{split[k]:.2f}" for k in ("generation", "tools", "rollout_rest",
                                                         "recompute", "update", "rest")) + " |")


if __name__ == "__main__":
    main()
