"""The exact entropy change of one RL step (analysis.entropy_change): after ppo_epochs x
mini-batches of real Megatron updates, entropy/delta equals a direct before/after computation —
a float64 transformers model loaded with the actor's exported weights before and after the step —
at TP=1, TP=2 and PP=2; cov/step and its per-source values equal the formula on the concatenated
step at DP=2."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from tiny_models import hf_weights, random_samples, tiny_actor, tiny_hf_config

from megatron_entropy.trainer.entropy_change import entropy_change_metrics

TEMPERATURE = 0.7


def _samples():
    """Four groups of two responses; groups 0, 1 from source 'a', 2, 3 from 'b' (so at DP=2
    each rank holds both sources)."""
    return random_samples(11, prompt_len=(3, 8), response_len=(5, 13), adv_scale=1.0,
                          source=lambda group: "a" if group < 2 else "b")


def _step_worker(tensor: int, pipeline: int):
    """recompute -> 2 epochs x 2 mini-batches of updates -> entropy_change, on this rank's DP
    share; returns the metrics, the full weights before and after, and the samples."""
    from megatron_entropy.config import AlgorithmConfig, TrainerConfig
    from megatron_entropy.trainer.rollouts import dp_share

    # One step of 2 epochs x 2 mini-batches: 4 updates.
    trainer = TrainerConfig(lr=3e-2, steps=1, grad_clip=0.0, weight_decay=0.0,
                            micro_batch_tokens=40, mini_batches_per_step=2, ppo_epochs=2, seed=0)
    actor = tiny_actor(tensor, pipeline, AlgorithmConfig(loss="ppo_clip", logprob_impl="fused"),
                       trainer, TEMPERATURE)
    mine = dp_share(_samples())
    before = hf_weights(actor)
    actor.recompute(mine)
    actor.update(mine, step=1)
    metrics = actor.entropy_change(mine)
    after = hf_weights(actor)
    return metrics, before, after, mine


def _hf_entropies(weights: dict, samples) -> list[torch.Tensor]:
    """Per-token entropy of each response at TEMPERATURE, in float64, from a transformers
    model holding ``weights``: the direct computation, independent of Megatron and our ops."""
    import transformers

    cfg = tiny_hf_config("qwen2")
    config = transformers.AutoConfig.for_model(
        "qwen2", **{k: v for k, v in cfg.items() if k != "model_type"})
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    model.load_state_dict({k: v.double() for k, v in weights.items()}, strict=True)
    out = []
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(ids).logits[0, len(s.prompt_ids) - 1:-1] / TEMPERATURE
            logp = torch.log_softmax(logits, dim=-1)
            out.append(-(logp.exp() * logp).sum(-1))
    return out


# Megatron's fp32 forward against a float64 forward of the same weights. The entropies are
# ~6.9 nats (a random tiny model), where one fp32 ulp is 4.8e-7; the fp32 logits of 2 layers
# and the op's sums over 1000 vocabulary entries each add a few ulps (measured: <= 1.1 ulp on
# AMD EPYC). 20 ulps per entropy, twice that for a difference of two.
H_ATOL = 1e-5


def _check_against_direct(metrics: dict, before_w: dict, after_w: dict, samples) -> float:
    h_before = _hf_entropies(before_w, samples)
    h_after = _hf_entropies(after_w, samples)
    for s, hb in zip(samples, h_before):
        # The recompute (H_before of the metric) is the direct computation's.
        torch.testing.assert_close(s.entropy.double(), hb, rtol=0, atol=H_ATOL)
    deltas = [ha - hb for ha, hb in zip(h_after, h_before)]
    want = float(torch.cat(deltas).mean())
    assert metrics["entropy/delta"] == pytest.approx(want, abs=2 * H_ATOL)
    seq = float(torch.stack([d.mean() for d in deltas]).mean())
    assert metrics["entropy/delta_seq_mean"] == pytest.approx(seq, abs=2 * H_ATOL)
    for src in ("a", "b"):
        d = torch.cat([d for d, s in zip(deltas, samples) if s.source == src])
        assert metrics[f"entropy/{src}/delta"] == pytest.approx(float(d.mean()), abs=2 * H_ATOL)
    return want


@pytest.mark.parametrize("tensor,pipeline", [(1, 1), (2, 1), (1, 2)])
def test_entropy_delta_equals_direct_before_after(tensor, pipeline):
    world = tensor * pipeline
    results = run_distributed(_step_worker, world, tensor, pipeline)
    metrics, before_w, after_w, samples = results[0]
    for m, *_ in results[1:]:
        assert m == metrics  # every rank of the replica logs the same numbers
    want = _check_against_direct(metrics, before_w, after_w, samples)
    # The updates moved entropy well beyond the tolerance, so the comparison can fail.
    assert abs(want) > 50 * H_ATOL, want


def _cov(logp: torch.Tensor, adv: torch.Tensor) -> float:
    return float(((logp - logp.mean()) * (adv - adv.mean())).mean())


def test_cov_step_equals_the_formula_on_the_concatenated_step_at_dp2():
    (m0, before_w, after_w, s0), (m1, _, after_w1, s1) = run_distributed(_step_worker, 2, 1, 1)
    assert m0 == m1
    for name in after_w:  # one replica's update: DP ranks hold the same weights
        assert torch.equal(after_w[name], after_w1[name]), name
    step = s0 + s1
    # whole groups on each rank, half of them each
    g0, g1 = {s.group for s in s0}, {s.group for s in s1}
    assert not g0 & g1 and len(g0) == len(g1) > 0

    def concat(samples):
        logp = torch.cat([s.old_logprobs.double() for s in samples])
        adv = torch.cat([torch.full((len(s.response_ids),), s.advantage, dtype=torch.float64)
                         for s in samples])
        return logp, adv

    # float64 throughout; only summation order differs (merge across ranks vs one sum).
    assert m0["cov/step"] == pytest.approx(_cov(*concat(step)), rel=1e-12, abs=1e-15)
    for src in ("a", "b"):
        part = [s for s in step if s.source == src]
        assert m0[f"cov/{src}/step"] == pytest.approx(_cov(*concat(part)), rel=1e-12, abs=1e-15)
    _check_against_direct(m0, before_w, after_w, step)


def test_per_source_values_add_up_to_the_step_and_empty_sequences_are_skipped():
    g = torch.Generator().manual_seed(0)
    lengths, sources = [3, 5, 0, 4, 2], ["x", "y", "y", "x", "y"]
    before = [torch.rand(n, generator=g) for n in lengths]
    after = [b + torch.randn(b.shape, generator=g) * 0.1 for b in before]
    logp = [-torch.rand(n, generator=g) * 3 for n in lengths]
    adv = [1.5, -0.5, 2.0, 0.25, -1.0]
    m = entropy_change_metrics(before, after, logp, adv, sources)
    keep = [i for i, n in enumerate(lengths) if n]
    lp = torch.cat([logp[i].double() for i in keep])
    a = torch.cat([torch.full((lengths[i],), adv[i], dtype=torch.float64) for i in keep])
    d = torch.cat([(after[i] - before[i]).double() for i in keep])
    assert m["cov/step"] == pytest.approx(_cov(lp, a), rel=1e-12)
    assert m["entropy/delta"] == pytest.approx(float(d.mean()), rel=1e-12)
    assert m["entropy/delta_seq_mean"] == pytest.approx(
        sum(float((after[i] - before[i]).double().mean()) for i in keep) / len(keep), rel=1e-12)
    # Law of total covariance: within-source values plus the between-source term.
    src = torch.tensor([ord(sources[i]) for i in keep for _ in range(lengths[i])])
    total = 0.0
    for name in ("x", "y"):
        w = src == ord(name)
        total += float(w.double().mean()) * (
            m[f"cov/{name}/step"] + float((lp[w].mean() - lp.mean()) * (a[w].mean() - a.mean())))
    assert total == pytest.approx(m["cov/step"], rel=1e-12)
    with pytest.raises(ValueError, match="same tokens"):
        entropy_change_metrics([torch.zeros(2)], [torch.zeros(3)], [torch.zeros(2)], [0.0], ["x"])
