"""The entropy methods against straightforward one-process references written here from each
paper's definition (the authors' code where the paper leaves a detail to it), in value and
gradient: EntroPIC, SIREN, Lp-Reg, Entropy Ratio Clipping, positive-advantage reweighting, the
clip schedules, Skywork-OR1's adaptive coefficient and AER; the step's populations split over
micro-batches give what one population gives; combinations a paper does not define are refused
with one line naming the key."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_entropy.algorithms.aggregation import step_normalizer
from megatron_entropy.algorithms.clipping import clip_schedule_knobs, scheduled_clip_high
from megatron_entropy.algorithms.entropy_methods import (PROXY_SHIFT, TOP_P_ENTROPY,
                                                         EntropyMethods, StepPlan)
from megatron_entropy.algorithms.entropy_regularizers import difficulty_weights
from megatron_entropy.algorithms.method_settings import (AdaptiveEntropySettings, AERSettings,
                                                         ClipScheduleSettings,
                                                         EntropyRatioClipSettings,
                                                         EntroPICSettings, LpRegSettings,
                                                         PositiveReweightSettings, SirenSettings)
from megatron_entropy.algorithms.policy_loss import policy_loss, reduce_metrics
from megatron_entropy.config import AlgorithmConfig, ConfigError, load_config


def _batch(seed: int = 0, rows: int = 5, cols: int = 9):
    """A [rows, cols] micro-batch: ragged valid lengths, log-probs over (-6, 0), old ones near
    them, a signed advantage per row, entropies over (0.1, 3)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).double()
    logp = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 6
    old = logp + 0.3 * (torch.rand(rows, cols, generator=g, dtype=torch.float64) - 0.5)
    adv = (torch.randn(rows, generator=g, dtype=torch.float64) * 1.5)[:, None].expand(rows,
                                                                                     cols)
    ent = 0.1 + 2.9 * torch.rand(rows, cols, generator=g, dtype=torch.float64)
    return dict(logp=logp, old=old.clamp(max=-1e-4), adv=adv.clone(), mask=mask, ent=ent)


def _config(**sections) -> AlgorithmConfig:
    return AlgorithmConfig(loss="ppo_clip", clip_ratio_low=0.2, clip_ratio_high=0.28, **sections)


def _ppo(logp, old, adv, eps_low=0.2, eps_high=0.28):
    ratio = torch.exp(logp - old)
    return torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps_low, 1 + eps_high))


# ------------------------------------------------------------------------------ EntroPIC


def test_entropic_controller_is_the_authors_pi_loop():
    """alpha = clip(kp e + ki I, -1, 1) with the integral of the earlier errors (the authors'
    dp_actor: the integral takes e after alpha is computed)."""
    methods = EntropyMethods(_config(entropic=EntroPICSettings(enabled=True, target=0.5, kp=2.0,
                                                               ki=0.3)))
    integral, got, want = 0.0, [], []
    for h in (1.2, 0.9, 0.55, 0.3, 0.1, 0.1, 0.2):
        mask = torch.ones(1, 4)
        got.append(methods.step_inputs([torch.full((1, 4), h, dtype=torch.float64)], [mask],
                                       None)["entropic"])
        error = h - 0.5
        want.append(min(max(2.0 * error + 0.3 * integral, -1.0), 1.0))
        integral += error
    assert got == pytest.approx(want, rel=1e-12)
    assert max(want) == 1.0 and min(want) < 0  # both the clip and a negative alpha


def test_entropic_term_equals_the_authors_formula():
    """loss = alpha * token-mean over pi_old > high_prob of (-ratio |A|), with its gradient."""
    d = _batch(1)
    a = _config(entropic=EntroPICSettings(enabled=True, high_prob=0.05))
    methods = EntropyMethods(a)
    plan = StepPlan(methods, [d["mask"]], [d["adv"]], [d["old"]], {}, None, {"entropic": 0.7},
                    None)
    logp = d["logp"].clone().requires_grad_()
    term, metrics = plan.extra_loss(0, logp, d["old"], d["adv"], d["mask"], 1.0, None, None)
    term.backward()
    term = term.detach()
    x = d["logp"].clone().requires_grad_()
    high = d["mask"].bool() & (d["old"] > math.log(0.05))
    want = 0.7 * (-(torch.exp(x - d["old"]) * d["adv"].abs())[high]).sum() / high.sum()
    want.backward()
    assert float(term) == pytest.approx(float(want.detach()), rel=1e-12)
    torch.testing.assert_close(logp.grad, x.grad, rtol=1e-12, atol=1e-14)
    assert 0 < reduce_metrics([metrics])["entropic/high_prob_frac"] < 1


# ------------------------------------------------------------------------------ SIREN


def _siren_reference(h, mask, q, coef, anchor):
    """The authors' objective on one population: each row's tokens above its nanquantile of the
    top-p entropy, the sequence mean of the rows' token means, coef (Hbar - anchor)^2."""
    rows = []
    for r in range(h.shape[0]):
        vals = h[r][mask[r].bool()]
        keep = vals > torch.quantile(vals.detach(), q)
        if keep.any():
            rows.append(vals[keep].mean())
    return coef * (torch.stack(rows).mean() - anchor) ** 2


def test_siren_gradient_is_the_authors_squared_deviation():
    """Split in two micro-batches, the summed gradient equals that of coef (Hbar - anchor)^2 on
    the whole population; the anchor is the first step's Hbar."""
    d = _batch(2, rows=6)
    h = d["ent"].clone()
    a = _config(siren=SirenSettings(enabled=True, coef=0.3, peak_quantile=0.8))
    methods = EntropyMethods(a)
    first = [h[r][d["mask"][r].bool()] * 1.1 for r in range(6)]  # the first step's samples
    methods.begin_step(first, None)
    anchor_rows = [x[x > torch.quantile(x, 0.8)].mean() for x in first]
    assert methods.siren_anchor == pytest.approx(float(torch.stack(anchor_rows).mean()),
                                                 rel=1e-12)
    parts = [[0, 1, 2], [3, 4, 5]]
    masks = [d["mask"][p] for p in parts]
    hs = [h[p] for p in parts]
    plan = StepPlan(methods, masks, [d["adv"][p] for p in parts], [d["old"][p] for p in parts],
                    {TOP_P_ENTROPY: hs}, None, {}, None)
    leaf = h.clone().requires_grad_()
    total = sum(plan.extra_loss(i, d["logp"][p], d["old"][p], d["adv"][p], masks[i], 1.0,
                                leaf[p], None)[0] for i, p in enumerate(parts))
    total.backward()
    ref_leaf = h.clone().requires_grad_()
    _siren_reference(ref_leaf, d["mask"], 0.8, 0.3, methods.siren_anchor).backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-12, atol=1e-15)
    assert ref_leaf.grad.abs().max() > 0


# ------------------------------------------------------------------------------ Lp-Reg


def _lp_reg_reference(s, logp, old, shift, adv, mask):
    """The authors' compute_policy_loss_lp_reg on one population: per advantage side, the
    max(1, int(n fraction)) lowest log-probs when that is > 1, those below the proxy get
    coef * k3(logp -> proxy); token-mean over the valid tokens."""
    valid = mask.bool()
    flat_lp, flat_adv = logp[valid], adv[valid]
    proxy = (old + shift)[valid]
    chosen = torch.zeros_like(flat_lp, dtype=torch.bool)
    for side, frac in ((flat_adv > 0, s.pos_fraction), (flat_adv < 0, s.neg_fraction)):
        idx = side.nonzero().squeeze(1)
        k = max(1, int(idx.numel() * frac))
        if idx.numel() and k > 1:
            low = idx[torch.topk(flat_lp.detach()[idx], k, largest=False).indices]
            chosen[low] = True
    chosen &= flat_lp.detach() < proxy
    kl = torch.exp(proxy - flat_lp) - (proxy - flat_lp) - 1
    return s.coef * torch.where(chosen, kl, 0).sum() / valid.sum(), int(chosen.sum())


def test_lp_reg_equals_the_authors_selection_and_kl():
    d = _batch(3, rows=8, cols=12)
    g = torch.Generator().manual_seed(9)
    shift = torch.rand(d["logp"].shape, generator=g, dtype=torch.float64) * 0.5
    shift[torch.rand(d["logp"].shape, generator=g) < 0.3] = -math.inf  # filtered targets
    s = LpRegSettings(enabled=True, neg_fraction=0.3, pos_fraction=0.2, coef=0.7)
    a = _config(lp_reg=s)
    old = d["logp"]  # the recompute's log-probs select (on-policy)
    plan = StepPlan(EntropyMethods(a), [d["mask"]], [d["adv"]], [old],
                    {PROXY_SHIFT: [shift]}, None, {}, None)
    n = float(d["mask"].sum())
    logp = d["logp"].clone().requires_grad_()
    term, metrics = plan.extra_loss(0, logp, old, d["adv"], d["mask"], n, None, shift)
    term.backward()
    x = d["logp"].clone().requires_grad_()
    want, chosen = _lp_reg_reference(s, x, old, shift, d["adv"], d["mask"])
    want.backward()
    assert chosen > 0
    assert float(term.detach()) == pytest.approx(float(want.detach()), rel=1e-12)
    torch.testing.assert_close(logp.grad, x.grad, rtol=1e-12, atol=1e-14)
    assert reduce_metrics([metrics])["lp_reg/selected_frac"] == pytest.approx(chosen / n)


def test_lp_reg_split_over_micro_batches_selects_as_one_population():
    d = _batch(4, rows=8, cols=12)
    shift = torch.full(d["logp"].shape, 0.3, dtype=torch.float64)
    a = _config(lp_reg=LpRegSettings(enabled=True, neg_fraction=0.4))
    whole = StepPlan(EntropyMethods(a), [d["mask"]], [d["adv"]], [d["logp"]],
                     {PROXY_SHIFT: [shift]}, None, {}, None).lp_selected[0]
    parts = [[0, 1, 2, 3, 4], [5, 6, 7]]
    split = StepPlan(EntropyMethods(a), [d["mask"][p] for p in parts],
                     [d["adv"][p] for p in parts], [d["logp"][p] for p in parts],
                     {PROXY_SHIFT: [shift[p] for p in parts]}, None, {}, None).lp_selected
    assert torch.equal(torch.cat(split), whole) and whole.any()
    # Each part on its own would choose its own lowest tokens: another set.
    alone = [StepPlan(EntropyMethods(a), [d["mask"][p]], [d["adv"][p]], [d["logp"][p]],
                      {PROXY_SHIFT: [shift[p]]}, None, {}, None).lp_selected[0] for p in parts]
    assert not torch.equal(torch.cat(alone), whole)


# --------------------------------------------------------------- ERC and the reweighting


def _run_loss(a, d, adjust, entropy=None):
    logp = d["logp"].clone().requires_grad_()
    loss, metrics = policy_loss(a, logp, d["old"], d["adv"], d["mask"],
                                normalizer=float(d["mask"].sum()), entropy=entropy,
                                adjust=adjust)
    loss.backward()
    return loss.detach(), logp.grad, metrics


def test_entropy_ratio_clipping_detaches_tokens_outside_the_band():
    """The authors' grpo_erc: (H + 1e-8) / (H_old + 1e-8) outside (0.95, 1.05) keeps the token's
    PPO term in the value and takes it out of the gradient."""
    d = _batch(5)
    a = _config(entropy_ratio_clip=EntropyRatioClipSettings(enabled=True))
    old_ent = d["ent"] * (1 + 0.1 * (torch.rand(d["ent"].shape,
                                                generator=torch.Generator().manual_seed(1))
                                     - 0.5))
    plan = StepPlan(EntropyMethods(a), [d["mask"]], [d["adv"]], None, {}, None, {}, None)
    adjust, metrics = plan.adjustments(0, d["adv"], d["mask"], d["ent"], old_ent)
    got, grad, _ = _run_loss(a, d, adjust)
    x = d["logp"].clone().requires_grad_()
    ratio = (d["ent"] + 1e-8) / (old_ent + 1e-8)
    inside = (ratio > 0.95) & (ratio < 1.05)
    per = _ppo(x, d["old"], d["adv"])
    per = torch.where(inside, per, per.detach())
    want = torch.where(d["mask"].bool(), per, 0).sum() / d["mask"].sum()
    want.backward()
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-12)
    torch.testing.assert_close(grad, torch.where(d["mask"].bool(), x.grad, 0), rtol=1e-12,
                               atol=1e-15)
    frac = reduce_metrics([metrics])["erc/clipped_frac"]
    assert 0 < frac < 1


def test_positive_advantage_reweighting_scales_the_positive_tokens():
    d = _batch(6)
    a = _config(positive_reweight=PositiveReweightSettings(enabled=True, weight=0.25))
    plan = StepPlan(EntropyMethods(a), [d["mask"]], [d["adv"]], None, {}, None, {}, None)
    adjust, _ = plan.adjustments(0, d["adv"], d["mask"], d["ent"], d["ent"])
    got, grad, _ = _run_loss(a, d, adjust)
    x = d["logp"].clone().requires_grad_()
    per = _ppo(x, d["old"], d["adv"]) * torch.where(d["adv"] > 0, 0.25, 1.0)
    want = torch.where(d["mask"].bool(), per, 0).sum() / d["mask"].sum()
    want.backward()
    assert bool((d["adv"] > 0).any() and (d["adv"] < 0).any())
    assert float(got) == pytest.approx(float(want.detach()), rel=1e-12)
    torch.testing.assert_close(grad, torch.where(d["mask"].bool(), x.grad, 0), rtol=1e-12,
                               atol=1e-15)


# ------------------------------------------------------------------ adaptive coefficients


def test_skywork_coefficient_and_its_gated_bonus():
    """alpha_k = c_k 1[e_k <= target]; c moves by delta towards raising the entropy; the bonus
    -alpha token-mean(H) enters the loss with the entropy's gradient."""
    s = AdaptiveEntropySettings(enabled=True, target=0.5, delta=0.01, initial=0.02, coef_max=0.05)
    methods = EntropyMethods(_config(adaptive_entropy=s))
    c, got, want = 0.02, [], []
    for e in (0.6, 0.4, 0.3, 0.3, 0.3, 0.7, 0.45):
        h = torch.full((1, 2), e, dtype=torch.float64)
        got.append(methods.step_inputs([h], [torch.ones(1, 2)], None)["adaptive"])
        want.append(c if e <= 0.5 else 0.0)
        c = min(max(c + 0.01 if e <= 0.5 else c - 0.01, 0.0), 0.05)
    assert got == pytest.approx(want, rel=1e-12)
    d = _batch(7)
    a = _config(adaptive_entropy=s)
    plan = StepPlan(EntropyMethods(a), [d["mask"]], [d["adv"]], None, {}, None,
                    {"adaptive": 0.03}, None)
    adjust, _ = plan.adjustments(0, d["adv"], d["mask"], d["ent"], d["ent"])
    ent = d["ent"].clone().requires_grad_()
    logp = d["logp"].clone().requires_grad_()
    loss, _ = policy_loss(a, logp, d["old"], d["adv"], d["mask"],
                          normalizer=float(d["mask"].sum()), entropy=ent, adjust=adjust)
    loss.backward()
    valid = d["mask"].bool()
    torch.testing.assert_close(ent.grad, torch.where(valid, -0.03 / d["mask"].sum(), 0.0),
                               rtol=1e-12, atol=1e-15)


def test_aer_coefficient_anchor_and_difficulty_weights():
    """H* = target_ratio x the first step's entropy; alpha moves by lr (H* - e) / H* within
    [0, coef_max]; each response's bonus weighs 1 - its prompt's accuracy."""
    s = AERSettings(enabled=True, target_ratio=0.5, lr=0.02, initial=0.01, coef_max=0.03)
    methods = EntropyMethods(_config(aer=s))
    alpha, got, want = 0.01, [], []
    for e in (2.0, 1.5, 1.2, 0.8, 0.9, 1.4):
        h = torch.full((1, 3), e, dtype=torch.float64)
        got.append(methods.step_inputs([h], [torch.ones(1, 3)], None)["aer"])
        want.append(alpha)
        alpha = min(max(alpha + 0.02 * (1.0 - e) / 1.0, 0.0), 0.03)
    assert got == pytest.approx(want, rel=1e-12)
    assert difficulty_weights([1, 0, 0, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 2, 2, 2]) == \
        pytest.approx([2 / 3, 2 / 3, 2 / 3, 0.0, 0.0, 1.0, 1.0, 1.0])
    d = _batch(8, rows=3)
    a = _config(aer=s)
    plan = StepPlan(EntropyMethods(a), [d["mask"]], [d["adv"]], None, {}, [[0.5, 0.0, 1.0]],
                    {"aer": 0.02}, None)
    adjust, _ = plan.adjustments(0, d["adv"], d["mask"], d["ent"], d["ent"])
    want_coef = 0.02 * torch.tensor([0.5, 0.0, 1.0], dtype=torch.float64)[:, None]
    torch.testing.assert_close(adjust.entropy_coef, want_coef.expand(d["mask"].shape))


# ------------------------------------------------------------------------ clip schedules


def test_clip_schedules_follow_their_shapes():
    s = ClipScheduleSettings(shape="increase_decrease", high_peak=0.4)
    values = [scheduled_clip_high(s, 0.28, step, 11) for step in range(1, 12)]
    assert values[0] == values[-1] == pytest.approx(0.28) and max(values) == pytest.approx(0.4)
    assert values.index(max(values)) == 5
    s = ClipScheduleSettings(shape="decrease_increase_decrease", high_peak=0.4, high_floor=0.1)
    assert [scheduled_clip_high(s, 0.28, step, 7) for step in (1, 3, 5, 7)] == \
        pytest.approx([0.28, 0.1, 0.4, 0.1])
    s = ClipScheduleSettings(shape="oscillating_decay", high_peak=0.5, periods=2)
    values = [scheduled_clip_high(s, 0.2, step, 101) for step in range(1, 102)]
    assert values[0] == pytest.approx(0.2) and values[-1] == pytest.approx(0.2)
    assert max(values[:50]) > max(values[50:]) > 0.2  # oscillating, decaying
    assert clip_schedule_knobs(ClipScheduleSettings(), 0.28, 3, 10) == {}


# ------------------------------------------------------------------------ the config


@pytest.mark.parametrize("overrides,key", [
    (["algorithm.siren.enabled=true", "algorithm.aer.enabled=true"], "algorithm.siren.enabled"),
    (["algorithm.adaptive_entropy.enabled=true", "algorithm.entropy_coef=0.01"],
     "algorithm.adaptive_entropy.enabled"),
    (["algorithm.lp_reg.enabled=true", "algorithm.loss=cispo"], "algorithm.lp_reg.enabled"),
    (["algorithm.entropy_ratio_clip.enabled=true", "algorithm.loss=gspo"],
     "algorithm.entropy_ratio_clip.enabled"),
    (["algorithm.clip_schedule.shape=increase_decrease", "algorithm.loss=kl_cov"],
     "algorithm.clip_schedule.shape"),
    (["algorithm.siren.enabled=true", "algorithm.entropy_control.enabled=true",
      "algorithm.entropy_control.knob=entropy_coef", "algorithm.entropy_coef=0.001"],
     "algorithm.siren.enabled"),
])
def test_undefined_combinations_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides)
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


@pytest.mark.parametrize("loss", ["ppo_clip", "clip_cov", "kl_cov", "cispo", "ce_gppo"])
def test_the_methods_compose_with_the_token_level_losses(loss):
    """EntroPIC, SIREN, ERC and the reweighting are additive or per-token: every token-level
    loss takes them (Lp-Reg is PPO-clip's only, the paper's)."""
    cfg = load_config(overrides=[f"algorithm.loss={loss}", "algorithm.entropic.enabled=true",
                                 "algorithm.siren.enabled=true",
                                 "algorithm.entropy_ratio_clip.enabled=true",
                                 "algorithm.positive_reweight.enabled=true"])
    methods = EntropyMethods(cfg.algorithm)
    assert methods.selects and methods.active and methods.token_stat_names() == (TOP_P_ENTROPY,)


def test_step_normalizer_of_no_high_probability_token_leaves_the_term_out():
    d = _batch(9)
    a = _config(entropic=EntroPICSettings(enabled=True, high_prob=0.999))
    plan = StepPlan(EntropyMethods(a), [d["mask"]], [d["adv"]], [d["old"]], {}, None,
                    {"entropic": 0.5}, None)
    assert plan.high_normalizer is None
    assert step_normalizer(plan.high, "token-mean") == 0
    logp = d["logp"].clone().requires_grad_()
    term, _ = plan.extra_loss(0, logp, d["old"], d["adv"], d["mask"], 1.0, None, None)
    term.backward()
    assert float(term.detach()) == 0.0 and float(logp.grad.abs().max()) == 0.0


def test_the_methods_state_resumes_exactly_and_a_checkpoint_without_it_is_refused():
    """The controllers and SIREN's anchor through a checkpoint's trainer state (a JSON round
    trip): the resumed methods give the coefficients the uninterrupted ones give."""
    import json

    from megatron_entropy.trainer.entropy_control import methods_state, restore_methods

    a = _config(entropic=EntroPICSettings(enabled=True, target=0.3),
                aer=AERSettings(enabled=True, initial=0.02, lr=0.01))
    entropies = [0.9, 0.7, 0.5, 0.45, 0.2, 0.25]

    def step(m, e):
        h = torch.full((1, 3), e, dtype=torch.float64)
        return m.step_inputs([h], [torch.ones(1, 3)], None)

    straight = EntropyMethods(a)
    want = [step(straight, e) for e in entropies]
    first = EntropyMethods(a)
    got = [step(first, e) for e in entropies[:3]]
    saved = json.loads(json.dumps(methods_state(first)))
    resumed = EntropyMethods(a)
    restore_methods(resumed, saved)
    got += [step(resumed, e) for e in entropies[3:]]
    assert got == want
    with pytest.raises(ConfigError, match="written without the entropy methods"):
        restore_methods(EntropyMethods(a), {})
    assert methods_state(EntropyMethods(_config())) == {}
