"""The shared-prompt micro-batch layout (trainer/batch.py) through the actor and Megatron: the
same recompute entropies and the same weights after a step's four updates as the padded layout,
up to rounding, on rows that hold several responses of one prompt; also at TP=2 and PP=2 (the
pipeline's messages are the rows' shape, not the samples')."""

from __future__ import annotations

import torch

from actor_updates import UPDATES, rounding_paths, update_worker
from harness import run_distributed
from tiny_models import (hf_weights, initial_weights_worker, random_samples, tiny_actor,
                         tiny_hf_config)
from tolerance import rounding_tol, update_tol

from megatron_entropy.models.arch import arch_from_hf_config
from megatron_entropy.trainer.batch import pack_micro_batches

BUDGET = 64  # tokens of a micro-batch: rows of 2-3 responses
# At temperature 1 the tiny random model's entropies all sit near log V; at 0.1 they spread over
# ~1-4 nats and show any token that sees other context.
TEMPERATURE = 0.1
ARCH = arch_from_hf_config(tiny_hf_config("qwen2"))


def _shared_rows(samples) -> list[torch.Tensor]:
    """The token rows the actor packs (its cost rule with the tiny model's numbers)."""
    return [mb.tokens for mb in pack_micro_batches(
        samples, BUDGET, layout="shared_prompt", pairs_per_token=ARCH.attention_pairs_per_token)]


def _paths(samples) -> tuple[int, int]:
    """The rounding paths of a log-prob and a gradient: the transformer over the longest row (its
    softmax and P.V sums run over the row's keys, the masked ones adding zeros), then the step's
    tokens for a gradient."""
    return rounding_paths(samples, max(t.shape[1] for t in _shared_rows(samples)))


def test_shared_prompt_layout_equals_the_padded_one():
    samples = random_samples(0, shared_prompts=True)
    # some rows hold several responses
    assert sum(t.shape[0] for t in _shared_rows(samples)) < len(samples)
    ((wp, mp, w0),) = run_distributed(update_worker, 1, "kl_cov", "global", "recompute",
                                      micro_batch_tokens=BUDGET, shared_prompts=True,
                                      temperature=TEMPERATURE)
    ((ws, ms, _),) = run_distributed(update_worker, 1, "kl_cov", "global", "recompute",
                                     micro_batch_tokens=BUDGET, shared_prompts=True,
                                     layout="shared_prompt", temperature=TEMPERATURE)
    logp_path, path = _paths(samples)
    for a, b in zip(ms["recompute_entropies"], mp["recompute_entropies"]):
        torch.testing.assert_close(a, b, rtol=0, atol=rounding_tol(b, logp_path, torch.float32))
    assert ms["selected_frac"] == mp["selected_frac"] > 0  # the same tokens chosen
    for name in wp:
        torch.testing.assert_close(ws[name], wp[name], rtol=0, msg=name,
                                   atol=update_tol(wp[name], w0[name], UPDATES, path))
    # The step moved the weights far beyond that tolerance.
    assert max((wp[n] - w0[n]).abs().max() for n in wp) > 1e-3


def _step_worker(tensor: int, pipeline: int, layout: str, initial: dict):
    """From the full weights ``initial``: recompute -> 2 epochs x 2 mini-batches of KL-Cov
    updates at global scope (the same token choice in any packing); the full HF-named weights
    before and after (on the replica's leader), the metrics and the layout the actor took."""
    from megatron_entropy.config import AlgorithmConfig, TrainerConfig

    trainer = TrainerConfig(lr=1e-2, steps=1, grad_clip=0.0, adam_eps=1.0, weight_decay=0.0,
                            micro_batch_tokens=BUDGET, mini_batches_per_step=2, ppo_epochs=2,
                            seed=5, micro_batch_layout=layout)
    algorithm = AlgorithmConfig(loss="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=1.0,
                                cov_scope="global", logprob_impl="fused")
    actor = tiny_actor(tensor, pipeline, algorithm, trainer, TEMPERATURE, initial=initial)
    samples = random_samples(0, shared_prompts=True)
    before = hf_weights(actor)
    actor.recompute(samples)
    metrics = actor.update(samples, step=1)
    return before, hf_weights(actor), metrics, actor.layouts.candidates


def test_shared_prompt_layout_at_tp2_and_pp2():
    (initial,) = run_distributed(initial_weights_worker, 1)
    ((w0, w1, m1, layout),) = run_distributed(_step_worker, 1, 1, 1, "padded", initial)
    assert layout == ("padded",)
    _, path = _paths(random_samples(0, shared_prompts=True))
    for tensor, pipeline in ((2, 1), (1, 2)):
        results = run_distributed(_step_worker, 2, tensor, pipeline, "shared_prompt", initial)
        _, w2, m2, layout = results[0]
        assert layout == ("shared_prompt",)
        assert m2["selected_frac"] == m1["selected_frac"] > 0, (tensor, pipeline)
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=0,
                                       msg=f"{name} at TP {tensor} PP {pipeline}",
                                       atol=update_tol(w1[name], w0[name], UPDATES, path))
