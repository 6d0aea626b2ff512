"""The actor's updates through Megatron: with cov_scope=global the update does not depend on how
the step is split over DP ranks and micro-batches (selection, loss and gradient are those of the
whole step), in both selection modes; micro_batch scope selects per micro-batch."""

from __future__ import annotations

import pytest
import torch

from harness import init_megatron, run_distributed
from tiny_models import random_samples, tiny_hf_config

from megatron_entropy.models.arch import arch_from_hf_config


def _update_worker(loss: str, scope: str, selection_logprobs: str):
    from megatron_entropy.algorithms.policy_loss import PolicyLossSettings
    from megatron_entropy.models.sharding import full_state_dict
    from megatron_entropy.trainer.actor import Actor, ActorSettings
    from megatron_entropy.trainer.model_setup import (OptimSettings, build_optimizer,
                                                      build_trainable_model)
    from megatron_entropy.trainer.rollouts import dp_share

    init_megatron()
    arch = arch_from_hf_config(tiny_hf_config("qwen2"))
    chunks = build_trainable_model(arch, 1, 1, "fp32", "local", 64)
    # adam_eps = 1: updates proportional to the gradients. With a tiny eps Adam turns float noise
    # in near-zero gradients into full-size steps, and the comparison would test that noise.
    optimizer, scheduler = build_optimizer(chunks, OptimSettings(lr=1e-2, total_steps=4,
                                                                 grad_clip=0, adam_eps=1.0))
    actor = Actor(arch, chunks, optimizer, scheduler,
                  PolicyLossSettings(loss=loss, clip_cov_ratio=0.1, clip_cov_lb=0.0,
                                     clip_cov_ub=100.0, kl_cov_ratio=0.1, kl_cov_coef=1.0,
                                     clip_ratio_low=1.0, clip_ratio_high=1.0),
                  ActorSettings(logprob_impl="fused", micro_batch_tokens=24,
                                mini_batches_per_step=2, ppo_epochs=2, cov_scope=scope,
                                global_selection_logprobs=selection_logprobs, seed=5))
    mine = dp_share(random_samples(0))
    actor.recompute(mine)
    metrics = actor.update(mine, step=1)
    return full_state_dict(chunks[0]), metrics


@pytest.mark.parametrize("loss,selection", [("kl_cov", "fresh"), ("kl_cov", "recompute"),
                                            ("clip_cov", "fresh"), ("clip_cov", "recompute")])
def test_global_scope_update_is_independent_of_the_dp_split(loss, selection):
    ((w1, m1),) = run_distributed(_update_worker, 1, loss, "global", selection)
    (w2, m2), (w2b, _) = run_distributed(_update_worker, 2, loss, "global", selection)
    ((w0, _),) = run_distributed(_update_worker, 1, "ppo_clip", "micro_batch", "recompute")
    assert m1["selected_frac"] > 0
    assert m1["selected_frac"] == pytest.approx(m2["selected_frac"], abs=1e-12)
    assert m1["cov_selected_mean"] == pytest.approx(m2["cov_selected_mean"], rel=1e-6)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, atol=1e-7, msg=name)
        torch.testing.assert_close(w2b[name], w2[name], rtol=0, atol=0, msg=name)
    # The selection changes the update (against plain PPO without clipping), so the
    # comparison above covers it.
    assert max((w1[n] - w0[n]).abs().max() for n in w1) > 1e-4


def test_micro_batch_scope_selects_inside_each_micro_batch():
    """Same data, same seed: choosing the top Cov tokens per micro-batch (the paper's code)
    instead of over the whole step changes which tokens are penalised, and so the update."""
    ((wm, mm),) = run_distributed(_update_worker, 1, "kl_cov", "micro_batch", "recompute")
    ((wg, mg),) = run_distributed(_update_worker, 1, "kl_cov", "global", "recompute")
    assert mm["selected_frac"] > 0 and mg["selected_frac"] > 0
    assert mm["cov_selected_mean"] != pytest.approx(mg["cov_selected_mean"], rel=1e-3)
    assert max((wm[n] - wg[n]).abs().max() for n in wm) > 1e-6
