"""The in-process rollout engine against plain transformers forwards and reference samplers."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

from serving_model import reference, reference_entropies
from tiny_models import save_tiny_hf_model
from tolerance import logprob_tol

from megatron_entropy.data import generate_problems, load_tokenizer, render_prompt
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.rollout.inprocess import InProcessEngine, sample_tokens
from megatron_entropy.runtime.seeds import sample_seed
from megatron_entropy.weight_sync import InPlaceSync

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart_model"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(QUICKSTART)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tokenizer):
    """The shipped quickstart model (Qwen2, tied embeddings) and random tiny Qwen2 / Llama models
    (untied) that share its tokenizer."""
    dirs = {"quickstart": QUICKSTART}
    for family, seed in (("qwen2", 0), ("llama", 1), ("qwen2_other", 2)):
        d = tmp_path_factory.mktemp(family)
        save_tiny_hf_model(family.split("_")[0], d, seed=seed, vocab_size=len(tokenizer))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(QUICKSTART / name, d / name)
        dirs[family] = d
    return dirs


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Chat-formatted arithmetic prompts of different lengths (left padding is exercised)."""
    problems = generate_problems(4, 1, 3, 20, seed=4)
    texts = [render_prompt(p.question, tokenizer) for p in problems]
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert len({len(x) for x in ids}) > 1
    return ids


def _hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["quickstart", "qwen2", "llama"])
def test_logprobs_equal_a_plain_forward(model_dirs, prompts, family):
    engine = InProcessEngine(model_dirs[family], batch_size=5)  # 8 samples: 2 batches
    ref_model = _hf_model(model_dirs[family])
    for temperature, top_p, top_k in [(1.0, 1.0, -1), (0.7, 0.8, 20)]:
        sp = SamplingParams(n=2, temperature=temperature, top_p=top_p, top_k=top_k,
                            max_new_tokens=10, seed=7)
        out = engine.generate(prompts, sp)
        assert [len(group) for group in out] == [2] * len(prompts)
        for prompt, group in zip(prompts, out):
            for c in group:
                assert len(c.token_ids) == len(c.logprobs) >= 1
                assert c.finish_reason in ("stop", "length")
                # Batched, left-padded, from a KV cache vs one plain forward: up to rounding.
                ref, tol = reference(ref_model, prompt, c.token_ids, temperature)
                worst = max(abs(x - y) for x, y in zip(c.logprobs, ref))
                assert worst <= tol, (temperature, worst, tol)
                # The entropy at each token, of the same full tempered distribution: its sum
                # over the vocabulary rounds as often again as the log-softmax's normaliser.
                ref_h, h_tol = reference_entropies(ref_model, prompt, c.token_ids, temperature)
                assert len(c.entropies) == len(c.token_ids)
                worst = max(abs(x - y) for x, y in zip(c.entropies, ref_h))
                assert worst <= h_tol, (temperature, worst, h_tol)


def test_greedy_equals_transformers_generate(model_dirs, prompts):
    ref_model = _hf_model(QUICKSTART)
    engine = InProcessEngine(QUICKSTART, batch_size=3)
    out = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=40))
    for prompt, (c,) in zip(prompts, out):
        expected = ref_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=40,
                                      eos_token_id=2, pad_token_id=0)[0, len(prompt):].tolist()
        assert c.token_ids == expected
        # Greedy log-probs are those of temperature 1.
        ref, tol = reference(ref_model, prompt, c.token_ids)
        assert max(abs(x - y) for x, y in zip(c.logprobs, ref)) <= tol


def _reference_sample(model, prompt, seed, temperature, top_p, top_k, max_new_tokens, eos):
    """Sampling written out plainly: full forward per token, sort, cut, inverse CDF."""
    g = torch.Generator().manual_seed(seed)
    out = []
    while len(out) < max_new_tokens:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out])).logits[0, -1].float()
        probs = torch.softmax(logits / temperature, dim=-1)
        order = sorted(range(len(probs)), key=lambda v: -probs[v].item())
        kept = order[:top_k] if top_k > 0 else order
        mass = sum(probs[v].item() for v in kept)
        cut, acc = [], 0.0
        for v in kept:
            if acc / mass >= top_p:
                break
            cut.append(v)
            acc += probs[v].item()
        u = torch.rand((), generator=g, dtype=torch.float64).item()
        target, running, token = u * acc, 0.0, cut[-1]
        for v in cut:
            running += probs[v].item()
            if running > target:
                token = v
                break
        out.append(token)
        if token in eos:
            break
    return out


def test_samples_follow_their_seeds_whatever_the_batch(model_dirs, prompts):
    path = model_dirs["qwen2"]  # random weights: diverse samples
    sp = SamplingParams(n=2, temperature=0.8, top_p=0.9, top_k=12, max_new_tokens=8, seed=123)
    small = InProcessEngine(path, batch_size=1).generate(prompts, sp)
    big = InProcessEngine(path, batch_size=64).generate(prompts, sp)
    assert [[c.token_ids for c in g] for g in small] == [[c.token_ids for c in g] for g in big]
    ref_model = _hf_model(path)
    for i in (0, 3):
        for j in range(2):
            expected = _reference_sample(ref_model, prompts[i], sample_seed(123, i, j), 0.8, 0.9,
                                         12, 8, eos={2})
            assert big[i][j].token_ids == expected
    other = InProcessEngine(path).generate(prompts, SamplingParams(
        n=2, temperature=0.8, top_p=0.9, top_k=12, max_new_tokens=8, seed=124))
    assert [c.token_ids for g in other for c in g] != [c.token_ids for g in big for c in g]


def test_sampler_distribution_and_truncation():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0]])
    n = 200_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for temperature, top_p, top_k in [(1.0, 1.0, -1), (0.5, 1.0, -1), (1.0, 1.0, 3),
                                      (1.3, 0.6, -1), (1.0, 0.7, 5), (1.0, 0.7, 3)]:
        tokens, logp, ent = sample_tokens(logits.expand(n, -1), u, temperature, top_p, top_k)
        probs = torch.softmax(logits[0] / temperature, dim=-1)
        # Reference truncation: top-k, renormalise, smallest prefix with mass >= top_p.
        keep = torch.zeros(8, dtype=torch.bool)
        keep[:top_k if top_k > 0 else 8] = True
        kept = probs * keep / (probs * keep).sum()
        prefix = torch.cumsum(kept, 0) - kept < top_p
        target = kept * prefix / (kept * prefix).sum()
        freq = torch.bincount(tokens, minlength=8).double() / n
        assert (freq[target == 0] == 0).all()
        # Five standard deviations of a frequency over n draws (p (1 - p) <= 1/4).
        assert (freq - target).abs().max() <= 5 * math.sqrt(0.25 / n), (temperature, top_p,
                                                                          top_k, freq, target)
        # Before truncation; log-softmax vs log of softmax: up to the rounding of the 8-term
        # normaliser, the temperature, exp and log.
        want = torch.log(probs)[tokens]
        torch.testing.assert_close(logp, want, rtol=0, atol=logprob_tol(
            logits / temperature, want, logits.shape[-1] + 3))
        # The entropy of the whole tempered distribution (not the truncated one), in float64;
        # its sum over the vocabulary adds as many roundings again.
        p64 = torch.softmax(logits[0].double() / temperature, dim=-1)
        h = float(-(p64 * p64.log()).sum())
        assert (ent - h).abs().max() <= logprob_tol(logits / temperature, p64.log(),
                                                    2 * (logits.shape[-1] + 3)), (ent[0], h)
    greedy, logp, ent = sample_tokens(logits, torch.zeros(1), 0.0)
    want = torch.log_softmax(logits[0], -1)[0]
    assert greedy.item() == 0 and abs(logp.item() - want.item()) <= logprob_tol(
        logits, want, logits.shape[-1])
    p64 = torch.softmax(logits[0].double(), dim=-1)  # greedy: the distribution at T = 1
    assert abs(ent.item() - float(-(p64 * p64.log()).sum())) <= logprob_tol(
        logits, p64.log(), 2 * logits.shape[-1])


def test_stop_conditions(prompts):
    engine = InProcessEngine(QUICKSTART)
    (full,), = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=60))
    assert full.finish_reason == "stop" and full.token_ids[-1] == 2  # <|im_end|>, the EOS
    assert "<|im_end|>" not in full.text and "\n" in full.text and "\\boxed{" in full.text

    (c,), = engine.generate(prompts[:1], SamplingParams(temperature=0.0, stop=("\n",)))
    assert c.finish_reason == "stop"
    assert c.text == full.text[:full.text.index("\n")]
    assert c.token_ids == full.token_ids[:len(c.token_ids)]
    assert "\n" in engine.tokenizer.decode(c.token_ids)  # the stop token is kept in the ids

    (c,), = engine.generate(prompts[:1], SamplingParams(temperature=0.0, stop=("oxed", "\\b")))
    assert c.text == full.text[:full.text.index("\\b")]  # the earliest of the stop strings

    stop_id = full.token_ids[3]
    (c,), = engine.generate(prompts[:1], SamplingParams(temperature=0.0,
                                                        stop_token_ids=(stop_id,)))
    assert c.finish_reason == "stop"
    assert c.token_ids == full.token_ids[:full.token_ids.index(stop_id) + 1]

    (c,), = engine.generate(prompts[:1], SamplingParams(temperature=0.0, max_new_tokens=3))
    assert c.finish_reason == "length" and c.token_ids == full.token_ids[:3]
    assert len(c.logprobs) == 3


def test_load_weights(model_dirs, prompts):
    engine = InProcessEngine(model_dirs["qwen2"])
    source = InProcessEngine(model_dirs["qwen2_other"])
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=5)
    before = engine.generate(prompts, sp)
    expected = source.generate(prompts, sp)
    stats = InPlaceSync(engine, bucket_bytes=2**20).push(source.model.state_dict().items(),
                                                         version=3)
    assert stats["weight_sync/tensors"] == len(source.model.state_dict())
    assert stats["weight_sync/bytes"] == sum(t.numel() * 4 for t in
                                             source.model.state_dict().values())
    assert stats["weight_sync/seconds"] > 0
    after = engine.generate(prompts, sp)
    flat = lambda out: [c.token_ids for g in out for c in g]  # noqa: E731
    assert flat(after) == flat(expected) != flat(before)
    for a, e in zip((c for g in after for c in g), (c for g in expected for c in g)):
        assert a.logprobs == e.logprobs
        assert a.meta["weight_version"] == 3

    state = dict(source.model.state_dict())
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        engine.load_weights(missing.items(), version=4)
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(3,\)"):
        engine.load_weights([("model.norm.weight", torch.zeros(3))], version=4)
    with pytest.raises(KeyError, match="'decoder.bogus' is not a weight"):
        engine.load_weights([("decoder.bogus", torch.zeros(3))], version=4)


def test_load_weights_tied_embeddings(prompts):
    engine = InProcessEngine(QUICKSTART)
    ref = _hf_model(QUICKSTART)
    torch.manual_seed(0)
    new = {k: v + 0.01 * torch.randn_like(v) for k, v in ref.state_dict().items()
           if k != "lm_head.weight"}  # a tied model's head is its embedding
    engine.load_weights(new.items(), version=1)
    assert torch.equal(engine.model.lm_head.weight, new["model.embed_tokens.weight"])
    ref.load_state_dict(new, strict=False)
    ref.tie_weights()
    (c,), = engine.generate(prompts[:1], SamplingParams(temperature=1.0, max_new_tokens=8, seed=1))
    want, tol = reference(ref, prompts[0], c.token_ids)
    assert max(abs(x - y) for x, y in zip(c.logprobs, want)) <= tol


def test_bad_input(prompts):
    engine = InProcessEngine(QUICKSTART)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([prompts[0], []], SamplingParams())
    with pytest.raises(ValueError, match="n >= 1"):
        engine.generate(prompts, SamplingParams(n=0))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        InProcessEngine(QUICKSTART / "nope")
    with pytest.raises(ValueError, match="dtype 'fp8'"):
        InProcessEngine(QUICKSTART, dtype="fp8")
    assert engine.metrics() == {"rollout/response_tokens": 0.0}
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=4, temperature=0.0))
    m = engine.metrics()
    assert m["rollout/response_tokens"] >= 1 and m["rollout/tokens_per_s"] > 0


def test_quickstart_model_solves_some_of_the_task():
    """The shipped policy, prompted as the RL run prompts it, is right some of the time: RL has
    something to start from and room to improve."""
    from megatron_entropy.config import DataConfig
    from megatron_entropy.data import load_prompt_dataset
    from megatron_entropy.rewards import math_rewards

    engine = InProcessEngine(QUICKSTART)
    val = load_prompt_dataset(DataConfig(), engine.tokenizer, 1024, "val")
    out = engine.generate([it.prompt_ids for it in val],
                          SamplingParams(temperature=0.0, max_new_tokens=48))
    rewards = math_rewards([g[0].text for g in out], [it.answer for it in val])
    assert all(g[0].finish_reason == "stop" for g in out)  # it ends its answers with EOS
    assert 0.2 <= sum(rewards) / len(rewards) <= 0.5


def test_a_small_model_decodes_on_one_thread(model_dirs, prompts, tmp_path, tokenizer):
    """On the CPU a model under SMALL_MODEL_PARAMS decodes with one intra-op thread (a second
    one costs more to wake than it saves), a larger one with the process's threads; the count
    is the process's again afterwards, also when generation fails."""
    from megatron_entropy.rollout.inprocess import SMALL_MODEL_PARAMS

    big = save_tiny_hf_model("qwen2", tmp_path / "big", hidden_size=512, intermediate_size=1536,
                             num_attention_heads=8, num_key_value_heads=2,
                             vocab_size=len(tokenizer))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QUICKSTART / name, big / name)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for path, want in ((QUICKSTART, 1), (big, 2)):
            engine = InProcessEngine(path)
            params = sum(p.numel() for p in engine.model.parameters())
            assert (params < SMALL_MODEL_PARAMS) == (want == 1), params
            seen = []
            engine.model.register_forward_pre_hook(
                lambda *_: seen.append(torch.get_num_threads()))
            engine.generate(prompts[:1], SamplingParams(n=2, max_new_tokens=3, seed=0))
            assert seen and set(seen) == {want}
            assert torch.get_num_threads() == 2
            with pytest.raises(IndexError):  # a token id beyond the vocabulary, mid-forward
                engine.generate([[10 ** 6]], SamplingParams(max_new_tokens=2))
            assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
