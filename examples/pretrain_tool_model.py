"""Train the tool study's starting policy from scratch on CPU: the hinted task's two-mode policy
(examples/pretrain_hinted_model.py) that also, rarely and often badly, calls a calculator.

Supervised on responses prompted exactly as the RL run prompts, each training problem answered
in one of three modes drawn at random: the guess boxed (direct), the terms added two at a time
(worked), or, with ``--tool-prob``, a call of the calculator in the ``plain`` tool format,
``<call>calculator: 13+7+18</call>``, whose result the real calculator inserts
(``<result>38</result>``, not trained on: it is the tool's, not the policy's) before the policy
boxes it. ``--bad-call-prob`` of the calls are malformed: a dangling ``+`` (the calculator answers
an error and the policy falls back to the guess) or a term left out (a wrong total, boxed). The
tokenizer has the format's tags as whole tokens. Training stops once T = 1 samples on held-out
problems, rolled out through the real multi-turn loop, copy the guess in the direct mode at least
``--target-copy`` of the time and the worked mode is right at least ``--target-worked``; the
measured start (share and accuracy of every mode, the tool calls' accuracy) goes into
training_summary.json.

    python examples/pretrain_tool_model.py                   # writes examples/tool_model
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import time
from pathlib import Path

import torch

from megatron_entropy.config import HintedConfig, load_config
from megatron_entropy.data.dataset import DEFAULT_PROMPT_SUFFIX, render_prompt
from megatron_entropy.data.hinted import (direct_solution, hinted_splits, hinted_worked_solution,
                                          mode_accuracy, solution_mode)
from megatron_entropy.rewards import math_rewards
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.tool_use.engine import build_rollout_engine
from megatron_entropy.tool_use.tools import Calculator, ToolError
from pretrain_hinted_model import hinted_arguments
from pretrain_quickstart_model import (build_model, build_tokenizer, make_portable, save,
                                       train_on_examples)

TAGS = ["<call>", "</call>", "<result>", "</result>"]
TOOLS = {"names": ["calculator"], "format": "plain", "max_turns": 2, "workers": 2}


def calculator_result(expression: str) -> str:
    """What the rollout loop inserts for a call (tool_use/pool.py's text of a result)."""
    try:
        return Calculator()(expression=expression)
    except ToolError as e:
        return f"error: {e}"


def tool_turns(problem, rng: random.Random, bad: bool) -> list[tuple[str, str]]:
    """(generated, inserted) pieces of a tool-mode response; ``bad``: a malformed call."""
    terms = list(map(str, problem.terms))
    expression = "+".join(terms)
    if bad:
        expression = expression + "+" if rng.random() < 0.5 else "+".join(
            t for k, t in enumerate(terms) if k != rng.randrange(len(terms)))
    result = calculator_result(expression)
    answer = problem.guess if result.startswith("error") else result
    return [(f"<call>calculator: {expression}</call>", f"<result>{result}</result>"),
            (f"\\boxed{{{answer}}}", "")]


def encode(tokenizer, prompt_ids: list[int], turns: list[tuple[str, str]]):
    """(prompt, response, keep): each piece tokenised on its own, as the loop inserts it."""
    response, keep = [], []
    for k, (generated, inserted) in enumerate(turns):
        g = tokenizer.encode(generated + ("<|im_end|>" if k == len(turns) - 1 else ""),
                             add_special_tokens=False)
        ins = tokenizer.encode(inserted, add_special_tokens=False) if inserted else []
        response += g + ins
        keep += [1] * len(g) + [0] * len(ins)
    return prompt_ids, response, keep


def rollout(out_dir: Path, problems, n: int, temperature: float, max_new: int):
    """Responses of the saved model through the multi-turn loop with the real calculator."""
    cfg = load_config(data={"rollout": {"tools": TOOLS, "batch_size": 128}})
    engine = build_rollout_engine(cfg.rollout, out_dir, out_dir)
    try:
        prompts = [engine.tokenizer.encode(render_prompt(p.question, engine.tokenizer, True,
                                                         DEFAULT_PROMPT_SUFFIX),
                                           add_special_tokens=False) for p in problems]
        done = engine.generate(prompts, SamplingParams(n=n, temperature=temperature, seed=0,
                                                       max_new_tokens=max_new))
    finally:
        engine.shutdown()
    texts = [c.text for group in done for c in group]
    rewards = math_rewards(texts, [p.answer for p in problems for _ in range(n)])
    return texts, rewards


def report(texts: list[str], rewards: list[float], problems, n: int) -> dict:
    modes = mode_accuracy(texts, rewards)
    guesses = [p.guess for p in problems for _ in range(n)]
    direct = [t for t in texts if solution_mode(t) == "direct"]
    copied = sum(t.strip() == f"\\boxed{{{g}}}" for t, g in zip(texts, guesses)
                 if solution_mode(t) == "direct")
    calls = [t for t in texts if solution_mode(t) == "tool"]
    return {"samples": len(texts), "accuracy": sum(rewards) / len(rewards),
            "modes": {m: {"share": c / len(texts), "accuracy": a} for m, (c, a) in modes.items()},
            "copy_rate": copied / max(1, len(direct)),
            "tool_call_error_frac": sum("<result>error" in t for t in calls) / max(1, len(calls))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    hinted_arguments(ap, Path(__file__).parent / "tool_model")
    ap.add_argument("--direct-prob", type=float, default=0.46)
    ap.add_argument("--tool-prob", type=float, default=0.06,
                    help="share of training responses that call the calculator")
    ap.add_argument("--bad-call-prob", type=float, default=0.5,
                    help="share of those calls that are malformed")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()
    task = HintedConfig()
    splits = hinted_splits(args.num_train, args.held_out, args.held_out, task.min_terms,
                           task.max_terms, task.max_operand, task.guess_right, task.seed,
                           task.guess_error)
    rng = random.Random(args.seed)
    responses = []
    for p in splits["train"]:
        u = rng.random()
        if u < args.tool_prob:
            responses.append(tool_turns(p, rng, rng.random() < args.bad_call_prob))
        elif u < args.tool_prob + args.direct_prob:
            responses.append([(direct_solution(p), "")])
        else:
            responses.append([(hinted_worked_solution(p, rng), "")])
    corpus = [f"user\n{p.question} {DEFAULT_PROMPT_SUFFIX}" for p in splits["train"][:5000]]
    corpus += ["\nassistant\n" + "".join(g + i for g, i in r) for r in responses[:5000]]
    tokenizer = build_tokenizer(corpus, args.vocab)
    tokenizer.add_tokens(TAGS)  # whole tokens, kept in decoded text
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(len(tokenizer), args, eos_id, pad_id)
    prompts = tokenizer([render_prompt(p.question, tokenizer, True, DEFAULT_PROMPT_SUFFIX)
                         for p in splits["train"]], add_special_tokens=False)["input_ids"]
    examples = [encode(tokenizer, ids, r) for ids, r in zip(prompts, responses)]
    max_new = max(len(e[1]) for e in examples) + 8
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer: {len(tokenizer)} tokens; model: {n_params / 1e6:.2f}M parameters; "
          f"{len(examples)} training problems", flush=True)
    val = splits["val"][:args.eval_problems]
    history = []

    def evaluate(step: int) -> float:
        save(model, tokenizer, args.out)
        texts, rewards = rollout(args.out, val, 1, 1.0, max_new)
        r = report(texts, rewards, val, 1)
        history.append({"step": step, **r, "seconds": round(time.time() - started, 1)})
        print(f"step {step}: T=1 accuracy {r['accuracy']:.3f}; modes "
              + ", ".join(f"{m} {v['share']:.2f} ({v['accuracy']})" for m, v in r["modes"].items())
              + f"; copy {r['copy_rate']:.2f}", flush=True)
        worked = r["modes"]["worked"]["accuracy"] or 0.0
        return 1.0 if r["copy_rate"] >= args.target_copy and worked >= args.target_worked else 0.0

    args.target_acc = 1.0
    step, _ = train_on_examples(model, examples, pad_id, args, rng, started, evaluate)
    save(model, tokenizer, args.out)
    make_portable(args.out)
    texts, rewards = rollout(args.out, val, args.report_samples, 1.0, max_new)
    held = [p.question for p in splits["val"] + splits["test"]]
    summary = {"steps": step, "seconds": round(time.time() - started, 1), "parameters": n_params,
               "vocab": len(tokenizer), "max_new_tokens": max_new,
               "held_out_sha256": hashlib.sha256("\n".join(held).encode()).hexdigest(),
               "start_t1": report(texts, rewards, val, args.report_samples),
               "history": history, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary["start_t1"], indent=2))


if __name__ == "__main__":
    main()
