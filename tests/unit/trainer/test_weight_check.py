"""trainer/weight_check.py's judgement: the tolerances follow the coarser dtype's roundoff, the
per-step check over the rollout tokens names the server whose mean or 0.99 quantile is beyond
them (over a DP group of 2 ranks, each holding part of the tokens), counts only the tokens of
the version asked for, and the old flat config keys say where they went."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed

from megatron_entropy.config import ConfigError, load_config
from megatron_entropy.runtime.dtypes import DTYPES
from megatron_entropy.trainer.batch import Sample
from megatron_entropy.trainer.weight_check import (MEAN_ROUNDOFFS, QUANTILE_ROUNDOFFS,
                                                   WeightCheckError, check_rollout_weights,
                                                   tolerances)

BF16 = tolerances("bf16", "fp32")


def test_tolerances_are_roundoffs_of_the_coarser_dtype():
    u = DTYPES["bf16"].unit_roundoff
    assert BF16 == (MEAN_ROUNDOFFS * u, QUANTILE_ROUNDOFFS * u)
    assert tolerances("fp32", "bf16") == BF16
    # Correct bf16 weights measure up to 7.3e-3 mean; a copy with 0.5 x std noise 0.17.
    assert 7.3e-3 * 3 < BF16[0] < 0.17 / 3
    assert tolerances("fp32", "fp32") == (1e-3, 1e-2)  # the floors
    assert tolerances("bf16", "fp32", 0.5, 2.0) == (0.5, 2.0)


def _samples(rank: int, shift: dict[int, float], spikes: dict[int, float]) -> list[Sample]:
    """Rank ``rank``'s half of 2 servers' samples: engine = recompute + N(0, 2e-3) (bf16-like
    rounding), + ``shift[server]`` on every token, + ``spikes[server]`` on one token in 40."""
    g = torch.Generator().manual_seed(rank)
    out = []
    for server in (0, 1):
        for k in range(6):
            old = -3 * torch.rand(40, generator=g)
            noise = torch.randn(40, generator=g, dtype=torch.float64) * 2e-3
            noise += shift.get(server, 0.0)
            noise[k::40] += spikes.get(server, 0.0)
            out.append(Sample(prompt_ids=[1], response_ids=list(range(2, 42)),
                              engine_logprobs=(old.double() + noise).tolist(), reward=0.0,
                              group=k, source="x", old_logprobs=old, server=server,
                              weight_version="3" if k else "2"))
    return out


def _check_worker(shift, spikes, version):
    import torch.distributed as dist

    try:
        return check_rollout_weights(_samples(dist.get_rank(), shift, spikes), dist.group.WORLD,
                                     BF16, 0.99, version, "at step 4", torch.device("cpu"))
    except WeightCheckError as e:
        return str(e)


def test_the_rollout_check_names_the_server_beyond_its_mean_or_quantile():
    good, shifted, spiky, other_version = run_distributed(
        lambda: [_check_worker({}, {}, None), _check_worker({1: 0.17}, {}, None),
                 _check_worker({}, {0: 1.0}, None), _check_worker({1: 0.17}, {}, "2")], 2)[0]
    assert good["weight_check/rollout_tokens"] == 2 * 2 * 6 * 40
    assert good["weight_check/rollout_drift_mean"] < 3e-3
    assert shifted.startswith("weight check at step 4: the rollout engine's log-probs disagree")
    assert "server 1: |engine - trainer| mean 0.17 nats > 0.0312 over 480 tokens" in shifted
    assert "server 0" not in shifted
    # One token in 40 off by 1 nat: the mean (0.027) passes, the 0.99 quantile does not.
    assert "server 0: |engine - trainer| p99 1 nats > 0.125 (mean 0.02" in spiky, spiky
    # Version "2" is one sample in 6 per server and rank: only those are checked.
    assert "over 80 tokens" in other_version


def test_the_old_flat_weight_check_keys_say_where_they_are_now():
    with pytest.raises(ConfigError, match="'rollout.weight_check_tokens' is now "
                                          "'rollout.weight_check.tokens'"):
        load_config(None, ["rollout.weight_check_tokens=16"])
    with pytest.raises(ConfigError, match="rollout.weight_check is a section: set "
                                          "rollout.weight_check.enabled=false"):
        load_config(None, ["rollout.weight_check=false"])
    assert load_config(None, ["rollout.weight_check.enabled=false"]).rollout.weight_check \
        .enabled is False
