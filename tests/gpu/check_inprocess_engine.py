"""GPU check of the in-process rollout engine (run by hand on a machine with CUDA; not collected by
pytest).

    python tests/gpu/check_inprocess_engine.py

On the quickstart model: engine on ``cuda`` in fp32 and bf16, sampled log-probs at T=1 against a
plain transformers forward of prompt + response on the same device (fp32 <= 1e-4; bf16 is
reported, with a loose bound: the engine and the forward use different kernels), samples equal
for batch_size 1 and 64 (fp32), weights updated in place on the GPU, and the tokens/s of a
batched decode. Prints one line per check and exits non-zero on any failure.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
MODEL = REPO / "examples" / "quickstart_model"


def main() -> int:
    from transformers import AutoModelForCausalLM

    from megatron_entropy.data import generate_problems, load_tokenizer, render_prompt
    from megatron_entropy.rollout.base import SamplingParams
    from megatron_entropy.rollout.inprocess import DTYPES, InProcessEngine

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    tok = load_tokenizer(MODEL)
    problems = generate_problems(16, 1, 2, 20, seed=0)
    prompts = tok([render_prompt(p.question, tok) for p in problems],
                  add_special_tokens=False)["input_ids"]
    failures = 0
    for dtype, tol in (("fp32", 1e-4), ("bf16", 0.1)):
        engine = InProcessEngine(MODEL, dtype=dtype, batch_size=64, device="cuda")
        ref = AutoModelForCausalLM.from_pretrained(str(MODEL), dtype=DTYPES[dtype]).cuda().eval()
        out = engine.generate(prompts, SamplingParams(n=4, temperature=1.0, max_new_tokens=32,
                                                      seed=3))
        worst = 0.0
        with torch.no_grad():
            for prompt, group in zip(prompts, out):
                for c in group:
                    ids = torch.tensor([prompt + c.token_ids], device="cuda")
                    logits = ref(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
                    lp = torch.log_softmax(logits, -1).gather(
                        -1, torch.tensor(c.token_ids, device="cuda")[:, None])[:, 0].cpu()
                    worst = max(worst, (lp - torch.tensor(c.logprobs)).abs().max().item())
        ok = worst <= tol
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {dtype}: max |engine - forward| logprob {worst:.2e} "
              f"(bound {tol})")
        if dtype == "fp32":
            small = InProcessEngine(MODEL, batch_size=1, device="cuda").generate(
                prompts[:4], SamplingParams(n=2, temperature=1.0, max_new_tokens=16, seed=3))
            same = [[c.token_ids for c in g] for g in small] == \
                   [[c.token_ids[:16] for c in g] for g in out[:4]]
            failures += not same
            print(f"{'ok  ' if same else 'FAIL'} fp32: samples independent of the batch size")
            state = {k: v * 1.01 for k, v in ref.state_dict().items()}
            engine.load_weights(state.items(), version=1)
            moved = torch.allclose(engine.model.model.norm.weight, state["model.norm.weight"])
            failures += not moved
            print(f"{'ok  ' if moved else 'FAIL'} fp32: load_weights on the GPU")
        engine.metrics()  # reset the counters
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.generate(prompts * 8, SamplingParams(n=8, temperature=1.0, max_new_tokens=64,
                                                    seed=1))
        torch.cuda.synchronize()
        m = engine.metrics()
        print(f"info {dtype}: {m['rollout/response_tokens']:.0f} tokens in "
              f"{time.perf_counter() - start:.1f}s ({m['rollout/tokens_per_s']:.0f} tokens/s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
