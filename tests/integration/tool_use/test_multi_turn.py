"""The multi-turn loop on the in-process engine with a real model that calls tools
(megatron_entropy/testing/tool_script.py): a three-turn trajectory with the calculator and the
code tool keeps the engine's token ids and the tools' tokens exactly, masks what it inserted,
carries the engine's log-prob of every generated token (a transformers recompute's) and
reproduces from its seed; budgets and turn limits end it; branching after a rising entropy
keeps each prompt's sample count and the branches' prefixes."""

from __future__ import annotations

import pytest
import torch
import transformers

from megatron_entropy.config import load_config
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.testing import tool_script
from megatron_entropy.tool_use.engine import build_rollout_engine
from megatron_entropy.tool_use.metrics import trajectory_metrics, turn_runs


@pytest.fixture(scope="module")
def model_dir():
    return tool_script.hf_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def _engine(model_dir, tmp_path, **tools):
    settings = {"names": ["calculator", "python"], "format": "plain", "workers": 2, **tools}
    cfg = load_config(data={"rollout": {"tools": settings}})
    return build_rollout_engine(cfg.rollout, model_dir, tmp_path)


def _prompt(tokenizer, a: int, b: int, maybe: bool = False) -> list[int]:
    return tokenizer.encode(tool_script.question(a, b, maybe), add_special_tokens=False)


def test_a_three_turn_trajectory_keeps_token_ids_masks_and_logprobs(model_dir, tokenizer,
                                                                    tmp_path):
    engine = _engine(model_dir, tmp_path)
    try:
        prompt = _prompt(tokenizer, 2, 3)
        ((c,),) = engine.generate([prompt], SamplingParams(n=1, temperature=0.0,
                                                           max_new_tokens=64))
    finally:
        engine.shutdown()
    ids, mask = [], []
    for generated, inserted in tool_script.script(2, 3):
        g = tokenizer.encode(generated, add_special_tokens=False)
        ins = tokenizer.encode(inserted, add_special_tokens=False) if inserted else []
        ids += g + ins
        mask += [1] * len(g) + [0] * len(ins)
    ids.append(tokenizer.eos_token_id)
    mask.append(1)
    # The results are what the real tools answered: 2+3 by the calculator, print(5*2) by Python.
    assert c.text == "".join(g + i for g, i in tool_script.script(2, 3))
    assert (c.token_ids, c.loss_mask, c.finish_reason) == (ids, mask, "stop")
    stats = c.meta["trajectory"]
    assert (stats.turns, stats.calls, stats.errors, stats.timeouts) == (3, 2, 0, 0)
    assert stats.tool_tokens == mask.count(0) and len(turn_runs(mask)) == 3
    # Log-probs: the engine's for each generated token (greedy: softmax at T = 1) equal a
    # teacher-forced transformers pass over the whole trajectory; 0 on inserted tokens.
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True,
                                                          dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
    got = torch.tensor(c.logprobs, dtype=torch.float64)
    keep = torch.tensor(mask, dtype=torch.bool)
    # The engine decodes with a KV cache, turn by turn; the reference in one pass: fp32 rounding.
    torch.testing.assert_close(got[keep], ref[keep], rtol=0, atol=1e-4)
    assert (got[~keep] == 0).all() and c.entropies is not None and len(c.entropies) == len(ids)


def test_sampled_trajectories_reproduce_from_their_seed(model_dir, tokenizer, tmp_path):
    engine = _engine(model_dir, tmp_path)
    try:
        prompts = [_prompt(tokenizer, 6, 7), _prompt(tokenizer, 4, 1, maybe=True)]
        sampling = SamplingParams(n=3, temperature=1.5, max_new_tokens=48, seed=11)
        first = engine.generate(prompts, sampling)
        again = engine.generate(prompts, sampling)
        metrics = engine.metrics()
    finally:
        engine.shutdown()
    assert [[c.token_ids for c in g] for g in first] == [[c.token_ids for c in g] for g in again]
    assert [[c.loss_mask for c in g] for g in first] == [[c.loss_mask for c in g] for g in again]
    assert metrics["time/tools"] > 0 and metrics["time/generate"] > 0


def test_the_budget_and_the_turn_limit_end_a_trajectory(model_dir, tokenizer, tmp_path):
    prompt = _prompt(tokenizer, 2, 3)
    first_turn = len(tokenizer.encode(tool_script.script(2, 3)[0][0], add_special_tokens=False))
    engine = _engine(model_dir, tmp_path, max_turns=2)
    try:
        # Room for the first turn and 2 tokens of its result: the result is cut, nothing more.
        ((cut,),) = engine.generate([prompt], SamplingParams(
            n=1, temperature=0.0, max_new_tokens=first_turn + 2))
        ((two,),) = engine.generate([prompt], SamplingParams(n=1, temperature=0.0,
                                                             max_new_tokens=64))
    finally:
        engine.shutdown()
    assert cut.finish_reason == "length" and len(cut.token_ids) == first_turn + 2
    assert cut.loss_mask == [1] * first_turn + [0, 0]
    # Two turns: the second turn's call is written, never run (no result after it).
    assert two.meta["trajectory"].turns == 2 and two.text.endswith("</call>")
    assert two.loss_mask[-1] == 1 and two.finish_reason == "stop"


def test_branching_after_a_rising_entropy_keeps_the_sample_budget(model_dir, tokenizer,
                                                                  tmp_path):
    """After the first result the maybe-doubled prompt is a coin flip (entropy ~log 2 at the first
    token, against ~0 at the trajectory's start): each of its 2 initial samples branches 2 more
    from there. The doubled prompt stays sure of itself: no branch, its budget filled from the
    prompt."""
    engine = _engine(model_dir, tmp_path, branching={"enabled": True, "initial_samples": 2,
                                                     "window": 1, "threshold": 0.3,
                                                     "branches": 2})
    try:
        sure, coin = engine.generate(
            [_prompt(tokenizer, 2, 3), _prompt(tokenizer, 4, 1, maybe=True)],
            SamplingParams(n=6, temperature=1.0, max_new_tokens=48, seed=3))
    finally:
        engine.shutdown()
    assert len(sure) == len(coin) == 6
    assert [c.meta["trajectory"].branched for c in sure] == [False] * 6
    assert [c.meta["trajectory"].branched for c in coin] == [False, False] + [True] * 4
    for c in coin[2:]:
        first_result_end = turn_runs(c.loss_mask)[1][0]  # the second turn's start
        parents = [p for p in coin[:2] if p.token_ids[:first_result_end]
                   == c.token_ids[:first_result_end]]
        assert parents and c.loss_mask[:first_result_end] == parents[0].loss_mask[:first_result_end]
    # Every sample is a member of its prompt's group.
    trajectories = [[c.meta["trajectory"] for c in g] for g in (sure, coin)]
    metrics = trajectory_metrics([(t, [1.0] * 6, [len(c.token_ids) for c in g])
                                  for t, g in zip(trajectories, (sure, coin))])
    assert metrics["tools/branched_frac"] == 4 / 12
