"""The entropy token rules (algorithms/token_rules.py) against one-process references of their
formulas written here: over a micro-batch, and for the global scope over the concatenated step
at DP=2 (forked gloo ranks); TP peers select alike; the step's split does not change the
selection or the gradient; the collectives are counted."""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed
from loss_references import (LOSS_SCALE, agg_data, make_batch, policy_logp, ref_aggregate,
                             ref_kl, ref_select, ref_token_losses, valid_list)

from megatron_entropy.algorithms.aggregation import AGG_MODES, step_normalizer
from megatron_entropy.settings import SettingError
from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.algorithms.policy_loss import (PolicyLossSettings, TokenAdjustments,
                                                     policy_loss, reduce_metrics,
                                                     select_tokens_global)
from megatron_entropy.algorithms.settings import check_token_rules
from megatron_entropy.algorithms.token_rules import (TokenRuleSettings, entropy_clip_global,
                                                     entropy_clip_micro_batch,
                                                     high_entropy_metrics,
                                                     high_entropy_normalizer, select_high_entropy,
                                                     select_high_entropy_global, shape_advantages)
from megatron_entropy.ops.quantile import top_fraction_count

# ------------------------------------------------------------------------ references


def ref_top_fraction(h: torch.Tensor, rho: float) -> torch.Tensor:
    """The 80/20 code's k = max(1, int(N rho + 0.9999)) highest, ties to the earlier token."""
    k = max(1, int(h.numel() * rho + 0.9999))
    chosen = torch.zeros(h.numel(), dtype=torch.bool)
    chosen[torch.sort(h, descending=True, stable=True).indices[:k]] = True
    return chosen


def ref_archer_high(entropy: torch.Tensor, mask: torch.Tensor, q: float) -> torch.Tensor:
    """Archer's code, literally: each row's nanquantile over its valid tokens, H > it."""
    masked = torch.where(mask.bool(), entropy, float("nan"))
    threshold = torch.nanquantile(masked, q, dim=-1, keepdim=True)
    return (masked > threshold) & mask.bool()


def ref_order_statistic(h: torch.Tensor, q: float) -> torch.Tensor:
    """x_(floor(q (n - 1))) of a 1-D tensor, ascending from 0."""
    return torch.sort(h).values[math.floor(q * (h.numel() - 1))]


def ref_pg_over(per, rows, chosen, mode, pg_normalizer, num_rows):
    """The policy-gradient term over the chosen tokens only (the 80/20 rule); ``num_rows`` is
    the seq-mean-* denominator (times L for seq-mean-token-sum-norm)."""
    if mode == "token-mean":
        return per[chosen].sum() / pg_normalizer
    total = 0.0
    for r in rows.unique():
        v = per[(rows == r) & chosen]
        if v.numel():
            total = total + (v.mean() if mode == "seq-mean-token-mean" else v.sum())
    return total / num_rows


def ref_archer_loss(s, lp, old, adv, ref, high, rules, normalizer):
    """ppo_clip with per-token clip ranges, pg / normalizer, plus Archer's per-group KL means."""
    ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    f64 = dict(dtype=torch.float64)
    low = torch.where(high, torch.tensor(rules.high_clip_ratio_low, **f64),
                      torch.tensor(s.clip_ratio_low, **f64))
    up = torch.where(high, torch.tensor(rules.high_clip_ratio_high, **f64),
                     torch.tensor(s.clip_ratio_high, **f64))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + up)
    per = torch.maximum(l1, l2)
    if s.dual_clip_c is not None:
        per = torch.where(adv < 0, torch.minimum(per, -adv * s.dual_clip_c), per)
    loss = per.sum() / normalizer
    kl = ref_kl(lp, ref, s.kl_type)
    for group, coef in ((~high, s.kl_coef), (high, rules.high_entropy_kl_coef)):
        if group.any():
            loss = loss + coef * kl[group].mean()
    return loss


def _entropy(rows: int, cols: int, seed: int, discrete: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if discrete:  # many exact ties
        return torch.tensor([0.1, 0.5, 0.9, 1.3, 1.7, 2.1], dtype=torch.float64)[
            torch.randint(0, 6, (rows, cols), generator=g)]
    return torch.rand(rows, cols, generator=g, dtype=torch.float64) * 3


# ------------------------------------------------------------------------ high-entropy minority

PPO = PolicyLossSettings(loss="ppo_clip", entropy_coef=0.01, kl_coef=0.1, kl_type="k3")
MINORITY = TokenRuleSettings(high_entropy_minority=True, high_entropy_rho=0.2)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("discrete", [False, True])
def test_high_entropy_minority_micro_batch_equals_reference(mode, discrete):
    s = PolicyLossSettings(**{**PPO.__dict__, "loss_agg_mode": mode,
                              "loss_scale_factor": LOSS_SCALE})
    d = make_batch(6, 20, seed=1)
    mask = d["mask"]
    h = _entropy(6, 20, seed=2, discrete=discrete)
    h[mask == 0] = float("nan")  # garbage where masked must not matter
    selected = select_high_entropy(MINORITY, h, mask)
    normalizer = step_normalizer([mask], mode, None, s.loss_scale_factor)
    pg_norm = high_entropy_normalizer(MINORITY, [mask], mode, None)
    logp = d["logp"].clone().requires_grad_()
    loss, metrics = policy_loss(s, logp, d["old"], d["adv"], mask, normalizer=normalizer,
                                entropy=d["entropy"], ref_logp=d["ref"],
                                adjust=TokenAdjustments(pg_mask=selected, pg_normalizer=pg_norm))
    loss.backward()

    lp = valid_list(d["logp"], mask).clone().requires_grad_()
    old, adv, ref, en = (valid_list(d[k], mask) for k in ("old", "adv", "ref", "entropy"))
    rows = mask.nonzero()[:, 0]
    chosen = ref_top_fraction(valid_list(h, mask), 0.2)
    per = ref_token_losses(s, lp, old, adv, None)
    sequences = len(rows.unique()) * (LOSS_SCALE if mode == "seq-mean-token-sum-norm" else 1)
    expected = ref_pg_over(per, rows, chosen, mode, float(chosen.sum()), sequences) \
        - s.entropy_coef * ref_aggregate(en, rows, mode, normalizer) \
        + s.kl_coef * ref_aggregate(ref_kl(lp, ref, s.kl_type), rows, mode, normalizer)
    expected.backward()

    assert torch.equal(valid_list(selected, mask), chosen)
    if discrete:  # the cut splits a tie: the earlier tokens win
        kth = valid_list(h, mask)[chosen].min()
        assert int((valid_list(h, mask) == kth).sum()) > int((valid_list(h, mask)[chosen] == kth)
                                                             .sum())
    assert (pg_norm is None) == (mode != "token-mean")
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(valid_list(logp.grad, mask), lp.grad, rtol=1e-12, atol=1e-14)
    assert reduce_metrics([metrics])["pg_loss"] == pytest.approx(
        float(per[chosen].mean().detach()), rel=1e-12)
    got = reduce_metrics([high_entropy_metrics(selected, h, mask)])
    hv = valid_list(h, mask)
    assert got["entropy_rule/pg_token_frac"] == pytest.approx(float(chosen.double().mean()))
    assert got["entropy_rule/pg_token_entropy_mean"] == pytest.approx(float(hv[chosen].mean()))
    assert got["entropy_rule/other_token_entropy_mean"] == pytest.approx(
        float(hv[~chosen].mean()))


def test_top_fraction_count_is_the_reference_ceiling():
    # 15 * 0.2 = 3.0000000000000004 in floating point: the slack keeps k at 3, not 4
    assert [top_fraction_count(n, 0.2) for n in (0, 1, 4, 5, 15, 16)] == [0, 1, 1, 1, 3, 4]
    assert top_fraction_count(7, 1.0) == 7


def test_micro_batch_normalizer_sums_each_micro_batch_count():
    masks = [make_batch(r, c, seed=10 + i)["mask"] for i, (r, c) in enumerate([(3, 10), (2, 14)])]
    counts = [int(m.sum()) for m in masks]
    assert high_entropy_normalizer(MINORITY, masks, "token-mean", None) == \
        sum(max(1, int(n * 0.2 + 0.9999)) for n in counts)


# ------------------------------------------------------------------------ entropy clip (Archer)

ARCHER_PPO = PolicyLossSettings(loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.2,
                                dual_clip_c=3.0, kl_coef=0.05, kl_type="k3")
ARCHER = TokenRuleSettings(entropy_clip=True, high_entropy_kl_coef=0.01)


@pytest.mark.parametrize("scope", ["response", "micro_batch"])
def test_entropy_clip_micro_batch_equals_reference(scope):
    rules = TokenRuleSettings(**{**ARCHER.__dict__, "entropy_clip_scope": scope})
    d = make_batch(6, 20, seed=4)
    mask = d["mask"]
    d["logp"] = d["old"] + 0.6 * torch.randn(6, 20, generator=torch.Generator().manual_seed(9),
                                             dtype=torch.float64)  # ratios beyond both ranges
    h = _entropy(6, 20, seed=5)
    h[mask == 0] = float("nan")
    adjust, metrics = entropy_clip_micro_batch(rules, ARCHER_PPO, h, mask)
    normalizer = float(mask.sum())
    logp = d["logp"].clone().requires_grad_()
    loss, _ = policy_loss(ARCHER_PPO, logp, d["old"], d["adv"], mask, normalizer=normalizer,
                          ref_logp=d["ref"], adjust=adjust)
    loss.backward()

    if scope == "response":
        high = ref_archer_high(h, mask, 0.8)
        thresholds = torch.nanquantile(torch.where(mask.bool(), h, float("nan")), 0.8, dim=-1)
        want_threshold = float(thresholds[~thresholds.isnan()].mean())
    else:
        t = torch.quantile(valid_list(h, mask), 0.8)
        high, want_threshold = (h > t) & mask.bool(), float(t)
    high_v = valid_list(high, mask)
    lp = valid_list(d["logp"], mask).clone().requires_grad_()
    old, adv, ref = (valid_list(d[k], mask) for k in ("old", "adv", "ref"))
    expected = ref_archer_loss(ARCHER_PPO, lp, old, adv, ref, high_v, rules, normalizer)
    expected.backward()

    assert 0 < int(high_v.sum()) < len(high_v)
    ratio = torch.exp(lp.detach() - old)
    assert ((ratio[high_v] > 1.2) & (ratio[high_v] < 1.5)).any()  # the wider range matters
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(valid_list(logp.grad, mask), lp.grad, rtol=1e-12, atol=1e-14)
    got = reduce_metrics([metrics])
    assert got["entropy_rule/high_entropy_frac"] == pytest.approx(float(high_v.double().mean()))
    # The order statistic x_(floor(q (n-1))) is <= the interpolated quantile (same split).
    assert got["entropy_rule/entropy_threshold"] <= want_threshold + 1e-12


def test_entropy_clip_threshold_with_ties_is_the_order_statistic():
    d = make_batch(6, 20, seed=6)
    h = _entropy(6, 20, seed=7, discrete=True)
    rules = TokenRuleSettings(entropy_clip=True, entropy_clip_scope="micro_batch",
                              entropy_clip_quantile=0.6)
    adjust, _ = entropy_clip_micro_batch(rules, ARCHER_PPO, h, d["mask"])
    hv = valid_list(h, d["mask"])
    threshold = ref_order_statistic(hv, 0.6)
    high = hv > threshold
    assert high.any() and not high.all() and (hv == threshold).sum() > 1
    assert torch.equal(valid_list(adjust.clip_low, d["mask"]) == 0.5, high)  # ties stay below


def test_entropy_clip_without_kl_leaves_the_kl_term_alone():
    s = PolicyLossSettings(loss="ppo_clip", kl_coef=0.0)
    d = make_batch(4, 8, seed=3)
    adjust, _ = entropy_clip_micro_batch(TokenRuleSettings(entropy_clip=True), s,
                                         _entropy(4, 8, 1), d["mask"])
    assert adjust.kl_coef is None and adjust.clip_low is not None


# ------------------------------------------------------------------------ advantage shaping


@pytest.mark.parametrize("loss", ["ppo_clip", "clip_cov", "kl_cov"])
def test_advantage_shaping_equals_reference_with_every_loss(loss):
    s = PolicyLossSettings(loss=loss, clip_cov_ratio=0.05, kl_cov_ratio=0.1)
    rules = TokenRuleSettings(entropy_advantage=True, entropy_advantage_alpha=0.4,
                              entropy_advantage_kappa=2.0)
    d = make_batch(6, 20, seed=1)
    mask = d["mask"]
    shaped, metrics = shape_advantages(rules, d["adv"], d["entropy"], mask)
    logp = d["logp"].clone().requires_grad_()
    normalizer = 57.0
    loss_val, _ = policy_loss(s, logp, d["old"], shaped, mask, normalizer=normalizer,
                              generator=torch.Generator().manual_seed(7))
    loss_val.backward()

    lp = valid_list(d["logp"], mask).clone().requires_grad_()
    old, adv, en = (valid_list(d[k], mask) for k in ("old", "adv", "entropy"))
    psi = torch.minimum(0.4 * en, adv.abs() / 2.0)
    adv_shaped = adv + psi
    chosen, _ = ref_select(s, lp, old, adv_shaped, seed=7)  # Cov on the shaped advantage
    expected = ref_token_losses(s, lp, old, adv_shaped, chosen).sum() / normalizer
    expected.backward()

    torch.testing.assert_close(valid_list(shaped, mask), adv_shaped, rtol=1e-15, atol=0)
    assert ((psi < 0.4 * en).any() and (psi == 0.4 * en).any())  # both sides of the min
    assert torch.equal(torch.sign(adv_shaped[adv != 0]), torch.sign(adv[adv != 0]))
    torch.testing.assert_close(loss_val, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(valid_list(logp.grad, mask), lp.grad, rtol=1e-12, atol=1e-14)
    got = reduce_metrics([metrics])
    assert got["entropy_rule/adv_bonus_mean"] == pytest.approx(float(psi.mean()))
    assert got["entropy_rule/adv_bonus_capped_frac"] == pytest.approx(
        float((adv.abs() / 2 < 0.4 * en).double().mean()))


# ------------------------------------------------------------------------ global scope, DP=2

SHAPES = [(3, 10), (2, 14), (4, 8), (2, 12)]  # rank 0 holds the first two, rank 1 the others


def _step(discrete: bool):
    step = [make_batch(r, c, seed=20 + i) for i, (r, c) in enumerate(SHAPES)]
    for i, (d, (r, c)) in enumerate(zip(step, SHAPES)):
        d["h"] = _entropy(r, c, seed=40 + i, discrete=discrete)
        d["h"][d["mask"] == 0] = float("nan")
        d["logp"] = torch.where(d["mask"] == 1, d["old"] + 0.5 * torch.randn(
            r, c, generator=torch.Generator().manual_seed(60 + i), dtype=torch.float64),
            d["logp"])
    return step


def _global_worker(rule: str, discrete: bool, mode: str):
    import torch.distributed as dist

    group = dist.group.WORLD
    mine = _step(discrete)[2 * dist.get_rank(): 2 * dist.get_rank() + 2]
    masks = [d["mask"] for d in mine]
    if rule == "minority":
        s = PolicyLossSettings(**{**PPO.__dict__, "loss_agg_mode": mode})
        selected, pg_norm = select_high_entropy_global(MINORITY, [d["h"] for d in mine], masks,
                                                       mode, group)
        adjusts = [TokenAdjustments(pg_mask=m, pg_normalizer=pg_norm) for m in selected]
        flags = selected
    else:
        s = ARCHER_PPO
        rules = TokenRuleSettings(**{**ARCHER.__dict__, "entropy_clip_scope": "global"})
        adjusts, _ = entropy_clip_global(rules, s, [d["h"] for d in mine], masks, group)
        flags = [a.clip_low == rules.high_clip_ratio_low for a in adjusts]
    normalizer = step_normalizer(masks, s.loss_agg_mode, group)
    out = []
    for d, adjust, flag in zip(mine, adjusts, flags):
        logp = d["logp"].clone().requires_grad_()
        loss, _ = policy_loss(s, logp, d["old"], d["adv"], d["mask"], normalizer=normalizer,
                              entropy=d["entropy"], ref_logp=d["ref"], adjust=adjust)
        loss.backward()
        out.append((flag & d["mask"].bool(), float(loss.detach()), logp.grad))
    return out


def _concat(step, key):
    return torch.cat([valid_list(d[key], d["mask"]) for d in step])


@pytest.mark.parametrize("rule,discrete,mode", [("minority", False, "token-mean"),
                                                ("minority", True, "token-mean"),
                                                ("minority", False, "seq-mean-token-mean"),
                                                ("archer", False, "token-mean"),
                                                ("archer", True, "token-mean")])
def test_global_scope_dp2_equals_one_process_over_the_step(rule, discrete, mode):
    results = [mb for rank in run_distributed(_global_worker, 2, rule, discrete, mode)
               for mb in rank]
    step = _step(discrete)
    masks = [d["mask"] for d in step]
    lp = _concat(step, "logp").requires_grad_()
    old, adv, ref, en, h = (_concat(step, k) for k in ("old", "adv", "ref", "entropy", "h"))
    rows = torch.cat([m.nonzero()[:, 0] + 100 * i for i, m in enumerate(masks)])
    if rule == "minority":
        s = PolicyLossSettings(**{**PPO.__dict__, "loss_agg_mode": mode})
        chosen = ref_top_fraction(h, 0.2)
        normalizer = float(len(rows)) if mode == "token-mean" else float(len(rows.unique()))
        per = ref_token_losses(s, lp, old, adv, None)
        expected = ref_pg_over(per, rows, chosen, mode, float(chosen.sum()), len(rows.unique())) \
            - s.entropy_coef * ref_aggregate(en, rows, mode, normalizer) \
            + s.kl_coef * ref_aggregate(ref_kl(lp, ref, s.kl_type), rows, mode, normalizer)
    else:
        rules = ARCHER
        threshold = ref_order_statistic(h, 0.8) if discrete else torch.quantile(h, 0.8)
        chosen = h > threshold
        expected = ref_archer_loss(ARCHER_PPO, lp, old, adv, ref, chosen, rules, len(rows))
    expected.backward()

    got = torch.cat([valid_list(f, m) for (f, _, _), m in zip(results, masks)])
    assert torch.equal(got, chosen)
    n0 = sum(int(m.sum()) for m in masks[:2])
    assert chosen[:n0].any() and chosen[n0:].any() and not chosen.all()
    assert sum(loss for _, loss, _ in results) == pytest.approx(float(expected.detach()),
                                                                rel=1e-12)
    got_grad = torch.cat([valid_list(g, m) for (_, _, g), m in zip(results, masks)])
    torch.testing.assert_close(got_grad, lp.grad, rtol=1e-11, atol=1e-14)


# ------------------------------------------------------------------------ collectives


def _count_collectives(rule: str):
    """Run one rule's per-step work with torch.distributed's collectives counted."""
    import torch.distributed as dist

    calls = []
    real_gather, real_reduce = dist.all_gather, dist.all_reduce

    def gather(parts, t, group=None, **kw):
        calls.append(("all_gather", t.numel() * t.element_size()))
        return real_gather(parts, t, group=group, **kw)

    def reduce(t, *a, **kw):
        calls.append(("all_reduce", t.numel() * t.element_size()))
        return real_reduce(t, *a, **kw)

    dist.all_gather, dist.all_reduce = gather, reduce
    try:
        group = dist.group.WORLD
        mine = _step(False)[2 * dist.get_rank(): 2 * dist.get_rank() + 2]
        hs, masks = [d["h"] for d in mine], [d["mask"] for d in mine]
        if rule == "minority_global":
            select_high_entropy_global(MINORITY, hs, masks, "token-mean", group)
        elif rule == "minority_micro_batch":
            high_entropy_normalizer(MINORITY, masks, "token-mean", group)
            [select_high_entropy(MINORITY, h, m) for h, m in zip(hs, masks)]
        elif rule == "archer_global":
            entropy_clip_global(TokenRuleSettings(entropy_clip=True, entropy_clip_scope="global"),
                                ARCHER_PPO, hs, masks, group)
        elif rule == "archer_global_no_kl":
            entropy_clip_global(TokenRuleSettings(entropy_clip=True, entropy_clip_scope="global"),
                                PolicyLossSettings(loss="ppo_clip"), hs, masks, group)
        elif rule == "archer_response":
            [entropy_clip_micro_batch(ARCHER, ARCHER_PPO, h, m) for h, m in zip(hs, masks)]
    finally:
        dist.all_gather, dist.all_reduce = real_gather, real_reduce
    return calls


def test_collectives_per_step_are_few_and_of_size_k():
    n_total = sum(int(d["mask"].sum()) for d in _step(False))
    k = top_fraction_count(n_total, 0.2)
    k_archer = n_total - math.floor(0.8 * (n_total - 1))
    want = {"minority_global": [("all_gather", 8), ("all_gather", 8 * k), ("all_gather", 16)],
            "minority_micro_batch": [("all_reduce", 8)],
            "archer_global": [("all_gather", 8), ("all_gather", 8 * k_archer),
                              ("all_gather", 16)],
            "archer_global_no_kl": [("all_gather", 8), ("all_gather", 8 * k_archer)],
            "archer_response": []}
    for rule, calls in want.items():
        for rank_calls in run_distributed(_count_collectives, 2, rule):
            assert rank_calls == calls, rule


# ------------------------------------------------------------------------ TP=2: same choice


def _tp_worker():
    """DP=2 x TP=2: each TP rank computes the entropy from its own vocab shard, then selects."""
    import torch.distributed as dist

    from megatron_entropy.ops.logprob_entropy import vocab_parallel_logprob_entropy

    dp, tp = divmod(dist.get_rank(), 2)
    tp_groups = [dist.new_group([2 * d, 2 * d + 1]) for d in range(2)]
    dp_groups = [dist.new_group([t, 2 + t]) for t in range(2)]
    vocab, v_pad, hs, masks = 90, 128, [], []
    for i in range(2):
        g = torch.Generator().manual_seed(70 + 2 * dp + i)
        logits = torch.randn(5 * 12, v_pad, generator=g) * 3  # float32, as in training
        targets = torch.randint(0, vocab, (5 * 12,), generator=g)
        shard = logits[:, tp * v_pad // 2:(tp + 1) * v_pad // 2].contiguous()
        _, h = vocab_parallel_logprob_entropy(shard, targets, vocab_size=vocab,
                                              group=tp_groups[dp], chunk_tokens=16)
        hs.append(h.view(5, 12))
        masks.append(make_batch(5, 12, seed=80 + 2 * dp + i, garbage=False)["mask"].float())
    out = [select_high_entropy(MINORITY, h, m) for h, m in zip(hs, masks)]
    out += select_high_entropy_global(MINORITY, hs, masks, "token-mean", dp_groups[tp])[0]
    s = PolicyLossSettings(loss="ppo_clip", kl_coef=0.1)
    for scope in ("response", "micro_batch"):
        rules = TokenRuleSettings(entropy_clip=True, entropy_clip_scope=scope)
        out += [entropy_clip_micro_batch(rules, s, h, m)[0].kl_coef for h, m in zip(hs, masks)]
    rules = TokenRuleSettings(entropy_clip=True, entropy_clip_scope="global")
    out += [a.kl_coef for a in entropy_clip_global(rules, s, hs, masks, dp_groups[tp])[0]]
    return out


def test_tp2_ranks_select_the_same_tokens():
    results = run_distributed(_tp_worker, 4)
    for a, b in ((0, 1), (2, 3)):
        assert len(results[a]) == len(results[b]) == 10
        for x, y in zip(results[a], results[b]):
            assert torch.equal(x, y)
    assert all(x.any() for x in results[0][:4])


# ------------------------------------------------------------------------ split invariance


def _split_grad(rule: str, splits: list[list[int]], dp_group=None):
    """One optimizer step of a tiny softmax policy, the step's rows split into micro-batches
    ``splits`` (this rank's); returns (the full-step [8, 9] rule mask of these rows, grad)."""
    x, targets, theta0, old, adv, mask = agg_data()
    g = torch.Generator().manual_seed(11)
    ref = old + 0.3 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    theta = theta0.clone().requires_grad_()
    with torch.no_grad():  # the step's recompute pass: log-probs and entropies that select
        probs = torch.softmax(x @ theta0, dim=-1)
        h = -(probs * probs.log()).sum(-1)
    if rule == "minority":
        s = PolicyLossSettings(loss="ppo_clip", kl_coef=0.1)
        selected, pg_norm = select_high_entropy_global(MINORITY, [h[r] for r in splits],
                                                       [mask[r] for r in splits], "token-mean",
                                                       dp_group)
        adjusts = [TokenAdjustments(pg_mask=m, pg_normalizer=pg_norm) for m in selected]
        flags = selected
    elif rule == "archer":
        s = ARCHER_PPO
        rules = TokenRuleSettings(**{**ARCHER.__dict__, "entropy_clip_scope": "global"})
        adjusts, _ = entropy_clip_global(rules, s, [h[r] for r in splits],
                                         [mask[r] for r in splits], dp_group)
        flags = [a.clip_low == 0.5 for a in adjusts]
    else:  # shaping, then KL-Cov's global Cov selection on the shaped advantages
        s = PolicyLossSettings(loss="kl_cov", kl_cov_ratio=0.1)
        rules = TokenRuleSettings(entropy_advantage=True)
        adv = shape_advantages(rules, adv, h, mask)[0]
        lp = policy_logp(theta0, x, targets)
        sels = select_tokens_global(s, [lp[r] for r in splits], [old[r] for r in splits],
                                    [adv[r] for r in splits], [mask[r] for r in splits],
                                    dp_group=dp_group, seed=0)
        adjusts = [TokenAdjustments() for _ in splits]
        flags = [sel.selected for sel in sels]
    normalizer = step_normalizer([mask[r] for r in splits], s.loss_agg_mode, dp_group)
    full = torch.zeros(mask.shape, dtype=torch.bool)
    for i, r in enumerate(splits):
        loss, _ = policy_loss(s, policy_logp(theta, x[r], targets[r]), old[r], adv[r], mask[r],
                              normalizer=normalizer, ref_logp=ref[r], adjust=adjusts[i],
                              selection=sels[i] if rule == "shaping" else None)
        loss.backward()
        full[r] = flags[i] & mask[r].bool()
    return full, theta.grad


def _dp_split_worker(rule: str):
    import torch.distributed as dist

    splits = [[[0, 5], [2]], [[7, 1, 3], [4, 6]]][dist.get_rank()]
    full, grad = _split_grad(rule, splits, dist.group.WORLD)
    dist.all_reduce(grad)  # what DDP does
    return full, grad


@pytest.mark.parametrize("rule", ["minority", "archer", "shaping"])
def test_selection_and_gradient_do_not_depend_on_the_split(rule):
    whole_mask, whole = _split_grad(rule, [list(range(8))])
    three_mask, three = _split_grad(rule, [[0, 1, 2], [3, 4], [5, 6, 7]])
    (m0, g0), (m1, g1) = run_distributed(_dp_split_worker, 2, rule)
    assert whole_mask.any() and not torch.equal(whole_mask, agg_data()[-1].bool())
    assert torch.equal(three_mask, whole_mask) and torch.equal(m0 | m1, whole_mask)
    for g in (three, g0, g1):
        torch.testing.assert_close(g, whole, rtol=1e-12, atol=1e-14)


def test_micro_batch_scope_selection_does_depend_on_the_split():
    # The control for the test above: the reference's per-micro-batch population changes with
    # the split (verl issues 7818/7829 are this).
    x, targets, theta0, old, adv, mask = agg_data()
    probs = torch.softmax(x @ theta0, dim=-1)
    h = -(probs * probs.log()).sum(-1)
    whole = select_high_entropy(MINORITY, h, mask)
    parts = torch.cat([select_high_entropy(MINORITY, h[r], mask[r])
                       for r in ([0, 1, 2], [3, 4], [5, 6, 7])])
    assert not torch.equal(whole, parts)


# ------------------------------------------------------------------------ bad settings


@pytest.mark.parametrize("rules,loss,setting", [
    (TokenRuleSettings(high_entropy_minority=True), PolicyLossSettings(loss="kl_cov"),
     "high_entropy_minority"),
    (TokenRuleSettings(high_entropy_minority=True), PolicyLossSettings(loss="clip_cov"),
     "high_entropy_minority"),
    (TokenRuleSettings(entropy_clip=True), PolicyLossSettings(loss="clip_cov"), "entropy_clip"),
    (TokenRuleSettings(entropy_clip=True), PolicyLossSettings(loss="kl_cov"), "entropy_clip"),
    (TokenRuleSettings(entropy_clip=True, high_entropy_minority=True),
     PolicyLossSettings(loss="ppo_clip"), "entropy_clip"),
    (TokenRuleSettings(entropy_clip=True, high_clip_ratio_low=0.1),
     PolicyLossSettings(loss="ppo_clip"), "high_clip_ratio_low"),
    (TokenRuleSettings(entropy_clip=True, high_clip_ratio_high=0.1),
     PolicyLossSettings(loss="ppo_clip"), "high_clip_ratio_high"),
    (TokenRuleSettings(entropy_clip=True, high_entropy_kl_coef=0.5),
     PolicyLossSettings(loss="ppo_clip", kl_coef=0.1), "high_entropy_kl_coef"),
    (TokenRuleSettings(entropy_clip=True),
     PolicyLossSettings(loss="ppo_clip", kl_coef=0.1, loss_agg_mode="seq-mean-token-sum"),
     "entropy_clip"),
])
def test_refused_combinations_name_the_setting(rules, loss, setting):
    with pytest.raises(SettingError, match=f"^{setting}: ") as err:
        check_token_rules(rules, loss)
    assert err.value.setting == setting


def test_allowed_combinations_pass():
    for loss in ("ppo_clip", "clip_cov", "kl_cov"):
        check_token_rules(TokenRuleSettings(entropy_advantage=True), PolicyLossSettings(loss=loss))
    check_token_rules(TokenRuleSettings(high_entropy_minority=True, entropy_advantage=True),
                      PolicyLossSettings(loss="ppo_clip", loss_agg_mode="seq-mean-token-mean"))
    check_token_rules(TokenRuleSettings(entropy_clip=True), ARCHER_PPO)


@pytest.mark.parametrize("kwargs,setting", [
    (dict(high_entropy_rho=0.0), "high_entropy_rho"), (dict(high_entropy_rho=1.5),
                                                       "high_entropy_rho"),
    (dict(high_entropy_scope="batch"), "high_entropy_scope"),
    (dict(entropy_clip_quantile=1.0), "entropy_clip_quantile"),
    (dict(entropy_clip_scope="sequence"), "entropy_clip_scope"),
    (dict(high_clip_ratio_low=1.0), "high_clip_ratio_low"),
    (dict(high_entropy_kl_coef=-1.0), "high_entropy_kl_coef"),
    (dict(entropy_advantage_alpha=0.0), "entropy_advantage_alpha"),
    (dict(entropy_advantage_kappa=0.5), "entropy_advantage_kappa"),
])
def test_bad_rule_settings_give_one_error_naming_the_setting(kwargs, setting):
    with pytest.raises(SettingError, match=f"^{setting}: "):
        TokenRuleSettings(**kwargs)


def test_adjustments_are_checked_by_the_loss():
    d = make_batch(4, 6, seed=2, garbage=False)
    args = (d["logp"], d["old"], d["adv"], d["mask"])
    clip = TokenAdjustments(clip_low=torch.full((4, 6), 0.3))
    with pytest.raises(ValueError, match="per-token clip ranges apply to ppo_clip only"):
        policy_loss(PolicyLossSettings(loss="clip_cov"), *args, normalizer=10, adjust=clip)
    with pytest.raises(ValueError, match=r"adjust.weight has shape \(4, 5\)"):
        policy_loss(PPO, *args, normalizer=10, entropy=d["entropy"], ref_logp=d["ref"],
                    adjust=TokenAdjustments(weight=torch.ones(4, 5)))
    with pytest.raises(ValueError, match="per-token kl_coef needs the reference"):
        policy_loss(PolicyLossSettings(loss="ppo_clip"), *args, normalizer=10,
                    adjust=TokenAdjustments(kl_coef=torch.ones(4, 6)))
    bad = torch.ones(4, 6)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="adjust.weight contain NaN"):
        policy_loss(PolicyLossSettings(loss="ppo_clip"), *args, normalizer=10,
                    adjust=TokenAdjustments(weight=bad))
    with pytest.raises(ValueError, match="both set pg_mask"):
        TokenAdjustments(pg_mask=d["mask"].bool()).merged(TokenAdjustments(pg_mask=d["mask"]
                                                                           .bool()))
    merged = TokenAdjustments(weight=torch.full((4, 6), 2.0), pg_mask=d["mask"].bool()).merged(
        TokenAdjustments(weight=torch.full((4, 6), 3.0)))
    assert torch.equal(merged.weight, torch.full((4, 6), 6.0)) and merged.pg_mask is not None


@pytest.mark.parametrize("rules,algorithm,message", [
    (dict(high_entropy_rho=0.0), {}, r"algorithm\.token_rules\.high_entropy_rho: 0\.0 is out "
                                     r"of range; it must be > 0"),
    (dict(high_entropy_rho=1.5), {}, r"algorithm\.token_rules\.high_entropy_rho: 1\.5 is out "
                                     r"of range; it must be <= 1"),
    (dict(high_entropy_minority=True), dict(loss="kl_cov"),
     r"algorithm\.token_rules\.high_entropy_minority: combines with ppo_clip only, not kl_cov"),
    (dict(entropy_clip=True), dict(loss="clip_cov"),
     r"algorithm\.token_rules\.entropy_clip: combines with ppo_clip only, not clip_cov"),
    (dict(entropy_clip=True, high_clip_ratio_high=0.1), dict(loss="ppo_clip"),
     r"algorithm\.token_rules\.high_clip_ratio_high: high-entropy tokens get a wider clip"),
    (dict(entropy_clip=True, high_entropy_kl_coef=0.5), dict(loss="ppo_clip", kl_coef=0.1),
     r"algorithm\.token_rules\.high_entropy_kl_coef: high-entropy tokens get a weaker KL"),
    (dict(entropy_clip_scope="row"), {}, r"algorithm\.token_rules\.entropy_clip_scope: 'row' "
                                         r"is not allowed"),
])
def test_config_refuses_bad_rules_naming_the_key(rules, algorithm, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(data={"algorithm": {**algorithm, "token_rules": rules}})


def test_config_builds_the_rule_settings():
    cfg = load_config(data={"algorithm": {"loss": "ppo_clip", "token_rules": {
        "entropy_clip": True, "entropy_clip_scope": "global", "high_clip_ratio_high": 0.6}}})
    assert cfg.algorithm.token_rules == TokenRuleSettings(
        entropy_clip=True, entropy_clip_scope="global", high_clip_ratio_high=0.6)
