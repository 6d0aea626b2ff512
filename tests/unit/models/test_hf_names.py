"""The safetensors headers read without torch (models/hf_names.py): what safetensors itself
reads from the file, and a file whose data does not fit its header refused naming it."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_entropy.models.hf_names import safetensors_header


def test_the_header_is_what_safetensors_reads(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.zeros(3, 5), "b.bias": torch.ones(7, dtype=torch.bfloat16)},
              str(path), metadata={"format": "pt"})
    header = safetensors_header(path)
    with safe_open(str(path), "pt") as f:
        assert sorted(header) == sorted(f.keys())
        for name in f.keys():
            assert header[name]["shape"] == list(f.get_slice(name).get_shape())
    assert header["b.bias"]["dtype"] == "BF16"


@pytest.mark.parametrize("damage", ["one byte short", "one byte more", "header past the end"])
def test_a_file_its_header_does_not_fit_is_refused_naming_it(tmp_path, damage):
    path = tmp_path / "model.safetensors"
    save_file({"a.weight": torch.zeros(3, 5)}, str(path))
    data = path.read_bytes()
    if damage == "one byte short":
        data = data[:-1]
    elif damage == "one byte more":
        data += b"\0"
    else:
        data = struct.pack("<Q", len(data)) + data[8:]
    path.write_bytes(data)
    with pytest.raises(ValueError, match=f"{path} is not a complete safetensors file"):
        safetensors_header(path)
