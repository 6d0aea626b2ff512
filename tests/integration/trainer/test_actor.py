"""The actor's updates through Megatron: with cov_scope=global the update does not depend on how
the step is split over DP ranks and micro-batches (selection, loss and gradient are those of the
whole step), in both selection modes; micro_batch scope selects per micro-batch."""

from __future__ import annotations

import pytest
import torch

from actor_updates import (RULE_TEMPERATURE, RULES, UPDATES, drift_engine_logprobs, rounding_paths,
                           rule_reference, step_entropies, update_worker)
from harness import init_megatron, run_distributed
from loss_references import ref_aggregate, ref_corrected_terms
from tiny_models import random_samples, tiny_hf_config
from tolerance import rounding_tol, update_tol

from megatron_entropy.models.arch import arch_from_hf_config


@pytest.mark.parametrize("loss,selection,correction", [
    ("kl_cov", "fresh", None), ("kl_cov", "recompute", None), ("clip_cov", "fresh", None),
    ("clip_cov", "recompute", None), ("kl_cov", "recompute", "mis")],
    ids=["kl_cov-fresh", "kl_cov-recompute", "clip_cov-fresh", "clip_cov-recompute",
         "kl_cov-recompute-mis"])
def test_global_scope_update_is_independent_of_the_dp_split(loss, selection, correction):
    """With mis, the rejected tokens leave the step's denominator and Cov population over the
    whole DP group, not per rank."""
    extra = {} if correction is None else {"correction": {"mode": correction}}
    ((w1, m1, w0),) = run_distributed(update_worker, 1, loss, "global", selection, **extra)
    (w2, m2, _), (w2b, _, _) = run_distributed(update_worker, 2, loss, "global", selection,
                                               **extra)
    if correction:  # the same tokens rejected: a ratio of counts
        assert 0 < m1["rollout_corr/masked_frac"] == m2["rollout_corr/masked_frac"] < 1
    ((wp, _, _),) = run_distributed(update_worker, 1, "ppo_clip", "micro_batch", "recompute")
    # Split over 2 DP ranks the micro-batches hold other samples (other padding, other GEMM
    # shapes) and the grads are summed in another order: the same math up to rounding along
    # the path of a log-prob (tests/helpers/tolerance.py) and of a gradient (+ every token of the step).
    samples = random_samples(0)
    logp_path, path = rounding_paths(samples)
    assert m1["selected_frac"] > 0
    assert m1["selected_frac"] == m2["selected_frac"]  # the same tokens: a ratio of counts
    # Cov = (A - mean A)(logp - mean logp): each logp and their mean move by rounding.
    logp_tol = rounding_tol(m1["max_abs_logp"], logp_path)
    cov_tol = 2 * max(abs(s.advantage) for s in samples) * 2 * logp_tol
    assert m1["cov_selected_mean"] == pytest.approx(m2["cov_selected_mean"], abs=cov_tol)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, msg=name,
                                   atol=update_tol(w1[name], w0[name], UPDATES, path))
        torch.testing.assert_close(w2b[name], w2[name], rtol=0, atol=0, msg=name)
    # The selection changes the update (against plain PPO without clipping), so the
    # comparison above covers it.
    assert max((w1[n] - wp[n]).abs().max() for n in w1) > 1e-4


def test_distributed_optimizer_at_dp2_equals_the_plain_optimizer_at_dp1():
    """Megatron's distributed optimizer on gloo/CPU (grads reduce-scattered, each DP rank
    updating its shard of the fp32 main weights and Adam moments, params all-gathered): 4 updates
    of one step at DP=2 give the weights the plain optimizer gives at DP=1, up to the rounding
    of a split step (as in the DP-split test above); both DP ranks hold the same weights."""
    ((w1, m1, w0),) = run_distributed(update_worker, 1, "kl_cov", "global", "recompute")
    (w2, m2, _), (w2b, _, _) = run_distributed(update_worker, 2, "kl_cov", "global", "recompute",
                                               distributed_optimizer=True)
    samples = random_samples(0)
    _, path = rounding_paths(samples)
    assert set(m2["optimizers"]) == {"DistributedOptimizer"} != set(m1["optimizers"])
    assert m1["selected_frac"] == m2["selected_frac"]
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, msg=name,
                                   atol=update_tol(w1[name], w0[name], UPDATES, path))
        torch.testing.assert_close(w2b[name], w2[name], rtol=0, atol=0, msg=name)
    assert max((w1[n] - w0[n]).abs().max() for n in w1) > 1e-3  # the updates moved the weights


def test_overlapped_grad_reduce_and_param_gather_give_the_same_update():
    """trainer.overlap_communication (on GPUs by default) at DP=2 with the distributed optimizer:
    grads reduce-scattered bucket by bucket during the backward and the params all-gathered
    during the next mini-batch's forward give, on both ranks, the same weights bit for bit as
    the synchronous reduce and gather (the same reductions in the same buckets)."""
    sync = run_distributed(update_worker, 2, "kl_cov", "global", "recompute",
                           distributed_optimizer=True)
    overlapped = run_distributed(update_worker, 2, "kl_cov", "global", "recompute",
                                 distributed_optimizer=True, overlap=True)
    for (ws, ms, _), (wo, mo, _) in zip(sync, overlapped):
        assert ms["selected_frac"] == mo["selected_frac"]
        for name in ws:
            torch.testing.assert_close(wo[name], ws[name], rtol=0, atol=0, msg=name)


def test_micro_batch_scope_selects_inside_each_micro_batch():
    """Same data, same seed: choosing the top Cov tokens per micro-batch (the paper's code)
    instead of over the whole step changes which tokens are penalised, and so the update."""
    ((wm, mm, _),) = run_distributed(update_worker, 1, "kl_cov", "micro_batch", "recompute")
    ((wg, mg, _),) = run_distributed(update_worker, 1, "kl_cov", "global", "recompute")
    assert mm["selected_frac"] > 0 and mg["selected_frac"] > 0
    assert mm["cov_selected_mean"] != pytest.approx(mg["cov_selected_mean"], rel=1e-3)
    assert max((wm[n] - wg[n]).abs().max() for n in wm) > 1e-6


def test_a_loss_knob_of_the_step_acts_as_the_configured_value_would():
    """The entropy controller's knob reaches the loss as a runtime value of the step (the
    ``algorithm`` section keeps the configured one): KL-Cov at k = 0.1 given k = 0.3 for the step
    makes the update a run configured with k = 0.3 makes, bit for bit, and another than k = 0.1."""
    ((wk, mk, _),) = run_distributed(update_worker, 1, "kl_cov", "global", "recompute",
                                     loss_knobs={"kl_cov_ratio": 0.3})
    ((wc, mc, _),) = run_distributed(update_worker, 1, "kl_cov", "global", "recompute",
                                     kl_cov_ratio=0.3)
    ((w0, m0, _),) = run_distributed(update_worker, 1, "kl_cov", "global", "recompute")
    assert mk["selected_frac"] == mc["selected_frac"] > m0["selected_frac"]
    for name in wk:
        torch.testing.assert_close(wk[name], wc[name], rtol=0, atol=0, msg=name)
    assert max((wk[n] - w0[n]).abs().max() for n in wk) > 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_a_sequence_without_response_tokens_changes_no_update(mode):
    """The step's normaliser counts valid tokens (token-mean) or sequences with a valid token
    (seq-mean-*), as ``aggregation.step_normalizer`` does: a sample with an empty response adds
    nothing to the loss and nothing to its denominator, so the update is the same without it.
    (Micro-batches of 48 tokens: the empty response shares one with another sample.)"""
    ((w, _, w0),) = run_distributed(update_worker, 1, "ppo_clip", "micro_batch", "recompute",
                                    mode, False, 48)
    ((we, _, _),) = run_distributed(update_worker, 1, "ppo_clip", "micro_batch", "recompute",
                                    mode, True, 48)
    samples = random_samples(0)
    _, path = rounding_paths(samples)
    for name in w:
        torch.testing.assert_close(we[name], w[name], rtol=0, msg=name,
                                   atol=update_tol(w[name], w0[name], UPDATES, path))


def _rule_run(dp: int, rule: str, micro_batch_tokens: int, with_rule: bool = True):
    loss, scope, clip, rules = RULES[rule]
    return run_distributed(update_worker, dp, loss, scope, "recompute", "token-mean", False,
                           micro_batch_tokens, rules if with_rule else None, clip,
                           RULE_TEMPERATURE)


@pytest.mark.parametrize("rule", list(RULES))
def test_token_rule_update_equals_its_formula_and_ignores_the_split(rule):
    """Global scope through the actor: the rule's selection equals its one-process formula over
    each optimizer step (metrics), and the update at DP=1 with 24-token micro-batches equals the
    one at DP=2 with 1000-token ones (one micro-batch per rank and mini-batch: other
    populations, paddings and GEMM shapes at once); without the rule it differs (the rule
    reaches the loss)."""
    ((w1, m1, w0),) = _rule_run(1, rule, 24)
    (w2, m2, _), (w2b, m2b, _) = _rule_run(2, rule, 1000)
    ((wo, _, _),) = _rule_run(1, rule, 24, with_rule=False)
    # Each run against the formula on its own recompute's entropies (another packing computes
    # them in another order: equal up to rounding, not bit for bit).
    # Shaping runs in fp32 (the advantages' dtype): each positive term of the mean is within one
    # fp32 rounding (2^-24 relative) of the float64 reference. The others select fp32 values
    # and average them in float64.
    rel = 2 ** -23 if rule == "shaping" else 1e-12
    for m, ranks in ((m1, [m1]), (m2, [m2, m2b])):
        for name, want in rule_reference(rule, step_entropies(ranks)).items():
            assert m[name] == pytest.approx(want, rel=rel), name
    ref = rule_reference(rule, step_entropies([m1]))
    if rule == "shaping":
        assert 0 < ref["entropy_rule/adv_bonus_capped_frac"] < 1  # both branches of the min
        assert m1["selected_frac"] == m2["selected_frac"] > 0
    samples = random_samples(0)
    _, path = rounding_paths(samples)
    for name in w1:
        torch.testing.assert_close(w2[name], w1[name], rtol=0, msg=name,
                                   atol=update_tol(w1[name], w0[name], UPDATES, path))
        torch.testing.assert_close(w2b[name], w2[name], rtol=0, atol=0, msg=name)
    assert max((w1[n] - wo[n]).abs().max() for n in w1) > 1e-4


# Rollout correction through the actor against its one-process formula: each mode and level
# once, mis at token level with KL-Cov (the rejected tokens leave the Cov population). Every
# loss with every mode against the formula: tests/unit/algorithms/test_rollout_correction.py.
CORRECTIONS = {
    "ppo_clip": {"none": {}, "tis-geometric": dict(mode="tis", level="geometric", tis_cap=1.2),
                 "mis-geometric": dict(mode="mis", level="geometric", mis_low=0.9,
                                       mis_high=1.1)},
    "kl_cov": {"none": {}, "tis-token": dict(mode="tis", level="token"),
               "mis-token": dict(mode="mis", level="token")}}
CORRECTION_EPOCHS = 2


def _correction_worker(loss: str):
    """For each of CORRECTIONS[loss], from the same initial weights: the weights after the actor's
    2 updates of one step (1 mini-batch x 2 epochs, 24-token micro-batches, global Cov scope
    selecting with a fresh forward) and after 2 updates whose loss is the one-process formula
    (tests/unit/algorithms/test_rollout_correction.py) on the whole step as one micro-batch, with the same
    optimizer; the actor's metrics; the smallest margin of the reference's selection (rounding
    must not change it); the initial weights; the step's samples."""

    from megatron_entropy.algorithms.rollout_correction import RolloutCorrectionSettings
    from megatron_entropy.config import (AlgorithmConfig, ModelConfig, ParallelConfig,
                                         TrainerConfig)
    from megatron_entropy.models.sharding import full_state_dict, load_full_state_dict
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.batch import pack_micro_batches
    from megatron_entropy.trainer.model_setup import (build_optimizer, build_trainable_model,
                                                      optimizer_step)

    init_megatron()
    arch = arch_from_hf_config(tiny_hf_config("qwen2"))
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64),
        ParallelConfig())
    initial = full_state_dict(chunks[0])
    loss_keys = dict(loss=loss, clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=100.0,
                     kl_cov_ratio=0.05, kl_cov_coef=1.0, clip_ratio_low=0.05,
                     clip_ratio_high=0.05, logprob_impl="fused", cov_scope="global",
                     global_selection_logprobs="fresh")
    s = AlgorithmConfig(**loss_keys)
    trainer = TrainerConfig(lr=1e-2, steps=1, ppo_epochs=CORRECTION_EPOCHS, grad_clip=0.0,
                            adam_eps=1.0, weight_decay=0.0, micro_batch_tokens=24, seed=5)
    samples = random_samples(0)
    out, margins = {}, []
    for name, kwargs in CORRECTIONS[loss].items():
        st = RolloutCorrectionSettings(**kwargs)
        weights = []
        for path in ("actor", "reference"):
            load_full_state_dict(chunks[0], initial)
            optimizer, scheduler = build_optimizer(chunks, trainer)
            actor = Actor(arch, chunks, optimizer, scheduler,
                          AlgorithmConfig(**loss_keys, rollout_correction=st), trainer, 1.0)
            actor.recompute(samples)
            drift_engine_logprobs(samples)
            if path == "actor":
                metrics = actor.update(samples, step=1)
            else:
                (mb,) = pack_micro_batches(samples, 10 ** 6)
                rows = mb.rows
                old = torch.cat([x.old_logprobs for x in samples]).double()
                adv = torch.tensor([x.advantage for x in samples for _ in x.response_ids],
                                   dtype=torch.float64)
                engine = torch.tensor([e for x in samples for e in x.engine_logprobs],
                                      dtype=torch.float64)
                for epoch in range(CORRECTION_EPOCHS):
                    seed = ((5 * 1_000_003 + 1) * 1009 + epoch) * 101  # the actor's draw

                    def loss_fn(model, output, mb, seed=seed):
                        logp, _ = actor._token_stats(model, output, mb)
                        per, kept_rows, kept, _ = ref_corrected_terms(
                            s, st, logp.double(), old, adv, engine, rows, seed)
                        margins.append(_selection_margin(s, logp.detach().double()[kept],
                                                         adv[kept]))
                        value = ref_aggregate(per, kept_rows, "token-mean", len(kept_rows))
                        return value.float(), torch.tensor(mb.num_tokens, dtype=torch.int), {}

                    actor._run_schedule(chunks, [mb], loss_fn, forward_only=False)
                    optimizer_step(optimizer, scheduler, chunks)
            weights.append(full_state_dict(chunks[0]))
        out[name] = (*weights, metrics)
    return out, min(margins), initial, samples


def _selection_margin(s, logp, adv) -> float:
    """How far the reference's Cov selection is from changing: KL-Cov, the gap between the
    k-th and the next largest Cov; Clip-Cov, the closest Cov to the candidates' lower bound."""
    cov = (adv - adv.mean()) * (logp - logp.mean())
    if s.loss == "kl_cov":
        k = max(1, int(cov.numel() * s.kl_cov_ratio))
        top = torch.sort(cov, descending=True).values
        return float(top[k - 1] - top[k])
    if s.loss == "clip_cov":
        return float((cov - s.clip_cov_lb).abs().min())
    return float("inf")


@pytest.mark.parametrize("loss", list(CORRECTIONS))
def test_rollout_correction_update_equals_its_formula(loss):
    """tis and mis at both levels through the actor (engine log-probs in the micro-batches,
    mis's mask in the step normalizer and the global Cov population, tis's weight in the
    loss): 2 updates equal those of the one-process formula on the whole step to rounding
    (another packing: the path of a gradient, as the DP-split test); each correction changes
    the update; mode none equals the formula without correction."""
    out, margin, w0, samples = run_distributed(_correction_worker, 1, loss)[0]
    logp_path, path = rounding_paths(samples)
    max_logp = float(torch.cat([s.old_logprobs for s in samples]).abs().max())
    # Cov = (A - mean A)(logp - mean logp): each logp moves by rounding along its path.
    cov_tol = 2 * max(abs(s.advantage) for s in samples) * 2 * rounding_tol(max_logp, logp_path)
    assert margin > cov_tol
    none = out["none"][0]
    for name, (actor, reference, metrics) in out.items():
        for p in actor:
            torch.testing.assert_close(actor[p], reference[p], rtol=0, msg=f"{name} {p}",
                                       atol=update_tol(reference[p], w0[p], CORRECTION_EPOCHS,
                                                       path))
        if name != "none":
            assert max((actor[p] - none[p]).abs().max() for p in actor) > 1e-4, name
        if name.startswith("mis"):
            assert 0 < metrics["rollout_corr/masked_frac"] < 1
        if name.startswith("tis"):
            assert metrics["rollout_corr/clipped_frac"] > 0  # the cap binds
            assert metrics["rollout_corr/weight_max"] == CORRECTIONS[loss][name].get("tis_cap",
                                                                                     2.0)
        assert metrics["rollout_corr/s/kl_k3"] == metrics["rollout_corr/kl_k3"] > 0


def test_rollout_correction_needs_engine_logprobs_unless_it_is_off():
    """A sample without an engine log-prob per token: mode tis names the key and the samples;
    mode none (metrics only) skips that micro-batch, as it skips one with a NaN log-prob."""
    from megatron_entropy.algorithms.rollout_correction import RolloutCorrectionSettings
    from megatron_entropy.config import AlgorithmConfig, TrainerConfig
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.batch import pack_micro_batches

    samples = random_samples(0)
    for s in samples:
        s.old_logprobs = torch.full((len(s.response_ids),), -1.0)
    samples[0].engine_logprobs = samples[0].engine_logprobs[:-1]
    samples[3].engine_logprobs[2] = float("nan")

    def correct(mode):
        actor = Actor(None, [], None, None,
                      AlgorithmConfig(rollout_correction=RolloutCorrectionSettings(mode=mode)),
                      TrainerConfig(), 1.0)
        mbs = pack_micro_batches(samples, 24)
        return mbs, actor._correct_rollouts(mbs, samples)

    with pytest.raises(ValueError, match=r"^algorithm\.rollout_correction\.mode=tis needs the "
                                         r"engine's log-prob of every response token; samples "
                                         r"\[0(, \d+)*\] lack some"):
        correct("tis")
    mbs, corrections = correct("none")
    skipped = [mb.index for mb in mbs if 0 in mb.sample_ids or 3 in mb.sample_ids]
    assert skipped and sorted(corrections) == [mb.index for mb in mbs if mb.index not in skipped]
