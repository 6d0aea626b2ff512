"""The in-process engine's KV-cache bound (rollout.kv_cache_gb): a budget that holds fewer
sequences than rollout.batch_size decodes them in smaller batches, to the same tokens (each
sample draws from its own generator); a budget that cannot hold one sequence is one error
naming the settings, before any decoding."""

from __future__ import annotations

import pytest
import torch

from serving_model import make_tp2_model
from tolerance import rounding_tol, transformer_terms


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tp2_model(tmp_path_factory.mktemp("model"))


def test_a_small_kv_budget_decodes_in_smaller_batches_to_the_same_tokens(model_dir):
    from megatron_entropy.rollout.base import SamplingParams
    from megatron_entropy.rollout.inprocess import InProcessEngine

    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    sampling = SamplingParams(n=4, temperature=1.0, seed=7, max_new_tokens=40)
    free = InProcessEngine(model_dir, dtype="fp32", batch_size=8)
    per_sequence = free.kv_bytes_per_token * (5 + 40)
    # 4 layers... of the tiny model: keys and values of 2 KV heads x 16 dims, fp32, a layer
    assert free.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert free.batch_rows(5, 40) == 8
    tight = InProcessEngine(model_dir, dtype="fp32", batch_size=8,
                            kv_cache_gb=3.5 * per_sequence / 2 ** 30)
    assert tight.batch_rows(5, 40) == 3
    want, got = free.generate(prompts, sampling), tight.generate(prompts, sampling)
    # other batch shapes, other GEMM blockings: the same log-probs up to rounding
    from megatron_entropy.models.arch import load_arch

    terms = transformer_terms(load_arch(model_dir), 45, log_softmax=True)
    for a, b in zip(want, got):
        assert [c.token_ids for c in a] == [c.token_ids for c in b]
        lp_a, lp_b = (torch.tensor([x for c in cs for x in c.logprobs]) for cs in (a, b))
        torch.testing.assert_close(lp_b, lp_a, rtol=0, atol=rounding_tol(lp_a, terms))


def test_a_budget_without_room_for_one_sequence_is_one_clear_error(model_dir):
    from megatron_entropy.rollout.base import SamplingParams
    from megatron_entropy.rollout.inprocess import InProcessEngine

    engine = InProcessEngine(model_dir, dtype="fp32", kv_cache_gb=1e-6)
    with pytest.raises(ValueError, match=r"cannot hold one sequence of 3 prompt \+ "
                                         r"rollout\.max_new_tokens=32768 tokens.*"
                                         r"rollout\.kv_cache_gb"):
        engine.generate([[1, 2, 3]], SamplingParams(n=1, max_new_tokens=32768))
