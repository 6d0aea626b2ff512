"""Fixtures the server tests share."""

from __future__ import annotations

import pytest
import torch

from serving_model import make_served_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    import transformers

    root = tmp_path_factory.mktemp("sglang_models")
    a = make_served_model(root / "a", seed=0)
    b = make_served_model(root / "b", seed=1)
    load = lambda d: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
        d, local_files_only=True, dtype=torch.float32).eval()
    return {"a": a, "b": b, "model_a": load(a), "model_b": load(b)}
