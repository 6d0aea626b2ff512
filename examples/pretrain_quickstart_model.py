"""Train the quickstart policy from scratch on CPU: a tiny Qwen2-style model that already solves
some of the synthetic arithmetic task, so that RL has something to improve.

It builds a byte-level BPE tokenizer (Qwen2's pre-tokenizer: digits one by one) with a Qwen-style
chat template, then trains the model supervised on worked solutions ("3 * 5 = 15", one operation
per line, ending in \\boxed{answer}) of generated problems, prompted exactly as the RL run prompts
it (chat template + the paper's \\boxed{} instruction). The validation problems of the default
``data.arithmetic`` config are held out. Training stops as soon as greedy accuracy on them reaches
``--target-acc`` (the quickstart wants a model that is right only some of the time), and the
folder is written as config.json, generation_config.json, model.safetensors, tokenizer.json,
tokenizer_config.json.

    python examples/pretrain_quickstart_model.py --out examples/quickstart_model
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_entropy.config import ArithmeticConfig
from megatron_entropy.data.arithmetic import generate_problems, train_val_problems
from megatron_entropy.data.dataset import DEFAULT_PROMPT_SUFFIX, render_prompt
from megatron_entropy.rewards import math_rewards
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.inprocess import InProcessEngine

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# Qwen2's pre-tokenizer split (digits one by one). transformers 5 rebuilds a qwen2 model's
# tokenizer with exactly this pipeline whatever tokenizer.json says, so the tokenizer must use it
# for every loader (transformers 4/5, vLLM) to produce the ids the model was trained on.
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
               r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def build_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE,
                                   model_max_length=512)


def build_model(vocab_size: int, args, eos_id: int, pad_id: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.ffn,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=512, rope_theta=10000.0,
        rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
        bos_token_id=pad_id, eos_token_id=eos_id, pad_token_id=pad_id)
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(args.seed)
    return Qwen2ForCausalLM(config)


def encode_examples(problems, tokenizer) -> list[tuple[list[int], list[int]]]:
    prompts = [render_prompt(p.question, tokenizer, True, DEFAULT_PROMPT_SUFFIX) for p in problems]
    prompt_ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    answers = tokenizer([p.solution + "<|im_end|>" for p in problems],
                        add_special_tokens=False)["input_ids"]
    return list(zip(prompt_ids, answers))


def make_batch(examples, pad_id: int):
    """Right-padded tokens and labels; only response tokens are trained on (of an example
    (prompt, response, keep), the response tokens that ``keep`` marks: not what a tool inserted)."""
    width = max(len(e[0]) + len(e[1]) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), -100, dtype=torch.long)
    for i, (p, r, *keep) in enumerate(examples):
        seq = p + r
        ids[i, :len(seq)] = torch.tensor(seq)
        target = torch.tensor(r)
        if keep:
            target = torch.where(torch.tensor(keep[0], dtype=torch.bool), target, -100)
        labels[i, len(p):len(seq)] = target
    return ids, labels


def rewards_of(out_dir: Path, problems, tokenizer, max_new_tokens: int, temperature: float = 0.0,
               n: int = 1) -> list[float]:
    """Per-sample rewards of the saved model (problem-major), sampled as the RL run samples."""
    engine = InProcessEngine(out_dir, dtype="fp32", batch_size=128)
    prompt_ids = [p for p, _ in encode_examples(problems, tokenizer)]
    done = engine.generate(prompt_ids, SamplingParams(n=n, temperature=temperature, seed=0,
                                                      max_new_tokens=max_new_tokens))
    return math_rewards([c.text for group in done for c in group],
                        [p.answer for p in problems for _ in range(n)])


def save(model, tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    make_portable(out_dir)


def make_portable(out_dir: Path) -> None:
    """Readable by transformers 4.x and 5.x and by serving stacks: the chat template inside
    tokenizer_config.json, the generic fast-tokenizer class, rope theta and dtype under both their
    old and new keys."""
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.update(chat_template=CHAT_TEMPLATE, tokenizer_class="PreTrainedTokenizerFast")
    cfg.pop("backend", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    for extra in ("chat_template.jinja", "special_tokens_map.json"):
        (out_dir / extra).unlink(missing_ok=True)
    model_cfg_path = out_dir / "config.json"
    model_cfg = json.loads(model_cfg_path.read_text())
    rope = model_cfg.get("rope_parameters") or {}
    model_cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    model_cfg.setdefault("torch_dtype", model_cfg.get("dtype", "float32"))
    model_cfg_path.write_text(json.dumps(model_cfg, indent=2) + "\n")


def tokenizer_and_model(train, args):
    """A tokenizer fitted on the first 5000 training texts, the model, the pad id and the encoded
    examples (each item of ``train`` has .question and .solution)."""
    # The text between the template's special tokens, so that "user\n" etc. merge too.
    corpus = [f"user\n{p.question} {DEFAULT_PROMPT_SUFFIX}" for p in train[:5000]]
    corpus += [f"\nassistant\n{p.solution}" for p in train[:5000]]
    tokenizer = build_tokenizer(corpus, args.vocab)
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = build_model(len(tokenizer), args, eos_id, pad_id)
    return tokenizer, model, pad_id, encode_examples(train, tokenizer)


def train_on_examples(model, examples, pad_id: int, args, rng: random.Random, started: float,
                      evaluate: Callable[[int], float], lengths: list[int] | None = None
                      ) -> tuple[int, float]:
    """Supervised training in shuffled batches (AdamW, warm-up then cosine to 10%), evaluated
    every ``args.eval_every`` steps; stops at ``args.max_steps`` or once ``evaluate(step)``
    reaches ``args.target_acc``. Returns the steps taken and the last accuracy. With
    ``args.length_buckets`` = K > 0, each batch is drawn from a window of K batches' examples
    sorted by ``lengths`` (default: the responses' lengths), so that long responses are not
    padded to short ones."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.max_steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))

    batches: list[list[int]] = []
    window = args.batch_size * max(1, getattr(args, "length_buckets", 0))
    acc, step = 0.0, 0
    model.train()
    while step < args.max_steps:
        if not batches:
            order = list(range(len(examples)))
            rng.shuffle(order)
            # Taken from the end, the remainder at the start left out.
            order = order[::-1][:len(order) - len(order) % args.batch_size]
            if window > args.batch_size:
                order = [i for w in range(0, len(order), window) for i in sorted(
                    order[w:w + window],
                    key=lambda i: len(examples[i][1]) if lengths is None else lengths[i])]
            batches = [order[b:b + args.batch_size] for b in range(0, len(order),
                                                                     args.batch_size)][::-1]
            if window > args.batch_size:
                rng.shuffle(batches)
        batch = [examples[i] for i in batches.pop()]
        ids, labels = make_batch(batch, pad_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f} lr {lr_at(step):.2e} "
                  f"{time.time() - started:.0f}s", flush=True)
        if step % args.eval_every == 0:
            model.eval()
            acc = evaluate(step)
            model.train()
            if acc >= args.target_acc:
                break
    return step, acc


def common_arguments(ap: argparse.ArgumentParser, out: Path, *, hidden: int, ffn: int,
                     layers: int, vocab: int, num_train: int, batch_size: int, lr: float,
                     warmup: int, max_steps: int, eval_every: int, eval_problems: int,
                     threads: int, threads_help: str | None = None) -> None:
    """The options every pretrain script has (the model's shape, the data's size, the schedule,
    threads and seed), at the script's own defaults."""
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--ffn", type=int, default=ffn)
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=vocab)
    ap.add_argument("--num-train", type=int, default=num_train)
    ap.add_argument("--batch-size", type=int, default=batch_size)
    ap.add_argument("--lr", type=float, default=lr)
    ap.add_argument("--warmup", type=int, default=warmup)
    ap.add_argument("--max-steps", type=int, default=max_steps)
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--eval-problems", type=int, default=eval_problems)
    ap.add_argument("--threads", type=int, default=threads, help=threads_help)
    ap.add_argument("--seed", type=int, default=1234)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_arguments(ap, Path(__file__).parent / "quickstart_model", hidden=128, ffn=384,
                     layers=4, vocab=400, num_train=200_000, batch_size=64, lr=2e-3, warmup=200,
                     max_steps=20_000, eval_every=100, eval_problems=256, threads=2)
    ap.add_argument("--held-out", type=int, default=1024,
                    help="validation problems of the RL config kept out of training")
    ap.add_argument("--target-acc", type=float, default=0.3,
                    help="stop once greedy validation accuracy reaches this")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    started = time.time()

    # An RL run's validation problems (data.arithmetic with its default seed: the first num_val
    # problems of one stream, for any num_val up to --held-out) never appear in training; the first
    # --eval-problems of them measure accuracy (the first num_val = 64 are the default RL val set).
    arith = ArithmeticConfig()
    _, held_out = train_val_problems(0, args.held_out, arith.min_ops, arith.max_ops,
                                     arith.max_operand, arith.seed)
    val, rl_val = held_out[:args.eval_problems], held_out[:arith.num_val]
    train = generate_problems(args.num_train, arith.min_ops, arith.max_ops, arith.max_operand,
                              seed=args.seed, exclude=frozenset(p.question for p in held_out))

    tokenizer, model, pad_id, examples = tokenizer_and_model(train, args)
    n_params = sum(p.numel() for p in model.parameters())
    max_new = max(len(r) for _, r in examples) + 8
    print(f"tokenizer: {len(tokenizer)} tokens; model: {n_params / 1e6:.2f}M parameters; "
          f"{len(examples)} training problems; prompt ~{len(examples[0][0])} tokens", flush=True)

    history = []

    def evaluate(step: int) -> float:
        save(model, tokenizer, args.out)
        rewards = rewards_of(args.out, val, tokenizer, max_new)
        acc, rl_acc = sum(rewards) / len(rewards), sum(rewards[:len(rl_val)]) / len(rl_val)
        history.append({"step": step, "val_acc": acc, "rl_val_acc": rl_acc,
                        "seconds": round(time.time() - started, 1)})
        print(f"step {step}: greedy accuracy {acc:.3f} on {len(val)} held-out problems, "
              f"{rl_acc:.3f} on the RL validation set", flush=True)
        return acc

    step, acc = train_on_examples(model, examples, pad_id, args, random.Random(args.seed), started,
                                  evaluate)

    seconds = time.time() - started
    # What RL starts from: accuracy of samples at temperature 1, per number of operations.
    sampled = rewards_of(args.out, val, tokenizer, max_new, temperature=1.0, n=4)
    by_source: dict[str, list[float]] = {}
    for i, p in enumerate(val):
        by_source.setdefault(p.source, []).extend(sampled[4 * i:4 * i + 4])
    summary = {"steps": step, "seconds": round(seconds, 1), "greedy_val_acc": acc,
               "sampled_val_acc_t1": sum(sampled) / len(sampled),
               "sampled_val_acc_t1_by_source": {k: sum(v) / len(v)
                                                for k, v in sorted(by_source.items())},
               "eval_problems": len(val), "parameters": n_params, "vocab": len(tokenizer),
               "history": history, "args": {k: str(v) for k, v in vars(args).items()}}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"done: {step} steps in {seconds:.0f}s, greedy accuracy {acc:.3f}, sampled (T=1) "
          f"{summary['sampled_val_acc_t1']:.3f}; wrote {args.out}")


if __name__ == "__main__":
    main()
