"""Rollout mismatch correction (algorithms/rollout_correction.py) against a one-process reference
of its formulas written here, with each of ppo_clip, clip_cov and kl_cov; the step's split
(micro-batches, DP=2) does not change the gradient; bad settings and config values name the
setting / key. Through the actor: tests/integration/trainer/test_actor.py."""

from __future__ import annotations

import math

import pytest
import torch

from harness import run_distributed
from loss_references import (agg_data, level_log_ratio, make_batch, policy_logp, ref_aggregate,
                             ref_corrected_terms, ref_correction, ref_kl, valid_list)

from megatron_entropy.algorithms.aggregation import step_normalizer
from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.settings import SettingError
from megatron_entropy.algorithms.policy_loss import (PolicyLossSettings, policy_loss,
                                                     reduce_metrics, select_tokens_global)
from megatron_entropy.algorithms.rollout_correction import (RolloutCorrectionSettings,
                                                            correct_rollout)

SOURCES = ["math", "gsm", "math", "gsm", "math", "code"]


def _batch(seed: int):
    """A micro-batch whose engine log-probs drift from the recompute per token and per row."""
    d = make_batch(6, 20, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    row_shift = torch.tensor([0.0, 0.0, 0.05, -1.0, 1.2, 0.1], dtype=torch.float64)[:, None]
    d["engine"] = d["old"] - row_shift + 0.5 * torch.randn(6, 20, generator=g,
                                                           dtype=torch.float64)
    return d


CASES = [(loss, mode, level) for loss in ("ppo_clip", "clip_cov", "kl_cov")
         for mode, level in (("tis", "token"), ("tis", "geometric"), ("mis", "token"),
                             ("mis", "geometric"))]


@pytest.mark.parametrize("loss,mode,level", CASES)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_correction_equals_reference_with_every_loss(loss, mode, level, agg):
    s = PolicyLossSettings(loss=loss, clip_cov_ratio=0.05, clip_cov_lb=0.2, kl_cov_ratio=0.1,
                           entropy_coef=0.01, kl_coef=0.05, kl_type="k3", loss_agg_mode=agg)
    st = RolloutCorrectionSettings(mode=mode, level=level, tis_cap=1.5, mis_low=0.6,
                                   mis_high=1.8)
    d = _batch(seed=3)
    corr = correct_rollout(st, d["old"], d["engine"], d["mask"], SOURCES)
    mask = corr.mask
    normalizer = step_normalizer([mask], agg)
    logp = d["logp"].clone().requires_grad_()
    loss_val, metrics = policy_loss(s, logp, d["old"], d["adv"], mask, normalizer=normalizer,
                                    entropy=d["entropy"], ref_logp=d["ref"], adjust=corr.adjust,
                                    generator=torch.Generator().manual_seed(7))
    loss_val.backward()

    m0 = d["mask"]
    rows0 = m0.nonzero()[:, 0]
    lp_all = valid_list(d["logp"], m0).clone().requires_grad_()
    per, rows, kept, chosen = ref_corrected_terms(
        s, st, lp_all, *(valid_list(d[k], m0) for k in ("old", "adv", "engine")), rows0, seed=7)
    weight, _ = ref_correction(st, valid_list(d["old"], m0), valid_list(d["engine"], m0), rows0)
    lp = lp_all[kept]
    ref, en = (valid_list(d[k], m0)[kept] for k in ("ref", "entropy"))
    norm = float(len(rows)) if agg == "token-mean" else float(len(rows.unique()))
    expected = ref_aggregate(per, rows, agg, norm) \
        - s.entropy_coef * ref_aggregate(en, rows, agg, norm) \
        + s.kl_coef * ref_aggregate(ref_kl(lp, ref, s.kl_type), rows, agg, norm)
    expected.backward()

    assert normalizer == norm
    if mode == "mis":
        assert 0 < int((~kept).sum()) < len(kept)
        assert torch.equal(valid_list(mask, m0).bool(), kept)
        if level == "geometric":  # whole sequences go
            assert all(kept[rows0 == r].all() or not kept[rows0 == r].any()
                       for r in rows0.unique())
    else:
        assert torch.equal(mask, m0) and ((weight < 1) & (weight > 0)).any()
        assert (weight == 1.5).any()  # the cap binds
    if s.loss != "ppo_clip":
        assert chosen.any()
    torch.testing.assert_close(loss_val, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(valid_list(logp.grad, m0), lp_all.grad, rtol=1e-12, atol=1e-14)
    assert torch.equal(logp.grad[mask == 0], torch.zeros_like(logp.grad[mask == 0]))
    if weight is not None:
        assert reduce_metrics([metrics])["pg_loss"] == pytest.approx(float(per.detach().mean()),
                                                                     rel=1e-12)


@pytest.mark.parametrize("mode,level", [("none", "token"), ("tis", "token"), ("tis", "geometric"),
                                        ("mis", "token"), ("mis", "geometric")])
def test_metrics_equal_their_definitions(mode, level):
    st = RolloutCorrectionSettings(mode=mode, level=level, tis_cap=1.5, mis_low=0.6,
                                   mis_high=1.8)
    d = _batch(seed=5)
    m0 = d["mask"]
    got = reduce_metrics([correct_rollout(st, d["old"], d["engine"], m0, SOURCES).metrics])
    rows = m0.nonzero()[:, 0]
    old, engine = valid_list(d["old"], m0), valid_list(d["engine"], m0)
    lr = old - engine
    rho = torch.exp(level_log_ratio(lr, rows, level))
    want = {"rollout_corr/ratio_mean": rho.mean(), "rollout_corr/ratio_max": rho.max(),
            "rollout_corr/kl_k1": (engine - old).mean(),
            "rollout_corr/kl_k3": (torch.exp(lr) - 1 - lr).mean()}
    for src in set(SOURCES):
        on = torch.tensor([SOURCES[int(r)] == src for r in rows])
        want[f"rollout_corr/{src}/kl_k1"] = (engine - old)[on].mean()
        want[f"rollout_corr/{src}/kl_k3"] = (torch.exp(lr) - 1 - lr)[on].mean()
    if mode == "tis":
        w = torch.clamp(rho, max=1.5)
        want.update({"rollout_corr/weight_mean": w.mean(), "rollout_corr/weight_max": w.max(),
                     "rollout_corr/clipped_frac": (rho > 1.5).double().mean()})
    if mode == "mis":
        out = (rho < 0.6) | (rho > 1.8)
        want.update({"rollout_corr/masked_frac": out.double().mean(),
                     "rollout_corr/seq_masked_frac": torch.stack(
                         [out[rows == r].any() for r in rows.unique()]).double().mean()})
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k] == pytest.approx(float(v), rel=1e-12, abs=1e-15), k
    assert got["rollout_corr/kl_k3"] > 0


def test_none_changes_nothing():
    d = _batch(seed=2)
    corr = correct_rollout(RolloutCorrectionSettings(), d["old"], d["engine"], d["mask"])
    assert corr.mask is d["mask"] and corr.adjust.weight is None


def test_extreme_drift_stays_finite():
    d = _batch(seed=2)
    engine = d["engine"].clone()
    engine[0, 0] = d["old"][0, 0] - 500.0  # a ratio of e^500 (clamped to e^20)
    corr = correct_rollout(RolloutCorrectionSettings(mode="tis"), d["old"], engine, d["mask"])
    assert float(corr.adjust.weight[0, 0]) == 2.0
    got = reduce_metrics([corr.metrics])
    assert got["rollout_corr/ratio_max"] == pytest.approx(math.exp(20))
    assert all(math.isfinite(v) for v in got.values())


# ------------------------------------------------------------------------ split invariance


def _split_grad(mode: str, level: str, splits: list[list[int]], dp_group=None):
    x, targets, theta0, old, adv, mask = agg_data()
    g = torch.Generator().manual_seed(13)
    engine = old - 0.6 * torch.randn(old.shape, generator=g, dtype=torch.float64)
    st = RolloutCorrectionSettings(mode=mode, level=level, tis_cap=1.5, mis_low=0.7,
                                   mis_high=1.4)
    s = PolicyLossSettings(loss="kl_cov", kl_cov_ratio=0.1)
    corrs = [correct_rollout(st, old[r], engine[r], mask[r]) for r in splits]
    masks = [c.mask for c in corrs]
    theta = theta0.clone().requires_grad_()
    with torch.no_grad():
        lp = policy_logp(theta0, x, targets)
    sels = select_tokens_global(s, [lp[r] for r in splits], [old[r] for r in splits],
                                [adv[r] for r in splits], masks, dp_group=dp_group, seed=0)
    normalizer = step_normalizer(masks, s.loss_agg_mode, dp_group)
    for r, c, sel in zip(splits, corrs, sels):
        loss, _ = policy_loss(s, policy_logp(theta, x[r], targets[r]), old[r], adv[r], c.mask,
                              normalizer=normalizer, selection=sel, adjust=c.adjust)
        loss.backward()
    return theta.grad


def _dp_split_worker(mode: str, level: str):
    import torch.distributed as dist

    splits = [[[0, 5], [2]], [[7, 1, 3], [4, 6]]][dist.get_rank()]
    grad = _split_grad(mode, level, splits, dist.group.WORLD)
    dist.all_reduce(grad)
    return grad


@pytest.mark.parametrize("mode,level", [("tis", "token"), ("mis", "token"), ("mis", "geometric")])
def test_gradient_does_not_depend_on_the_split(mode, level):
    whole = _split_grad(mode, level, [list(range(8))])
    three = _split_grad(mode, level, [[0, 1, 2], [3, 4], [5, 6, 7]])
    for g in [three] + run_distributed(_dp_split_worker, 2, mode, level):
        torch.testing.assert_close(g, whole, rtol=1e-12, atol=1e-14)
    # The correction does something here.
    assert (whole - _split_grad("none", "token", [list(range(8))])).abs().max() > 1e-6


# ------------------------------------------------------------------------ bad input


@pytest.mark.parametrize("kwargs,setting", [
    (dict(mode="is"), "mode"), (dict(level="sequence"), "level"), (dict(tis_cap=0.0), "tis_cap"),
    (dict(mis_low=1.2), "mis_low"), (dict(mis_high=0.9), "mis_high")])
def test_bad_settings_name_the_setting(kwargs, setting):
    with pytest.raises(SettingError, match=f"^{setting}: ") as err:
        RolloutCorrectionSettings(**kwargs)
    assert err.value.setting == setting


def test_bad_input_raises_one_clear_error():
    d = _batch(seed=1)
    st = RolloutCorrectionSettings(mode="tis")
    with pytest.raises(ValueError, match="must share one"):
        correct_rollout(st, d["old"], d["engine"][:, :5], d["mask"])
    engine = d["engine"].clone()
    engine[0, 0] = float("nan")
    with pytest.raises(ValueError, match="^engine_logp contain NaN"):
        correct_rollout(st, d["old"], engine, d["mask"])
    with pytest.raises(ValueError, match="sources names 2 rows"):
        correct_rollout(st, d["old"], d["engine"], d["mask"], ["a", "b"])


@pytest.mark.parametrize("key,value,match", [
    ("mode", "is", r"mode: 'is' is not allowed; choose one of 'none', 'tis', 'mis'"),
    ("level", "sequence", r"level: 'sequence' is not allowed"),
    ("tis_cap", 0, r"tis_cap: 0\.0 is out of range; it must be > 0"),
    ("mis_low", 1.5, r"mis_low: 1\.5 is out of range; it must be <= 1"),
    ("mis_high", 0.5, r"mis_high: 0\.5 is out of range; it must be >= 1"),
    ("mis_hgh", 2, r"unknown config key 'algorithm\.rollout_correction\.mis_hgh'; did you mean "
                   r"'algorithm\.rollout_correction\.mis_high'")])
def test_config_errors_name_the_key(key, value, match):
    with pytest.raises(ConfigError, match=match if key == "mis_hgh" else
                       r"^algorithm\.rollout_correction\." + match):
        load_config(data={"algorithm": {"rollout_correction": {key: value}}})


def test_config_default_is_none_and_settings_follow_the_config():
    assert load_config(data={}).algorithm.rollout_correction == RolloutCorrectionSettings()
    a = load_config(overrides=["algorithm.rollout_correction.mode=mis",
                               "algorithm.rollout_correction.level=geometric",
                               "algorithm.rollout_correction.mis_low=0.8"]).algorithm
    assert a.rollout_correction == RolloutCorrectionSettings(
        mode="mis", level="geometric", mis_low=0.8)
