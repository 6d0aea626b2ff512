"""Packed micro-batches and context-parallel shards (trainer/packing.py,
trainer/context_parallel.py) as data: what each row holds, where each response token is
predicted, which CP rank holds which token, and how the step's groups are dealt to DP ranks."""

from __future__ import annotations

import pytest
import torch

from tiny_models import random_samples

from megatron_entropy.config import ConfigError
from megatron_entropy.trainer.batch import pack_micro_batches
from megatron_entropy.trainer.context_parallel import chunk_positions, shard_micro_batch
from megatron_entropy.trainer.packing import (SampleOrder, balance_groups, first_fit_decreasing,
                                              group_cost, micro_batch_cost,
                                              packed_micro_batches, resolve_layouts)


def test_first_fit_decreasing_fills_bins_longest_first():
    # 9 first (bin 0), 7 (bin 1: 16 > 10), 5 (bin 2), 3 -> bin 1 (10), 2 -> bin 2, 1 -> bin 0
    assert first_fit_decreasing([3, 9, 5, 7, 2, 1], 10) == [[0, 3], [1, 5], [2, 4]]
    # an item over the capacity gets a bin of its own; every item is placed once
    bins = first_fit_decreasing([30, 4, 4, 4], 10)
    assert bins == [[0], [1, 2], [3]]
    lengths = torch.randint(1, 50, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    bins = first_fit_decreasing(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(200))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # FFD's bound: at most 11/9 OPT + 1 bins, and OPT >= total / capacity
    assert len(bins) <= 11 / 9 * sum(lengths) / 64 + 2


def test_a_packed_row_holds_its_samples_back_to_back():
    samples = random_samples(3, groups=3, per_group=2)
    (mb,) = packed_micro_batches(samples, 10 ** 6)
    assert mb.tokens.shape[0] == 1 and mb.sample_ids == list(range(6))
    row, pos = mb.tokens[0].tolist(), mb.position_ids[0].tolist()
    start = 0
    for i, s in enumerate(samples):
        n = s.length
        assert row[start:start + n] == s.prompt_ids + s.response_ids
        assert pos[start:start + n] == list(range(n))  # positions restart per sample
        assert int(mb.cu_seqlens[i]) == int(mb.cu_seqlens_padded[i]) == start
        start += n
    assert len(row) == start  # no padding without context parallelism
    # each response token is predicted at the token before it in its own sample
    assert torch.equal(mb.tokens[0, mb.flat_positions + 1], mb.targets)
    # the same [B, R] tensors as the padded layout of the same samples
    (padded,) = pack_micro_batches(samples, 10 ** 6)
    for name in ("targets", "rows", "cols", "mask", "advantages"):
        assert torch.equal(getattr(mb, name), getattr(padded, name)), name


def test_packed_rows_pad_each_sample_for_context_parallelism():
    samples = random_samples(4, groups=2, per_group=2)
    mbs = packed_micro_batches(samples, 40, multiple=4, row_multiple=1)
    for mb in mbs:
        lengths = (mb.cu_seqlens_padded[1:] - mb.cu_seqlens_padded[:-1]).tolist()
        real = (mb.cu_seqlens[1:] - mb.cu_seqlens[:-1]).tolist()
        assert all(n % 4 == 0 and 0 <= n - r < 4 for n, r in zip(lengths, real))
        assert mb.tokens.shape[1] == sum(lengths) and (sum(lengths) <= 40 or len(lengths) == 1)
        assert mb.sample_ids == sorted(mb.sample_ids)
    assert sorted(i for mb in mbs for i in mb.sample_ids) == list(range(4))
    # the row's end padded for sequence parallelism
    (mb,) = packed_micro_batches(samples, 10 ** 6, row_multiple=8)
    assert mb.tokens.shape[1] % 8 == 0 and int(mb.cu_seqlens_padded[-1]) == mb.tokens.shape[1]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_context_parallel_ranks_hold_balanced_chunks_of_every_sequence(layout):
    samples = random_samples(5, groups=2, per_group=2)
    cp = 2
    (mb,) = (packed_micro_batches(samples, 10 ** 6, multiple=2 * cp) if layout == "packed"
             else pack_micro_batches(samples, 10 ** 6))
    shards = [shard_micro_batch(mb, r, cp) for r in range(cp)]
    # every response token's statistics computed by exactly one rank, at the same token
    owner = shards[0].stat_owner
    assert all(torch.equal(s.stat_owner, owner) for s in shards)
    assert owner.shape == (mb.num_tokens,) and set(owner.tolist()) == {0, 1}
    for r, shard in enumerate(shards):
        own = (shard.stat_owner == r).nonzero().squeeze(1)
        assert torch.equal(shard.targets, mb.targets[own])
        flat_local = shard.tokens.reshape(-1)[shard.flat_positions]
        assert torch.equal(flat_local, mb.tokens.reshape(-1)[mb.flat_positions[own]])
        # half of each row, chunks r and 2cp-1-r of each sequence
        assert shard.tokens.shape[1] * cp == (mb.tokens.shape[1] + (-mb.tokens.shape[1]) % 4
                                              if layout == "padded" else mb.tokens.shape[1])
    assert chunk_positions(8, 8, 0, 2) == [8, 9, 14, 15]
    assert chunk_positions(8, 8, 1, 2) == [10, 11, 12, 13]


def test_shared_prompt_rows_are_not_split_over_context_parallel_ranks():
    samples = random_samples(3, groups=2, per_group=3, shared_prompts=True)
    (mb,) = pack_micro_batches(samples, 10 ** 6, layout="shared_prompt")
    with pytest.raises(ValueError, match="shared-prompt rows"):
        shard_micro_batch(mb, 0, 2)


def test_sample_order_joins_and_splits_any_micro_batches():
    samples = random_samples(6, groups=3, per_group=2)
    mbs = packed_micro_batches(samples, 24)
    assert len(mbs) > 1 and [i for mb in mbs for i in mb.sample_ids] != list(range(6))
    order = SampleOrder(mbs)
    joined = order.join([mb.advantages for mb in mbs])
    (padded,) = pack_micro_batches(samples, 10 ** 6)
    torch.testing.assert_close(joined[:, :padded.mask.shape[1]], padded.advantages, rtol=0,
                               atol=0)
    for a, mb in zip(order.split(joined), mbs):
        assert torch.equal(a, mb.advantages)


def test_groups_are_dealt_by_cost_in_round_robins_rounds():
    # groups 0-1, 2-3, ... are dealt one to each rank (round robin's rounds), the costlier of a
    # round to the rank with the smaller load: two costly groups in rounds 0 and 2
    costs = [group_cost(lengths) for lengths in
             ([100, 100], [5, 5], [5, 5], [5, 5], [90, 90], [5, 5], [5, 5], [20, 20])]
    owner = balance_groups(costs, 2)
    assert all(owner[2 * j] != owner[2 * j + 1] for j in range(4))
    assert owner[0] != owner[4]  # round robin would give both to rank 0
    assert balance_groups([(1.0, 1.0)] * 5, 2) == [0, 1, 0, 1, 0]  # ties: round robin's
    # pairs as well as tokens: equal tokens, one group of each round far costlier in attention
    costs = [group_cost(lengths) for lengths in ([64], [8] * 8, [64], [8] * 8)]
    owner = balance_groups(costs, 2)
    assert owner[0] != owner[2] and owner[1] != owner[3]
    loads = [[sum(c[j] for c, o in zip(costs, owner) if o == p) for p in (0, 1)]
             for j in (0, 1)]
    assert loads[0][0] == loads[0][1] and loads[1][0] == loads[1][1]


def test_cost_counts_a_packed_row_by_its_sequences():
    samples = random_samples(7, groups=4, per_group=2, response_len=(5, 60))
    (packed,) = packed_micro_batches(samples, 10 ** 6)
    (padded,) = pack_micro_batches(samples, 10 ** 6)
    lengths = [s.length for s in samples]
    assert micro_batch_cost(packed, 0.0) == sum(n * n for n in lengths)
    assert micro_batch_cost(padded, 1.0) == 8 * (max(lengths) ** 2 + max(lengths))
    assert micro_batch_cost(packed, 10.0) < micro_batch_cost(padded, 10.0)


def test_layouts_resolve_for_the_model_they_run_on():
    other = [torch.nn.Linear(4, 4)]  # neither the local spec's attention nor TE's
    assert resolve_layouts("auto", None, other).candidates == ("padded",)
    assert "no packed sequences" in resolve_layouts("auto", None, other).note
    with pytest.raises(ConfigError, match=r"trainer\.micro_batch_layout=packed: the model's "
                                          "attention takes no packed sequences"):
        resolve_layouts("packed", None, other)
    with pytest.raises(ConfigError, match=r"parallel\.context=2: the model's attention"):
        resolve_layouts("auto", None, other, context=2)
