"""The ``eval`` config section: what ``megatron-entropy eval`` measures and how it samples."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_entropy.settings import SettingError, Settings
from megatron_entropy.settings import setting as _f


@dataclass
class EvalConfig(Settings):
    """The paper's protocol by default: n samples per problem at temperature 0.6, top-p 0.95,
    plus one greedy answer."""

    split: Literal["test", "val"] = _f("test", help="test: the task's held-out test split (or "
                                                    "eval.files); val: the validation split")
    files: list[str] = _f(default_factory=list, help="jsonl/parquet test files (data.*_key "
                                                     "name their fields); replace the split")
    n_samples: int = _f(16, ge=1, help="samples per problem: pass@k for k = 1, 2, 4, ... n")
    temperature: float = _f(0.6, gt=0, help="of the n samples")
    top_p: float = _f(0.95, gt=0, le=1, help="nucleus sampling of the n samples")
    greedy: bool = _f(True, help="also one greedy answer per problem (pass@1 greedy)")
    max_new_tokens: int = _f(0, ge=0, help="0 = rollout.max_new_tokens")
    num_problems: int = _f(0, ge=0, help="the first N problems of the split; 0 = all")
    seed: int = _f(0, help="sampling seed of the n samples")

    def validate(self) -> None:
        super().validate()
        if self.split == "val" and self.files:
            raise SettingError("files", "test files replace the test split: leave eval.split "
                                        "at test")
