"""ReMax: one greedy response per prompt from a real in-process engine, scored with the group's
responses; its reward is the group's baseline (advantage r - b), it is not trained on, and the
rank-0 path of asynchronous rollouts gives the same samples. And `train` end to end with
algorithm.advantage=remax."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from harness import metrics_rows, run_distributed, train_from_dict
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


def text_reward(response: str, ground_truth: str) -> float:
    """A reward of the text that varies between responses (the tiny random model never answers
    right), and is not the length (the greedy responses all run to max_new_tokens)."""
    return float(sum(map(ord, response)) % 101)


def _train_worker(cfg: dict):
    """``train`` on ``cfg``, recording each greedy request to the engine (prompts, texts) and,
    per step, each kept group (prompt, answer, source, baseline) and the samples made of it."""
    from megatron_entropy.rollout.inprocess import InProcessEngine
    from megatron_entropy.trainer import loop

    greedy, steps = [], []
    generate, to_samples = InProcessEngine.generate, loop.groups_to_samples

    def recording_generate(self, prompts, sampling, *args, **kwargs):
        out = generate(self, prompts, sampling, *args, **kwargs)
        if sampling.temperature == 0:
            greedy.append({tuple(p): o[0].text for p, o in zip(prompts, out)})
        return out

    def recording_to_samples(step, estimator, norm_by_std):
        samples = to_samples(step, estimator, norm_by_std)
        groups = {gi: (tuple(g.item.prompt_ids), g.item.answer, g.item.source,
                       step.kept[gi].baseline) for gi, g in step.share}
        steps.append((groups, [(s.group, s.reward, s.advantage) for s in samples]))
        return samples

    InProcessEngine.generate, loop.groups_to_samples = recording_generate, recording_to_samples
    train_from_dict(cfg)
    return greedy, steps


def test_train_with_remax_scores_a_greedy_response_per_prompt_as_the_baseline(model_dir,
                                                                                tmp_path):
    """2 steps of ``train`` (in-process engine, the tiny model, a reward of the text that varies
    between responses): each step asks the engine for one greedy response per prompt, its
    reward (by the configured function) is the group's baseline, every trained sample's
    advantage is its reward minus that baseline, and the greedy response is not trained on."""
    cfg = {
        "model": {"hf_path": str(model_dir), "dtype": "fp32", "seq_length": 256},
        "rollout": {"n_samples": 3, "max_new_tokens": 8, "max_prompt_tokens": 96},
        "algorithm": {"loss": "ppo_clip", "advantage": "remax"},
        "reward": {"function": f"{Path(__file__).resolve()}:text_reward", "workers": 0},
        "data": {"prompts_per_step": 4, "apply_chat_template": False,
                 "dynamic_sampling": False, "arithmetic": {"num_train": 64}},
        "trainer": {"steps": 2, "lr": 1e-3, "micro_batch_tokens": 400, "save_interval": 0},
        "logging": {"name": "remax", "runs_dir": str(tmp_path), "progress_bar": False},
    }
    ((greedy, steps),) = run_distributed(_train_worker, 1, cfg, timeout=300)
    assert len(greedy) == len(steps) == 2  # one greedy request per step
    advantages = []
    for texts, (groups, samples) in zip(greedy, steps):
        assert sorted(prompt for prompt, *_ in groups.values()) == sorted(texts)
        for prompt, answer, _, baseline in groups.values():
            assert baseline == text_reward(texts[prompt], answer)
        assert sorted(g for g, _, _ in samples) == sorted(list(groups) * 3)  # n = 3 each
        for group, r, adv in samples:
            assert adv == r - groups[group][3]
            advantages.append(adv)
    assert any(a != 0 for a in advantages)  # the baseline is not the samples' reward
    assert len({g[3] for groups, _ in steps for g in groups.values()}) > 1  # nor a constant
    rows = metrics_rows(tmp_path / "remax")
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss/ppo_kl"]) and math.isfinite(r["grad_norm"]) for r in rows)
