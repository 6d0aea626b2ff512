"""A tiny model that calls tools across turns, trained on the spot (no hub), for the multi-turn
tests and benchmarks: servable by vLLM and the fake SGLang server (the served Qwen2 of
toy_models.py, its arithmetic BPE tokenizer).

It answers ``What is A + B, doubled?`` in three turns of the ``plain`` tool format: a calculator
call, a code-tool call on the calculator's result, then the boxed answer::

    <call>calculator: A+B</call>  [<result>S</result>]  <call>python: print(S*2)</call>
    [<result>2S\\n</result>]  \\boxed{2S}</s>

(bracketed: what the tools insert). ``What is A + B, maybe doubled?`` goes the same way up to the
first result, then either calls the code tool as above or boxes S at once, half of the time
each: the entropy of its first token after a tool result rises to ~log 2 (the branching tests).
Training stops once greedy decoding, teacher-forced, gives every scripted token. ``hf_dir()``
trains it once and keeps it in the cache (``MEGATRON_ENTROPY_CACHE``, else
``~/.cache/megatron-entropy``), under a digest of this file: a changed script trains anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers

from megatron_entropy.testing.toy_models import SERVED_ARCH, save_tiny_hf_model, save_tokenizer

PROMPTS = ((2, 3), (4, 1), (6, 7), (3, 8), (5, 5))
# Whole tokens of the tokenizer: short sequences, quick to train.
WORDS = ("<call>", "</call>", "<result>", "</result>", "calculator:", "python:", "print(",
         "What is", "doubled?", "maybe")


def question(a: int, b: int, maybe: bool = False) -> str:
    return f"What is {a} + {b}, {'maybe ' if maybe else ''}doubled?"


def script(a: int, b: int, doubled: bool = True) -> list[tuple[str, str]]:
    """(generated text, inserted text) of each turn; the last turn inserts nothing."""
    total = a + b
    first = (f"<call>calculator: {a}+{b}</call>", f"<result>{total}</result>")
    if not doubled:
        return [first, (f"\\boxed{{{total}}}", "")]
    return [first, (f"<call>python: print({total}*2)</call>", f"<result>{2 * total}\n</result>"),
            (f"\\boxed{{{2 * total}}}", "")]


def _example(tokenizer, prompt: str, turns: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """Token ids (each piece tokenised on its own, as the rollout loop inserts them) and the
    labels: the generated tokens and the end of sequence; -100 elsewhere."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    labels = [-100] * len(ids)
    for generated, inserted in turns:
        g = tokenizer.encode(generated, add_special_tokens=False)
        ins = tokenizer.encode(inserted, add_special_tokens=False) if inserted else []
        ids += g + ins
        labels += g + [-100] * len(ins)
    ids.append(tokenizer.eos_token_id)
    labels.append(tokenizer.eos_token_id)
    return ids, labels


def make_tool_script_model(out_dir: Path, max_steps: int = 400) -> Path:
    """Train the model (module docstring) into ``out_dir``; also writes ``prompts.jsonl`` (the
    scripted questions with their answers, for ``data.train_files``)."""
    out_dir = save_tiny_hf_model("qwen2", Path(out_dir), seed=0, **SERVED_ARCH)
    save_tokenizer(out_dir, SERVED_ARCH["vocab_size"], WORDS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(out_dir), local_files_only=True, dtype=torch.float32)
    examples = [_example(tokenizer, question(a, b), script(a, b)) for a, b in PROMPTS]
    examples += [_example(tokenizer, question(a, b, True), script(a, b, doubled))
                 for a, b in PROMPTS[:2] for doubled in (True, False)]
    width = max(len(ids) for ids, _ in examples)
    ids = torch.tensor([i + [0] * (width - len(i)) for i, _ in examples])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in examples])
    forced = labels[:, 1:] != -100
    exact = forced.clone()
    exact[len(PROMPTS):] = False  # the maybe-doubled ones branch: no single right token there
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    for step in range(max_steps):
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 24:
            with torch.no_grad():
                pred = model(input_ids=ids).logits[:, :-1].argmax(-1)
            right = (pred == labels[:, 1:]) | ~exact
            if bool(right.all()) and loss.item() < 0.1:
                break
    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    rows = [{"prompt": question(a, b), "answer": str(2 * (a + b))} for a, b in PROMPTS]
    (out_dir / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out_dir


def hf_dir() -> Path:
    """The trained model's folder in the cache (trained first if absent)."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    root = Path(os.environ.get("MEGATRON_ENTROPY_CACHE")
                or Path.home() / ".cache" / "megatron-entropy")
    out = root / f"tool-script-{digest}"
    if (out / "prompts.jsonl").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    # Trained aside and moved in whole: a concurrent or killed run never leaves half a model.
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root))
    try:
        make_tool_script_model(tmp)
        tmp.rename(out)
    except OSError:
        if not (out / "prompts.jsonl").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(hf_dir())
