"""Train the long-response policy from scratch on CPU: a tiny Qwen2-style model for the chains
task (``data.task: chains``, megatron_entropy/data/chains.py) that follows an addition chain line
by line, so that RL starts with responses of ~100 to ~2,000 tokens that are right only some of
the time.

Like examples/pretrain_quickstart_model.py (whose tokenizer, model and batching it uses), with
one twist that keeps training cheap: every line of a chain depends only on the line before it, so
the model learns from whole short chains (up to ``--full-steps`` additions, which teach the end of
a chain) and from the first ``--prefix-lines`` lines of long ones (which teach large counts and
totals; their responses are cut there, without an end token), never from a sequence longer than
a few hundred tokens. The validation problems of the default ``data.chains`` config are held
out; training stops once greedy accuracy on the first ``--eval-problems`` of them (whole chains,
of every length) reaches ``--target-acc``.

    python examples/pretrain_chains_model.py --out examples/chains_model
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from megatron_entropy.config import ChainsConfig
from megatron_entropy.data.chains import ChainProblem, chain_splits
from megatron_entropy.data.dataset import DEFAULT_PROMPT_SUFFIX, render_prompt
from pretrain_quickstart_model import (common_arguments, rewards_of, save, tokenizer_and_model,
                                       train_on_examples)


class Worked:
    """A problem with its (possibly cut) worked solution, as the quickstart helpers read it."""

    def __init__(self, problem: ChainProblem, lines: int | None = None):
        self.question, self.answer, self.source = problem.question, problem.answer, problem.source
        self.solution = problem.solution(lines)
        self.whole = lines is None or lines >= problem.steps


def training_items(args, held_out: set[str]) -> list[Worked]:
    """Whole short chains and the first lines of long ones (module docstring)."""
    rng = random.Random(args.seed)
    cfg = ChainsConfig()
    items = []
    while len(items) < args.num_train:
        p = ChainProblem(rng.randint(1, cfg.max_start), rng.randint(1, cfg.max_step),
                         rng.randint(1, args.full_steps) if rng.random() < 0.6
                         else rng.randint(args.full_steps + 1, cfg.max_steps))
        if p.question in held_out:
            continue
        items.append(Worked(p, None if p.steps <= args.full_steps else args.prefix_lines))
    return items


def encode(items: list[Worked], tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids): a whole chain ends with the end token, a cut one does not."""
    prompts = [render_prompt(p.question, tokenizer, True, DEFAULT_PROMPT_SUFFIX) for p in items]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    responses = tokenizer([p.solution + ("<|im_end|>" if p.whole else "\n") for p in items],
                          add_special_tokens=False)["input_ids"]
    return list(zip(prompt_ids, responses))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap, Path(__file__).parent / "chains_model", hidden=64, ffn=192, layers=2,
                     vocab=300, num_train=30_000, batch_size=16, lr=3e-3, warmup=50,
                     max_steps=1400, eval_every=700, eval_problems=4, threads=1)
    ap.add_argument("--full-steps", type=int, default=12,
                    help="chains up to this many additions are trained on whole")
    ap.add_argument("--prefix-lines", type=int, default=12,
                    help="lines kept of the longer chains")
    ap.add_argument("--target-acc", type=float, default=0.5,
                    help="stop once greedy accuracy on whole validation chains reaches this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()

    cfg = ChainsConfig()
    val = chain_splits(cfg, 0, 0)["val"]
    items = training_items(args, {p.question for p in val})
    tokenizer, model, pad_id, _ = tokenizer_and_model(items[:5000], args)
    # RoPE's frequencies do not depend on it: the config states what the RL runs reach
    model.config.max_position_embeddings = tokenizer.model_max_length = 4096
    examples = encode(items, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tokenizer)} tokens; model: {n_params / 1e6:.2f}M parameters; "
          f"{len(examples)} examples, longest {max(len(p) + len(r) for p, r in examples)} "
          "tokens", flush=True)
    evals = [Worked(p) for p in val[:args.eval_problems]]
    max_new = 13 * cfg.max_steps + 16
    history = []

    def evaluate(step: int) -> float:
        save(model, tokenizer, args.out)
        rewards = rewards_of(args.out, evals, tokenizer, max_new)
        acc = sum(rewards) / len(rewards)
        history.append({"step": step, "greedy_acc": acc,
                        "seconds": round(time.time() - started, 1)})
        print(f"step {step}: greedy accuracy {acc:.3f} on {len(evals)} whole validation "
              "chains", flush=True)
        return acc

    step, acc = train_on_examples(model, examples, pad_id, args, random.Random(args.seed),
                                  started, evaluate)
    save(model, tokenizer, args.out)
    sampled = rewards_of(args.out, evals, tokenizer, max_new, temperature=1.0, n=2)
    summary = {"steps": step, "seconds": round(time.time() - started, 1), "greedy_acc": acc,
               "sampled_acc_t1": sum(sampled) / len(sampled), "eval_problems": len(evals),
               "parameters": n_params, "vocab": len(tokenizer), "history": history,
               "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"done: {step} steps in {summary['seconds']:.0f}s, greedy accuracy {acc:.3f}, "
          f"sampled (T=1) {summary['sampled_acc_t1']:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
