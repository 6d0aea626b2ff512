"""algorithm.old_logprobs=engine: the actor takes the engine's log-probs and entropies of the
tokens it sampled as the step's old policy, with no forward of the model."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from tiny_models import random_samples

from megatron_entropy.config import AlgorithmConfig, ConfigError, TrainerConfig, load_config
from megatron_entropy.trainer.actor import Actor


def _engine_actor() -> Actor:
    # No model at all: a forward of the policy would fail, so the values can only be the engine's.
    return Actor(None, [], None, None, AlgorithmConfig(old_logprobs="engine"), TrainerConfig(),
                 temperature=1.0)


def _with_engine_stats(samples: list, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [replace(s, engine_logprobs=(-torch.rand(len(s.response_ids), generator=g,
                                                    dtype=torch.float64) * 5).tolist(),
                    engine_entropies=(torch.rand(len(s.response_ids), generator=g,
                                                 dtype=torch.float64) * 3).tolist())
            for s in samples]


def test_the_old_policy_is_the_engines_own_numbers():
    samples = _with_engine_stats(random_samples(0))
    _engine_actor().recompute(samples)
    for s in samples:
        # The engine's values as fp32 tensors, not a recomputation of them.
        assert s.old_logprobs.dtype == s.entropy.dtype == torch.float32
        assert torch.equal(s.old_logprobs, torch.tensor(s.engine_logprobs, dtype=torch.float32))
        assert torch.equal(s.entropy, torch.tensor(s.engine_entropies, dtype=torch.float32))


@pytest.mark.parametrize("broken,says", [
    (dict(engine_entropies=None), "no entropies"),
    (dict(engine_logprobs=[-1.0]), "1 log-probs"),
    (dict(exact_logprobs=False), "renormalised by the server"),
])
def test_a_sample_without_the_engines_numbers_is_one_clear_error(broken, says):
    samples = _with_engine_stats(random_samples(0))
    samples[3] = replace(samples[3], **broken)
    with pytest.raises(ValueError, match="algorithm.old_logprobs=engine") as e:
        _engine_actor().recompute(samples)
    assert says in str(e.value)


@pytest.mark.parametrize("overrides,says", [
    (["rollout.engine=vllm", "rollout.server.urls=[http://127.0.0.1:1]"],
     r"needs the engine's entropy of every sampled token, which only rollout\.engine=inprocess "
     r"reports \(rollout\.engine=vllm\)"),
    (["algorithm.rollout_correction.mode=tis"],
     r"algorithm\.rollout_correction\.mode=tis weighs the actor's recompute"),
    (["rollout.routing_replay=recompute"],
     r"rollout\.routing_replay=recompute replays the routing the actor's recompute records"),
])
def test_what_needs_the_recompute_refuses_the_engines_old_logprobs(overrides, says):
    with pytest.raises(ConfigError, match=says):
        load_config(overrides=["algorithm.old_logprobs=engine", *overrides])
    # The same settings with the recompute are a valid config.
    load_config(overrides=["algorithm.old_logprobs=recompute", *overrides])
