"""Prompt datasets: rows from jsonl / json / parquet files or the synthetic arithmetic task,
rendered with the tokenizer's chat template and the paper's ``\\boxed{}`` instruction, tokenised.

A row needs a prompt (a string, or a list of chat messages ``{"role", "content"}``) and a ground
truth answer; its data source is optional (default: the file's stem). Keys are given by
``data.prompt_key``, ``data.answer_key`` and ``data.source_key``; a dotted key reaches into nested
fields, so verl-style files work as they are (``data.answer_key=reward_model.ground_truth``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Sequence, Union

import pyarrow.parquet as pq
from transformers import AutoTokenizer

from megatron_entropy.config import (ArithmeticConfig, ChainsConfig, DataConfig, HintedConfig,
                                     SumsConfig)
from megatron_entropy.data.arithmetic import train_val_problems
from megatron_entropy.data.chains import chain_splits
from megatron_entropy.data.hinted import hinted_splits
from megatron_entropy.data.sums import train_val_sum_problems
from megatron_entropy.models.tokenizer_files import tokenizer_problem
from megatron_entropy.runtime.files import relative_note

# Both splits come from one generation (the validation problems are drawn apart from the
# training ones): a run that loads its train and val splits generates them once.
_train_val_problems = functools.lru_cache(maxsize=2)(train_val_problems)
_train_val_sum_problems = functools.lru_cache(maxsize=2)(train_val_sum_problems)

# The instruction appended to every question in the paper's training data (verl / PRIME format).
DEFAULT_PROMPT_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."

Prompt = Union[str, list[dict]]
OverlongPolicy = Literal["drop", "truncate_left", "error"]


class DatasetError(ValueError):
    """A dataset file or row that cannot be used; the message names the file and the row."""


@dataclass(frozen=True)
class PromptRow:
    prompt: Prompt
    answer: str
    source: str
    where: str  # "file.jsonl:12" (line) or "file.parquet row 11", for error messages


@dataclass(frozen=True)
class PromptItem:
    prompt_ids: list[int]
    answer: str
    source: str
    text: str  # the rendered prompt (chat template + suffix) that prompt_ids encode


# ------------------------------------------------------------------------------------- reading


def _lookup(record: Any, dotted: str) -> Any:
    node = record
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _iter_records(path: Path) -> Iterator[tuple[str, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DatasetError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte "
                                       f"{e.start + 1} of the line)") from None
                if not line.strip():
                    continue
                try:
                    yield f"{path}:{lineno}", json.loads(line)
                except json.JSONDecodeError as e:
                    raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
    elif suffix == ".json":
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise DatasetError(f"{path}:{line}: not UTF-8 text ({e.reason})") from None
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(records, list):
            raise DatasetError(f"{path}: a .json dataset must hold a list of rows")
        for i, record in enumerate(records):
            yield f"{path} row {i}", record
    elif suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a bad file
            raise DatasetError(f"{path}: cannot read parquet ({e})") from None
        for i, record in enumerate(table.to_pylist()):
            yield f"{path} row {i}", record
    else:
        raise DatasetError(f"{path}: unknown dataset format {path.suffix!r}; "
                           "use .jsonl, .json or .parquet")


def _check_messages(messages: list, where: str, key: str) -> list[dict]:
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DatasetError(f"{where}: {key!r} is a list but not of chat messages "
                               f"{{'role': str, 'content': str}}: {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def read_rows(path: Union[str, Path], prompt_key: str = "prompt", answer_key: str = "answer",
              source_key: str = "data_source") -> list[PromptRow]:
    """All rows of one file; a row without a prompt or an answer raises naming file and row."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"dataset file {str(path)!r} does not exist{relative_note(path)}")
    rows = []
    for where, record in _iter_records(path):
        if not isinstance(record, dict):
            raise DatasetError(f"{where}: a row must be an object, got {type(record).__name__}")
        prompt = _lookup(record, prompt_key)
        if isinstance(prompt, list):
            prompt = _check_messages(prompt, where, prompt_key)
        if prompt is not None and not isinstance(prompt, (str, list)):
            raise DatasetError(f"{where}: the prompt under {prompt_key!r} (data.prompt_key) is "
                               f"{type(prompt).__name__} {prompt!r}, not text or a list of "
                               "messages")
        if not prompt:
            raise DatasetError(f"{where}: row has no prompt under {prompt_key!r} "
                               f"(data.prompt_key); its keys are {sorted(record)}")
        answer = _lookup(record, answer_key)
        if answer is None or (isinstance(answer, str) and not answer.strip()):
            raise DatasetError(f"{where}: row has no answer under {answer_key!r} "
                               f"(data.answer_key); its keys are {sorted(record)}")
        source = _lookup(record, source_key)
        rows.append(PromptRow(prompt=prompt, answer=str(answer).strip(),
                              source=str(source) if source not in (None, "") else path.stem,
                              where=where))
    if not rows:
        raise DatasetError(f"dataset file {str(path)!r} has no rows")
    return rows


def arithmetic_rows(cfg: ArithmeticConfig, split: Literal["train", "val"]) -> list[PromptRow]:
    train, val = _train_val_problems(cfg.num_train, cfg.num_val, cfg.min_ops, cfg.max_ops,
                                    cfg.max_operand, cfg.seed)
    problems = train if split == "train" else val
    return [PromptRow(prompt=p.question, answer=p.answer, source=p.source,
                      where=f"arithmetic {split} problem {i}") for i, p in enumerate(problems)]


def sums_rows(cfg: SumsConfig, split: Literal["train", "val"]) -> list[PromptRow]:
    train, val = _train_val_sum_problems(cfg.num_train, cfg.num_val, cfg.min_terms, cfg.max_terms,
                                        cfg.max_operand, cfg.seed, cfg.subtract_prob)
    problems = train if split == "train" else val
    return [PromptRow(prompt=p.question, answer=p.answer, source=p.source,
                      where=f"sums {split} problem {i}") for i, p in enumerate(problems)]


def chains_rows(cfg: ChainsConfig, split: Literal["train", "val", "test"]) -> list[PromptRow]:
    # The test split is always drawn: training skips its chains.
    problems = chain_splits(cfg, cfg.num_train if split == "train" else 0, cfg.num_test)[split]
    return [PromptRow(prompt=p.question, answer=p.answer, source=p.source,
                      where=f"chains {split} problem {i}") for i, p in enumerate(problems)]


def hinted_rows(cfg: HintedConfig, split: Literal["train", "val", "test"]) -> list[PromptRow]:
    problems = hinted_splits(cfg.num_train if split == "train" else 0, cfg.num_val,
                             cfg.num_test if split == "test" else 0, cfg.min_terms,
                             cfg.max_terms, cfg.max_operand, cfg.guess_right, cfg.seed,
                             cfg.guess_error)[split]
    return [PromptRow(prompt=p.question, answer=p.answer, source=p.source,
                      where=f"hinted {split} problem {i}") for i, p in enumerate(problems)]


# ------------------------------------------------------------------------------------- rendering


def resolve_suffix(prompt_suffix: str) -> str:
    return DEFAULT_PROMPT_SUFFIX if prompt_suffix == "default" else prompt_suffix


def render_prompt(prompt: Prompt, tokenizer: Any, apply_chat_template: bool = True,
                  suffix: str = DEFAULT_PROMPT_SUFFIX, tools: Optional[list[dict]] = None) -> str:
    """The prompt text the policy sees: the question with ``suffix`` appended (to the last user
    message of a conversation), in the tokenizer's chat template with the assistant turn opened
    (and ``tools``, the tools the policy may call, listed as the template lists them)."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        messages = [dict(m) for m in prompt]
    if suffix:
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        if not users:
            raise DatasetError(f"conversation has no user message to append the suffix to: "
                               f"{prompt!r}")
        last = messages[users[-1]]
        last["content"] = f"{last['content']} {suffix}" if last["content"] else suffix
    if apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DatasetError("data.apply_chat_template=true but the tokenizer has no chat "
                               "template; set data.apply_chat_template=false for plain text")
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **({"tools": tools} if tools else {}))
    if len(messages) != 1:
        raise DatasetError("a multi-message conversation needs data.apply_chat_template=true")
    return messages[0]["content"]


def encode_texts(tokenizer: Any, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
    """``tokenizer(texts, add_special_tokens=...)["input_ids"]``. A fast tokenizer's Rust
    backend is called directly when it is set up as that call would set it (no truncation or
    padding, the same special-token splitting): the same ids without the per-text Python that
    builds the full encodings, half the time of a 20000-prompt dataset."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(
        tokenizer, "is_fast", False) else None
    if (backend is None or backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != bool(getattr(tokenizer, "split_special_tokens",
                                                             False))):
        return tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"]
    return [e.ids for e in backend.encode_batch(texts, add_special_tokens=add_special_tokens)]


class PromptDataset(Sequence[PromptItem]):
    """Tokenised prompts with their answers and sources, in file order."""

    def __init__(self, items: list[PromptItem], dropped_overlong: int = 0):
        self.items = items
        self.dropped_overlong = dropped_overlong

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i):  # type: ignore[override]
        return self.items[i]

    @property
    def sources(self) -> list[str]:
        return sorted({it.source for it in self.items})

    @classmethod
    def from_rows(cls, rows: Sequence[PromptRow], tokenizer: Any, *, max_prompt_tokens: int,
                  apply_chat_template: bool = True, prompt_suffix: str = "default",
                  overlong: OverlongPolicy = "drop", tools: Optional[list[dict]] = None
                  ) -> "PromptDataset":
        suffix = resolve_suffix(prompt_suffix)
        texts = [render_prompt(r.prompt, tokenizer, apply_chat_template, suffix, tools)
                 for r in rows]
        # A chat template writes its own special tokens (BOS included); plain text gets the
        # tokenizer's defaults.
        encoded = encode_texts(tokenizer, texts, add_special_tokens=not apply_chat_template)
        items, dropped = [], 0
        for row, text, ids in zip(rows, texts, encoded):
            if len(ids) > max_prompt_tokens:
                if overlong == "error":
                    raise DatasetError(f"{row.where}: prompt has {len(ids)} tokens, more than "
                                       f"rollout.max_prompt_tokens={max_prompt_tokens}")
                if overlong == "drop":
                    dropped += 1
                    continue
                ids = ids[-max_prompt_tokens:]
            items.append(PromptItem(prompt_ids=list(ids), answer=row.answer, source=row.source,
                                    text=text))
        if rows and not items:
            raise DatasetError(f"every one of the {len(rows)} prompts is longer than "
                               f"rollout.max_prompt_tokens={max_prompt_tokens}")
        return cls(items, dropped_overlong=dropped)


def load_tokenizer(hf_dir: Union[str, Path]) -> Any:
    """The tokenizer of an HF model folder, offline; DatasetError naming the missing file where
    the folder has none (transformers would build an empty one)."""
    problem = tokenizer_problem(hf_dir)
    if problem:
        raise DatasetError(problem)
    return AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)


def load_prompt_dataset(data: DataConfig, tokenizer: Any, max_prompt_tokens: int,
                        split: Literal["train", "val", "test"],
                        tools: Optional[list[dict]] = None) -> PromptDataset:
    """The train, validation or test prompts of a run. No ``data.train_files`` means the
    synthetic task ``data.task`` (train and validation; test: data.task hinted, and chains
    with data.chains.num_test); real
    training files without ``data.val_files`` mean no validation set (an empty dataset).
    ``tools``: the tools the chat template lists in each prompt."""
    problem = data.split_problem(split)
    if problem:
        raise DatasetError(problem)
    files = data.train_files if split == "train" else data.val_files
    if split == "test":
        rows = (chains_rows(data.chains, "test") if data.task == "chains"
                else hinted_rows(data.hinted, "test"))
    elif files:
        rows: list[PromptRow] = []
        for f in files:
            try:
                rows += read_rows(f, data.prompt_key, data.answer_key, data.source_key)
            except DatasetError as e:
                if not Path(f).is_file():
                    raise DatasetError(f"data.{split}_files: {e}") from None
                raise
    elif split == "val" and data.train_files:
        return PromptDataset([])
    elif data.task == "sums":
        rows = sums_rows(data.sums, split)
    elif data.task == "hinted":
        rows = hinted_rows(data.hinted, split)
    elif data.task == "chains":
        rows = chains_rows(data.chains, split)
    else:
        rows = arithmetic_rows(data.arithmetic, split)
    return PromptDataset.from_rows(rows, tokenizer, max_prompt_tokens=max_prompt_tokens,
                                   apply_chat_template=data.apply_chat_template,
                                   prompt_suffix=data.prompt_suffix,
                                   overlong=data.overlong_prompts, tools=tools)


def data_notes(train: PromptDataset, val: PromptDataset, prompts_per_step: int,
               max_prompt_tokens: int, validation_asked: str = ""
               ) -> tuple[list[str], dict[str, float]]:
    """What the data settings change without an error: warnings for the console, and the
    metrics that record it (``data/dropped_overlong``, ``data/val_dropped_overlong``,
    ``data/prompt_repeats_per_step``: how often one prompt is drawn in a step).
    ``validation_asked``: the setting that asks for validation (``trainer.val_interval=4``), if
    one does; with no validation prompt it is said that none will run."""
    notes = []
    if validation_asked and not len(val):
        notes.append(f"{validation_asked}, but there are no validation prompts (data.train_files "
                     "without data.val_files): no validation runs; set data.val_files")
    for name, ds in (("train", train), ("validation", val)):
        if ds.dropped_overlong:
            notes.append(f"data.overlong_prompts=drop: dropped {ds.dropped_overlong} of "
                         f"{ds.dropped_overlong + len(ds)} {name} prompts longer than "
                         f"rollout.max_prompt_tokens={max_prompt_tokens}")
    repeats = max(prompts_per_step / len(train), 1.0) if len(train) else 0.0
    if repeats > 1:
        notes.append(f"data.prompts_per_step={prompts_per_step} is more than the {len(train)} "
                     f"train prompts: each is drawn about {repeats:.1f} times a step")
    return notes, {"data/dropped_overlong": float(train.dropped_overlong),
                   "data/val_dropped_overlong": float(val.dropped_overlong),
                   "data/prompt_repeats_per_step": repeats}
