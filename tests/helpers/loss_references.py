"""References written from the policy losses' formulas, on one process, and the small batches
and differentiable toy policy the loss tests share (tests/unit and tests/integration)."""

from __future__ import annotations

import torch

from megatron_entropy.algorithms.policy_loss import PolicyLossSettings
from megatron_entropy.algorithms.rollout_correction import RolloutCorrectionSettings


# The constant L of seq-mean-token-sum-norm in the tests that run every aggregation mode (the
# other modes ignore it): not 1, so that a normaliser without it changes the loss.
LOSS_SCALE = 7


def ref_select(s: PolicyLossSettings, lp, old, adv, seed: int):
    """Selected flags over a 1-D list of valid tokens (population = the whole list)."""
    lp, old, adv = lp.detach(), old.detach(), adv.detach()
    cov = (adv - adv.mean()) * (lp - lp.mean())
    n_valid = lp.numel()
    chosen = torch.zeros(n_valid, dtype=torch.bool)
    if s.loss == "clip_cov":
        ratio = torch.exp(lp - old)
        l1 = -adv * ratio
        l2 = -adv * torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
        cand = [i for i in range(n_valid)
                if not l2[i] > l1[i] and s.clip_cov_lb < cov[i] < s.clip_cov_ub]
        if cand:
            n = min(max(int(s.clip_cov_ratio * n_valid), 1), len(cand))
            perm = torch.randperm(len(cand), generator=torch.Generator().manual_seed(seed))
            for p in perm[:n].tolist():
                chosen[cand[p]] = True
    elif s.loss == "kl_cov" and n_valid:
        k = max(1, int(n_valid * s.kl_cov_ratio))
        # Largest first; among equal values the earlier token (stable sort).
        order = torch.sort(cov, descending=True, stable=True).indices
        chosen[order[:k]] = True
    return chosen, cov


def ref_token_losses(s: PolicyLossSettings, lp, old, adv, chosen):
    """Per-token policy loss over a 1-D list of valid tokens (lp carries the gradient)."""
    if s.loss == "ppo_clip":
        ratio = torch.exp(torch.clamp(lp - old, -20, 20))
    else:
        ratio = torch.exp(lp - old)
    l1 = -adv * ratio
    l2 = -adv * torch.clamp(ratio, 1 - s.clip_ratio_low, 1 + s.clip_ratio_high)
    if s.loss == "ppo_clip":
        out = torch.maximum(l1, l2)
        if s.dual_clip_c is not None:
            out = torch.where(adv < 0, torch.minimum(out, -adv * s.dual_clip_c), out)
        return out
    if s.loss == "clip_cov":
        return torch.maximum(l1, l2) * (~chosen).double()
    return torch.where(chosen, l1 + s.kl_cov_coef * (lp - old).abs(), l1)


def ref_kl(lp, ref, kind):
    if kind == "k1":
        return lp - ref
    if kind == "abs":
        return (lp - ref).abs()
    x = (ref - lp).clamp(-20, 20)
    return (x.exp() - x - 1).clamp(-10, 10)


def ref_aggregate(values, rows, mode, normalizer):
    """values: 1-D over valid tokens; rows: the sequence id of each. seq-mean-token-sum-norm
    sums like seq-mean-token-sum: its constant L is part of ``normalizer``."""
    if mode == "token-mean":
        return values.sum() / normalizer
    total = 0.0
    for r in rows.unique():
        v = values[rows == r]
        total = total + (v.mean() if mode == "seq-mean-token-mean" else v.sum())
    return total / normalizer


def valid_list(t, mask):
    return t[mask.bool()]


def make_batch(rows: int, cols: int, seed: int, discrete: bool = False, garbage: bool = True):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, cols + 1, (rows,), generator=g)
    mask = (torch.arange(cols)[None, :] < lengths[:, None]).double()
    if rows > 2:
        mask[1] = 0  # one empty sequence
    if discrete:  # many exact ties: binary-reward advantages and a few log-prob levels
        adv = torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0).double()
        levels = torch.tensor([0.0, -0.5, -1.0, -2.0, -4.0], dtype=torch.float64)
        logp = levels[torch.randint(0, 5, (rows, cols), generator=g)]
    else:
        adv = torch.randn(rows, generator=g, dtype=torch.float64) * 1.5
        logp = -torch.rand(rows, cols, generator=g, dtype=torch.float64) * 4
    old = logp + 0.3 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    adv = adv[:, None].expand(rows, cols).clone()
    entropy = torch.rand(rows, cols, generator=g, dtype=torch.float64) * 2
    ref = logp + 0.2 * torch.randn(rows, cols, generator=g, dtype=torch.float64)
    if garbage:  # what sits at masked positions must not matter
        for t in (logp, old, adv, entropy, ref):
            t[mask == 0] = float("nan")
    return dict(logp=logp, old=old, adv=adv, mask=mask, entropy=entropy, ref=ref)


def policy_logp(theta, x, targets):
    """A tiny differentiable policy: log-probs [B, S] of targets under softmax(x @ theta)."""
    return torch.log_softmax(x @ theta, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def agg_data():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(8, 9, 4, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 6, (8, 9), generator=g)
    theta = torch.randn(4, 6, generator=g, dtype=torch.float64)
    d = make_batch(8, 9, seed=6, garbage=False)
    mask = d["mask"]
    mask[1] = (torch.arange(9) < 2).double()  # lengths differ a lot: splitting matters
    with torch.no_grad():
        old = policy_logp(theta, x, targets) + 0.2 * torch.randn(8, 9, generator=g,
                                                                  dtype=torch.float64)
    return x, targets, theta, old, d["adv"], mask


def level_log_ratio(lr, rows, level):
    if level == "token":
        return lr
    means = {int(r): lr[rows == r].mean() for r in rows.unique()}
    return torch.stack([means[int(r)] for r in rows])


def ref_correction(st: RolloutCorrectionSettings, old, engine, rows):
    """(weight per valid token or None, kept flags) over 1-D lists of valid tokens."""
    rho = torch.exp(level_log_ratio((old - engine).clamp(-20, 20), rows, st.level))
    if st.mode == "tis":
        return torch.clamp(rho, max=st.tis_cap), torch.ones_like(rho, dtype=torch.bool)
    if st.mode == "mis":
        return None, (rho >= st.mis_low) & (rho <= st.mis_high)
    return None, torch.ones_like(rho, dtype=torch.bool)


def ref_corrected_terms(s: PolicyLossSettings, st: RolloutCorrectionSettings, lp_all, old, adv,
                        engine, rows, seed: int):
    """The corrected policy-gradient terms over 1-D lists of valid tokens (the step's, in
    order; ``lp_all`` carries the gradient): (per-token terms of the kept tokens, their rows,
    the kept flags, Clip-Cov's/KL-Cov's chosen among the kept). mis: the kept tokens are the
    whole population, Cov's included; tis: the terms times the weight. ``seed`` drives
    Clip-Cov's draw."""
    weight, kept = ref_correction(st, old, engine, rows)
    lp, old_k, adv_k = lp_all[kept], old[kept], adv[kept]
    chosen, _ = ref_select(s, lp, old_k, adv_k, seed=seed)
    per = ref_token_losses(s, lp, old_k, adv_k, chosen)
    if weight is not None:
        per = per * weight[kept]
    return per, rows[kept], kept, chosen
