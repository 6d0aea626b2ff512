"""Train the study policy from scratch on CPU: a tiny Qwen2-style model for the sums task
(``data.task: sums``) whose worked solutions fork, so that it starts RL with entropy to trade.

Like examples/pretrain_quickstart_model.py (whose tokenizer, model and batching it uses): a
byte-level BPE tokenizer with a chat template, then supervised training on worked solutions
prompted exactly as the RL run prompts. Each training problem gets one worked solution drawn at
random (``megatron_entropy.data.sums.worked_solution``): the terms in a uniformly random order,
each line adding two to four numbers, so the policy learns every valid way. The validation
problems of the default ``data.sums`` config are held out. Training stops once the accuracy of
samples at temperature 1 on held-out problems reaches ``--target-acc``; the script then measures
what RL starts from (accuracy and per-token entropy at T = 1, entropy split by token kind, and how
reliable each kind of line is) into training_summary.json.

    python examples/pretrain_study_model.py --out examples/study_model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import re
import time
from pathlib import Path

import torch

from megatron_entropy.config import SumsConfig
from megatron_entropy.data.dataset import load_tokenizer
from megatron_entropy.data.sums import (generate_sum_problems, train_val_sum_problems,
                                        worked_solution)
from megatron_entropy.rewards import math_rewards
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.inprocess import InProcessEngine
from pretrain_quickstart_model import (common_arguments, encode_examples, save,
                                       tokenizer_and_model, train_on_examples)


class Worked:
    """A problem with one of its worked solutions (what ``encode_examples`` reads)."""

    def __init__(self, problem, solution: str):
        self.question, self.answer, self.source = problem.question, problem.answer, problem.source
        self.solution = solution


def sample_responses(out_dir: Path, problems, tokenizer, n: int, temperature: float,
                     max_new_tokens: int):
    """Responses of the saved model, ``n`` per problem (problem-major), sampled as RL samples."""
    engine = InProcessEngine(out_dir, dtype="fp32", batch_size=128)
    prompt_ids = [p for p, _ in encode_examples(problems, tokenizer)]
    done = engine.generate(prompt_ids, SamplingParams(n=n, temperature=temperature, seed=0,
                                                      max_new_tokens=max_new_tokens))
    return engine.model, prompt_ids, done


@torch.no_grad()
def token_entropies(model, prompt_ids, completions, batch: int = 64) -> list[torch.Tensor]:
    """Entropy (nats, T = 1, full vocabulary) of the policy at every response position."""
    pairs = [(p, c.token_ids) for p, group in zip(prompt_ids, completions) for c in group]
    out = []
    for i in range(0, len(pairs), batch):
        chunk = pairs[i:i + batch]
        width = max(len(p) + len(r) for p, r in chunk)
        ids = torch.zeros((len(chunk), width), dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for j, (p, r) in enumerate(chunk):
            ids[j, :len(p) + len(r)] = torch.tensor(p + r)
            mask[j, :len(p) + len(r)] = 1
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits.float(), -1)
        ent = -(logp.exp() * logp).sum(-1)
        for j, (p, r) in enumerate(chunk):
            out.append(ent[j, len(p) - 1:len(p) + len(r) - 1].clone())
    return out


def token_kind(prev: str, text: str) -> str:
    """Which decision a response token is, from the text before it: a term chosen (the first
    number or one after an operator), a result digit (after ``=``, boxed or not), a copy (the
    running total that starts a later line), an operator (whether the line goes on with ``+`` or
    ``-`` or ends with ``=``), or layout."""
    stripped = text.strip()
    if stripped.isdigit():
        if re.search(r"=(\\boxed\{)?-?\d*\Z", prev):
            return "result_digit"
        if re.search(r"\n-?\d*\Z", prev):
            return "copy_digit"
        return "term_digit"
    if stripped and set(stripped) <= set("+-="):
        return "operator"
    return "layout"


LINE = re.compile(r"^(-?\d+(?:[+-]\d+)+)=")  # "7+15-4=18", "-3+9=\boxed{6}"


def start_report(out_dir: Path, problems, tokenizer, n: int, max_new_tokens: int) -> dict:
    """What RL starts from at T = 1: accuracy, per-token entropy (token mean and mean of
    per-sequence means, as the trainer logs them), entropy per token kind, and accuracy of
    responses by how they were written."""
    model, prompt_ids, done = sample_responses(out_dir, problems, tokenizer, n, 1.0,
                                               max_new_tokens)
    flat = [c for group in done for c in group]
    rewards = math_rewards([c.text for c in flat], [p.answer for p in problems for _ in range(n)])
    entropies = token_entropies(model, prompt_ids, done)
    kinds: dict[str, list[float]] = {}
    by_style: dict[str, list[float]] = {}
    lengths = []
    for c, ent, r in zip(flat, entropies, rewards):
        lengths.append(len(c.token_ids))
        text = ""
        for tok, h in zip(c.token_ids, ent.tolist()):
            piece = tokenizer.decode([tok])
            kinds.setdefault(token_kind(text, piece), []).append(h)
            text += piece
        lines = c.text.split("\n")
        widths = [len(re.findall(r"\d+", m.group(1))) for m in map(LINE.match, lines) if m]
        by_style.setdefault(f"widest_line_{max(widths, default=0)}_numbers", []).append(r)
    tokens = sum(len(e) for e in entropies)
    mean = lambda xs: sum(xs) / max(1, len(xs))  # noqa: E731
    return {
        "samples": len(flat), "temperature": 1.0, "accuracy": mean(rewards),
        "entropy_token_mean": float(sum(float(e.sum()) for e in entropies) / tokens),
        "entropy_seq_mean": mean([float(e.mean()) for e in entropies if len(e)]),
        "response_length_mean": mean(lengths),
        "entropy_by_token_kind": {k: {"share_of_tokens": len(v) / tokens, "mean": mean(v)}
                                  for k, v in sorted(kinds.items())},
        "accuracy_by_style": {k: {"share": len(v) / len(flat), "accuracy": mean(v)}
                              for k, v in sorted(by_style.items())},
    }


def prepare(train, args):
    """The tokenizer, model, pad id and encoded examples (``tokenizer_and_model``), the model's
    parameter count and the generation cap (the longest training response + 8), printed."""
    tokenizer, model, pad_id, examples = tokenizer_and_model(train, args)
    n_params = sum(p.numel() for p in model.parameters())
    max_new = max(len(r) for _, r in examples) + 8
    print(f"tokenizer: {len(tokenizer)} tokens; model: {n_params / 1e6:.2f}M parameters; "
          f"{len(examples)} training problems; responses up to {max_new - 8} tokens", flush=True)
    return tokenizer, model, pad_id, examples, n_params, max_new


def held_out_digest(problems) -> str:
    """sha256 of the held-out questions, one a line: tests check that the RL validation set of
    the default data.sums config is among them."""
    return hashlib.sha256("\n".join(p.question for p in problems).encode()).hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap, Path(__file__).parent / "study_model", hidden=128, ffn=384, layers=4,
                     vocab=400, num_train=100_000, batch_size=64, lr=2e-3, warmup=200,
                     max_steps=20_000, eval_every=100, eval_problems=256, threads=1,
                     threads_help="the shipped model was trained on one thread")
    sums = SumsConfig()
    ap.add_argument("--min-terms", type=int, default=sums.min_terms)
    ap.add_argument("--max-terms", type=int, default=sums.max_terms)
    ap.add_argument("--max-operand", type=int, default=sums.max_operand)
    ap.add_argument("--subtract-prob", type=float, default=sums.subtract_prob,
                    help="the task's settings; data.sums of the RL run must match them")
    ap.add_argument("--more-prob", type=float, default=0.5,
                    help="chance that a solution line with 2 (or 3) numbers takes one more")
    ap.add_argument("--max-numbers", type=int, default=4, help="most numbers on one line")
    ap.add_argument("--held-out", type=int, default=1024,
                    help="validation problems of the RL config kept out of training")
    ap.add_argument("--target-acc", type=float, default=0.3,
                    help="stop once accuracy of T=1 samples on held-out problems reaches this")
    ap.add_argument("--report-samples", type=int, default=4, help="samples per problem at the end")
    ap.add_argument("--measure", type=Path, default=None, metavar="MODEL_DIR",
                    help="train nothing: print the T=1 report of this HF model folder (e.g. an RL "
                         "run exported with tools/convert_mcore_to_hf.py)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()

    sizes = (args.min_terms, args.max_terms, args.max_operand)
    _, held_out = train_val_sum_problems(0, args.held_out, *sizes, sums.seed, args.subtract_prob)
    val = [Worked(p, "") for p in held_out[:args.eval_problems]]
    if args.measure:
        tokenizer = load_tokenizer(args.measure)
        print(json.dumps(start_report(args.measure, val, tokenizer, args.report_samples, 96),
                         indent=2))
        return
    rng = random.Random(args.seed)
    train = [Worked(p, worked_solution(p.terms, rng, args.more_prob, args.max_numbers))
             for p in generate_sum_problems(args.num_train, *sizes, seed=args.seed,
                                            exclude=frozenset(p.question for p in held_out),
                                            subtract_prob=args.subtract_prob)]

    tokenizer, model, pad_id, examples, n_params, max_new = prepare(train, args)

    history = []

    def evaluate(step: int) -> float:
        save(model, tokenizer, args.out)
        _, _, done = sample_responses(args.out, val, tokenizer, 1, 1.0, max_new)
        rewards = math_rewards([g[0].text for g in done], [w.answer for w in val])
        acc = sum(rewards) / len(rewards)
        history.append({"step": step, "sampled_acc_t1": acc,
                        "seconds": round(time.time() - started, 1)})
        print(f"step {step}: accuracy of T=1 samples {acc:.3f} on {len(val)} held-out "
              f"problems", flush=True)
        return acc

    step, acc = train_on_examples(model, examples, pad_id, args, rng, started, evaluate)

    seconds = time.time() - started
    report = start_report(args.out, val, tokenizer, args.report_samples, max_new)
    summary = {"steps": step, "seconds": round(seconds, 1), "eval_problems": len(val),
               "held_out": len(held_out), "held_out_sha256": held_out_digest(held_out),
               "parameters": n_params, "vocab": len(tokenizer), "start_t1": report,
               "history": history, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"done: {step} steps in {seconds:.0f}s; wrote {args.out}")


if __name__ == "__main__":
    main()
