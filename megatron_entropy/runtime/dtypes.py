"""The one table of floating-point dtypes: the config's spelling (``fp32``, ``bf16``, ``fp16``),
the long name torch, Hugging Face's config.json and the servers' ``--dtype`` use (``float32``,
...), the bytes of an element and the unit roundoff. Standard library only, so the config and
``plan`` load it without torch; a torch dtype is ``getattr(torch, long_name(name))``."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal, Optional

DtypeName = Literal["fp32", "bf16", "fp16"]


@dataclass(frozen=True)
class Dtype:
    name: str           # the config's spelling
    long_name: str      # torch's attribute, config.json's "dtype", a server's --dtype
    bytes: int
    unit_roundoff: float  # half an ulp at 1


DTYPES = {d.name: d for d in (Dtype("fp32", "float32", 4, 2.0**-24),
                              Dtype("bf16", "bfloat16", 2, 2.0**-8),
                              Dtype("fp16", "float16", 2, 2.0**-11))}
assert tuple(DTYPES) == typing.get_args(DtypeName)
# The long names, accepted in configs as another spelling of the short ones (run folders'
# config.yaml from before the one spelling say rollout.server.dtype: bfloat16).
DTYPE_ALIASES = {d.long_name: d.name for d in DTYPES.values()}


def long_name(name: str) -> str:
    """``"bf16"`` -> ``"bfloat16"``; anything else (a server's ``"auto"``) stays."""
    return DTYPES[name].long_name if name in DTYPES else name


def name_of_long(long: object) -> Optional[str]:
    """config.json's ``"bfloat16"`` -> ``"bf16"``; None if absent or unknown."""
    return DTYPE_ALIASES.get(str(long))
