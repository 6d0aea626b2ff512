"""Checkpoint conversion: HF -> Megatron dist checkpoint -> HF.

A converted checkpoint loads at TP=1, TP=2 and PP=2 and gives transformers' logits; the round trip
is bit-identical; the checkpoint has exactly the layout Megatron's own save writes; a trainer's
checkpoint (model + optimizer) exports the trained weights; bad inputs fail with one clear message.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest
import torch

from harness import init_megatron, run_distributed
from bridge_checks import LAYOUTS, S, check_results, load_and_run, run_conversions, tokens_for
from cli_modules import cli_modules
from tiny_models import FAMILIES, save_tiny_hf_model

from megatron_entropy.models.arch import load_arch

REPO = Path(__file__).resolve().parents[3]
FAMILY_NAMES = list(FAMILIES) + ["qwen2_tied"]


def _error_of(direction: str, src: Path, out: Path, kwargs: dict) -> str:
    """Worker: the message of the error one conversion raises ('' if it succeeds)."""
    try:
        run_conversions([(direction, src, out, kwargs)])
    except (OSError, KeyError, ValueError) as e:
        return f"{type(e).__name__}: {e.args[0] if isinstance(e, KeyError) else e}"
    return ""


@pytest.fixture(scope="module")
def converted(tiny_hf, tmp_path_factory):
    """family -> fp32 dist checkpoint of the tiny HF model."""
    root = tmp_path_factory.mktemp("mcore")
    jobs = [("to_mcore", tiny_hf[f][0], root / f, {}) for f in FAMILY_NAMES]
    run_distributed(run_conversions, 1, jobs)
    return {f: root / f for f in FAMILY_NAMES}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_converted_checkpoint_gives_transformers_logits(tiny_hf, converted, family, layout):
    hf_dir, tokens, ref_logits, ref_tensors = tiny_hf[family]
    tp, pp = LAYOUTS[layout]
    results = run_distributed(load_and_run, tp * pp, hf_dir, tp, pp, "ckpt", tokens,
                              ckpt_dir=converted[family])
    check_results(results, ref_logits, ref_tensors, load_arch(hf_dir))


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_round_trip_is_bit_identical(tiny_hf, converted, family, tmp_path):
    from safetensors.torch import load_file

    hf_dir = tiny_hf[family][0]
    [[stats]] = run_distributed(run_conversions, 1, [("to_hf", converted[family], tmp_path / "hf", {})])
    ref = load_file(hf_dir / "model.safetensors")
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert out.keys() == ref.keys()
    for name, t in ref.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    assert stats["tensors"] == len(ref)
    for meta in ("config.json", "generation_config.json"):
        assert json.loads((tmp_path / "hf" / meta).read_text()) == json.loads(
            (hf_dir / meta).read_text())
    arch = json.loads((converted[family] / "arch.json").read_text())
    assert arch == load_arch(hf_dir).to_dict()


def _megatron_save(hf_dir: Path, out: Path) -> None:
    """Worker: Megatron's own dist_checkpointing.save of the model loaded from HF."""
    from megatron.core import dist_checkpointing

    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.megatron_checkpoint import model_sharded_state_dict

    init_megatron()
    arch = load_arch(hf_dir)
    model = build_gpt_model(arch, dtype="fp32", transformer_impl="local", seq_length=64)
    load_hf_weights(model, hf_dir, arch)
    out.mkdir()
    dist_checkpointing.save(model_sharded_state_dict(model), str(out))


def _read_all(ckpt: Path) -> dict:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    tensors = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.items()
               if isinstance(v, TensorStorageMetadata)}
    dcp_load(tensors, checkpoint_id=str(ckpt), no_dist=True)
    return tensors


@pytest.mark.parametrize("family", ["qwen3", "qwen2_tied"])
def test_layout_equals_megatrons_own_save(tiny_hf, converted, family, tmp_path):
    """Same keys, global shapes, dtypes and chunks as dist_checkpointing.save writes for the model,
    the same common.pt and metadata.json, and the same tensor values."""
    from torch.distributed.checkpoint import FileSystemReader

    run_distributed(_megatron_save, 1, tiny_hf[family][0], tmp_path / "ref")
    ours = FileSystemReader(str(converted[family])).read_metadata().state_dict_metadata
    ref = FileSystemReader(str(tmp_path / "ref")).read_metadata().state_dict_metadata
    assert ours.keys() == ref.keys()
    for key, md in ref.items():
        if hasattr(md, "size"):
            assert ours[key].size == md.size and ours[key].properties.dtype == \
                md.properties.dtype, key
            assert sorted(map(str, ours[key].chunks)) == sorted(map(str, md.chunks)), key
    for name in ("common.pt", "metadata.json"):
        assert (converted[family] / name).read_bytes() == (tmp_path / "ref" / name).read_bytes()
    ours_t, ref_t = _read_all(converted[family]), _read_all(tmp_path / "ref")
    for key, t in ref_t.items():
        assert torch.equal(ours_t[key], t), key


def _train_and_save(hf_dir: Path, ckpt: Path):
    """Worker at TP=2: load HF weights into the trainer's model, take one optimizer step, save
    model + optimizer as the trainer does, return the exported (trained) weights."""
    from megatron.core import dist_checkpointing
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_entropy.models.bridge import export_hf_weights, load_hf_weights
    from megatron_entropy.models.megatron_checkpoint import (model_sharded_state_dict,
                                                             write_checkpoint_metadata)
    from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
    from megatron_entropy.trainer.model_setup import (build_optimizer, build_trainable_model,
                                                      optimizer_step)

    init_megatron(tensor=2)
    arch = load_arch(hf_dir)
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64),
        ParallelConfig(tensor=2))
    load_hf_weights(chunks, hf_dir, arch)
    optimizer, scheduler = build_optimizer(chunks, TrainerConfig(lr=1e-2, steps=1,
                                                                 weight_decay=0.0))
    tokens = tokens_for(1000)
    pos = torch.arange(S).expand_as(tokens)

    def step(data_iter, model):
        out = model(next(data_iter), pos, None, labels=torch.roll(tokens, -1, dims=1))
        return out, lambda ce: (ce.mean(), torch.tensor(1), {"loss": ce.mean().detach().clone()})

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]), model=chunks,
                                num_microbatches=1, seq_length=S, micro_batch_size=tokens.shape[0])
    assert optimizer_step(optimizer, scheduler, chunks)["update_successful"]
    exported = [(n, None if t is None else t.clone()) for n, t in export_hf_weights(chunks, arch)]
    model_sd = model_sharded_state_dict(chunks)
    dist_checkpointing.save({**model_sd, "optimizer": optimizer.sharded_state_dict(
        model_sd["model"])}, str(ckpt))
    if torch.distributed.get_rank() == 0:
        write_checkpoint_metadata(ckpt, arch, hf_dir)
    return exported


def test_trainer_checkpoint_exports_trained_weights(tiny_hf, tmp_path):
    from safetensors.torch import load_file

    hf_dir, _, _, original = tiny_hf["llama"]
    ckpt = tmp_path / "checkpoints" / "step_00000001"
    ckpt.mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text(ckpt.name)
    trained, _ = run_distributed(_train_and_save, 2, hf_dir, ckpt)
    # The trainer's checkpoints/ folder: its `latest` pointer names the checkpoint.
    run_distributed(run_conversions, 1, [("to_hf", tmp_path / "checkpoints", tmp_path / "hf", {})])
    out = load_file(tmp_path / "hf" / "model.safetensors")
    assert out.keys() == dict(trained).keys()
    changed = 0
    for name, t in trained:
        assert torch.equal(out[name], t), name
        changed += not torch.equal(t, original[name])
    assert changed >= len(out) // 2, "the step must move the weights, else the test proves little"


# ------------------------------------------------------------------------------------ bad input


def _bad_hf(kind: str, src: Path, root: Path) -> tuple[Path, dict]:
    """An HF folder (and conversion kwargs) broken in one way."""
    from safetensors.torch import load_file, save_file

    bad = root / kind
    shutil.copytree(src, bad)
    weights = bad / "model.safetensors"
    kwargs: dict = {}
    if kind in ("missing_shard", "partial_shard"):
        import transformers

        weights.unlink()
        model = transformers.AutoModelForCausalLM.from_pretrained(src)
        model.save_pretrained(bad, max_shard_size="300KB")
        shard = sorted(bad.glob("model-*.safetensors"))[1]
        if kind == "missing_shard":
            shard.unlink()
        else:
            os.truncate(shard, shard.stat().st_size // 2)
    elif kind == "missing_tensor":
        tensors = load_file(weights)
        del tensors["model.layers.1.mlp.down_proj.weight"]
        save_file(tensors, weights, metadata={"format": "pt"})
    elif kind == "extra_tensor":
        tensors = load_file(weights)
        tensors["model.layers.0.self_attn.o_proj.bias"] = torch.zeros(64)
        save_file(tensors, weights, metadata={"format": "pt"})
    elif kind == "unsupported_arch":
        cfg = json.loads((bad / "config.json").read_text())
        cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
        (bad / "config.json").write_text(json.dumps(cfg))
    elif kind == "wrong_shape":
        cfg = json.loads((bad / "config.json").read_text())
        cfg["intermediate_size"] = 256
        (bad / "config.json").write_text(json.dumps(cfg))
    elif kind == "fp16_overflow":
        tensors = load_file(weights)
        tensors["model.layers.0.mlp.up_proj.weight"][3, 5] = 1e6
        save_file(tensors, weights, metadata={"format": "pt"})
        kwargs = {"dtype": "fp16"}
    elif kind == "tp_does_not_divide":
        kwargs = {"tensor": 3}
    return bad, kwargs


HF_ERRORS = {
    "missing_shard": r"FileNotFoundError: .*index.json lists shards that do not exist",
    "partial_shard": r"ValueError: .*model-00002-of-.*\.safetensors is not a complete safetensors",
    "missing_tensor": r"KeyError: .*1 tensors of the LlamaForCausalLM model are missing from the "
                      r"checkpoint, e.g. \['model.layers.1.mlp.down_proj.weight'\]",
    "extra_tensor": r"KeyError: .*1 tensors have no place in the Megatron model, e.g. "
                    r"\['model.layers.0.self_attn.o_proj.bias'\]",
    "unsupported_arch": r"UnsupportedModelError: .*architecture \['GPT2LMHeadModel'\] is not "
                        r"supported; supported: Qwen2ForCausalLM, Qwen3ForCausalLM, "
                        r"LlamaForCausalLM, MistralForCausalLM",
    "wrong_shape": r"ValueError: model.layers.0.mlp.down_proj.weight has shape \(64, 128\), but "
                   r"config.json implies \(64, 256\)",
    "fp16_overflow": r"CheckpointError: model.layers.0.mlp.gate_proj.weight \+ "
                     r"model.layers.0.mlp.up_proj.weight: values up to 1e\+06 do not fit in "
                     r"torch.float16",
    "tp_does_not_divide": r"CheckpointError: --tp 3 --pp 1: .*does not divide the model's 4 "
                          r"attention heads, 2 query groups",
}


def test_bad_hf_inputs_fail_with_one_clear_message(tiny_hf, tmp_path):
    import re

    src = tiny_hf["llama"][0]
    for kind, pattern in HF_ERRORS.items():
        bad, kwargs = _bad_hf(kind, src, tmp_path)
        out = tmp_path / f"out_{kind}"
        (message,) = run_distributed(_error_of, 1, "to_mcore", bad, out, kwargs)
        assert re.search(pattern, message), f"{kind}: {message!r}"
        assert not out.exists() and not list(tmp_path.glob(f".out_{kind}.tmp-*")), \
            f"{kind}: a failed conversion must leave nothing behind"


def test_bad_checkpoint_inputs_fail_with_one_clear_message(tiny_hf, converted, tmp_path):
    import re

    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted["qwen2"], ckpt)

    def error(src, **kwargs):
        (message,) = run_distributed(_error_of, 1, "to_hf", src, tmp_path / "out", kwargs)
        return message

    # An output folder that holds something is refused unless overwrite is given.
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"old")
    assert re.search(r"out already exists and is not empty .* pass --overwrite", error(ckpt))
    assert error(ckpt, overwrite=True) == ""
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 3
    shutil.rmtree(tmp_path / "out")

    assert "is not a Megatron dist checkpoint (no metadata.json)" in error(tmp_path)
    other = tmp_path / "other"
    shutil.copytree(ckpt, other)
    (other / "arch.json").unlink()
    assert re.search(r"lacks 2 tensors of a Qwen3ForCausalLM model, e\.g\. "
                     r"\['decoder.layers.self_attention.q_layernorm.weight'",
                     error(other, hf_config_from=tiny_hf["qwen3"][0]))
    shutil.rmtree(other / "hf")
    assert "no config.json in" in error(other) and "--hf-config-from" in error(other)
    data = sorted(ckpt.glob("*.distcp"))[0]
    os.truncate(data, data.stat().st_size - 100)
    assert re.search(rf"data file {data.name} is truncated", error(ckpt))
    data.unlink()
    assert re.search(rf"data file {data.name} is missing", error(ckpt))


def test_hf_output_of_existing_folder_refused_and_overwritten(tiny_hf, converted, tmp_path):
    out = tmp_path / "mcore"
    src = tiny_hf["qwen2"][0]
    assert run_distributed(_error_of, 1, "to_mcore", src, out, {}) == [""]
    message, = run_distributed(_error_of, 1, "to_mcore", src, out, {})
    assert "already exists and is not empty" in message and "--overwrite" in message
    assert run_distributed(_error_of, 1, "to_mcore", src, out, {"overwrite": True}) == [""]
    assert (out / "metadata.json").is_file() and (out / "arch.json").is_file()


def _interrupted_conversion(src: Path, out: Path) -> int:
    """Worker: a conversion that gets SIGTERM while it writes; the tool's exit code."""
    import signal

    from megatron_entropy.models import conversion

    convert = conversion.hf_to_megatron

    def terminated(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return convert(*args, **kwargs)

    conversion.hf_to_megatron = terminated
    return conversion.run_conversion(
        lambda: conversion.convert_hf_to_checkpoint(src, out), str)


def test_interrupted_conversion_leaves_no_temporary_folder(tiny_hf, tmp_path, capfd):
    from megatron_entropy.models.hf_io import temp_sibling

    out = tmp_path / "mcore"
    assert run_distributed(_interrupted_conversion, 1, tiny_hf["qwen2"][0], out) == [130]
    assert "megatron-entropy convert: interrupted: the partial output was removed" in \
        capfd.readouterr().err
    assert list(tmp_path.iterdir()) == []
    # A writer killed outright (-9) cannot clean up: the next writer of that folder removes its
    # temporary folder, and leaves a live writer's alone.
    dead = subprocess.Popen(["true"])
    dead.wait()
    killed = tmp_path / f".mcore.tmp-{dead.pid}-x1"
    live = tmp_path / f".mcore.tmp-{os.getpid()}-x2"
    for folder in (killed, live):
        folder.mkdir()
        (folder / "common.pt").write_bytes(b"partial")
    fresh = temp_sibling(out)
    assert sorted(tmp_path.iterdir()) == sorted([live, fresh])


# ------------------------------------------------------------------------------------------ CLI


def _tool(name: str, *args: str, env: Optional[dict] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tools" / name), *args, "--quiet"],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=env)


@pytest.mark.slow
def test_tools_run_with_any_accepted_megatron_without_the_cpu_layer(tmp_path):
    """The tools hide the GPUs, so on a GPU cluster they run where the CPU compatibility layer
    would apply; conversion needs none of it, and the layer refuses any megatron-core but the
    one it was written for. Under a megatron-core that reports 0.17.0 (the package metadata accepts it) both
    tools convert, and the round trip is bit-identical."""
    from safetensors.torch import load_file

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import megatron.core\n"
                                           "megatron.core.__version__ = '0.17.0'\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    check = subprocess.run([sys.executable, "-c", "from megatron_entropy.runtime import "
                            "cpu_compat; cpu_compat.apply()"], capture_output=True, text=True,
                           env=env, timeout=300)
    assert "but 0.17.0 is installed" in check.stderr  # the layer would refuse this version
    src = save_tiny_hf_model("llama", tmp_path / "src")
    done = _tool("convert_hf_to_mcore.py", "--hf-dir", str(src), "--out", str(tmp_path / "ckpt"),
                 env=env)
    assert done.returncode == 0, done.stderr
    done = _tool("convert_mcore_to_hf.py", "--ckpt", str(tmp_path / "ckpt"), "--out",
                 str(tmp_path / "out"), env=env)
    assert done.returncode == 0, done.stderr
    ref, out = load_file(src / "model.safetensors"), load_file(tmp_path / "out" /
                                                              "model.safetensors")
    assert out.keys() == ref.keys()
    assert all(torch.equal(out[name], t) for name, t in ref.items())


def test_the_commands_errors_are_one_line_naming_the_command(tmp_path):
    """A missing input folder is refused in one line before torch (and Megatron) load."""
    missing = tmp_path / "missing"
    for args, line in (
            (["mcore-to-hf", "--ckpt", str(missing)], f"{missing} does not exist"),
            (["hf-to-mcore", "--hf-dir", str(missing)], f"--hf-dir: '{missing}' does not exist")):
        loaded, err = cli_modules("convert", *args, "--out", str(tmp_path / "out"), code=2)
        assert err == [f"megatron-entropy convert: error: {line}"]
        assert "torch" not in loaded
    assert not (tmp_path / "out").exists()


def _cli_exit_and_stderr(argv: list[str]) -> tuple[int, str]:
    """Worker: ``megatron-entropy ARGV`` (what the tools run), its exit code and stderr."""
    import contextlib
    import io

    from megatron_entropy.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


@pytest.mark.slow
def test_cli_round_trip_bf16_sharded_loads_in_transformers(tmp_path):
    """Both tools as a user runs them: bf16 at --tp 2, exported as several shards with an index;
    transformers loads the result and computes what the bf16 source computes."""
    import transformers

    src = save_tiny_hf_model("qwen3", tmp_path / "src")
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    done = _tool("convert_hf_to_mcore.py", "--hf-dir", str(src), "--out", str(ckpt), "--tp", "2",
                 "--pp", "2", "--dtype", "bf16")
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr  # megatron-core's notes train hides
    assert "wrote 21 tensors" in done.stdout
    # (the tool's own command, in a worker forked from here: no second interpreter start-up)
    (refused,) = run_distributed(_cli_exit_and_stderr, 1, ["convert", "hf-to-mcore", "--hf-dir",
                                                          str(src), "--out", str(ckpt)])
    assert refused[0] == 2 and "pass --overwrite" in refused[1], refused
    done = _tool("convert_mcore_to_hf.py", "--ckpt", str(ckpt), "--out", str(out),
                 "--max-shard-size", "200KB")
    assert done.returncode == 0, done.stderr
    assert "wrote 25 tensors" in done.stdout
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tokens = tokens_for(1000)
    ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    got = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert got.dtype == torch.bfloat16
    ref_sd = ref.state_dict()
    for name, t in got.state_dict().items():
        assert torch.equal(t, ref_sd[name]), name
    with torch.no_grad():
        assert torch.equal(got(tokens).logits, ref(tokens).logits)
