"""The micro-batch layouts (trainer/batch.py): a shared-prompt row holds the prompt once and the
responses of consecutive samples of that prompt; each response token is predicted from the same
token at the same position as in the padded layout, and sees exactly what it sees there."""

from __future__ import annotations

import pytest
import torch

from tiny_models import random_samples

from megatron_entropy.config import ConfigError
from megatron_entropy.trainer.batch import pack_micro_batches
from megatron_entropy.trainer.packing import resolve_layouts


def _context(mb, b: int, t: int) -> tuple[int, list[tuple[int, int]]]:
    """For response token ``t`` of the micro-batch's sample ``b``: the token its prediction is
    read at, and the (token, position) pairs that token may attend to, in order."""
    k = int(((mb.rows == b) & (mb.cols == t)).nonzero())
    flat = int(mb.flat_positions[k])
    row, q = divmod(flat, mb.tokens.shape[1])
    if mb.attention_mask is None:
        seen = list(range(q + 1))  # the model's causal mask
    else:
        seen = (~mb.attention_mask[row, 0, q]).nonzero().flatten().tolist()
    return int(mb.tokens[row, q]), [(int(mb.tokens[row, j]), int(mb.position_ids[row, j]))
                                    for j in seen]


def test_shared_prompt_rows_see_what_padded_rows_see():
    samples = random_samples(3, groups=3, per_group=4, shared_prompts=True)
    padded = pack_micro_batches(samples, 10 ** 6)
    shared = pack_micro_batches(samples, 10 ** 6, layout="shared_prompt")
    (p,), (s,) = padded, shared
    assert s.sample_ids == p.sample_ids == list(range(12))
    assert s.tokens.shape[0] == 3 and p.tokens.shape[0] == 12  # a row per prompt
    # a row is its prompt once and its samples' responses
    assert s.tokens.shape[1] == max(len(samples[4 * g].prompt_ids) + sum(
        len(samples[i].response_ids) for i in range(4 * g, 4 * g + 4)) for g in range(3))
    for name in ("targets", "rows", "cols", "mask", "advantages"):
        assert torch.equal(getattr(s, name), getattr(p, name)), name
    for b, x in enumerate(samples):
        for t in range(len(x.response_ids)):
            # the same predicting token, and the same tokens at the same positions before it
            assert _context(s, b, t) == _context(p, b, t), (b, t)
    # padding attends to itself only (a softmax row needs one key)
    pad = s.tokens.shape[1] - 1
    row = min(range(3), key=lambda g: sum(len(samples[i].response_ids)
                                          for i in range(4 * g, 4 * g + 4)))
    assert (~s.attention_mask[row, 0, pad]).nonzero().flatten().tolist() == [pad]


def test_shared_prompt_rows_keep_the_budget_and_the_order():
    samples = random_samples(4, groups=2, per_group=4, shared_prompts=True)
    budget = max(x.length for x in samples) + 3
    mbs = pack_micro_batches(samples, budget, layout="shared_prompt")
    assert [i for mb in mbs for i in mb.sample_ids] == list(range(8))
    for mb in mbs:
        assert mb.tokens.numel() <= budget or mb.tokens.shape[0] == 1
    # a row takes a second response only while prompt + responses fit the budget
    assert max(mb.tokens.shape[1] for mb in mbs) <= budget
    # samples of different prompts never share a row
    alone = random_samples(4, groups=2, per_group=4)
    (mb,) = pack_micro_batches(alone, 10 ** 6, layout="shared_prompt")
    assert mb.tokens.shape[0] == 8 and mb.attention_mask is None


def test_a_response_joins_its_prompts_row_only_while_that_pays():
    """768 attention pairs a token (the quickstart model's): 20-token responses to a 30-token
    prompt share one row (each saves 30 x 768 pair-costs and adds at most ~6,000 pairs), while
    2000-token ones keep their own rows (the second would add (4030^2 - 2 x 2030^2) = 8.0M
    pairs to save 23,040), unless a token's linear layers cost far more than that."""
    def rows(response_len: int, pairs_per_token: float) -> int:
        samples = random_samples(5, groups=1, per_group=4, shared_prompts=True,
                                 prompt_len=(30, 31), response_len=(response_len,
                                                                    response_len + 1))
        return sum(mb.tokens.shape[0] for mb in pack_micro_batches(
            samples, 10 ** 6, layout="shared_prompt", pairs_per_token=pairs_per_token))
    assert rows(20, 768.0) == 1
    assert rows(2000, 768.0) == 4
    assert rows(2000, 1e6) == 1


def test_unknown_layout_is_named():
    with pytest.raises(ValueError, match="'thd'"):
        pack_micro_batches(random_samples(0), 100, layout="thd")


def test_shared_prompt_rows_need_the_local_attention():
    """A model whose attention is not the local spec's (Transformer Engine's, whose causal
    kernels take no explicit mask; here a module with no attention at all): auto is padded, and
    asking for shared_prompt is one error naming the key. (A real local model resolves to
    shared_prompt or packed in tests/integration/trainer/test_shared_prompt.py; MoE refuses in
    test_moe_rl.py.)"""
    other = [torch.nn.Linear(4, 4)]
    assert resolve_layouts("auto", None, other).candidates == ("padded",)
    assert resolve_layouts("padded", None, other).candidates == ("padded",)
    with pytest.raises(ConfigError, match=r"trainer\.micro_batch_layout=shared_prompt: the "
                                          r"model's attention is not the local spec's"):
        resolve_layouts("shared_prompt", None, other)
