"""Prompt datasets, the arithmetic task, the resumable sampler and dynamic sampling."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_entropy.config import ArithmeticConfig, DataConfig
from megatron_entropy.data import (DEFAULT_PROMPT_SUFFIX, DatasetError, GroupFilter, PromptDataset,
                                   PromptSampler, arithmetic_rows, data_notes, generate_problems,
                                   load_prompt_dataset, load_tokenizer, read_rows, render_prompt,
                                   train_val_problems)
from megatron_entropy.data.dataset import encode_texts

QUICKSTART = Path(__file__).resolve().parents[3] / "examples" / "quickstart_model"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(QUICKSTART)


# ------------------------------------------------------------------------------ arithmetic


def test_arithmetic_answers_and_steps_are_correct():
    problems = generate_problems(400, 1, 4, 30, seed=3)
    assert {p.num_ops for p in problems} == {1, 2, 3, 4}
    for p in problems:
        expr = re.fullmatch(r"What is (.*)\?", p.question).group(1)
        assert int(p.answer) == eval(expr)  # Python's precedence is the reference
        *steps, last = p.solution.split("\n")
        assert last == f"\\boxed{{{p.answer}}}"
        assert len(steps) == p.num_ops
        for step in steps:  # every line is one correct binary operation
            lhs, rhs = step.split(" = ")
            assert eval(lhs) == int(rhs)
        assert p.source == f"arithmetic_{p.num_ops}op"


def test_arithmetic_is_deterministic_and_val_is_held_out():
    a = train_val_problems(3000, 200, 1, 2, 10, seed=5)
    b = train_val_problems(3000, 200, 1, 2, 10, seed=5)
    assert a == b
    train, val = a
    assert len(train) == 3000 and len(val) == 200
    assert not {p.question for p in train} & {p.question for p in val}
    assert train_val_problems(3000, 200, 1, 2, 10, seed=6)[0] != train
    # A smaller validation set is a prefix of a larger one: the quickstart model's pretraining
    # keeps the first 1024 out, so any data.arithmetic.num_val <= 1024 is held out.
    assert train_val_problems(10, 50, 1, 2, 10, seed=5)[1] == val[:50]
    with pytest.raises(ValueError, match="min_ops"):
        generate_problems(1, 3, 2, 10, seed=0)


def test_arithmetic_rows_follow_the_config():
    cfg = ArithmeticConfig(num_train=50, num_val=7, min_ops=2, max_ops=2, max_operand=9, seed=1)
    train, val = arithmetic_rows(cfg, "train"), arithmetic_rows(cfg, "val")
    assert len(train) == 50 and len(val) == 7
    assert {r.source for r in train + val} == {"arithmetic_2op"}
    assert all(isinstance(r.prompt, str) and r.answer.lstrip("-").isdigit() for r in train)


# ------------------------------------------------------------------------------ files


ROWS = [
    {"prompt": "What is 2 + 2?", "answer": "4", "data_source": "toy"},
    {"prompt": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 3 * 3?"}], "answer": 9},
    {"prompt": "Half of one?", "answer": "\\frac{1}{2}", "data_source": "toy"},
]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    return path


def test_jsonl_json_and_parquet_read_the_same(tmp_path):
    jsonl = read_rows(_write_jsonl(tmp_path / "d.jsonl", ROWS))
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    as_json = read_rows(tmp_path / "d.json")
    # Parquet wants one type per column: every prompt as messages, answers as strings.
    as_messages = [r["prompt"] if isinstance(r["prompt"], list)
                   else [{"role": "user", "content": r["prompt"]}] for r in ROWS]
    pq.write_table(pa.Table.from_pylist([
        {"prompt": m, "answer": str(r["answer"]), "data_source": r.get("data_source")}
        for m, r in zip(as_messages, ROWS)]), tmp_path / "d.parquet")
    parquet = read_rows(tmp_path / "d.parquet")
    assert [r.prompt for r in parquet] == as_messages
    for rows in (jsonl, as_json, parquet):
        if rows is not parquet:
            assert [r.prompt for r in rows] == [r["prompt"] for r in ROWS]
        assert [r.answer for r in rows] == ["4", "9", "\\frac{1}{2}"]
        assert [r.source for r in rows] == ["toy", "d", "toy"]  # missing source: file stem
    assert jsonl[1].where.endswith("d.jsonl:2") and parquet[2].where.endswith("d.parquet row 2")


def test_nested_keys_read_verl_style_rows(tmp_path):
    rows = [{"question": [{"role": "user", "content": "1+1?"}], "ability": "math",
             "reward_model": {"ground_truth": "2", "style": "rule"}, "src": "mini"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    (row,) = read_rows(tmp_path / "verl.parquet", prompt_key="question",
                       answer_key="reward_model.ground_truth", source_key="src")
    assert row.prompt == [{"role": "user", "content": "1+1?"}]
    assert (row.answer, row.source) == ("2", "mini")


@pytest.mark.parametrize("bad, match", [
    ({"prompt": "q"}, r"bad\.jsonl:3: row has no answer under 'answer' \(data.answer_key\)"),
    ({"prompt": "q", "answer": "  "}, r"bad\.jsonl:3: row has no answer"),
    ({"question": "q", "answer": "1"}, r"bad\.jsonl:3: row has no prompt under 'prompt'"),
    ({"prompt": [{"role": "user"}], "answer": "1"}, r"bad\.jsonl:3: 'prompt' is a list but not"),
    ({"prompt": 17, "answer": "1"}, r"bad\.jsonl:3: the prompt under 'prompt' \(data.prompt_key\) "
                                    r"is int 17, not text or a list of messages"),
])
def test_bad_rows_name_file_and_line(tmp_path, bad, match):
    path = _write_jsonl(tmp_path / "bad.jsonl", [ROWS[0], ROWS[2], bad])
    with pytest.raises(DatasetError, match=match):
        read_rows(path)


def test_bad_files(tmp_path):
    (tmp_path / "x.jsonl").write_text('{"prompt": "q", "answer": "1"}\n{not json\n')
    with pytest.raises(DatasetError, match=r"x\.jsonl:2: not valid JSON"):
        read_rows(tmp_path / "x.jsonl")
    with pytest.raises(DatasetError, match="does not exist"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "x.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match="unknown dataset format '.csv'"):
        read_rows(tmp_path / "x.csv")
    pq.write_table(pa.Table.from_pylist([{"prompt": "a", "answer": "1"},
                                         {"prompt": "b", "answer": None}]), tmp_path / "p.parquet")
    with pytest.raises(DatasetError, match=r"p\.parquet row 1: row has no answer"):
        read_rows(tmp_path / "p.parquet")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DatasetError, match="has no rows"):
        read_rows(tmp_path / "empty.jsonl")


# ------------------------------------------------------------------------------ rendering


def test_render_prompt_chat_template_and_suffix(tokenizer):
    text = render_prompt("What is 2 + 2?", tokenizer)
    assert text == ("<|im_start|>user\nWhat is 2 + 2? " + DEFAULT_PROMPT_SUFFIX +
                    "<|im_end|>\n<|im_start|>assistant\n")
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Q1"},
             {"role": "assistant", "content": "A1"}, {"role": "user", "content": "Q2"}]
    text = render_prompt(convo, tokenizer, suffix="Box it.")
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
                    "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2 Box it.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert convo[3]["content"] == "Q2"  # the caller's rows are not modified
    assert render_prompt("Q", tokenizer, apply_chat_template=False) == "Q " + DEFAULT_PROMPT_SUFFIX
    assert render_prompt("Q", tokenizer, apply_chat_template=False, suffix="") == "Q"


def test_render_prompt_errors(tokenizer):
    class NoTemplate:
        chat_template = None

    with pytest.raises(DatasetError, match="no chat template"):
        render_prompt("Q", NoTemplate())
    with pytest.raises(DatasetError, match="no user message"):
        render_prompt([{"role": "system", "content": "s"}], tokenizer)
    with pytest.raises(DatasetError, match="multi-message conversation needs"):
        render_prompt([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                      tokenizer, apply_chat_template=False)


def test_prompt_dataset_tokenises_and_handles_overlong(tokenizer, tmp_path):
    rows = read_rows(_write_jsonl(tmp_path / "d.jsonl", ROWS + [
        {"prompt": "What is " + " + ".join(["1"] * 60) + "?", "answer": "60"}]))
    full = PromptDataset.from_rows(rows, tokenizer, max_prompt_tokens=10_000)
    for item in full:
        assert item.prompt_ids == tokenizer(item.text, add_special_tokens=False)["input_ids"]
    lengths = [len(it.prompt_ids) for it in full]
    limit = max(lengths[:3])
    assert lengths[3] > limit
    dropped = PromptDataset.from_rows(rows, tokenizer, max_prompt_tokens=limit)
    assert [it.answer for it in dropped] == ["4", "9", "\\frac{1}{2}"]
    assert dropped.dropped_overlong == 1
    cut = PromptDataset.from_rows(rows, tokenizer, max_prompt_tokens=limit,
                                  overlong="truncate_left")
    assert cut[3].prompt_ids == full[3].prompt_ids[-limit:]
    with pytest.raises(DatasetError, match=r"d\.jsonl:4: prompt has \d+ tokens, more than "
                                           r"rollout.max_prompt_tokens"):
        PromptDataset.from_rows(rows, tokenizer, max_prompt_tokens=limit, overlong="error")
    assert full.sources == ["d", "toy"]
    notes, metrics = data_notes(dropped, full, 8, limit)
    assert notes == [f"data.overlong_prompts=drop: dropped 1 of 4 train prompts longer than "
                     f"rollout.max_prompt_tokens={limit}",
                     "data.prompts_per_step=8 is more than the 3 train prompts: each is drawn "
                     "about 2.7 times a step"]
    assert metrics == {"data/dropped_overlong": 1.0, "data/val_dropped_overlong": 0.0,
                       "data/prompt_repeats_per_step": 8 / 3}
    assert data_notes(full, full, 4, limit) == ([], {"data/dropped_overlong": 0.0,
                                                     "data/val_dropped_overlong": 0.0,
                                                     "data/prompt_repeats_per_step": 1.0})
    # Validation asked for, without validation prompts: said, not silently skipped.
    assert data_notes(full, PromptDataset([]), 4, limit, "trainer.val_interval=4")[0] == [
        "trainer.val_interval=4, but there are no validation prompts (data.train_files without "
        "data.val_files): no validation runs; set data.val_files"]
    assert data_notes(full, full, 4, limit, "trainer.val_interval=4")[0] == []


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_encode_texts_gives_the_tokenizers_ids(add_special_tokens):
    """The backend fast path and the fallbacks give what calling the tokenizer gives: with
    special tokens in the text, with a backend set to truncate (which the call turns off) and
    with special tokens split as text."""
    texts = [render_prompt(f"What is {i} * 3 - 40?", load_tokenizer(QUICKSTART))
             + "<|im_end|> héllo ½" * (i % 3) for i in range(20)]
    for setup in ("plain", "truncating backend", "split special tokens"):
        tok = load_tokenizer(QUICKSTART)
        if setup == "truncating backend":
            tok.backend_tokenizer.enable_truncation(max_length=4)
        if setup == "split special tokens":
            tok.split_special_tokens = True
        got = encode_texts(tok, texts, add_special_tokens)  # first: the call resets the backend
        expected = tok(texts, add_special_tokens=add_special_tokens)["input_ids"]
        assert max(len(ids) for ids in expected) > 4
        assert got == expected, setup


def test_bytes_that_are_not_utf8_name_file_and_line(tmp_path):
    good = json.dumps({"prompt": "1+1?", "answer": "2"}).encode() + b"\n"
    (tmp_path / "d.jsonl").write_bytes(good + b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(DatasetError, match=r"d\.jsonl:2: not UTF-8 text \(invalid "
                                           r"continuation byte at byte 16 of the line\)"):
        read_rows(tmp_path / "d.jsonl")
    (tmp_path / "d.json").write_bytes(b'[\n{"prompt": "caf\xe9", "answer": "1"}]')
    with pytest.raises(DatasetError, match=r"d\.json:2: not UTF-8 text"):
        read_rows(tmp_path / "d.json")


def test_load_prompt_dataset_synthetic_and_files(tokenizer, tmp_path):
    data = DataConfig(arithmetic=ArithmeticConfig(num_train=40, num_val=8))
    train = load_prompt_dataset(data, tokenizer, 512, "train")
    val = load_prompt_dataset(data, tokenizer, 512, "val")
    assert (len(train), len(val)) == (40, 8)
    assert set(train.sources) <= {"arithmetic_1op", "arithmetic_2op"}
    assert not {it.text for it in train} & {it.text for it in val}

    path = _write_jsonl(tmp_path / "t.jsonl", ROWS)
    files = DataConfig(train_files=[str(path), str(path)])
    assert len(load_prompt_dataset(files, tokenizer, 512, "train")) == 6
    assert len(load_prompt_dataset(files, tokenizer, 512, "val")) == 0
    missing = DataConfig(train_files=[str(tmp_path / "nope.parquet")])
    with pytest.raises(DatasetError, match=r"data.train_files: dataset file .*nope.parquet.* "
                                           "does not exist"):
        load_prompt_dataset(missing, tokenizer, 512, "train")


# ------------------------------------------------------------------------------ sampler


def test_sampler_epochs_are_permutations_and_request_sizes_do_not_matter():
    s = PromptSampler(7, shuffle=True, seed=3)
    pieces = [s.next_indices(k) for k in (3, 5, 1, 6)]  # 15 = two epochs and one more
    flat = [i for p in pieces for i in p]
    assert sorted(flat[:7]) == list(range(7)) and sorted(flat[7:14]) == list(range(7))
    assert flat[:7] != flat[7:14]  # each epoch has its own order
    assert PromptSampler(7, seed=3).next_indices(15) == flat
    assert PromptSampler(7, seed=4).next_indices(15) != flat
    assert PromptSampler(7, shuffle=False).next_indices(9) == [0, 1, 2, 3, 4, 5, 6, 0, 1]
    assert (s.epoch, s.position) == (2, 1)


def test_sampler_resumes_exactly():
    ref = PromptSampler(10, seed=11)
    ref.next_indices(13)
    state = json.loads(json.dumps(ref.state_dict()))  # what a checkpoint stores
    expected = ref.next_indices(25)
    resumed = PromptSampler(10, seed=999)  # the checkpoint's seed wins
    resumed.load_state_dict(state)
    assert resumed.next_indices(25) == expected
    with pytest.raises(ValueError, match="dataset of 10 prompts, this one has 11"):
        PromptSampler(11).load_state_dict(state)
    with pytest.raises(ValueError, match="empty"):
        PromptSampler(0)


# ------------------------------------------------------------------------------ dynamic sampling


def test_group_filter_drops_uniform_groups_and_refills():
    f = GroupFilter(target_groups=4, max_refill_rounds=2)
    assert f.prompts_needed() == 4
    f.add(["a", "b", "c", "d"], [[1, 1], [0, 1], [0, 0], [1, 0, 1]])
    assert f.kept == ["b", "d"] and not f.done
    assert f.prompts_needed() == 4  # deficit 2 at a keep rate of 1/2
    f.add(["e", "f", "g", "h"], [[1, 1], [1, 1], [1, 1], [0.5, 1]])
    assert f.kept == ["b", "d", "h"] and not f.done
    assert f.prompts_needed() == 3  # deficit 1 at 3/8 -> ceil(8/3)
    f.add(["i", "j", "k"], [[0, 1], [1, 0], [0, 0]])
    assert f.done and f.prompts_needed() == 0
    assert f.take() == ["b", "d", "h", "i"]  # the target, in arrival order
    m = f.metrics()
    assert m["data/kept_group_frac"] == pytest.approx(5 / 11)
    assert (m["data/sampling_rounds"], m["data/groups"]) == (3, 4)


def test_group_filter_gives_up_after_max_rounds_and_can_be_off():
    f = GroupFilter(target_groups=3, max_refill_rounds=1)
    f.add([1, 2, 3], [[0, 0]] * 3)
    assert not f.done and f.prompts_needed() == 3  # nothing kept yet: the whole target again
    f.add([4, 5, 6], [[1, 1], [0, 1], [1, 1]])
    assert f.done and f.take() == [5]
    off = GroupFilter(target_groups=2, max_refill_rounds=3, enabled=False)
    off.add(["x", "y"], [[1, 1], [0, 0]])
    assert off.done and off.take() == ["x", "y"]
    with pytest.raises(ValueError, match="2 groups but 1 reward lists"):
        off.add(["x", "y"], [[1, 1]])


def test_shipped_tokenizer_encodes_as_its_tokenizer_json(tokenizer):
    # transformers 5 rebuilds a qwen2 tokenizer's pipeline in code; the shipped tokenizer must
    # be one for which that changes nothing (the model was trained on these ids).
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(QUICKSTART / "tokenizer.json"))
    text = render_prompt("What is 12 * 3 - 40?", tokenizer) + "12 * 3 = 36\n\\boxed{-4} héllo ½"
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == raw.encode(text).ids
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.decode(raw.encode(text).ids) == text
