"""GRPO / Dr.GRPO / RLOO / REINFORCE++ (and its baseline) / OPO / GRPO pass@k advantages against
loops written from their definitions."""

from __future__ import annotations

import pytest
import torch

from megatron_entropy.algorithms.advantages import compute_advantages


def reference(estimator, rewards, group_ids, norm_by_std, eps=1e-6):
    out = torch.empty_like(rewards)
    for gid in group_ids.unique().tolist():
        idx = (group_ids == gid).nonzero().flatten().tolist()
        r = rewards[idx]
        n = len(idx)
        for j, i in enumerate(idx):
            if estimator == "rloo":
                others = [r[k] for k in range(n) if k != j]
                out[i] = r[j] - sum(others) / len(others) if others else r[j]
                continue
            mean = r.mean() if n > 1 else 0.0
            if estimator == "grpo" and norm_by_std:
                std = r.std() if n > 1 else 1.0  # unbiased, as torch.std
                out[i] = (r[j] - mean) / (std + eps)
            else:
                out[i] = r[j] - mean
    return out


@pytest.mark.parametrize("estimator,norm_by_std", [("grpo", True), ("grpo", False),
                                                   ("drgrpo", True), ("rloo", True)])
def test_equals_per_group_definition(estimator, norm_by_std):
    g = torch.Generator().manual_seed(0)
    # Interleaved groups of sizes 8, 8, 3, 1 (a singleton) and one with all-equal rewards.
    group_ids = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 5, 9, 5, 9, 5, 9, 5, 9, 2, 2, 2, 7, 4, 4, 4])
    rewards = torch.randint(0, 2, (len(group_ids),), generator=g).double()
    rewards[16:19] = torch.tensor([0.3, 1.0, 0.0], dtype=torch.float64)
    rewards[20:] = 1.0
    got = compute_advantages(estimator, rewards, group_ids, norm_by_std=norm_by_std)
    want = reference(estimator, rewards, group_ids, norm_by_std)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got[20:].abs().max() == 0 and got[:16].abs().max() > 0.5


def test_bad_input():
    r, ids = torch.ones(4), torch.tensor([0, 0, 1, 1])
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'"):
        compute_advantages("ppo", r, ids)
    with pytest.raises(ValueError, match=r"must both be \[N\]"):
        compute_advantages("grpo", r, ids[:3])
    with pytest.raises(ValueError, match="integer prompt ids"):
        compute_advantages("grpo", r, ids.float())
    with pytest.raises(ValueError, match="NaN"):
        compute_advantages("grpo", torch.tensor([1.0, float("nan"), 0.0, 1.0]), ids)
    with pytest.raises(ValueError, match="empty"):
        compute_advantages("grpo", torch.ones(0), torch.ones(0, dtype=torch.long))


def reference_token_weighted(estimator, rewards, group_ids, lengths, norm_by_std, eps=1e-6):
    """REINFORCE++ (+baseline) whitened over the list of every response token, OPO's
    length-weighted group baseline, pass@k's best-response gap, by plain loops."""
    out = torch.zeros_like(rewards)
    groups = {g: (group_ids == g).nonzero().flatten().tolist() for g in group_ids.unique().tolist()}
    if estimator.startswith("reinforce_plus_plus"):
        values = rewards.clone()
        if estimator.endswith("baseline"):
            for idx in groups.values():
                if len(idx) > 1:
                    values[idx] = rewards[idx] - rewards[idx].mean()
        tokens = torch.cat([values[i].repeat(int(lengths[i])) for i in range(len(values))])
        return (values - tokens.mean()) / torch.sqrt(tokens.var() + 1e-8)
    for idx in groups.values():
        r, n = rewards[idx], lengths[idx].double()
        if estimator == "opo":
            base = (n * r).sum() / n.sum() if len(idx) > 1 else 0.0
            out[idx] = r - base
        else:  # grpo_passk
            best = max(range(len(idx)), key=lambda j: (r[j], -j))
            second = max(r[j] for j in range(len(idx)) if j != best)
            gap = r[best] - second
            out[idx[best]] = gap / (r.std() + eps) if norm_by_std else gap
    return out


@pytest.mark.parametrize("estimator,norm_by_std", [
    ("reinforce_plus_plus", True), ("reinforce_plus_plus_baseline", True), ("opo", True),
    ("grpo_passk", True), ("grpo_passk", False)])
def test_token_weighted_and_passk_equal_their_definition(estimator, norm_by_std):
    g = torch.Generator().manual_seed(1)
    group_ids = torch.tensor([5, 9, 5, 9, 5, 9, 5, 9, 2, 2, 2, 4, 4, 4, 7])
    rewards = torch.tensor([0.2, 1.0, 0.9, 0.0, 0.5, 0.0, 0.1, 0.0, 0.3, 1.0, 1.0, 1.0, 1.0, 1.0,
                            0.0], dtype=torch.float64)  # group 2 ties at the top
    rewards[11:14] = 1.0  # all equal
    lengths = torch.randint(1, 40, (len(group_ids),), generator=g)
    lengths[3] = 0  # an empty response weighs nothing
    if estimator == "grpo_passk":  # every group needs two responses
        group_ids, rewards, lengths = group_ids[:-1], rewards[:-1], lengths[:-1]
    got = compute_advantages(estimator, rewards, group_ids, norm_by_std=norm_by_std,
                             lengths=lengths)
    want = reference_token_weighted(estimator, rewards, group_ids, lengths, norm_by_std)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got.abs().max() > 0.1
    if estimator in ("opo", "grpo_passk"):  # the all-equal group has nothing to learn
        assert got[11:14].abs().max() < 1e-12
    if estimator == "grpo_passk":
        assert (got[[2, 1]] != 0).all() and (got[8:] == 0).all()  # a tie at the top: no gap


def test_reinforce_plus_plus_weighs_responses_by_their_length():
    r, ids = torch.tensor([1.0, 0.0]), torch.tensor([0, 1])
    even = compute_advantages("reinforce_plus_plus", r, ids, lengths=torch.tensor([5, 5]))
    long_right = compute_advantages("reinforce_plus_plus", r, ids, lengths=torch.tensor([1, 9]))
    assert even[0] == pytest.approx(-even[1])
    assert long_right[0] > -long_right[1] > 0  # the mean sits near the long wrong answer


def test_estimators_that_need_lengths_or_pairs_say_so():
    r, ids = torch.ones(3), torch.tensor([0, 0, 1])
    for name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "opo"):
        with pytest.raises(ValueError, match=f"{name} needs the response lengths"):
            compute_advantages(name, r, ids)
    with pytest.raises(ValueError, match="at least 2 responses per prompt"):
        compute_advantages("grpo_passk", r, ids)


def test_remax_subtracts_the_greedy_baseline():
    r, ids = torch.tensor([1.0, 0.0, 1.0, 0.5]), torch.tensor([0, 0, 1, 1])
    b = torch.tensor([0.25, 0.25, 1.0, 1.0])
    torch.testing.assert_close(compute_advantages("remax", r, ids, baselines=b), r - b)
    with pytest.raises(ValueError, match="remax needs a finite greedy baseline"):
        compute_advantages("remax", r, ids)
    with pytest.raises(ValueError, match="remax needs a finite greedy baseline"):
        compute_advantages("remax", r, ids, baselines=torch.tensor([0.0, float("nan"), 0, 0]))
