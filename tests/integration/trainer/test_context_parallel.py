"""Context parallelism through the actor and Megatron: one RL step (recompute, then 2 epochs x 2
mini-batches of updates) at CP=2 gives every sample the log-probs and entropies, selects the
tokens, reports the losses and makes the update that CP=1 makes, up to rounding: PPO-clip,
Clip-Cov and KL-Cov at both Cov scopes, GSPO (a sequence split over the CP ranks is one
sequence-level ratio) and the 80/20 rule, on padded and packed micro-batches, and with TP=2 x
CP=2, PP=2 x CP=2 and LoRA adapters."""

from __future__ import annotations

from typing import Optional

import pytest
import torch

from actor_updates import UPDATES, drift_engine_logprobs, rounding_paths
from harness import run_distributed
from tiny_models import hf_weights, initial_weights_worker, random_samples, tiny_actor
from tolerance import rounding_tol, update_tol

from megatron_entropy.models.lora_settings import LoraSettings

TEMPERATURE = 0.1  # entropies spread over nats: a token that saw the wrong keys shows
SAMPLES = dict(groups=4, per_group=2, response_len=(6, 40))
BUDGET = 96  # several micro-batches per mini-batch in either layout


@pytest.fixture(scope="module")
def initial():
    (weights,) = run_distributed(initial_weights_worker, 1)
    return weights


def _step_worker(tensor: int, pipeline: int, context: int, layout: str, initial: dict,
                 algorithm: dict, samples: dict = SAMPLES, options: Optional[dict] = None):
    """From ``initial``: one step of the tiny policy at TP x PP x CP with the AlgorithmConfig
    fields ``algorithm`` on ``random_samples(1, **samples)`` (``options``: tiny_actor's model
    and optimizer options); the weights before and after (HF names, on the replica's leader),
    the metrics and every sample's log-probs and entropies."""
    from megatron.core import parallel_state as ps

    from megatron_entropy.config import AlgorithmConfig, TrainerConfig

    trainer = TrainerConfig(lr=1e-2, steps=1, grad_clip=0.0, adam_eps=1.0, weight_decay=0.0,
                            micro_batch_tokens=BUDGET, mini_batches_per_step=2, ppo_epochs=2,
                            seed=5, micro_batch_layout=layout)
    defaults = AlgorithmConfig()
    # nested sections (token_rules, rollout_correction, siren, ...) from their dicts
    sections = {k: type(getattr(defaults, k))(**v) for k, v in algorithm.items()
                if isinstance(v, dict)}
    correction = sections.get("rollout_correction", defaults.rollout_correction)
    settings = AlgorithmConfig(**{"kl_cov_ratio": 0.1, "kl_cov_coef": 1.0,
                                  "clip_cov_ratio": 0.2, "clip_cov_lb": -100.0,
                                  "clip_cov_ub": 100.0, "logprob_impl": "fused",
                                  **algorithm, **sections})
    actor = tiny_actor(tensor, pipeline, settings, trainer, TEMPERATURE, initial=initial,
                       context=context, **{"seq_length": 128, **(options or {})})
    assert ps.get_context_parallel_world_size() == context
    step_samples = random_samples(1, **samples)
    before = hf_weights(actor)
    actor.recompute(step_samples)
    if correction.mode != "none":
        drift_engine_logprobs(step_samples)
    metrics = actor.update(step_samples, step=1)
    stats = [(s.old_logprobs.double(), s.entropy.double()) for s in step_samples]
    return before, hf_weights(actor), metrics, stats


# A 30-token prompt and a 1-2 token response: every response token is predicted in the last
# quarter of its row, which CP rank 0 holds; rank 1 computes none but still takes part in the
# attention's backward (a zero gradient flows through its log-prob op).
SHORT = dict(groups=4, per_group=2, prompt_len=(30, 31), response_len=(1, 3))
CASES = {
    "ppo_clip": ("padded", dict(loss="ppo_clip")),
    "entropy bonus, a rank without response tokens": (
        "padded", dict(loss="ppo_clip", entropy_coef=0.05), SHORT),
    "clip_cov micro_batch": ("packed", dict(loss="clip_cov")),
    "clip_cov global": ("padded", dict(loss="clip_cov", cov_scope="global")),
    "kl_cov micro_batch": ("padded", dict(loss="kl_cov")),
    "kl_cov global": ("packed", dict(loss="kl_cov", cov_scope="global")),
    "gspo": ("packed", dict(loss="gspo", loss_agg_mode="seq-mean-token-mean")),
    "80/20 rule": ("padded", dict(loss="ppo_clip", token_rules=dict(
        high_entropy_minority=True, high_entropy_scope="global"))),
    "rollout correction (mis)": ("padded", dict(loss="kl_cov", cov_scope="global",
                                                rollout_correction=dict(mode="mis"))),
    # an entropy method whose loss term reads the training forward's vocab statistics (the
    # top-p entropy, with gradient)
    "SIREN": ("packed", dict(loss="ppo_clip", siren=dict(enabled=True, coef=0.5))),
}
# Metrics that say which tokens a rule took (ratios of counts: the same tokens, exactly).
COUNTS = ("selected_frac", "entropy_rule/pg_token_frac", "rollout_corr/masked_frac")


def _assert_same_step(got: tuple, want: tuple, label: str, samples: dict = SAMPLES) -> None:
    w0, w1, m1, s1 = want
    _, w2, m2, s2 = got
    logp_path, path = rounding_paths(random_samples(1, **samples))
    for (lp1, h1), (lp2, h2) in zip(s1, s2):
        torch.testing.assert_close(lp2, lp1, rtol=0, msg=label,
                                   atol=rounding_tol(lp1, logp_path, torch.float32))
        torch.testing.assert_close(h2, h1, rtol=0, msg=label,
                                   atol=rounding_tol(h1, logp_path, torch.float32))
    for key in COUNTS:
        if key in m1:
            assert m2[key] == m1[key], (label, key)
    for key in ("pg_loss", "ppo_kl", "entropy"):
        assert m2[key] == pytest.approx(m1[key], rel=0, abs=rounding_tol(m1[key], path)), \
            (label, key)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, msg=f"{name} {label}",
                                   atol=update_tol(w1[name], w0[name], UPDATES, path))
    assert max((w1[n] - w0[n]).abs().max() for n in w1) > 1e-3  # the step moved the weights


@pytest.mark.parametrize("case", list(CASES))
def test_context_parallel_equals_one_rank(initial, case):
    layout, algorithm, *samples = CASES[case]
    samples = samples[0] if samples else SAMPLES
    (want,) = run_distributed(_step_worker, 1, 1, 1, 1, layout, initial, dict(algorithm), samples)
    got = run_distributed(_step_worker, 2, 1, 1, 2, layout, initial, dict(algorithm), samples)
    for rank, result in enumerate(got):  # each CP rank holds the whole step's statistics
        assert result[2] == got[0][2], rank
    _assert_same_step(got[0], want, case, samples)
    if any(k in want[2] for k in COUNTS):
        assert max(want[2].get(k, 0.0) for k in COUNTS) > 0  # the rule selected something


@pytest.mark.parametrize("tensor,pipeline", [(2, 1), (1, 2)])
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_context_parallel_with_tensor_and_pipeline_parallelism(initial, tensor, pipeline, layout):
    algorithm = dict(loss="kl_cov", cov_scope="global")
    (want,) = run_distributed(_step_worker, 1, 1, 1, 1, layout, initial, dict(algorithm))
    got = run_distributed(_step_worker, 4, tensor, pipeline, 2, layout, initial, dict(algorithm),
                          timeout=300)
    _assert_same_step(got[0], want, f"TP={tensor} PP={pipeline} CP=2 {layout}")


def test_context_parallel_with_the_distributed_optimizer_and_recompute(initial):
    """The distributed optimizer sharding its state over DP x CP and full activation recompute
    (the backward runs each layer's forward again, its K/V gather included): CP=2 against a
    plain CP=1 step, up to fp32 rounding."""
    options = dict(recompute_activations=True, distributed_optimizer=True)
    algorithm = dict(loss="kl_cov", cov_scope="global")
    (want,) = run_distributed(_step_worker, 1, 1, 1, 1, "packed", initial, dict(algorithm))
    got = run_distributed(_step_worker, 2, 1, 1, 2, "packed", initial, dict(algorithm), SAMPLES,
                          options)
    _assert_same_step(got[0], want, "CP=2, distributed optimizer, recompute")


def test_context_parallel_in_bf16(initial):
    """bf16 weights and compute (fp32 main weights): CP=2 differs from CP=1 by at most twice
    what bf16 itself changes against fp32 at CP=1, in the log-probs and in the step's update
    (the weights after its four updates, all tensors together): rounding, not another
    function."""
    algorithm = dict(loss="kl_cov", cov_scope="global")
    bf16 = dict(dtype="bf16")
    (fp32,) = run_distributed(_step_worker, 1, 1, 1, 1, "packed", initial, dict(algorithm))
    (one,) = run_distributed(_step_worker, 1, 1, 1, 1, "packed", initial, dict(algorithm),
                             SAMPLES, bf16)
    (two, _) = run_distributed(_step_worker, 2, 1, 1, 2, "packed", initial, dict(algorithm),
                               SAMPLES, bf16)

    def logp_gap(a, b) -> float:
        return max(float((x[0] - y[0]).abs().max()) for x, y in zip(a[3], b[3]))

    def update_gap(a, b) -> float:
        return float(torch.cat([(a[1][n].float() - b[1][n].float()).reshape(-1)
                                for n in a[1]]).norm())

    assert 0 < logp_gap(two, one) <= 2 * logp_gap(one, fp32)
    assert 0 < update_gap(two, one) <= 2 * update_gap(one, fp32)
    assert update_gap(one, fp32) < 0.2 * update_gap(one, (None, one[0]))  # the step moved


def test_context_parallel_with_lora(initial):
    """LoRA adapters (the base frozen) under CP=2: every CP rank draws the same adapters, their
    gradients are reduced over DP x CP, and the step's merged weights equal CP=1's."""
    options = dict(lora=LoraSettings(rank=4, alpha=8.0))
    algorithm = dict(loss="kl_cov", cov_scope="global")
    (want,) = run_distributed(_step_worker, 1, 1, 1, 1, "packed", initial, dict(algorithm),
                              SAMPLES, options)
    got = run_distributed(_step_worker, 2, 1, 1, 2, "packed", initial, dict(algorithm), SAMPLES,
                          options)
    _assert_same_step(got[0], want, "CP=2, LoRA")
