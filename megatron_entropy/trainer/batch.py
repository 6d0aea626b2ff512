"""Rollout samples and their packing into micro-batches for the Megatron model.

A sample is one response to one prompt. A micro-batch keeps, for every response token, where in
the flattened [rows*S] input its prediction sits, so that log-probs and entropies are computed for
response tokens only and laid out as [B, R] (B samples, R = longest response in the micro-batch).
Two layouts of the input rows:

- ``padded``: a row per sample, prompt then response, right-padded to one length S; the
  model's own causal mask.
- ``shared_prompt``: a row per run of consecutive samples of one prompt: the prompt once, then
  each response; an explicit mask lets each response see the prompt and itself only, and each
  token keeps the position it has in its own sample (``position_ids``, for RoPE). The same
  function of each sample, with the prompt's forward (and backward) computed once for the run:
  with 8 samples of a 34-token prompt and ~21-token responses, ~0.4x the tokens. A response
  joins its prompt's row only while that pays: the prompt tokens it saves cost more in the
  linear layers than the row's longer attention adds (counted in full over the row, S^2 (query,
  key) pairs, since a masked kernel need not skip the hidden ones), so long responses to short
  prompts keep rows of their own.

The third, ``packed`` (samples back to back in one row, each attending to itself), is built by
trainer/packing.py on ``assemble_micro_batch``; context parallelism gives each rank its chunks
of the rows (trainer/context_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
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
    # Per response token: 1 where the policy generated it, 0 where it was inserted (a tool's
    # result and the chat template's tokens around it: Completion.loss_mask); None: all
    # generated. Inserted tokens are in no loss, token count, selection or statistic.
    loss_mask: Optional[list[int]] = None
    # Per response token, filled by the actor's forward-only passes.
    old_logprobs: Optional[torch.Tensor] = None
    ref_logprobs: Optional[torch.Tensor] = None
    entropy: Optional[torch.Tensor] = None
    # Vocab statistics some entropy methods read (trainer/step_methods.py), by name.
    token_stats: dict = field(default_factory=dict)
    # Mixture of experts: the recompute's top-k experts of every token (prompt and response) in
    # each MoE layer of this pipeline stage, [layers, length, k] (trainer/moe_routing.py).
    routing: Optional[torch.Tensor] = None
    # The rollout engine's experts of every token in every MoE layer, [layers, length, k] (the
    # in-process engine's Completion.meta["routing"]); None where the engine does not say.
    engine_routing: Optional[torch.Tensor] = None

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def generated(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [R] of the response tokens cut to the ones the policy generated."""
        if self.loss_mask is None:
            return values
        return values[torch.tensor(self.loss_mask, dtype=torch.bool, device=values.device)]


def engine_token_stats(s: Sample) -> tuple[torch.Tensor, torch.Tensor]:
    """The engine's (log-probs, entropies) [R] of a sample's response tokens, in fp32."""
    n = len(s.response_ids)
    if len(s.engine_logprobs) != n or s.engine_entropies is None or \
            len(s.engine_entropies) != n or not s.exact_logprobs:
        raise ValueError(f"algorithm.old_logprobs=engine needs the engine's log-prob and entropy "
                         f"of every response token under the full sampling distribution; a "
                         f"sample of {n} tokens has {len(s.engine_logprobs)} log-probs"
                         f"{'' if s.exact_logprobs else ' (renormalised by the server)'} and "
                         f"{'no' if s.engine_entropies is None else len(s.engine_entropies)} "
                         "entropies")
    return (torch.tensor(s.engine_logprobs, dtype=torch.float32),
            torch.tensor(s.engine_entropies, dtype=torch.float32))


@dataclass
class MicroBatch:
    tokens: torch.Tensor  # [rows, S] long, right-padded
    position_ids: torch.Tensor  # [rows, S] each token's position within its own sample
    # [N] index into [rows*S] of the logits predicting each response token
    flat_positions: torch.Tensor
    targets: torch.Tensor  # [N] the response tokens
    # (With context parallelism tokens, position_ids, flat_positions and targets are this CP
    # rank's part, and ``stat_owner`` says which CP rank computes each response token.)
    rows: torch.Tensor  # [N] sample b (of the B) of each response token
    cols: torch.Tensor  # [N] column r (token index within the response)
    mask: torch.Tensor  # [B, R] float, 1 on response tokens the policy generated
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
    # [rows, 1, S, S] bool, True where a query may not see a key (Megatron's convention); None:
    # the model's own causal mask (the padded layout).
    attention_mask: Optional[torch.Tensor] = None
    # The packed layout (one row): [n + 1] int32 bounds of its n sequences, real and padded
    # (each sequence padded to what context parallelism divides).
    cu_seqlens: Optional[torch.Tensor] = None
    cu_seqlens_padded: Optional[torch.Tensor] = None
    # Context parallelism: [N] the CP rank that computes each response token's statistics, and
    # [S / CP] the columns of the whole (CP-padded) rows that this rank's tokens are.
    stat_owner: Optional[torch.Tensor] = None
    cp_columns: Optional[torch.Tensor] = None
    # [rows, S] bool, True on padding (a row's right end, a packed sequence's divisibility
    # padding): a mixture of experts leaves it out of its router losses (Megatron's
    # ``padding_mask``). None: no padding (fillers).
    padding: Optional[torch.Tensor] = None

    @property
    def num_tokens(self) -> int:
        return int(self.rows.numel())

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """[N] per response token -> [B, R] (zeros elsewhere), differentiable."""
        out = values.new_zeros(self.mask.shape)
        return out.index_put((self.rows, self.cols), values)


def pack_micro_batches(samples: list[Sample], token_budget: int,
                       sample_ids: Optional[list[int]] = None, pad_id: int = 0,
                       layout: str = "padded", pairs_per_token: Optional[float] = None
                       ) -> list[MicroBatch]:
    """Greedy, order-preserving packing: a micro-batch grows while rows x longest row <=
    token_budget (``layout``: module docstring). A row longer than the budget gets a
    micro-batch of its own; a shared-prompt row takes another response while it stays within
    the budget (and always one) and, given ``pairs_per_token`` (the cost of one token through
    the linear layers in attention pairs), while that saves work."""
    ids = list(range(len(samples))) if sample_ids is None else sample_ids
    if layout == "padded":
        rows = [[i] for i in ids]
    elif layout == "shared_prompt":
        rows = _shared_prompt_rows(samples, ids, token_budget, pairs_per_token)
    else:
        raise ValueError(f"unknown micro-batch layout {layout!r} (padded, shared_prompt)")
    batches: list[list[list[int]]] = []
    current: list[list[int]] = []
    longest = 0
    for row in rows:
        n = _row_length(samples, row)
        if current and (len(current) + 1) * max(longest, n) > token_budget:
            batches.append(current)
            current, longest = [], 0
        current.append(row)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return [_make_micro_batch(samples, b, pad_id, k) for k, b in enumerate(batches)]


def _row_length(samples: list[Sample], row: list[int]) -> int:
    return len(samples[row[0]].prompt_ids) + sum(len(samples[i].response_ids) for i in row)


def _shared_prompt_rows(samples: list[Sample], ids: list[int], token_budget: int,
                        pairs_per_token: Optional[float]) -> list[list[int]]:
    """Runs of consecutive samples with the same prompt, each cut where it would pass the
    budget or stop paying."""
    rows: list[list[int]] = []
    for i in ids:
        s = samples[i]
        if rows and samples[rows[-1][0]].prompt_ids == s.prompt_ids:
            row, prompt, response = _row_length(samples, rows[-1]), len(s.prompt_ids), \
                len(s.response_ids)
            if row + response <= token_budget and (pairs_per_token is None or _pays(
                    row, prompt, response, pairs_per_token)):
                rows[-1].append(i)
                continue
        rows.append([i])
    return rows


def _pays(row: int, prompt: int, response: int, pairs_per_token: float) -> bool:
    """Whether a response costs less in a row of length ``row`` than in its own row: the
    prompt's tokens saved against the attention pairs added."""
    added_pairs = (row + response) ** 2 - row ** 2 - (prompt + response) ** 2
    return prompt * pairs_per_token >= added_pairs


def _make_micro_batch(samples: list[Sample], rows: list[list[int]], pad_id: int, index: int
                      ) -> MicroBatch:
    """A micro-batch of input rows, each the prompt of its samples once and their responses;
    a row of one sample is the padded layout's (no explicit mask)."""
    ids = [i for row in rows for i in row]
    S = max(_row_length(samples, row) for row in rows)
    # Built as lists and turned into tensors once: a small tensor operation per sample would
    # cost more than the work (each one can wake the other OpenMP threads).
    tokens, positions, segments, flat = [], [], [], []
    for g, row in enumerate(rows):
        prompt = samples[row[0]].prompt_ids
        P = len(prompt)
        row_tokens, row_positions, row_segments = list(prompt), list(range(P)), [0] * P
        for n, i in enumerate(row, start=1):
            response = samples[i].response_ids
            L = len(response)
            start = len(row_tokens)  # where this response begins in the row
            row_tokens.extend(response)
            row_positions.extend(range(P, P + L))
            row_segments.extend([n] * L)
            # response token t is predicted at the prompt's last token (t = 0), else at its
            # response's token t - 1
            flat.extend(g * S + (P - 1 if t == 0 else start + t - 1) for t in range(L))
        pad = S - len(row_tokens)
        tokens.append(row_tokens + [pad_id] * pad)
        positions.append(row_positions + list(range(len(row_tokens), S)))
        segments.append(row_segments + [-1] * pad)
    attention_mask = None
    if any(len(row) > 1 for row in rows):
        # A query sees the keys before it (and itself) of the prompt and of its own response;
        # padding sees itself only (a softmax row needs one key).
        seg = torch.tensor(segments)
        query, key = seg[:, :, None], seg[:, None, :]
        sees = ((key == 0) | (key == query)) & (query >= 0) & (key >= 0) & \
            torch.ones(S, S, dtype=torch.bool).tril()
        sees |= torch.eye(S, dtype=torch.bool)
        attention_mask = ~sees.unsqueeze(1)
    mb = assemble_micro_batch(samples, ids, tokens, positions, flat, index, attention_mask)
    mb.padding = torch.tensor(segments) < 0
    return mb


def assemble_micro_batch(samples: list[Sample], ids: list[int], tokens: list[list[int]],
                         positions: list[list[int]], flat: list[int], index: int,
                         attention_mask: Optional[torch.Tensor] = None) -> MicroBatch:
    """The micro-batch of input rows ``tokens`` (``positions`` each token's within its sample)
    whose response tokens, of the samples ``ids`` in order, are predicted at ``flat`` (indices
    into the flattened rows): the [B, R] layout of the response tokens and their values."""
    rows_s = [samples[i] for i in ids]
    lengths = [len(s.response_ids) for s in rows_s]
    R = max(max(lengths, default=0), 1)
    rows = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], dtype=torch.long)
    cols = torch.tensor([c for n in lengths for c in range(n)], dtype=torch.long)
    mask = (torch.arange(R)[None, :] < torch.tensor(lengths)[:, None]).float()
    if any(s.loss_mask is not None for s in rows_s):  # inserted tokens are no response tokens
        mask = mask.index_put((rows, cols), torch.tensor(
            [float(m) for s in rows_s for m in (s.loss_mask or [1] * len(s.response_ids))]))
    mb = MicroBatch(
        tokens=torch.tensor(tokens, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
        flat_positions=torch.tensor(flat, dtype=torch.long),
        targets=torch.tensor([t for s in rows_s for t in s.response_ids], dtype=torch.long),
        rows=rows, cols=cols, mask=mask,
        advantages=torch.where(mask > 0, torch.tensor([s.advantage for s in rows_s],
                                                      dtype=torch.float32)[:, None], 0.0),
        sample_ids=ids, index=index, attention_mask=attention_mask)
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
