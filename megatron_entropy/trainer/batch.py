"""Rollout samples and their packing into micro-batches for the Megatron model.

A sample is one response to one prompt. A micro-batch right-pads its samples to one length S and
keeps, for every response token, where in the flattened [B*S] input its prediction sits, so that
log-probs and entropies are computed for response tokens only and laid out as [B, R] (R = longest
response in the micro-batch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class Sample:
    prompt_ids: list[int]
    response_ids: list[int]
    engine_logprobs: list[float]
    reward: float
    group: int  # index of the prompt within the step; samples of one prompt share it
    source: str
    advantage: float = 0.0
    # Who generated it, for the weight check: the server's index (None: an in-process engine),
    # the weight version of all its tokens (None: unknown or several), and whether the engine's
    # log-probs are Completion.logprobs's (not renormalised over a top-p/top-k set).
    server: Optional[int] = None
    weight_version: Optional[str] = None
    exact_logprobs: bool = True
    # The engine's entropy of its sampling distribution at each response token, where it reports
    # one (the in-process engine); algorithm.old_logprobs=engine takes it as the step's entropy.
    engine_entropies: Optional[list[float]] = None
    # Per response token, filled by the actor's forward-only passes.
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    # Mixture of experts: the recompute's top-k experts of every token (prompt and response) in
    # each MoE layer of this pipeline stage, [layers, length, k] (trainer/moe_routing.py).
    routing: Optional[torch.Tensor] = None
    # The rollout engine's experts of every token in every MoE layer, [layers, length, k] (the
    # in-process engine's Completion.meta["routing"]); None where the engine does not say.
    engine_routing: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [B, S] long, right-padded
    position_ids: torch.Tensor  # [B, S]
    flat_positions: torch.Tensor  # [N] index into [B*S] of the logits predicting each response token
    targets: torch.Tensor  # [N] the response tokens
    rows: torch.Tensor  # [N] row b of each response token
    cols: torch.Tensor  # [N] column r (token index within the response)
    mask: torch.Tensor  # [B, R] float, 1 on response tokens
    advantages: torch.Tensor  # [B, R] the sequence's advantage on each of its tokens
    sample_ids: list[int]  # index of each row in the sample list it was packed from
    index: int = 0  # position in its list of micro-batches
    # [B, R] float: the actor's log-probs before the update and the reference model's (KL
    # penalty), from the samples' own; None when a sample lacks them.
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    # [B, R] float64: the engine's log-prob of each response token (rollout correction); None
    # when a sample has none for some token.
    engine_logprobs: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.targets.numel())

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N] per response token -> [B, R] (zeros elsewhere), differentiable."""
        out = values.new_zeros(self.mask.shape)
        return out.index_put((self.rows, self.cols), values)


def pack_micro_batches(samples: list[Sample], token_budget: int,
                       sample_ids: Optional[list[int]] = None, pad_id: int = 0) -> list[MicroBatch]:
    """Greedy, order-preserving packing: a micro-batch grows while rows x longest <= token_budget.

    A sample longer than the budget gets a micro-batch of its own.
    """
    ids = list(range(len(samples))) if sample_ids is None else sample_ids
    groups: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in ids:
        n = samples[i].length
        if current and (len(current) + 1) * max(longest, n) > token_budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return [_make_micro_batch(samples, g, pad_id, k) for k, g in enumerate(groups)]


def _make_micro_batch(samples: list[Sample], ids: list[int], pad_id: int, index: int
                      ) -> MicroBatch:
    rows_s = [samples[i] for i in ids]
    B = len(rows_s)
    S = max(s.length for s in rows_s)
    R = max(max(len(s.response_ids) for s in rows_s), 1)
    tokens = torch.full((B, S), pad_id, dtype=torch.long)
    mask = torch.zeros(B, R)
    adv = torch.zeros(B, R)
    flat, tgt, rr, cc = [], [], [], []
    for b, s in enumerate(rows_s):
        seq = s.prompt_ids + s.response_ids
        tokens[b, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        P, L = len(s.prompt_ids), len(s.response_ids)
        mask[b, :L] = 1.0
        adv[b, :L] = s.advantage
        # logits at position P-1+t predict response token t
        flat.extend(b * S + P - 1 + t for t in range(L))
        tgt.extend(s.response_ids)
        rr.extend([b] * L)
        cc.extend(range(L))
    mb = MicroBatch(
        tokens=tokens, position_ids=torch.arange(S).expand(B, S).contiguous(),
        flat_positions=torch.tensor(flat, dtype=torch.long),
        targets=torch.tensor(tgt, dtype=torch.long), rows=torch.tensor(rr, dtype=torch.long),
        cols=torch.tensor(cc, dtype=torch.long), mask=mask, advantages=adv, sample_ids=list(ids),
        index=index)
    mb.old_logprobs = _per_token(mb, [s.old_logprobs for s in rows_s])
    mb.ref_logprobs = _per_token(mb, [s.ref_logprobs for s in rows_s])
    if all(len(s.engine_logprobs) == len(s.response_ids) for s in rows_s):
        mb.engine_logprobs = mb.scatter(torch.tensor(
            [lp for s in rows_s for lp in s.engine_logprobs], dtype=torch.float64))
    return mb


def _per_token(mb: MicroBatch, values: list[Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """The rows' per-response-token values laid out [B, R]; None unless every row has them."""
    if any(v is None for v in values):
        return None
    return mb.scatter(torch.cat(values).float())


def to_device(mb: MicroBatch, device: torch.device) -> MicroBatch:
    if device.type == "cpu":
        return mb
    moved = {k: v.to(device, non_blocking=True) for k, v in vars(mb).items()
             if isinstance(v, torch.Tensor)}
    return MicroBatch(**{**vars(mb), **moved})
