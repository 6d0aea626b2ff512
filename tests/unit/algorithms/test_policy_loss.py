"""Policy losses, Cov selection and aggregation against a plain one-process implementation of the
formulas in DESIGN.md ("The algorithm"), written here over the list of valid tokens."""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed
from loss_references import (LOSS_SCALE, agg_data, make_batch, policy_logp, ref_aggregate, ref_kl,
                             ref_select, ref_token_losses, valid_list)

from megatron_entropy.algorithms.aggregation import AGG_MODES, step_normalizer
from megatron_entropy.algorithms.policy_loss import (PolicyLossSettings, policy_loss,
                                                     reduce_metrics, select_tokens_global,
                                                     select_tokens_micro_batch)

# ------------------------------------------------------------------------ the reference


# ------------------------------------------------------------------------ data


SETTINGS = {
    "ppo_clip": PolicyLossSettings(loss="ppo_clip"),
    "ppo_dual": PolicyLossSettings(loss="ppo_clip", dual_clip_c=1.5, clip_ratio_high=0.2),
    "clip_cov": PolicyLossSettings(loss="clip_cov", clip_cov_ratio=0.05),
    "kl_cov": PolicyLossSettings(loss="kl_cov", kl_cov_ratio=0.1),
    "clip_cov_reg": PolicyLossSettings(loss="clip_cov", clip_cov_ratio=0.05, entropy_coef=0.01,
                                       kl_coef=0.1, kl_type="k3",
                                       loss_agg_mode="seq-mean-token-mean"),
    "kl_cov_reg": PolicyLossSettings(loss="kl_cov", kl_cov_ratio=0.1, entropy_coef=0.02,
                                     kl_coef=0.05, kl_type="abs",
                                     loss_agg_mode="seq-mean-token-sum"),
    "ppo_k1": PolicyLossSettings(loss="ppo_clip", kl_coef=0.3, kl_type="k1"),
}


# ------------------------------------------------------------------------ micro_batch scope


@pytest.mark.parametrize("name", list(SETTINGS))
def test_micro_batch_scope_equals_reference(name):
    s = SETTINGS[name]
    d = make_batch(6, 20, seed=1)
    mask = d["mask"]
    normalizer = 57.0  # the whole step's count, larger than this micro-batch's
    logp = d["logp"].clone().requires_grad_()
    ent = d["entropy"].clone().requires_grad_()
    loss, metrics = policy_loss(s, logp, d["old"], d["adv"], mask, normalizer=normalizer,
                                entropy=ent, ref_logp=d["ref"],
                                generator=torch.Generator().manual_seed(7))
    loss.backward()
    got = reduce_metrics([metrics])

    lp = valid_list(d["logp"], mask).clone().requires_grad_()
    en = valid_list(d["entropy"], mask).clone().requires_grad_()
    old, adv, ref = (valid_list(d[k], mask) for k in ("old", "adv", "ref"))
    rows = mask.nonzero()[:, 0]
    chosen, cov = ref_select(s, lp, old, adv, seed=7)
    per = ref_token_losses(s, lp, old, adv, chosen)
    expected = ref_aggregate(per, rows, s.loss_agg_mode, normalizer)
    expected = expected - s.entropy_coef * ref_aggregate(en, rows, s.loss_agg_mode, normalizer)
    kl = ref_kl(lp, ref, s.kl_type)
    expected = expected + s.kl_coef * ref_aggregate(kl, rows, s.loss_agg_mode, normalizer)
    expected.backward()

    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(valid_list(logp.grad, mask), lp.grad, rtol=1e-12, atol=1e-14)
    if s.entropy_coef > 0:
        torch.testing.assert_close(valid_list(ent.grad, mask), en.grad, rtol=1e-12, atol=1e-14)
    else:
        assert ent.grad is None
    assert torch.equal(logp.grad[mask == 0], torch.zeros_like(logp.grad[mask == 0]))

    ratio = torch.exp(lp.detach() - old)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    seq_means = [valid_list(d["entropy"], mask)[rows == r].mean() for r in rows.unique()]
    want = {"pg_loss": per.mean(), "ppo_kl": (old - lp).mean(),
            "ppo_kl_abs": (lp - old).abs().mean(),
            "cov_mean": cov.mean(), "cov_max": cov.max(), "entropy": en.mean(),
            "entropy_seq_mean": torch.stack(seq_means).mean(), "kl_ref": kl.mean()}
    if s.loss != "kl_cov":
        want["pg_clipfrac"] = (l2 > l1).double().mean()
    if s.loss != "ppo_clip":
        want["selected_frac"] = chosen.double().mean()
        want["cov_selected_mean"] = cov[chosen].mean()
        want["cov_selected_max"] = cov[chosen].max()
        assert 0 < int(chosen.sum()) < chosen.numel()  # the selection really selects
    if s.dual_clip_c is not None:
        clip1 = torch.maximum(l1, l2)
        want["pg_clipfrac_lower"] = ((clip1 > -adv * s.dual_clip_c) & (adv < 0)).double().mean()
        assert want["pg_clipfrac_lower"] > 0
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v.detach()), rel=1e-9, abs=1e-12), k


def test_kl_cov_ties_go_to_the_earliest_token():
    s = PolicyLossSettings(loss="kl_cov", kl_cov_ratio=0.12)
    d = make_batch(8, 16, seed=3, discrete=True)
    sel = select_tokens_micro_batch(s, d["logp"], d["old"], d["adv"], d["mask"])
    lp, old, adv = (valid_list(d[k], d["mask"]) for k in ("logp", "old", "adv"))
    chosen, cov = ref_select(s, lp, old, adv, seed=0)
    kth = cov[chosen].min()
    assert int((cov == kth).sum()) > int((cov[chosen] == kth).sum())  # the cut splits a tie
    assert torch.equal(valid_list(sel.selected, d["mask"]), chosen)


def test_clip_cov_draw_follows_the_generator():
    s = SETTINGS["clip_cov"]
    d = make_batch(6, 20, seed=1)
    picks = [select_tokens_micro_batch(s, d["logp"], d["old"], d["adv"], d["mask"],
                                       torch.Generator().manual_seed(seed)).selected
             for seed in (5, 5, 6)]
    assert torch.equal(picks[0], picks[1])
    assert not torch.equal(picks[0], picks[2])


# ------------------------------------------------------------------------ global scope

# Four micro-batches of different shapes: DP rank 0 holds the first two, rank 1 the others.
SHAPES = [(3, 10), (2, 14), (4, 8), (2, 12)]


def _step(discrete: bool):
    return [make_batch(r, c, seed=10 + i, discrete=discrete) for i, (r, c) in enumerate(SHAPES)]


def _global_worker(setting: str, discrete: bool):
    import torch.distributed as dist

    s = SETTINGS[setting]
    rank = dist.get_rank()
    mine = _step(discrete)[2 * rank: 2 * rank + 2]
    normalizer = step_normalizer([d["mask"] for d in mine], s.loss_agg_mode, dist.group.WORLD)
    sels = select_tokens_global(s, [d["logp"] for d in mine], [d["old"] for d in mine],
                                [d["adv"] for d in mine], [d["mask"] for d in mine],
                                dp_group=dist.group.WORLD, seed=99)
    out = []
    for d, sel in zip(mine, sels):
        logp = d["logp"].clone().requires_grad_()
        loss, _ = policy_loss(s, logp, d["old"], d["adv"], d["mask"], normalizer=normalizer,
                              entropy=d["entropy"], ref_logp=d["ref"], selection=sel)
        loss.backward()
        out.append((sel.selected, float(loss.detach()), logp.grad))
    return out


@pytest.mark.parametrize("setting,discrete", [("clip_cov", False), ("kl_cov", True),
                                              ("kl_cov_reg", False), ("clip_cov_reg", False)])
def test_global_scope_dp2_equals_one_process_over_the_step(setting, discrete):
    s = SETTINGS[setting]
    results = [mb for rank in run_distributed(_global_worker, 2, setting, discrete)
               for mb in rank]
    step = _step(discrete)
    masks = [d["mask"] for d in step]
    lp = torch.cat([valid_list(d["logp"], d["mask"]) for d in step]).requires_grad_()
    old, adv, ref = (torch.cat([valid_list(d[k], d["mask"]) for d in step])
                     for k in ("old", "adv", "ref"))
    en = torch.cat([valid_list(d["entropy"], d["mask"]) for d in step])
    rows = torch.cat([m.nonzero()[:, 0] + 100 * i for i, m in enumerate(masks)])
    normalizer = float(len(rows)) if s.loss_agg_mode == "token-mean" else \
        float(len(rows.unique()))
    chosen, _ = ref_select(s, lp, old, adv, seed=99)
    per = ref_token_losses(s, lp, old, adv, chosen)
    expected = ref_aggregate(per, rows, s.loss_agg_mode, normalizer) \
        - s.entropy_coef * ref_aggregate(en, rows, s.loss_agg_mode, normalizer) \
        + s.kl_coef * ref_aggregate(ref_kl(lp, ref, s.kl_type), rows, s.loss_agg_mode, normalizer)
    expected.backward()

    got_chosen = torch.cat([valid_list(sel, m) for (sel, _, _), m in zip(results, masks)])
    assert torch.equal(got_chosen, chosen)
    assert 1 < int(chosen.sum()) < len(chosen)
    # The selection spans both ranks' tokens (it is not each rank's own top/draw).
    n0 = sum(int(m.sum()) for m in masks[:2])
    assert chosen[:n0].any() and chosen[n0:].any()
    assert sum(loss for _, loss, _ in results) == pytest.approx(float(expected.detach()), rel=1e-10)
    got_grad = torch.cat([valid_list(g, m) for (_, _, g), m in zip(results, masks)])
    torch.testing.assert_close(got_grad, lp.grad, rtol=1e-10, atol=1e-14)
    if discrete:
        cov_chosen = ref_select(s, lp, old, adv, 99)[1]
        kth = cov_chosen[chosen].min()
        assert int((cov_chosen == kth).sum()) > int((cov_chosen[chosen] == kth).sum())


# ------------------------------------------------------------------------ TP=2: same choice


def _tp_worker(world_tp: int, world_dp: int):
    """Ranks = DP x TP; each TP rank computes log-probs from its vocab shard, then selects."""
    import torch.distributed as dist

    from megatron_entropy.ops.logprob_entropy import vocab_parallel_logprob_entropy

    rank = dist.get_rank()
    dp, tp = divmod(rank, world_tp)
    tp_groups = [dist.new_group([d * world_tp + t for t in range(world_tp)])
                 for d in range(world_dp)]
    dp_groups = [dist.new_group([d * world_tp + t for d in range(world_dp)])
                 for t in range(world_tp)]
    vocab, v_pad = 90, 128
    out = {}
    logps, data = [], []
    for i in range(2):
        d = make_batch(5, 12, seed=40 + 2 * dp + i, garbage=False)
        g = torch.Generator().manual_seed(70 + 2 * dp + i)
        logits = torch.randn(5 * 12, v_pad, generator=g) * 4  # float32, as in training
        targets = torch.randint(0, vocab, (5 * 12,), generator=g)
        cols = slice(tp * v_pad // world_tp, (tp + 1) * v_pad // world_tp)
        logp, _ = vocab_parallel_logprob_entropy(logits[:, cols].contiguous(), targets,
                                                 vocab_size=vocab, group=tp_groups[dp],
                                                 chunk_tokens=16)
        logps.append(logp.view(5, 12))
        data.append(d)
    for name in ("clip_cov", "kl_cov"):
        s = PolicyLossSettings(loss=name, clip_cov_ratio=0.05, clip_cov_lb=0.1,
                               kl_cov_ratio=0.05)
        old = [lp + 0.1 * d["old"].float() for lp, d in zip(logps, data)]
        adv = [d["adv"].float() for d in data]
        masks = [d["mask"].float() for d in data]
        micro = [select_tokens_micro_batch(s, lp, o, a, m, torch.Generator().manual_seed(3))
                 .selected for lp, o, a, m in zip(logps, old, adv, masks)]
        glob = [sel.selected for sel in select_tokens_global(
            s, logps, old, adv, masks, dp_group=dp_groups[tp], seed=3)]
        out[name] = (micro, glob)
    return out


def _keyed_worker():
    """Rank r's rows with keys r, r + 2, r + 4, ...: in key order the ranks' rows interleave."""
    import torch.distributed as dist

    rank = dist.get_rank()
    mine = _step(False)[2 * rank: 2 * rank + 2]
    keys, k = [], rank
    for d in mine:
        keys.append(torch.arange(k, k + 2 * d["mask"].shape[0], 2))
        k += 2 * d["mask"].shape[0]
    sels = select_tokens_global(SETTINGS["clip_cov"], [d["logp"] for d in mine],
                                [d["old"] for d in mine], [d["adv"] for d in mine],
                                [d["mask"] for d in mine], dp_group=dist.group.WORLD, seed=99,
                                row_keys=keys)
    return [(key, sel.selected) for key, sel in zip(keys, sels)]


def test_global_draw_takes_the_rows_in_key_order_across_ranks():
    """With row keys, Clip-Cov's global draw is the one-process draw over every rank's rows
    sorted by key (here interleaved across the two DP ranks), not in rank order."""
    step = _step(False)
    width = max(c for _, c in SHAPES)

    def pad(t):
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    rows = {}
    for rank, part in enumerate([step[:2], step[2:]]):
        k = rank
        for d in part:
            for b in range(d["mask"].shape[0]):
                rows[k] = {name: pad(d[name])[b] for name in ("logp", "old", "adv", "mask")}
                k += 2
    order = sorted(rows)
    joined = {name: torch.stack([rows[k][name] for k in order]) for name in rows[order[0]]}
    (want,) = select_tokens_global(SETTINGS["clip_cov"], [joined["logp"]], [joined["old"]],
                                   [joined["adv"]], [joined["mask"]], dp_group=None, seed=99)
    got = {int(k): pad(sel)[b] for rank in run_distributed(_keyed_worker, 2)
           for keys, sel in rank for b, k in enumerate(keys)}
    assert 0 < int(want.selected.sum()) < int(joined["mask"].sum())  # a real draw
    for i, k in enumerate(order):
        assert torch.equal(got[k], want.selected[i]), k
    # rank order (no keys) draws other tokens: the keys matter
    plain = {}
    for r, rank in enumerate(run_distributed(_global_worker, 2, "clip_cov", False)):
        padded = torch.cat([pad(sel) for sel, _, _ in rank])
        plain.update({r + 2 * j: row for j, row in enumerate(padded)})
    assert any(not torch.equal(plain[k], got[k]) for k in order)


def test_tp2_ranks_select_the_same_tokens():
    # TP=2 x DP=2: TP peers (0, 1) and (2, 3) hold the same tokens; each computes its log-probs
    # from its own vocab shard and selects over its own DP group.
    results = run_distributed(_tp_worker, 4, 2, 2)
    for name in ("clip_cov", "kl_cov"):
        for a, b in ((0, 1), (2, 3)):
            micro_a, glob_a = results[a][name]
            micro_b, glob_b = results[b][name]
            for x, y in zip(micro_a + glob_a, micro_b + glob_b):
                assert torch.equal(x, y), name
        assert any(sel.any() for sel in results[0][name][0] + results[0][name][1])
        assert any(sel.any() for sel in results[2][name][1])


# ------------------------------------------------------------------------ aggregation


def _split_grad(setting: str, mode: str, splits: list[list[int]], dp_group=None,
                naive: bool = False):
    s = PolicyLossSettings(**{**SETTINGS[setting].__dict__, "loss_agg_mode": mode,
                              "loss_scale_factor": LOSS_SCALE})
    x, targets, theta0, old, adv, mask = agg_data()
    theta = theta0.clone().requires_grad_()
    normalizer = step_normalizer([mask[r] for r in splits], mode, dp_group, LOSS_SCALE)
    sels = None
    if s.loss != "ppo_clip":  # the step's population, so that the split cannot matter
        with torch.no_grad():
            lp = policy_logp(theta, x, targets)
        sels = select_tokens_global(s, [lp[r] for r in splits], [old[r] for r in splits],
                                    [adv[r] for r in splits], [mask[r] for r in splits],
                                    dp_group=dp_group, seed=1)
    for i, r in enumerate(splits):
        norm = float(step_normalizer([mask[r]], mode, None, LOSS_SCALE)) if naive else normalizer
        loss, _ = policy_loss(s, policy_logp(theta, x[r], targets[r]), old[r], adv[r], mask[r],
                              normalizer=norm, selection=None if sels is None else sels[i])
        loss.backward()
    return theta.grad


def _dp_split_worker(setting: str, mode: str):
    import torch.distributed as dist

    splits = [[[0, 5], [2]], [[7, 1, 3], [4, 6]]][dist.get_rank()]
    grad = _split_grad(setting, mode, splits, dist.group.WORLD)
    dist.all_reduce(grad)  # what DDP does (sum: the loss is normalised by the whole step)
    return grad


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("setting", ["ppo_clip", "kl_cov"])
def test_gradient_does_not_depend_on_the_split(setting, mode):
    whole = _split_grad(setting, mode, [list(range(8))])
    three = _split_grad(setting, mode, [[0, 1, 2], [3, 4], [5, 6, 7]])
    dp2 = run_distributed(_dp_split_worker, 2, setting, mode)
    torch.testing.assert_close(three, whole, rtol=1e-12, atol=1e-14)
    for g in dp2:
        torch.testing.assert_close(g, whole, rtol=1e-12, atol=1e-14)
    # The control: normalising each micro-batch by its own count changes the gradient.
    naive = _split_grad(setting, mode, [[0, 1, 2], [3, 4], [5, 6, 7]], naive=True)
    assert (naive - whole).abs().max() > 1e-3


# ------------------------------------------------------------------------ bad input


def test_bad_input_raises_one_clear_error():
    s = SETTINGS["kl_cov"]
    d = make_batch(4, 6, seed=2, garbage=False)
    args = (d["logp"], d["old"], d["adv"], d["mask"])
    with pytest.raises(ValueError, match=r"old_logp has shape \(4, 5\)"):
        policy_loss(s, d["logp"], d["old"][:, :5], d["adv"], d["mask"], normalizer=10)
    with pytest.raises(ValueError, match=r"logp must be \[B, S\]"):
        policy_loss(s, d["logp"].reshape(-1), d["old"].reshape(-1), d["adv"].reshape(-1),
                    d["mask"].reshape(-1), normalizer=10)
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        policy_loss(s, *args, normalizer=0)
    bad_adv = d["adv"].clone()
    bad_adv[0, 0] = float("nan")
    with pytest.raises(ValueError, match="advantages contain NaN"):
        policy_loss(s, d["logp"], d["old"], bad_adv, d["mask"], normalizer=10)
    bad_logp = d["logp"].clone()
    bad_logp[0, 0] = float("inf")
    with pytest.raises(ValueError, match="^logp contain NaN"):
        policy_loss(s, bad_logp, d["old"], d["adv"], d["mask"], normalizer=10)
    with pytest.raises(ValueError, match="only 0 and 1"):
        policy_loss(s, d["logp"], d["old"], d["adv"], d["mask"] * 0.5, normalizer=10)
    with pytest.raises(ValueError, match="entropy_coef > 0 needs"):
        policy_loss(SETTINGS["clip_cov_reg"], *args, normalizer=10)
    with pytest.raises(ValueError, match="^loss: 'clipcov' is not allowed; choose one of"):
        PolicyLossSettings(loss="clipcov")
    with pytest.raises(ValueError, match="no valid"):
        select_tokens_global(s, [d["logp"]], [d["old"]], [d["adv"]], [d["mask"] * 0],
                             dp_group=None, seed=0)


def _all_masked_worker(setting: str):
    import torch.distributed as dist

    s = SETTINGS[setting]
    rank = dist.get_rank()
    d = make_batch(4, 6, seed=8)  # NaN garbage at masked positions
    if rank == 1:
        d["mask"].zero_()
    normalizer = step_normalizer([d["mask"]], s.loss_agg_mode, dist.group.WORLD)
    logp = d["logp"].clone().requires_grad_()
    loss, metrics = policy_loss(s, logp, d["old"], d["adv"], d["mask"], normalizer=normalizer,
                                entropy=d["entropy"], ref_logp=d["ref"],
                                generator=torch.Generator().manual_seed(0))
    loss.backward()
    grad = logp.grad.clone()
    dist.all_reduce(grad)  # the rank with nothing to train still joins the collectives
    return float(loss), logp.grad, reduce_metrics([metrics], dist.group.WORLD)


@pytest.mark.parametrize("setting", ["ppo_clip", "clip_cov", "kl_cov_reg"])
def test_all_masked_micro_batch_is_zero_loss_that_joins_collectives(setting):
    (loss0, grad0, m0), (loss1, grad1, m1) = run_distributed(_all_masked_worker, 2, setting)
    assert loss1 == 0.0 and torch.equal(grad1, torch.zeros_like(grad1))
    assert math.isfinite(loss0) and loss0 != 0.0 and grad0.abs().max() > 0
    assert m0 == m1 and all(math.isfinite(v) for k, v in m0.items() if k != "cov_selected_max")


def test_settings_are_the_algorithm_config():
    """The algorithm section is the loss's settings: no mirror to drift from it."""
    from megatron_entropy.config import load_config

    cfg = load_config(overrides=["algorithm.loss=clip_cov", "algorithm.clip_cov_ratio=0.001",
                                 "algorithm.loss_agg_mode=seq-mean-token-sum"])
    s = cfg.algorithm
    assert isinstance(s, PolicyLossSettings)
    assert (s.loss, s.clip_cov_ratio, s.loss_agg_mode) == ("clip_cov", 0.001,
                                                            "seq-mean-token-sum")
