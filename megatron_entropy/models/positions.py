"""Per-token positions for a Megatron GPTModel's rotary embedding.

GPTModel rotates every row of a batch by the same positions 0..S-1 (its ``position_ids`` feed a
learned position embedding only). A row of the shared-prompt layout (trainer/batch.py) holds one
prompt and several responses, each response at the positions it has in its own sample, so the
rotation has to follow ``position_ids`` token by token: ``token_positions(model, position_ids)``
makes the model's rotary embedding return, for each token, Megatron's own table entry at that
token's position ([S, rows, 1, dim] instead of [S, 1, 1, dim]; the rotation broadcasts over the
heads either way).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
from torch import Tensor

from megatron_entropy.models.sharding import unwrap_model


@contextmanager
def token_positions(model: torch.nn.Module, position_ids: Tensor) -> Iterator[None]:
    """Inside, ``model``'s forward rotates each token by its own ``position_ids`` [rows, S]."""
    gpt = unwrap_model(model)
    kind = getattr(gpt, "position_embedding_type", None)
    if kind == "learned_absolute":  # the embedding already takes position_ids
        yield
        return
    if kind != "rope":
        raise ValueError(f"per-token positions need a RoPE or learned position embedding; the "
                         f"model has {kind!r} (use trainer.micro_batch_layout=padded)")
    rope = gpt.rotary_pos_emb
    table_of = type(rope).forward

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False,
                cp_group=None) -> Tensor:
        table = table_of(rope, int(position_ids.max()) + 1)  # [positions, 1, 1, dim]
        return table[:, 0, 0][position_ids.to(table.device)].transpose(0, 1).unsqueeze(2)

    rope.forward = forward
    try:
        yield
    finally:
        del rope.forward
