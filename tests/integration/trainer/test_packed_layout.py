"""Packed micro-batches (trainer/packing.py) through the actor and Megatron: the same log-probs,
entropies, losses and weights after a step's four updates as padded rows, up to rounding, at
DP=1, TP=2 and PP=2 for the same samples in a micro-batch, and with the packer's own bins (other
micro-batches than the padded layout's) at the global Cov scope; auto's choice per mini-batch."""

from __future__ import annotations

import pytest
import torch

from actor_updates import UPDATES, rounding_paths
from harness import run_distributed
from tiny_models import hf_weights, initial_weights_worker, random_samples, tiny_actor
from tolerance import rounding_tol, update_tol

# At temperature 0.1 the tiny random model's entropies spread over nats: a token that saw
# another sample's tokens would show far above rounding.
TEMPERATURE = 0.1
# Long-tailed responses (6-60 tokens) and short prompts: padding dominates padded rows.
SAMPLES = dict(groups=4, per_group=2, response_len=(6, 60))


@pytest.fixture(scope="module")
def initial():
    (weights,) = run_distributed(initial_weights_worker, 1)
    return weights


def _step_worker(tensor: int, pipeline: int, layout: str, budget: int, loss: str, scope: str,
                 initial: dict):
    """From ``initial``: recompute -> 2 epochs x 2 mini-batches of updates; the weights before
    and after (HF names, on the replica's leader), the metrics, every sample's log-probs and
    entropies, the micro-batches of the first mini-batch."""
    from megatron_entropy.config import AlgorithmConfig, TrainerConfig

    trainer = TrainerConfig(lr=1e-2, steps=1, grad_clip=0.0, adam_eps=1.0, weight_decay=0.0,
                            micro_batch_tokens=budget, mini_batches_per_step=2, ppo_epochs=2,
                            seed=5, micro_batch_layout=layout)
    algorithm = AlgorithmConfig(loss=loss, kl_cov_ratio=0.1, kl_cov_coef=1.0, clip_cov_ratio=0.2,
                                clip_cov_lb=-100.0, clip_cov_ub=100.0, cov_scope=scope,
                                logprob_impl="fused")
    actor = tiny_actor(tensor, pipeline, algorithm, trainer, TEMPERATURE, initial=initial,
                       seq_length=128)
    samples = random_samples(1, **SAMPLES)
    before = hf_weights(actor)
    actor.recompute(samples)
    metrics = actor.update(samples, step=1)
    stats = [(s.old_logprobs.double(), s.entropy.double()) for s in samples]
    first = [mb.sample_ids for mb in actor._pack(samples, list(range(4)))]
    return before, hf_weights(actor), metrics, stats, first


def _compare(got, want, path: int, logp_path: int, label: str) -> None:
    w0, w1, m1, s1, _ = want
    _, w2, m2, s2, _ = got
    for (lp1, h1), (lp2, h2) in zip(s1, s2):
        torch.testing.assert_close(lp2, lp1, rtol=0, atol=rounding_tol(lp1, logp_path, torch.float32),
                                   msg=label)
        torch.testing.assert_close(h2, h1, rtol=0, atol=rounding_tol(h1, logp_path, torch.float32),
                                   msg=label)
    assert m2["selected_frac"] == m1["selected_frac"] > 0, label  # the same tokens chosen
    for key in ("pg_loss", "ppo_kl", "entropy"):
        assert m2[key] == pytest.approx(m1[key], rel=0, abs=rounding_tol(m1[key], path)), key
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, msg=f"{name} {label}",
                                   atol=update_tol(w1[name], w0[name], UPDATES, path))
    assert max((w1[n] - w0[n]).abs().max() for n in w1) > 1e-3  # the step moved the weights


def test_packed_equals_padded_for_the_same_micro_batches(initial):
    """A budget that holds each mini-batch in one micro-batch either way: the same samples per
    micro-batch, so even Clip-Cov's micro-batch draw takes the same tokens."""
    logp_path, path = rounding_paths(random_samples(1, **SAMPLES))
    args = (10 ** 4, "clip_cov", "micro_batch", initial)
    (padded,) = run_distributed(_step_worker, 1, 1, 1, "padded", *args)
    (packed,) = run_distributed(_step_worker, 1, 1, 1, "packed", *args)
    assert packed[4] == padded[4] == [[0, 1, 2, 3]]
    _compare(packed, padded, path, logp_path, "DP=1")
    for tensor, pipeline in ((2, 1), (1, 2)):
        results = run_distributed(_step_worker, 2, tensor, pipeline, "packed", *args)
        _compare(results[0], padded, path, logp_path, f"TP={tensor} PP={pipeline}")


@pytest.mark.parametrize("loss", ["kl_cov", "clip_cov"])
def test_packed_bins_equal_padded_rows_at_global_scope(initial, loss):
    """A budget of 80 tokens: first-fit-decreasing bins hold other samples together than the
    padded rows do; at the global scope the population is the whole step either way."""
    logp_path, path = rounding_paths(random_samples(1, **SAMPLES))
    (padded,) = run_distributed(_step_worker, 1, 1, 1, "padded", 80, loss, "global", initial)
    (packed,) = run_distributed(_step_worker, 1, 1, 1, "packed", 80, loss, "global", initial)
    assert packed[4] != padded[4]
    _compare(packed, padded, path, logp_path, "packer's bins")


def _auto_worker():
    from megatron_entropy.config import AlgorithmConfig, TrainerConfig

    actor = tiny_actor(1, 1, AlgorithmConfig(), TrainerConfig(micro_batch_tokens=10 ** 4))
    long_tail = random_samples(2, **SAMPLES)
    shared = random_samples(2, groups=2, per_group=4, shared_prompts=True, prompt_len=(40, 41),
                            response_len=(3, 5))
    kind = lambda mbs: "packed" if mbs[0].cu_seqlens is not None else (  # noqa: E731
        "shared_prompt" if mbs[0].attention_mask is not None else "padded")
    return actor.layouts, kind(actor._pack(long_tail)), kind(actor._pack(shared))


def test_auto_takes_the_cheaper_of_packed_and_shared_prompt_rows():
    ((layouts, long_tail, shared),) = run_distributed(_auto_worker, 1)
    assert layouts.candidates == ("packed", "shared_prompt")
    assert long_tail == "packed" and shared == "shared_prompt"
