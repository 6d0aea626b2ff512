"""GRPO / Dr.GRPO / RLOO advantages against a per-group loop written from their definitions."""

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
