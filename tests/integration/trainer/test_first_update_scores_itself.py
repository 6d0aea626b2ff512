"""The step's first update scores its own samples (trainer/actor.py,
``first_update_scores_itself``): the recompute leaves the first mini-batch out, and its update's
forward, on the weights that sampled, gives those samples' old log-probs and entropies. The same
values and the same weights after a step's four updates as with the recompute of every sample,
up to rounding; at PP=2 every stage gets the values (the metrics read them on every rank)."""

from __future__ import annotations

import pytest
import torch

from actor_updates import UPDATES, rounding_paths
from harness import run_distributed
from tiny_models import hf_weights, initial_weights_worker, random_samples, tiny_actor
from tolerance import rounding_tol, update_tol

# Entropies spread over ~1-4 nats at 0.1 (at 1.0 they all sit near log V).
TEMPERATURE = 0.1


def _step_worker(pipeline: int, scores_itself: bool, initial: dict):
    """From the full weights ``initial``: recompute -> 2 epochs x 2 mini-batches of PPO-clip
    (a ratio far from its clip, so the gradient is a smooth function of the old log-probs);
    which samples the recompute left out, every sample's (old log-probs, entropies) after the
    update on this rank, the full weights before and after (on the replica's leader), the
    update's metrics."""
    from megatron_entropy.config import AlgorithmConfig, TrainerConfig

    trainer = TrainerConfig(lr=1e-2, steps=1, grad_clip=0.0, adam_eps=1.0, weight_decay=0.0,
                            micro_batch_tokens=24, mini_batches_per_step=2, ppo_epochs=2, seed=5)
    algorithm = AlgorithmConfig(loss="ppo_clip", clip_ratio_low=1.0, clip_ratio_high=1.0,
                                logprob_impl="fused")
    actor = tiny_actor(1, pipeline, algorithm, trainer, TEMPERATURE, initial=initial)
    assert actor.first_update_scores_itself  # these settings' default
    actor.first_update_scores_itself = scores_itself
    samples = random_samples(0)
    before = hf_weights(actor)
    actor.recompute(samples)
    left_out = [s.old_logprobs is None and s.entropy is None for s in samples]
    metrics = actor.update(samples, step=1)
    return (left_out, [(s.old_logprobs, s.entropy) for s in samples], before, hf_weights(actor),
            metrics)


@pytest.mark.parametrize("pipeline", [1, 2])
def test_the_first_update_scores_its_samples_as_the_recompute_would(pipeline):
    (initial,) = run_distributed(initial_weights_worker, 1)
    ((left, ref_stats, w0, ref_w, ref_m),) = run_distributed(_step_worker, 1, 1, False, initial)
    assert not any(left)
    samples = random_samples(0)
    logp_path, path = rounding_paths(samples)
    ranks = run_distributed(_step_worker, pipeline, pipeline, True, initial)
    for rank, (left, stats, _, _, metrics) in enumerate(ranks):
        # the recompute scored the second mini-batch only (8 samples, 2 mini-batches)
        assert left == [True] * 4 + [False] * 4, rank
        for i, ((lp, h), (ref_lp, ref_h)) in enumerate(zip(stats, ref_stats)):
            assert lp.dtype == h.dtype == torch.float32
            torch.testing.assert_close(lp, ref_lp, rtol=0, msg=f"rank {rank} sample {i}",
                                       atol=rounding_tol(ref_lp, logp_path, torch.float32))
            torch.testing.assert_close(h, ref_h, rtol=0, msg=f"rank {rank} sample {i}",
                                       atol=rounding_tol(ref_h, logp_path, torch.float32))
        # The rollout correction's metrics (mode none) cover the first mini-batch too: the mean
        # of engine - old log-prob over every token (the engine's are 0 in these samples).
        max_logp = max(float(lp.abs().max()) for lp, _ in ref_stats)
        assert metrics["rollout_corr/kl_k1"] == pytest.approx(
            ref_m["rollout_corr/kl_k1"], rel=0, abs=rounding_tol(max_logp, logp_path))
    weights = {n: t for _, _, _, w, _ in ranks for n, t in w.items()}
    assert weights.keys() == ref_w.keys()
    for name in ref_w:
        torch.testing.assert_close(weights[name], ref_w[name], rtol=0, msg=name,
                                   atol=update_tol(ref_w[name], w0[name], UPDATES, path))
    # The step moved the weights far beyond that tolerance.
    assert max((ref_w[n] - w0[n]).abs().max() for n in ref_w) > 1e-3
