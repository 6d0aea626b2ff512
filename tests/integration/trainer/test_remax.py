"""ReMax: one greedy response per prompt from a real in-process engine, scored with the group's
responses; its reward is the group's baseline (advantage r - b), it is not trained on, and the
rank-0 path of asynchronous rollouts gives the same samples."""

from __future__ import annotations

from dataclasses import replace

import pytest

from harness import run_distributed
from serving_model import make_tp2_model

from megatron_entropy.trainer.rollouts import StepGroups, groups_to_samples


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tp2_model(tmp_path_factory.mktemp("model"))


def _remax_worker(model_dir: str):
    from harness import init_megatron
    from megatron_entropy.data import PromptItem, load_tokenizer
    from megatron_entropy.rollout.base import SamplingParams
    from megatron_entropy.rollout.inprocess import InProcessEngine
    from megatron_entropy.trainer.rollouts import (collect_step_groups, distribute_step,
                                                   generate_step_local, groups_to_samples)

    init_megatron()
    engine = InProcessEngine(model_dir)
    tok = load_tokenizer(model_dir)
    items = [PromptItem(tok.encode(f"{i} + {i} ="), str(2 * i), "s", "") for i in range(5)]

    def reward_fn(texts, answers, sources):  # of the text: varies between responses
        return [float(len(t) % 4) for t in texts]

    sampling = SamplingParams(n=3, temperature=1.0, max_new_tokens=6, seed=3)
    step = collect_step_groups(engine, lambda n: items[:n], sampling, reward_fn, False,
                               target_groups=5, dynamic_sampling=False, max_refill_rounds=0,
                               greedy_baseline=True)
    local = generate_step_local(engine, lambda n: items[:n], sampling, reward_fn,
                                target_groups=5, dynamic_sampling=False, max_refill_rounds=0,
                                greedy_baseline=True)
    split, _ = distribute_step(local)
    # The reference: the same prompts' greedy responses, scored alone.
    greedy = engine.generate([it.prompt_ids for it in items],
                             SamplingParams(n=1, temperature=0.0, max_new_tokens=6, seed=3))
    want = reward_fn([out[0].text for out in greedy], [], [])
    return (step, groups_to_samples(step, "remax", True), groups_to_samples(split, "remax", True),
            want, groups_to_samples(collect_step_groups(
                engine, lambda n: items[:n], sampling, reward_fn, False, target_groups=5,
                dynamic_sampling=False, max_refill_rounds=0), "grpo", True))


def test_remax_baseline_is_the_greedy_responses_reward(model_dir):
    ((step, samples, split_samples, want, plain),) = run_distributed(
        _remax_worker, 1, str(model_dir), timeout=120)
    assert [s.baseline for s in step.kept] == want
    assert len(set(want)) > 1  # the baselines differ between prompts
    assert len(samples) == 15  # n = 3 per prompt: the greedy response is not trained on
    for s in samples:
        assert s.advantage == s.reward - want[s.group]
    assert split_samples == samples
    # The sampled responses are those of a run without the baseline (same seeds).
    assert [s.response_ids for s in samples] == [s.response_ids for s in plain]
    without = StepGroups([], [*step.kept[:1], replace(step.kept[1], baseline=None)], [])
    with pytest.raises(ValueError, match="remax needs each group's greedy baseline"):
        groups_to_samples(without, "remax", True)
