"""The policy-loss family (gspo, gmpo, cispo, sapo, ce_gppo, dppo_tv, dppo_kl, gpg) and the Cov
modifier against plain one-process implementations written here from each paper's formula, per
sequence over its list of valid tokens, in value and gradient, at every aggregation mode."""

from __future__ import annotations

import itertools

import pytest
import torch

from harness import run_distributed
from loss_references import LOSS_SCALE, policy_logp

from megatron_entropy.algorithms.aggregation import AGG_MODES, step_normalizer
from megatron_entropy.algorithms.loss_family import FAMILY_LOSSES
from megatron_entropy.algorithms.policy_loss import (PolicyLossSettings, policy_loss,
                                                     reduce_metrics, select_tokens_global,
                                                     select_tokens_micro_batch)
from megatron_entropy.config import ConfigError, load_config

FAMILY = list(FAMILY_LOSSES)
TOKEN_LEVEL = ["ppo_clip", "cispo", "sapo", "ce_gppo", "dppo_tv", "dppo_kl", "gpg"]


# ------------------------------------------------------------------------ the reference


def _one(value):
    """value in the forward pass, the gradient of log pi times value in the backward."""
    return lambda lp: value * (lp - lp.detach() + 1)


def ref_sequence(s: PolicyLossSettings, lp, old, adv):
    """The per-token loss values of one sequence (1-D over its valid tokens; lp has grad)."""
    el, eh = s.clip_ratio_low, s.clip_ratio_high
    lr = lp - old
    a = adv[0]  # the sequence-level losses take the sequence's advantage
    if s.loss == "gspo":
        seq = torch.exp(torch.clamp(lr.mean(), max=10.0))
        loss = torch.maximum(-a * seq, -a * torch.clamp(seq, 1 - el, 1 + eh))
        return loss.expand(lp.numel())
    if s.loss == "gmpo":
        clipped = torch.clamp(lr, -el, eh)
        c = torch.minimum(lr, clipped) if a > 0 else torch.maximum(lr, clipped)
        return (-a * torch.exp(c.mean())).expand(lp.numel())
    out = []
    for t in range(lp.numel()):
        A, x, o = adv[t], lp[t], old[t]
        r = torch.exp(torch.clamp(x - o, -20, 20))
        if s.loss == "ppo_clip":
            v = torch.maximum(-A * r, -A * torch.clamp(r, 1 - el, 1 + eh))
            if s.dual_clip_c is not None and A < 0:
                v = torch.minimum(v, -A * s.dual_clip_c)
        elif s.loss == "cispo":
            v = -float(torch.clamp(r.detach(), 1 - el, 1 + eh)) * A * x
        elif s.loss == "sapo":
            tau = s.sapo_tau_pos if A > 0 else s.sapo_tau_neg
            v = -A * 4 / tau * torch.sigmoid(tau * (r - 1))
        elif s.loss == "ce_gppo":
            r = torch.exp(x - o)
            if A < 0 and r < 1 - el:
                v = _one(-s.ce_gppo_beta1 * (1 - el) * A)(x)
            elif A > 0 and r > 1 + eh:
                v = _one(-s.ce_gppo_beta2 * (1 + eh) * A)(x)
            else:
                v = -A * r
            if s.dual_clip_c is not None and A < 0:
                v = torch.minimum(v, -A * s.dual_clip_c)
        elif s.loss in ("dppo_tv", "dppo_kl"):
            p, q = float(torch.exp(x.detach())), float(torch.exp(o))
            if s.loss == "dppo_tv":
                inside = p - q <= eh if A > 0 else p - q >= -el
            else:
                kl = q * (float(o) - float(x.detach())) + (1 - q) * torch.log(
                    torch.tensor((1 - q + 1e-8) / (1 - p + 1e-8), dtype=torch.float64))
                inside = (kl <= eh or p <= q) if A > 0 else (kl <= el or p >= q)
            v = -A * min(float(r.detach()), s.dppo_ratio_cap) * x * float(inside)
        elif s.loss == "gpg":
            v = -A * x
        out.append(v)
    return torch.stack(out)


def ref_frozen(s: PolicyLossSettings, lp, old, adv):
    """The tokens the loss passes no gradient (Clip-Cov never draws them), by the formulas."""
    g = torch.zeros(lp.numel(), dtype=torch.bool)
    x = lp.detach().clone().requires_grad_()
    for t in range(lp.numel()):
        v = ref_sequence(s, x[t:t + 1], old[t:t + 1], adv[t:t + 1])[0]
        (grad,) = torch.autograd.grad(v, x, allow_unused=True, retain_graph=True)
        g[t] = grad is None or float(grad[t]) == 0.0
    return g & (adv != 0)


def ref_select(s: PolicyLossSettings, lp, old, adv, seed):
    lp = lp.detach()
    cov = (adv - adv.mean()) * (lp - lp.mean())
    n = lp.numel()
    chosen = torch.zeros(n, dtype=torch.bool)
    if s.cov_modifier == "clip_cov":
        frozen = ref_frozen(s, lp, old, adv)
        cand = [i for i in range(n)
                if not frozen[i] and s.clip_cov_lb < cov[i] < s.clip_cov_ub]
        if cand:
            k = min(max(int(s.clip_cov_ratio * n), 1), len(cand))
            perm = torch.randperm(len(cand), generator=torch.Generator().manual_seed(seed))
            for p in perm[:k].tolist():
                chosen[cand[p]] = True
    elif s.cov_modifier == "kl_cov":
        k = max(1, int(n * s.kl_cov_ratio))
        chosen[torch.sort(cov, descending=True, stable=True).indices[:k]] = True
    return chosen


def reference(s: PolicyLossSettings, d: dict, normalizer: float, seed: int = 7):
    """(loss, grad of the valid log-probs as a 1-D list) by the formulas."""
    mask = d["mask"].bool()
    lp = d["logp"][mask].clone().requires_grad_()
    old, adv = d["old"][mask], d["adv"][mask]
    rows = mask.nonzero()[:, 0]
    per = torch.cat([ref_sequence(s, lp[rows == r], old[rows == r], adv[rows == r])
                     for r in rows.unique()]) if rows.numel() else lp * 0
    chosen = ref_select(s, lp, old, adv, seed)
    if s.cov_modifier == "clip_cov":
        per = per * (~chosen).double()
    elif s.cov_modifier == "kl_cov":
        per = torch.where(chosen, per + s.kl_cov_coef * (lp - old).abs(), per)
    mode = s.loss_agg_mode
    if mode == "token-mean":
        total = per.sum()
    else:  # seq-mean-token-sum-norm's constant L is part of the normalizer
        total = sum((per[rows == r].mean() if mode == "seq-mean-token-mean"
                     else per[rows == r].sum()) for r in rows.unique())
    loss = total / normalizer
    (grad,) = torch.autograd.grad(loss, lp, allow_unused=True)
    return loss.detach(), torch.zeros_like(lp) if grad is None else grad, chosen


# ------------------------------------------------------------------------ data


def make_batch(kind: str, seed: int = 1, rows: int = 6, cols: int = 12, spread: float = 0.3):
    """random; far (log-ratios up to +-30: ratios far outside every clip); single (one token a
    row); ties (binary advantages, a few log-prob levels, equal log-ratios). Row 1 is empty and
    masked positions hold NaN (they must not matter)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    if kind == "single":
        lengths[:] = 1
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).double()
    mask[1] = 0
    if kind == "ties":
        adv = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0).double()
        levels = torch.tensor([-0.05, -0.5, -1.0, -2.0], dtype=torch.float64)
        logp = levels[torch.randint(0, 4, (rows, cols), generator=g)]
        old = logp - 0.25
    else:
        adv = torch.randn(rows, generator=g, dtype=torch.float64) * 1.5
        logp = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 4 - 0.01
        spread = 30.0 if kind == "far" else spread
        old = logp + spread * (2 * torch.rand(rows, cols, generator=g, dtype=torch.float64) - 1)
        old = old.clamp(max=-1e-3)  # a log-prob
    adv = adv[:, None].expand(rows, cols).clone()
    for t in (logp, old, adv):
        t[mask == 0] = float("nan")
    return dict(logp=logp, old=old, adv=adv, mask=mask)


def run_loss(s: PolicyLossSettings, d: dict, normalizer: float, selection=None):
    logp = d["logp"].clone().requires_grad_()
    loss, metrics = policy_loss(s, logp, d["old"], d["adv"], d["mask"], normalizer=normalizer,
                                selection=selection, generator=torch.Generator().manual_seed(7))
    loss.backward()
    return loss.detach(), logp.grad, metrics


def _close(got, want):
    scale = max(1.0, float(want.abs().max())) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12 * scale)


# ------------------------------------------------------------------------ the losses


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss", FAMILY)
def test_each_loss_equals_its_formula_at_each_aggregation(loss, mode):
    s = PolicyLossSettings(loss=loss, loss_agg_mode=mode)
    d = make_batch("random")
    normalizer = 41.0
    got, grad, _ = run_loss(s, d, normalizer)
    want, want_grad, _ = reference(s, d, normalizer)
    _close(got, want)
    _close(grad[d["mask"].bool()], want_grad)
    assert torch.equal(grad[d["mask"] == 0], torch.zeros_like(grad[d["mask"] == 0]))
    assert want_grad.abs().max() > 0


@pytest.mark.parametrize("loss", ["ppo_clip", *FAMILY])
def test_fixed_normaliser_divides_the_token_sum_by_sequences_times_the_constant(loss):
    """seq-mean-token-sum-norm (Dr. GRPO's constant normaliser, as verl's agg_loss): the step's
    token losses summed over every response, divided by N L, N the step's non-empty sequences
    (7: row 1 is empty) and L the constant; over two micro-batches, values and gradients."""
    length = 20
    s = PolicyLossSettings(loss=loss, loss_agg_mode="seq-mean-token-sum-norm",
                           loss_scale_factor=length)
    d = make_batch("random", seed=9, rows=8)
    parts = [[0, 1, 2], [3, 4, 5, 6, 7]]
    normalizer = step_normalizer([d["mask"][p] for p in parts], s.loss_agg_mode, None,
                                 s.loss_scale_factor)
    assert normalizer == 7 * length
    runs = [run_loss(s, {k: d[k][p] for k in d}, normalizer) for p in parts]
    want, want_grad, _ = reference(s, d, 7 * length)
    _close(sum(r[0] for r in runs), want)
    _close(torch.cat([r[1] for r in runs])[d["mask"].bool()], want_grad)
    assert want_grad.abs().max() > 0
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm .* got None"):
        step_normalizer([d["mask"]], s.loss_agg_mode)


def test_the_fixed_normalisers_constant_defaults_to_the_response_budget():
    s = PolicyLossSettings(loss_agg_mode="seq-mean-token-sum-norm")
    assert s.with_response_budget(512).loss_scale_factor == 512
    fixed = PolicyLossSettings(loss_agg_mode="seq-mean-token-sum-norm", loss_scale_factor=64)
    assert fixed.with_response_budget(512).loss_scale_factor == 64
    cfg = load_config(overrides=["algorithm.loss_agg_mode=seq-mean-token-sum-norm",
                                 "algorithm.loss_scale_factor=300"])
    assert (cfg.algorithm.loss_agg_mode, cfg.algorithm.loss_scale_factor) == (
        "seq-mean-token-sum-norm", 300)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("kind", ["far", "single", "ties"])
@pytest.mark.parametrize("loss", FAMILY)
def test_edge_cases_equal_the_formula(loss, kind, mode):
    s = PolicyLossSettings(loss=loss, loss_agg_mode=mode, dual_clip_c=3.0)
    d = make_batch(kind, seed=3)
    got, grad, metrics = run_loss(s, d, 5.0)
    want, want_grad, _ = reference(s, d, 5.0)
    _close(got, want)
    _close(grad[d["mask"].bool()], want_grad)
    assert all(torch.isfinite(v).all() for v in metrics.values())


def test_far_ratios_really_clip():
    """The "far" inputs put tokens outside every clip: the losses that clip must clip some."""
    d = make_batch("far", seed=3)
    for loss in ("gspo", "gmpo", "cispo", "ce_gppo", "dppo_tv", "dppo_kl"):
        _, _, metrics = run_loss(PolicyLossSettings(loss=loss), d, 5.0)
        assert reduce_metrics([metrics])["pg_clipfrac"] > 0, loss


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss", FAMILY)
def test_global_scope_gives_the_same_loss_and_the_steps_cov(loss, mode):
    """Without a Cov rule the global selection chooses nothing: the loss is the micro-batch
    scope's, and Cov's metrics are those of the whole step (here two micro-batches)."""
    s = PolicyLossSettings(loss=loss, loss_agg_mode=mode, loss_scale_factor=LOSS_SCALE)
    d = make_batch("random", seed=8, rows=8)
    parts = [[0, 1, 2], [3, 4, 5, 6, 7]]
    split = {k: [d[k][p] for p in parts] for k in ("logp", "old", "adv", "mask")}
    sels = select_tokens_global(s, split["logp"], split["old"], split["adv"], split["mask"],
                                dp_group=None, seed=0)
    normalizer = step_normalizer(split["mask"], s.loss_agg_mode, None, s.loss_scale_factor)
    metrics = []
    for p, sel in zip(parts, sels):
        part = {k: d[k][p] for k in d}
        got, grad, m = run_loss(s, part, normalizer, sel)
        want, want_grad, _ = run_loss(s, part, normalizer)
        assert not sel.selected.any()
        assert torch.equal(got, want) and torch.equal(grad, want_grad)
        metrics.append(m)
    valid = d["mask"].bool()
    lp, adv = d["logp"][valid], d["adv"][valid]
    cov = (adv - adv.mean()) * (lp - lp.mean())
    assert reduce_metrics(metrics)["cov_mean"] == pytest.approx(float(cov.mean()), rel=1e-12)


@pytest.mark.parametrize("loss", FAMILY)
def test_all_masked_micro_batch_is_an_exact_zero_in_the_graph(loss):
    d = make_batch("random")
    d["mask"].zero_()
    got, grad, _ = run_loss(PolicyLossSettings(loss=loss), d, 3.0)
    assert float(got) == 0.0 and torch.equal(grad, torch.zeros_like(grad))


def test_sequence_losses_equal_the_sequence_objective_only_per_sequence():
    """GSPO/GMPO's clip acts on the whole response: one token far out clips every token of its
    sequence (GSPO), and moving one token's log-prob moves every token's gradient (GMPO)."""
    d = make_batch("random", seed=4)
    s = PolicyLossSettings(loss="gspo", clip_ratio_low=1e-3, clip_ratio_high=1e-3)
    _, _, metrics = run_loss(s, d, 10.0)
    frac = reduce_metrics([metrics])["pg_clipfrac"]
    # Each sequence clips all or none of its tokens: the fraction is a sum of whole rows.
    lengths = d["mask"].sum(1)
    sums = {float(lengths[list(c)].sum()) for n in range(7)
            for c in itertools.combinations(range(6), n)}
    assert any(abs(frac * lengths.sum() - v) < 1e-9 for v in sums)


# ------------------------------------------------------------------------ split, DP


def _split_grad(loss: str, mode: str, splits, dp_group=None):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 9, 4, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 6, (8, 9), generator=g)
    theta = torch.randn(4, 6, generator=g, dtype=torch.float64).requires_grad_()
    lengths = torch.tensor([9, 2, 5, 7, 1, 9, 3, 6])
    mask = (torch.arange(9)[None, :] < lengths[:, None]).double()
    adv = torch.randn(8, 1, generator=g, dtype=torch.float64).expand(8, 9).clone()
    with torch.no_grad():
        old = policy_logp(theta, x, targets) + 0.2 * torch.randn(8, 9, generator=g,
                                                                  dtype=torch.float64)
    s = PolicyLossSettings(loss=loss, loss_agg_mode=mode, loss_scale_factor=LOSS_SCALE)
    normalizer = step_normalizer([mask[r] for r in splits], mode, dp_group, LOSS_SCALE)
    for r in splits:
        out, _ = policy_loss(s, policy_logp(theta, x[r], targets[r]), old[r], adv[r], mask[r],
                             normalizer=normalizer)
        out.backward()
    return theta.grad


def _dp_worker(loss: str, mode: str):
    import torch.distributed as dist

    splits = [[[0, 5], [2]], [[7, 1, 3], [4, 6]]][dist.get_rank()]
    grad = _split_grad(loss, mode, splits, dist.group.WORLD)
    dist.all_reduce(grad)
    return grad


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("loss", ["gspo", "gmpo"])
def test_sequence_loss_gradient_does_not_depend_on_the_split(loss, mode):
    whole = _split_grad(loss, mode, [list(range(8))])
    three = _split_grad(loss, mode, [[0, 1, 2], [3, 4], [5, 6, 7]])
    torch.testing.assert_close(three, whole, rtol=1e-12, atol=1e-14)
    for grad in run_distributed(_dp_worker, 2, loss, mode):
        torch.testing.assert_close(grad, whole, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------------ the Cov modifier


@pytest.mark.parametrize("modifier", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("loss", TOKEN_LEVEL)
def test_cov_modifier_equals_the_formula(loss, modifier):
    s = PolicyLossSettings(loss=loss, cov_modifier=modifier, clip_cov_ratio=0.2,
                           clip_cov_lb=0.0, clip_cov_ub=5.0, kl_cov_ratio=0.1, dual_clip_c=1.5,
                           loss_agg_mode="seq-mean-token-sum")
    # Wide log-ratios: PPO's clip, dual-clip and DPPO's region leave tokens without gradient,
    # which Clip-Cov must not draw.
    d = make_batch("random", seed=2, rows=10, cols=30, spread=1.0)
    got, grad, metrics = run_loss(s, d, 9.0)
    want, want_grad, chosen = reference(s, d, 9.0)
    _close(got, want)
    _close(grad[d["mask"].bool()], want_grad)
    assert 0 < int(chosen.sum()) < chosen.numel()
    assert reduce_metrics([metrics])["selected_frac"] == pytest.approx(
        float(chosen.double().mean()), rel=1e-12)


def test_ppo_clip_with_the_clip_cov_modifier_is_clip_cov():
    d = make_batch("random", seed=5)
    common = dict(clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=5.0)
    a = run_loss(PolicyLossSettings(loss="ppo_clip", cov_modifier="clip_cov", **common), d, 8.0)
    b = run_loss(PolicyLossSettings(loss="clip_cov", **common), d, 8.0)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert reduce_metrics([a[2]])["selected_frac"] > 0


@pytest.mark.parametrize("modifier", ["clip_cov", "kl_cov"])
@pytest.mark.parametrize("loss", TOKEN_LEVEL)
def test_cov_modifier_global_scope_does_not_depend_on_the_split(loss, modifier):
    s = PolicyLossSettings(loss=loss, cov_modifier=modifier, clip_cov_ratio=0.2,
                           clip_cov_lb=0.0, kl_cov_ratio=0.1)
    d = make_batch("random", seed=6, rows=8)
    parts = [[0, 1, 2], [3, 4, 5, 6, 7]]
    whole = select_tokens_global(s, [d["logp"]], [d["old"]], [d["adv"]], [d["mask"]],
                                 dp_group=None, seed=3)[0]
    split = select_tokens_global(s, *([d[k][p] for p in parts]
                                      for k in ("logp", "old", "adv", "mask")),
                                 dp_group=None, seed=3)
    assert torch.equal(torch.cat([x.selected for x in split]), whole.selected)
    assert whole.selected.any()
    normalizer = float(d["mask"].sum())
    total = sum(run_loss(s, {k: d[k][p] for k in d}, normalizer, sel)[0]
                for p, sel in zip(parts, split))
    _close(total, run_loss(s, d, normalizer, whole)[0])
    if modifier == "kl_cov":  # deterministic: the micro-batch rule on the whole step agrees
        mb = select_tokens_micro_batch(s, d["logp"], d["old"], d["adv"], d["mask"])
        assert torch.equal(mb.selected, whole.selected)


@pytest.mark.parametrize("loss", ["gspo", "gmpo", "clip_cov", "kl_cov"])
def test_cov_modifier_is_refused_where_it_is_not_defined(loss):
    with pytest.raises(ConfigError, match=rf"algorithm.cov_modifier.*cannot modify the {loss}"):
        load_config(overrides=[f"algorithm.loss={loss}", "algorithm.cov_modifier=kl_cov"])


def test_the_entropy_controller_drives_the_cov_modifier_knob():
    """KL-Cov's ratio is a knob of any loss with the kl_cov modifier; the entropy bonus of any
    loss; a Cov knob of a loss without a Cov rule is refused."""
    on = ["algorithm.entropy_control.enabled=true", "algorithm.entropy_control.knob_max=0.5"]
    cfg = load_config(overrides=[*on, "algorithm.loss=sapo", "algorithm.cov_modifier=kl_cov",
                                 "algorithm.entropy_control.knob=kl_cov_ratio"])
    assert cfg.algorithm.cov_rule == "kl_cov"
    load_config(overrides=[*on, "algorithm.loss=gmpo", "algorithm.entropy_coef=0.01",
                           "algorithm.entropy_control.knob=entropy_coef"])
    with pytest.raises(ConfigError, match="kl_cov_ratio is not a knob of the gspo loss"):
        load_config(overrides=[*on, "algorithm.loss=gspo",
                               "algorithm.entropy_control.knob=kl_cov_ratio"])


def test_pass_at_k_needs_two_samples_per_prompt():
    with pytest.raises(ConfigError, match=r"grpo_passk needs rollout.n_samples >= 2.*got 1"):
        load_config(overrides=["algorithm.advantage=grpo_passk", "rollout.n_samples=1"])


def test_gmpo_clips_on_the_sequence_advantage_side():
    """A row whose token advantages have both signs (entropy shaping at kappa = 1 makes them):
    each log-ratio is clipped on the side of the row's mean advantage, the sign of the term
    -A_i exp(mean c) (docs/algorithms/policy_losses.md, "Where verl differs"). Clipping on each
    token's own sign, as verl's geo_mean does, gives another value (-0.416 against -0.358)."""
    lr = torch.tensor([[0.5, -0.5]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -0.2]], dtype=torch.float64)
    d = dict(logp=lr - 1.0, old=torch.full_like(lr, -1.0), adv=adv, mask=torch.ones_like(lr))
    s = PolicyLossSettings(loss="gmpo", clip_ratio_low=0.2, clip_ratio_high=0.28,
                           loss_agg_mode="seq-mean-token-mean")
    got, _, _ = run_loss(s, d, 1.0)
    row_side = torch.tensor([0.28, -0.5], dtype=torch.float64).mean()  # A_i = 0.4 > 0: min(c, clamp(c))
    assert float(got) == pytest.approx(-0.4 * float(torch.exp(row_side)), rel=1e-12)
    assert float(got) == pytest.approx(-0.358, abs=5e-4)
    token_side = torch.tensor([0.28, -0.2], dtype=torch.float64).mean()  # verl: each token by the sign of its own A
    assert -0.4 * float(torch.exp(token_side)) == pytest.approx(-0.416, abs=5e-4)


def test_dppo_caps_the_ratio_at_verls_clip_ratio_c():
    """The default cap of the detached IS ratio is verl's clip_ratio_c, 3: a token whose ratio is
    e^2 (inside the TV region: its probability moves by 0.06) is weighted 3, not e^2."""
    s = PolicyLossSettings(loss="dppo_tv")
    assert s.dppo_ratio_cap == 3.0
    logp = torch.tensor([[-2.0]], dtype=torch.float64)
    d = dict(logp=logp, old=logp - 2.0, adv=torch.ones_like(logp), mask=torch.ones_like(logp))
    _, grad, _ = run_loss(s, d, 1.0)
    assert float(grad) == pytest.approx(-3.0, rel=1e-12)


# ------------------------------------------------------------------------ the study


def test_every_loss_and_estimator_is_a_study_arm(tmp_path):
    """study.losses takes any of them by name (here from the command line, as
    docs/algorithms/policy_losses.md shows): each arm's run resolves to its loss/advantage."""
    from pathlib import Path

    from megatron_entropy.analysis.study import plan_study

    arms = [("grpo", ["algorithm.loss=ppo_clip"])]  # the study's baseline arm
    arms += [(loss, [f"algorithm.loss={loss}"]) for loss in FAMILY]
    arms += [("cispo_kl_cov", ["algorithm.loss=cispo", "algorithm.cov_modifier=kl_cov"])]
    arms += [(adv, ["algorithm.loss=ppo_clip", f"algorithm.advantage={adv}"])
             for adv in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo",
                         "grpo_passk", "remax")]
    listed = ", ".join(f"{{name: {n}, overrides: [{', '.join(o)}]}}" for n, o in arms)
    config = Path(__file__).resolve().parents[3] / "examples" / "study.yaml"
    plan = plan_study(str(config), [f"study.losses=[{listed}]", "study.seeds=[1]",
                                    "study.entropy_bonus.values=[]",
                                    "study.threshold_sweep.values=[]"],
                      str(tmp_path / "out"), quick=True)
    assert [r.name for r in plan.runs] == [f"{n}-seed1" for n, _ in arms]
    for run, (name, _) in zip(plan.runs, arms):
        a = run.config.algorithm
        assert name in ("grpo", a.loss, a.advantage) or \
            (a.loss, a.cov_modifier) == ("cispo", "kl_cov")
