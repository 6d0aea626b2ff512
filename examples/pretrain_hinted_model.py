"""Train the two-mode study policy from scratch on CPU: a tiny Qwen2-style model for the hinted
task (``data.task: hinted``) that answers either by taking the problem's guess or by working the
sum out, each about half of the time.

Like examples/pretrain_study_model.py (whose tokenizer, model, batching and measurements it
uses): supervised training on responses prompted exactly as the RL run prompts, each training
problem answered in one mode drawn at random (``--direct-prob``): the guess boxed
(``megatron_entropy.data.hinted.direct_solution``), or the terms added two at a time in a random
order. The validation and test problems of the default ``data.hinted`` config are held out.
Training stops once T = 1 samples on held-out problems copy the guess in the direct mode at least
``--target-copy`` of the time and the worked mode is right at least ``--target-worked`` of the
time; the worked mode is then still less accurate than the guess, which is what makes the
task a test of exploration (trained on, the worked mode overtakes the guess). The defaults
make examples/hinted_model.
The script measures what RL starts from (share and accuracy of each mode, entropy at the
mode-choice token against every other token) into training_summary.json.

    python examples/pretrain_hinted_model.py                 # writes examples/hinted_model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch

from megatron_entropy.config import HintedConfig
from megatron_entropy.data.dataset import load_tokenizer
from megatron_entropy.data.hinted import (direct_solution, hinted_splits, hinted_worked_solution,
                                          mode_accuracy, solution_mode)
from megatron_entropy.rewards import math_rewards
from pretrain_quickstart_model import (common_arguments, save, train_on_examples)
from pretrain_study_model import Worked, prepare, sample_responses, token_entropies


def start_report(out_dir: Path, problems, tokenizer, n: int, max_new_tokens: int) -> dict:
    """What RL starts from at T = 1: accuracy, share and accuracy of each mode, and the entropy
    of the mode-choice token (the response's first) against every other response token."""
    model, prompt_ids, done = sample_responses(out_dir, problems, tokenizer, n, 1.0,
                                               max_new_tokens)
    flat = [c for group in done for c in group]
    texts = [c.text for c in flat]
    rewards = math_rewards(texts, [p.answer for p in problems for _ in range(n)])
    entropies = token_entropies(model, prompt_ids, done)
    first = [float(e[0]) for e in entropies if len(e)]
    rest = torch.cat([e[1:] for e in entropies])
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    guess_right = [p.guess == int(p.answer) for p in problems for _ in range(n)]
    direct = [(r, g) for t, r, g in zip(texts, rewards, guess_right) if solution_mode(t) == "direct"]
    return {
        "samples": len(flat), "temperature": 1.0, "accuracy": mean(rewards),
        "modes": {m: {"share": count / len(flat), "accuracy": acc}
                  for m, (count, acc) in mode_accuracy(texts, rewards).items()},
        "direct_right_when_guess_right": mean([r for r, g in direct if g]),
        "direct_right_when_guess_wrong": mean([r for r, g in direct if not g]),
        "entropy_mode_token": mean(first),
        "entropy_other_tokens": float(rest.mean()) if len(rest) else 0.0,
        "entropy_seq_mean": mean([float(e.mean()) for e in entropies if len(e)]),
        "response_length_mean": mean([len(c.token_ids) for c in flat]),
    }


def hinted_arguments(ap: argparse.ArgumentParser, out: Path) -> None:
    """The options this script shares with examples/pretrain_tool_model.py: the model, the
    training and when it stops (``out``: the default folder)."""
    common_arguments(ap, out, hidden=64, ffn=256, layers=3, vocab=400, num_train=50_000,
                     batch_size=48, lr=3e-3, warmup=100, max_steps=3000, eval_every=100,
                     eval_problems=256, threads=2)
    ap.add_argument("--held-out", type=int, default=1024,
                    help="validation (and as many test) problems of the RL config kept out")
    ap.add_argument("--target-worked", type=float, default=0.45,
                    help="stop once the worked mode's T=1 accuracy on held-out problems reaches "
                         "this and the direct mode copies the guess --target-copy of the time")
    ap.add_argument("--target-copy", type=float, default=0.8)
    ap.add_argument("--report-samples", type=int, default=4, help="samples per problem at the end")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hinted_arguments(ap, Path(__file__).parent / "hinted_model")
    task = HintedConfig()
    ap.add_argument("--direct-prob", type=float, default=0.5,
                    help="share of training problems answered in the direct mode")
    ap.add_argument("--measure", type=Path, default=None, metavar="MODEL_DIR",
                    help="train nothing: print the T=1 report of this HF model folder")
    ap.add_argument("--guess-error", choices=["ten", "random"], default=task.guess_error,
                    help="how a wrong guess is off (data.hinted.guess_error)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()

    sizes = (task.min_terms, task.max_terms, task.max_operand, task.guess_right, task.seed,
             args.guess_error)
    splits = hinted_splits(args.num_train, args.held_out, args.held_out, *sizes)
    val = [Worked(p, "") for p in splits["val"][:args.eval_problems]]
    for w, p in zip(val, splits["val"]):
        w.guess = p.guess
    if args.measure:
        tokenizer = load_tokenizer(args.measure)
        print(json.dumps(start_report(args.measure, val, tokenizer, args.report_samples, 64),
                         indent=2))
        return
    rng = random.Random(args.seed)
    train = [Worked(p, direct_solution(p) if rng.random() < args.direct_prob
                    else hinted_worked_solution(p, rng)) for p in splits["train"]]

    tokenizer, model, pad_id, examples, n_params, max_new = prepare(train, args)

    history = []

    def evaluate(step: int) -> float:
        save(model, tokenizer, args.out)
        _, _, done = sample_responses(args.out, val, tokenizer, 1, 1.0, max_new)
        texts = [g[0].text for g in done]
        rewards = math_rewards(texts, [w.answer for w in val])
        modes = mode_accuracy(texts, rewards)
        copied = [solution_mode(t) == "direct" and t.strip() == f"\\boxed{{{w.guess}}}"
                  for t, w in zip(texts, val)]
        direct_n = modes["direct"][0]
        copy_rate = sum(copied) / max(1, direct_n)
        worked_acc = modes["worked"][1] or 0.0
        history.append({"step": step, "accuracy": sum(rewards) / len(rewards),
                        "modes": {m: list(v) for m, v in modes.items()}, "copy_rate": copy_rate,
                        "seconds": round(time.time() - started, 1)})
        print(f"step {step}: T=1 accuracy {sum(rewards) / len(rewards):.3f}; modes "
              + ", ".join(f"{m} {c} ({a if a is None else round(a, 3)})"
                          for m, (c, a) in modes.items())
              + f"; direct copies the guess {copy_rate:.2f}", flush=True)
        # train_on_examples stops at >= target: 1.0 once both parts are there.
        return 1.0 if copy_rate >= args.target_copy and worked_acc >= args.target_worked else 0.0

    args.target_acc = 1.0
    step, _ = train_on_examples(model, examples, pad_id, args, rng, started, evaluate)

    write_summary(args, tokenizer, splits, val, max_new, n_params, step,
                  time.time() - started, history)


def write_summary(args, tokenizer, splits, val, max_new: int, n_params: int, step: int,
                  seconds: float, history: list) -> None:
    """training_summary.json: the start report, the held-out digest and the training history."""
    report = start_report(args.out, val, tokenizer, args.report_samples, max_new)
    held = [p.question for p in splits["val"] + splits["test"]]
    summary = {"steps": step, "seconds": round(seconds, 1), "eval_problems": len(val),
               "held_out": args.held_out,
               "held_out_sha256": hashlib.sha256("\n".join(held).encode()).hexdigest(),
               "parameters": n_params, "vocab": len(tokenizer), "start_t1": report,
               "history": history, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"done: {step} steps in {seconds:.0f}s; wrote {args.out}")


if __name__ == "__main__":
    main()
