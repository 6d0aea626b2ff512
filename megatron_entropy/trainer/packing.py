"""Packed micro-batches (the THD layout): samples back to back in one row, each attending causally
to itself only, positions restarting at each sample.

A micro-batch is one row of at most ``trainer.micro_batch_tokens`` tokens (a longer sample gets a
row of its own). Which samples share a row is a first-fit-decreasing pass over their lengths,
so the long tail of reasoning responses no longer pads every row beside it to the longest; inside
a row the samples keep their order (so that a row holding the same samples as a padded
micro-batch gives the same [B, R] tensors), and the rows come in the order of their first sample.
Padding exists only where context parallelism needs it: each sample is padded to a multiple of
2 x CP (each of its 2 x CP chunks equal; x TP with sequence parallelism), and without CP the row's
end to a multiple of TP under sequence parallelism.

The row's sequence bounds (``cu_seqlens``, real and padded) reach the attention as Megatron's
``PackedSeqParams``: Transformer Engine's THD attention on a GPU, the local spec's one SDPA call
per sequence (models/context_parallel.py) elsewhere; either way the attention costs the sum of
len^2, and the rotary positions restart per sequence (Megatron's THD RoPE).

The step's groups are dealt to data-parallel ranks by ``balance_groups`` (trainer/rollouts.py):
as many groups per rank as round-robin dealing gives, chosen so that each rank's attention work
(sum of len^2) and tokens are even.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_entropy.models.arch import ModelArch
from megatron_entropy.models.attention import takes_explicit_masks, takes_packed_sequences
from megatron_entropy.settings import ConfigError
from megatron_entropy.trainer.batch import (MicroBatch, Sample, assemble_micro_batch,
                                            pack_micro_batches)
from megatron_entropy.trainer.context_parallel import shard_micro_batch


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices into ``lengths`` whose sums stay within ``capacity`` (an item longer than
    it gets a bin of its own): each item, longest first, into the first bin it fits. Each bin
    lists its items in index order; bins come in the order of their first item."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= capacity:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])


def padded_length(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def sample_multiple(tensor: int, context: int, sequence_parallel: bool) -> int:
    """What each packed sample's length is padded to a multiple of: 2 x CP chunks, each split
    over TP with sequence parallelism."""
    if context == 1:
        return 1
    return 2 * context * (tensor if sequence_parallel else 1)


def packed_micro_batches(samples: list[Sample], token_budget: int,
                         sample_ids: Optional[list[int]] = None, pad_id: int = 0,
                         multiple: int = 1, row_multiple: int = 1) -> list[MicroBatch]:
    """The samples ``sample_ids`` (default all) in packed rows of at most ``token_budget``
    tokens, one row per micro-batch (module docstring); ``multiple``: each sample's padding,
    ``row_multiple``: the row end's."""
    ids = list(range(len(samples))) if sample_ids is None else list(sample_ids)
    lengths = [padded_length(samples[i].length, multiple) for i in ids]
    return [_packed_row(samples, [ids[j] for j in b], pad_id, multiple, row_multiple, k)
            for k, b in enumerate(first_fit_decreasing(lengths, token_budget))]


def _packed_row(samples: list[Sample], ids: list[int], pad_id: int, multiple: int,
                row_multiple: int, index: int) -> MicroBatch:
    tokens: list[int] = []
    positions: list[int] = []
    flat: list[int] = []
    padding: list[bool] = []
    real, padded = [0], [0]
    for i in ids:
        s = samples[i]
        P, n = len(s.prompt_ids), s.length
        start = len(tokens)
        # response token t is predicted at the sample's token P - 1 + t
        flat.extend(start + P - 1 + t for t in range(len(s.response_ids)))
        size = padded_length(n, multiple)
        tokens += s.prompt_ids + s.response_ids + [pad_id] * (size - n)
        positions += range(size)
        padding += [False] * n + [True] * (size - n)
        real.append(real[-1] + n)
        padded.append(padded[-1] + size)
    extra = padded_length(len(tokens), row_multiple) - len(tokens)
    if extra:  # the last sequence takes the row's end padding
        tokens += [pad_id] * extra
        positions += range(positions[-1] + 1, positions[-1] + 1 + extra)
        padding += [True] * extra
        padded[-1] += extra
    mb = assemble_micro_batch(samples, ids, [tokens], [positions], flat, index)
    mb.padding = torch.tensor([padding])
    mb.cu_seqlens = torch.tensor(real, dtype=torch.int32)
    mb.cu_seqlens_padded = torch.tensor(padded, dtype=torch.int32)
    return mb


def thd_params(mb: MicroBatch) -> Optional[PackedSeqParams]:
    """Megatron's packed-sequence parameters of a packed micro-batch (None for the others)."""
    if mb.cu_seqlens is None:
        return None
    longest = int((mb.cu_seqlens_padded[1:] - mb.cu_seqlens_padded[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=mb.cu_seqlens,
                           cu_seqlens_kv=mb.cu_seqlens, cu_seqlens_q_padded=mb.cu_seqlens_padded,
                           cu_seqlens_kv_padded=mb.cu_seqlens_padded, max_seqlen_q=longest,
                           max_seqlen_kv=longest)


def micro_batches(samples: list[Sample], ids: Optional[list[int]], layouts: "Layouts",
                  token_budget: int, pairs_per_token: Optional[float], tensor: int = 1,
                  sequence_parallel: bool = False, context: int = 1, context_rank: int = 0
                  ) -> list[MicroBatch]:
    """The micro-batches of the samples ``ids`` (None: all) in the resolved ``layouts`` (auto:
    the cheapest of its candidates by ``micro_batch_cost``), this CP rank's part of them under
    context parallelism (``context`` > 1)."""
    packs = []
    for layout in layouts.candidates:
        if layout == "packed":
            packs.append(packed_micro_batches(
                samples, token_budget, ids,
                multiple=sample_multiple(tensor, context, sequence_parallel),
                row_multiple=tensor if sequence_parallel and context == 1 else 1))
        else:
            packs.append(pack_micro_batches(samples, token_budget, ids, layout=layout,
                                            pairs_per_token=pairs_per_token))
    mbs = packs[0] if len(packs) == 1 else min(
        packs, key=lambda mbs: sum(micro_batch_cost(mb, pairs_per_token or 0.0) for mb in mbs))
    if context > 1:
        mbs = [shard_micro_batch(mb, context_rank, context) for mb in mbs]
    return mbs


def micro_batch_cost(mb: MicroBatch, pairs_per_token: float) -> float:
    """A micro-batch's work in attention (query, key) pairs, counted as the shared-prompt rows'
    rule counts them (trainer/batch.py): a row of S tokens S^2 pairs (a masked kernel need not
    skip the hidden ones) and ``pairs_per_token`` for each token through the linear layers,
    padding included; a packed row each sequence's len^2."""
    rows, width = mb.tokens.shape
    if mb.cu_seqlens_padded is not None:
        lengths = (mb.cu_seqlens_padded[1:] - mb.cu_seqlens_padded[:-1]).double()
        pairs = float((lengths ** 2).sum())
    else:
        pairs = float(rows * width * width)
    return pairs + pairs_per_token * rows * width


@dataclass(frozen=True)
class Layouts:
    """``trainer.micro_batch_layout`` resolved for a policy: the layouts a pack may take (auto
    with several: the cheapest by ``micro_batch_cost`` for each mini-batch) and, for the
    start-up line, why."""

    candidates: tuple[str, ...]
    note: str


def resolve_layouts(setting: str, arch: Optional[ModelArch], model_chunks: list,
                    context: int = 1) -> Layouts:
    """Which layouts ``setting`` (auto, padded, shared_prompt, packed) allows this policy; a
    layout it cannot serve is a ConfigError naming the key. Shared-prompt rows need an
    attention that takes their explicit mask (the local spec's) and no context parallelism,
    and a mixture-of-experts policy (whose routing is recorded and replayed a sample at a time)
    takes none; packed rows (and CP) an attention that takes packed sequences (the local spec's
    SDPA or Transformer Engine's)."""
    moe = arch is not None and arch.is_moe
    chunks = bool(model_chunks)
    why_not = {
        "shared_prompt": "a mixture-of-experts policy records and replays its routing a "
                         "sample at a time, and a shared-prompt row's prompt tokens are "
                         "several samples'" if moe else
                         "context parallelism splits sequences, not shared-prompt rows"
                         if context > 1 else
                         None if chunks and takes_explicit_masks(model_chunks) else
                         "the model's attention is not the local spec's (Transformer "
                         "Engine's causal kernels take no explicit mask)",
        "packed": None if chunks and takes_packed_sequences(model_chunks) else
                  "the model's attention takes no packed sequences (neither the local spec's "
                  "SDPA nor Transformer Engine's)",
        "padded": None,
    }
    if context > 1 and why_not["packed"]:
        raise ConfigError(f"parallel.context={context}: {why_not['packed']}")
    if setting != "auto":
        if why_not.get(setting):
            raise ConfigError(f"trainer.micro_batch_layout={setting}: {why_not[setting]}; use "
                              "trainer.micro_batch_layout=padded (or auto)")
        return Layouts((setting,), setting)
    fits = tuple(layout for layout in ("packed", "shared_prompt") if not why_not[layout])
    if not fits:
        return Layouts(("padded",), f"padded ({why_not['packed']})")
    if len(fits) == 1:
        skipped = "shared_prompt" if fits == ("packed",) else "packed"
        return Layouts(fits, f"{fits[0]} (not {skipped}: {why_not[skipped]})")
    return Layouts(fits, "packed or shared-prompt rows, the cheaper for each mini-batch")


def balance_groups(costs: Sequence[tuple[float, float]], parts: int) -> list[int]:
    """The part (data-parallel rank) of each item of (tokens, attention pairs) ``costs``, dealt
    in rounds as round-robin dealing deals them (items ``j x parts`` to ``(j + 1) x parts - 1``
    one to each part, so a rank's j-th group, and with it each mini-batch's groups over the DP
    ranks, stay those of round robin), but within a round the costliest item to the part whose
    larger relative load (tokens or pairs, each over its mean per part) it raises least (ties:
    the lower part)."""
    n = len(costs)
    mean = [max(sum(c[j] for c in costs) / parts, 1e-30) for j in (0, 1)]
    load = [[0.0, 0.0] for _ in range(parts)]
    owner = [0] * n

    def weight(i: int) -> float:
        return costs[i][0] / mean[0] + costs[i][1] / mean[1]

    def after(p: int, i: int) -> float:
        return max((load[p][j] + costs[i][j]) / mean[j] for j in (0, 1))

    for start in range(0, n, parts):
        free = list(range(parts))
        for i in sorted(range(start, min(start + parts, n)), key=lambda i: (-weight(i), i)):
            p = min(free, key=lambda p: (after(p, i), p))
            free.remove(p)
            owner[i] = p
            load[p] = [load[p][j] + costs[i][j] for j in (0, 1)]
    return owner


def group_cost(lengths: Sequence[int]) -> tuple[float, float]:
    """(tokens, causal attention pairs) of a group's samples of these lengths."""
    return float(sum(lengths)), float(sum(n * n for n in lengths))


class SampleOrder:
    """The rows of a step's micro-batches ([B_k, R_k] tensors) as one [B, R] tensor in sample
    order, and back: the order in which the global Cov scope ranks and draws tokens, the same
    whichever micro-batches (layout, bins) hold the samples."""

    def __init__(self, mbs: Sequence[MicroBatch]) -> None:
        self.rows = sorted((sid, k, b) for k, mb in enumerate(mbs)
                           for b, sid in enumerate(mb.sample_ids))
        self.widths = [mb.mask.shape[1] for mb in mbs]
        self.width = max(self.widths, default=1)

    def join(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        """[B_k, R_k] per micro-batch -> [B, R] in sample order (zeros beyond a row's R_k)."""
        if not self.rows:
            return torch.zeros(0, self.width)
        return torch.stack([torch.nn.functional.pad(tensors[k][b], (0, self.width - self.widths[k]))
                            for _, k, b in self.rows])

    def split(self, joined: torch.Tensor) -> list[torch.Tensor]:
        """Inverse of ``join``."""
        out = [joined.new_zeros(len([r for r in self.rows if r[1] == k]), w)
               for k, w in enumerate(self.widths)]
        for i, (_, k, b) in enumerate(self.rows):
            out[k][b] = joined[i, :self.widths[k]]
        return out
