"""Rollout bytes each rank receives in one step, by DP size: each DP rank gets only its share.

    python bench/bench_rollout_share.py          # quickstart model and settings, 1 step

One step of the quickstart's rollouts (examples/quickstart.yaml: 32 prompts x 8 samples of <= 96
tokens, dynamic sampling with up to 2 refills) through ``collect_step_groups`` on forked gloo ranks,
for a shared engine (servers: global rank 0 generates everything) and per-rank in-process engines
(every DP leader generates its part), at (TP, DP) = (2, 1), (1, 2) and (1, 4). Prints each rank's
bytes received (pickled payloads from other ranks: the groups' statistics every rank gets, plus its
share of the kept groups) and the kept step's payload; JSON goes to runs/.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch.distributed as dist

# Imported once here (megatron-core with them), before the ranks are forked.
from megatron_entropy.config import load_config
from megatron_entropy.data import PromptSampler, load_prompt_dataset, load_tokenizer
from megatron_entropy.rewards import RewardScorer
from megatron_entropy.rollout import build_engine
from megatron_entropy.rollout.base import SamplingParams
# The forked gloo ranks of the tests, shared on purpose: the bench measures what the tests prove
# correct.
from megatron_entropy.testing.ranks import init_megatron, run_distributed
from megatron_entropy.trainer.rollouts import collect_step_groups

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
LAYOUTS = [(2, 2, True), (2, 1, True), (4, 1, True), (2, 2, False), (2, 1, False)]


def _worker(tensor: int, shared: bool) -> dict:
    init_megatron(tensor)
    cfg = load_config(QUICKSTART, [f"model.hf_path={REPO / 'examples' / 'quickstart_model'}"])
    r, d = cfg.rollout, cfg.data
    leader = dist.get_rank() == 0 if shared else dist.get_rank() % tensor == 0
    engine = build_engine(r, cfg.model.hf_path, Path("/tmp")) if leader else None
    data = load_prompt_dataset(d, load_tokenizer(cfg.model.hf_path), r.max_prompt_tokens, "train")
    sampler = PromptSampler(len(data), d.shuffle, d.seed)
    step = collect_step_groups(
        engine, lambda n: [data[i] for i in sampler.next_indices(n)],
        SamplingParams(n=r.n_samples, temperature=r.temperature, max_new_tokens=r.max_new_tokens,
                       seed=r.seed), RewardScorer(cfg.reward), shared, d.prompts_per_step,
        d.dynamic_sampling, d.max_refill_rounds)
    return {"bytes_received": step.bytes_received, "share_bytes": len(pickle.dumps(step.share)),
            "kept_groups": len(step.kept), "generated_groups": len(step.generated)}


def main() -> None:
    rows = []
    for world, tensor, shared in LAYOUTS:
        out = run_distributed(_worker, world, tensor, shared, timeout=600)
        step_bytes = sum(o["share_bytes"] for o in out[::tensor])  # one rank per DP replica
        rows.append({"engine": "shared" if shared else "per-rank", "tensor": tensor,
                     "dp": world // tensor, "kept_groups": out[0]["kept_groups"],
                     "generated_groups": out[0]["generated_groups"], "step_payload": step_bytes,
                     "bytes_received": [o["bytes_received"] for o in out]})
    print("| engine | TP | DP | kept / generated groups | kept payload (B) | bytes received by rank |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(f"| {row['engine']} | {row['tensor']} | {row['dp']} | {row['kept_groups']} / "
              f"{row['generated_groups']} | {row['step_payload']:,} | "
              f"{', '.join(f'{b:,}' for b in row['bytes_received'])} |")
    out_dir = REPO / "runs"
    out_dir.mkdir(exist_ok=True)
    (out_dir / "bench_rollout_share.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
