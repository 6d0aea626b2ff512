"""Train the policy of the long two-mode task from scratch on CPU: a tiny Qwen2-style model for
the chains task with a guess (``data.task: chains`` with ``data.chains.guess_right``,
megatron_entropy/data/chains.py) that answers either by boxing the problem's guess (a few tokens)
or by working the whole chain out (~400 tokens), each about half of the time.

Like examples/pretrain_hinted_model.py (whose measurements it shares) on the chains task: each
training problem is answered in one mode drawn at random (``--direct-prob``), the worked mode with
the whole chain, so the model learns to keep its place over the lengths RL samples. The
validation and test problems of the study's ``data.chains`` (the default lengths, guess right
``--guess-right`` of the time) are held out. Training stops once T = 1 samples on held-out
problems copy the guess in the direct mode at least ``--target-copy`` of the time and the worked
mode is right at least ``--target-worked`` of the time: below the guess's rate, with one slip
in a line enough to lose a chain, so that the worked mode pays less at first and practice (fewer
slips a line) can make it pay more. examples/long_model was made with it in two phases, the
second continuing the first (``--init``), stopped by the time budget short of the targets; its
training_summary.json holds the phases and what RL starts from, with the worked mode's accuracy
by chain length.

    python examples/pretrain_long_model.py                 # writes examples/long_model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from megatron_entropy.config import ChainsConfig
from megatron_entropy.data.chains import chain_splits
from megatron_entropy.data.dataset import load_tokenizer
from megatron_entropy.data.hinted import direct_solution, mode_accuracy, solution_mode
from megatron_entropy.rewards import math_rewards
from pretrain_hinted_model import hinted_arguments
from pretrain_quickstart_model import encode_examples, save, train_on_examples
from pretrain_study_model import Worked, prepare, sample_responses


def start_report(out_dir: Path, problems: list[Worked], tokenizer, n: int,
                 max_new_tokens: int) -> dict:
    """What RL starts from at T = 1: accuracy, share and accuracy of each mode, how often the
    direct mode copies the guess, and the worked mode's length and accuracy by chain length."""
    _, _, done = sample_responses(out_dir, problems, tokenizer, n, 1.0, max_new_tokens)
    flat = [(w, c) for w, group in zip(problems, done) for c in group]
    texts = [c.text for _, c in flat]
    rewards = math_rewards(texts, [w.answer for w, _ in flat])
    modes = [solution_mode(t) for t in texts]
    direct = [t.strip() == direct_solution(w) for (w, _), t, m in zip(flat, texts, modes)
              if m == "direct"]
    worked = [(w, len(c.token_ids), r) for (w, c), r, m in zip(flat, rewards, modes)
              if m == "worked"]
    by_length: dict[str, list[float]] = {}
    for w, _, r in worked:
        by_length.setdefault(w.source.removeprefix("hinted_chains_"), []).append(r)
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    return {
        "samples": len(flat), "temperature": 1.0, "accuracy": mean(rewards),
        "modes": {m: {"share": count / len(flat), "accuracy": acc}
                  for m, (count, acc) in mode_accuracy(texts, rewards).items()},
        "direct_copies_guess": mean(direct),
        "guess_right": mean([w.guess == int(w.answer) for w, _ in flat]),
        "worked_tokens_median": statistics.median([t for _, t, _ in worked]) if worked else 0,
        "worked_accuracy_by_length": {k: {"samples": len(v), "accuracy": mean(v)}
                                      for k, v in sorted(by_length.items())},
        "response_tokens_mean": mean([len(c.token_ids) for _, c in flat]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hinted_arguments(ap, Path(__file__).parent / "long_model")
    ap.set_defaults(vocab=300, num_train=40_000, batch_size=8, lr=3e-3, warmup=100,
                    max_steps=5000, eval_every=500, eval_problems=48, threads=1,
                    target_worked=0.35, report_samples=2)
    ap.add_argument("--length-buckets", type=int, default=32,
                    help="batches drawn from windows of this many batches sorted by length")
    ap.add_argument("--guess-right", type=float, default=0.6,
                    help="data.chains.guess_right of the RL runs")
    ap.add_argument("--direct-prob", type=float, default=0.5,
                    help="share of training problems answered in the direct mode")
    ap.add_argument("--report-problems", type=int, default=128)
    ap.add_argument("--init", type=Path, default=None, metavar="MODEL_DIR",
                    help="continue from this model folder (its tokenizer and weights) instead "
                         "of a new model")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()

    task = ChainsConfig(guess_right=args.guess_right, num_val=args.held_out)
    splits = chain_splits(task, args.num_train, args.held_out)

    def worked(p, solution: str) -> Worked:
        w = Worked(p, solution)
        w.guess = p.guess
        return w

    val = [worked(p, "") for p in splits["val"]]
    rng = random.Random(args.seed)
    train = [worked(p, direct_solution(p) if rng.random() < args.direct_prob else p.solution())
             for p in splits["train"]]
    if args.init:
        tokenizer = load_tokenizer(args.init)
        model = AutoModelForCausalLM.from_pretrained(args.init)
        pad_id = tokenizer.pad_token_id
        examples = encode_examples(train, tokenizer)
        n_params = sum(p.numel() for p in model.parameters())
        max_new = max(len(r) for _, r in examples) + 8
    else:
        tokenizer, model, pad_id, examples, n_params, max_new = prepare(train, args)
    # RoPE's frequencies do not depend on it: the config states what the RL runs reach
    model.config.max_position_embeddings = tokenizer.model_max_length = 4096

    history = []

    def evaluate(step: int) -> float:
        save(model, tokenizer, args.out)
        report = start_report(args.out, val[:args.eval_problems], tokenizer, 1, max_new)
        history.append({"step": step, "seconds": round(time.time() - started, 1), **report})
        modes = report["modes"]
        print(f"step {step}: T=1 accuracy {report['accuracy']:.3f}; "
              + ", ".join(f"{m} {v['share']:.2f} ({v['accuracy']})" for m, v in modes.items())
              + f"; copies {report['direct_copies_guess']:.2f}; worked by length "
              + json.dumps(report["worked_accuracy_by_length"]), flush=True)
        done = (report["direct_copies_guess"] >= args.target_copy
                and (modes["worked"]["accuracy"] or 0.0) >= args.target_worked)
        # train_on_examples stops at >= target: 1.0 once both parts are there.
        return 1.0 if done else 0.0

    args.target_acc = 1.0
    # Batches of chains of like lengths, each problem in its own mode: both modes in every
    # batch (batches of one mode swing the mode-choice token from step to step), no long
    # response padded to a short one.
    step, _ = train_on_examples(model, examples, pad_id, args, rng, started, evaluate,
                                lengths=[p.steps for p in splits["train"]])
    save(model, tokenizer, args.out)
    seconds = time.time() - started
    report = start_report(args.out, val[:args.report_problems], tokenizer, args.report_samples,
                          max_new)
    held = [p.chain for p in splits["val"] + splits["test"]]
    summary = {"steps": step, "seconds": round(seconds, 1), "parameters": n_params,
               "vocab": len(tokenizer), "held_out": args.held_out,
               "held_out_sha256": hashlib.sha256("\n".join(held).encode()).hexdigest(),
               "report_problems": args.report_problems, "start_t1": report, "history": history,
               "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"done: {step} steps in {seconds:.0f}s; wrote {args.out}")


if __name__ == "__main__":
    main()
