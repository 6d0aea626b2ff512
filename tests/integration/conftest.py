"""Fixtures the integration tests share."""

from __future__ import annotations

import pytest

from bridge_checks import hf_reference, tokens_for
from tiny_models import FAMILIES, save_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """family -> (HF folder, tokens, reference logits, reference tensors)."""
    out = {}
    for family in FAMILIES:
        hf_dir = save_tiny_hf_model(family, tmp_path_factory.mktemp(family))
        tokens = tokens_for(1000)
        out[family] = (hf_dir, tokens, *hf_reference(hf_dir, tokens))
    tied = save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("qwen2_tied"),
                              tie_word_embeddings=True)
    out["qwen2_tied"] = (tied, tokens_for(1000), *hf_reference(tied, tokens_for(1000)))
    return out
