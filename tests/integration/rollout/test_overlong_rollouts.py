"""DAPO's overlong shaping on real rollouts: the in-process engine's responses of a random tiny
model, scored by a constant reward, get it minus the overlong penalty of their own token
length (most run to rollout.max_new_tokens: the full penalty)."""

from __future__ import annotations

import pytest

from serving_model import make_tp2_model

from megatron_entropy.rewards.overlong import OverlongShaping, overlong_penalty


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tp2_model(tmp_path_factory.mktemp("model"))


def test_training_rewards_lose_the_overlong_penalty_of_their_length(model_dir):
    from megatron_entropy.data import PromptItem
    from megatron_entropy.rollout.base import SamplingParams
    from megatron_entropy.rollout.inprocess import InProcessEngine
    from megatron_entropy.trainer.rollouts import _generate_groups

    engine = InProcessEngine(model_dir, dtype="fp32")
    items = [PromptItem(prompt_ids=[5, 6, 7, 8], answer="1", source="s", text=""),
             PromptItem(prompt_ids=[9, 10, 11], answer="2", source="s", text="")]
    shaped = OverlongShaping(lambda texts, answers, sources: [2.0] * len(texts), limit=12,
                             buffer=6, penalty=1.0)
    groups = _generate_groups(engine, items, [0, 1], SamplingParams(
        n=4, temperature=1.0, seed=3, max_new_tokens=12), shaped)
    lengths = [len(c.token_ids) for g in groups.values() for c in g.completions]
    rewards = [r for g in groups.values() for r in g.rewards]
    assert rewards == pytest.approx([2.0 + overlong_penalty(n, 12, 6, 1.0) for n in lengths])
    assert min(rewards) == pytest.approx(1.0)  # cut at the limit: the whole penalty
