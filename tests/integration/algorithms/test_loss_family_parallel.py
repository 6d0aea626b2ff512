"""The sequence-level losses (GSPO, GMPO) through the actor and Megatron: their ratio spans a
whole response, so the update must be the same whether the step runs at TP=1, TP=2, PP=2 or
DP=2, with responses spread over many micro-batches. And a token-level loss of the family with
the Cov modifier at global scope: the same update at DP=1 and DP=2."""

from __future__ import annotations

import pytest
import torch

from actor_updates import rounding_paths, update_worker
from harness import run_distributed
from tiny_models import (hf_weights, initial_weights_worker, random_samples, tiny_actor,
                         tiny_hf_config)
from tolerance import grad_terms, rounding_tol, transformer_terms, update_tol

from megatron_entropy.models.arch import arch_from_hf_config

UPDATES = 4  # ppo_epochs x mini_batches_per_step


def _step_worker(tensor: int, pipeline: int, loss: str, mode: str, initial: dict):
    """From the full weights ``initial``: recompute -> 2 epochs x 2 mini-batches of updates on
    this rank's DP share; returns the full HF-named weights before and after (on the replica's
    leader) and the metrics."""
    from megatron_entropy.config import AlgorithmConfig, TrainerConfig
    from megatron_entropy.trainer.rollouts import dp_share

    # adam_eps = 1: updates proportional to the gradients (tests/helpers/tolerance.py).
    trainer = TrainerConfig(lr=1e-2, steps=1, grad_clip=0.0, adam_eps=1.0, weight_decay=0.0,
                            micro_batch_tokens=24, mini_batches_per_step=2, ppo_epochs=2, seed=5)
    # Narrow clip ranges, so that the sequence clip acts in the later updates.
    algorithm = AlgorithmConfig(loss=loss, loss_agg_mode=mode, clip_ratio_low=0.02,
                                clip_ratio_high=0.02, logprob_impl="fused")
    actor = tiny_actor(tensor, pipeline, algorithm, trainer, initial=initial)
    mine = dp_share(random_samples(0))
    before = hf_weights(actor)
    actor.recompute(mine)
    metrics = actor.update(mine, step=1)
    return before, hf_weights(actor), metrics


def _path() -> int:
    samples = random_samples(0)
    logp_path = transformer_terms(arch_from_hf_config(tiny_hf_config("qwen2")),
                                  max(s.length for s in samples), log_softmax=True)
    return grad_terms(logp_path, sum(len(s.response_ids) for s in samples))


# seq-mean-token-mean: the papers' objective (the other modes' split invariance is tested on
# the loss alone in tests/unit/algorithms/test_loss_family.py).
@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
def test_sequence_loss_update_is_the_same_at_tp2_pp2_and_dp2(loss):
    mode = "seq-mean-token-mean"
    (initial,) = run_distributed(initial_weights_worker, 1)
    ((w0, w1, m1),) = run_distributed(_step_worker, 1, 1, 1, loss, mode, initial)
    ((_, wp, _),) = run_distributed(_step_worker, 1, 1, 1, "ppo_clip", mode, initial)
    assert m1["pg_clipfrac"] > 0  # the sequence clip took part
    path = _path()
    for tensor, pipeline, world in ((2, 1, 2), (1, 2, 2), (1, 1, 2)):
        results = run_distributed(_step_worker, world, tensor, pipeline, loss, mode, initial)
        w2, m2 = results[0][1], results[0][2]
        assert m2["pg_clipfrac"] == m1["pg_clipfrac"], (tensor, pipeline)
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=0,
                                       msg=f"{name} at TP {tensor} PP {pipeline} world {world}",
                                       atol=update_tol(w1[name], w0[name], UPDATES, path))
    # The loss changes the update (against PPO-clip at the same clip range; the first update is
    # the same for both, ratio 1) far beyond the tolerance, so the comparisons above can fail.
    assert max(float((w1[n] - wp[n]).abs().max()) / update_tol(w1[n], w0[n], UPDATES, path)
               for n in w1) > 10


def test_cov_modifier_on_a_family_loss_at_global_scope_is_the_same_at_dp2():
    """SAPO with KL-Cov's penalty, cov_scope global, selecting with a fresh forward of the
    current weights, aggregated with the constant normaliser (L = 12): at DP=2 the selection
    (over both ranks' tokens), the normaliser (sequences of both ranks x L) and the summed
    gradients are those of the whole step at DP=1, so the update is the same up to rounding;
    both ranks hold the same weights."""
    extra = dict(loss_agg_mode="seq-mean-token-sum-norm",
                 algorithm_extra={"cov_modifier": "kl_cov", "loss_scale_factor": 12})
    ((w1, m1, w0),) = run_distributed(update_worker, 1, "sapo", "global", "fresh", **extra)
    (w2, m2, _), (w2b, _, _) = run_distributed(update_worker, 2, "sapo", "global", "fresh",
                                               **extra)
    samples = random_samples(0)
    logp_path, path = rounding_paths(samples)
    assert m1["selected_frac"] > 0
    assert m1["selected_frac"] == m2["selected_frac"]  # the same tokens: a ratio of counts
    # Cov = (A - mean A)(logp - mean logp): each logp and their mean move by rounding.
    cov_tol = 4 * max(abs(s.advantage) for s in samples) * rounding_tol(m1["max_abs_logp"],
                                                                         logp_path)
    assert m1["cov_selected_mean"] == pytest.approx(m2["cov_selected_mean"], abs=cov_tol)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, msg=name,
                                   atol=update_tol(w1[name], w0[name], UPDATES, path))
        torch.testing.assert_close(w2b[name], w2[name], rtol=0, atol=0, msg=name)
    # The penalty changes the update (against SAPO alone) far beyond the tolerance, so the
    # comparison above can fail.
    ((wn, _, _),) = run_distributed(update_worker, 1, "sapo", "global", "fresh",
                                    loss_agg_mode="seq-mean-token-sum-norm",
                                    algorithm_extra={"loss_scale_factor": 12})
    assert max(float((w1[n] - wn[n]).abs().max()) / update_tol(w1[n], w0[n], UPDATES, path)
               for n in w1) > 10
