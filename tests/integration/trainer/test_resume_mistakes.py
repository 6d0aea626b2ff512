"""Resume mistakes, met as a user meets them (`megatron-entropy train` in a fresh process): a
checkpoint of another model, one trained on other data, a damaged ``latest`` pointer. Each is
one line naming the checkpoint and what does not match, exit 2, before anything loads, and
nothing is written: a new run folder is not left behind, an existing one is as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from harness import init_megatron, run_distributed
from tiny_models import tiny_hf_config

from megatron_entropy.models.arch import ModelArch, arch_from_hf_config, load_arch

REPO = Path(__file__).resolve().parents[3]
MODEL = REPO / "examples" / "quickstart_model"


def _save(checkpoints: dict[str, tuple[dict, int]]) -> None:
    """Worker: for each run folder, a checkpoint at step 1 of the model of that architecture
    (ModelArch.to_dict) whose data position is for a dataset of that many prompts."""
    from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
    from megatron_entropy.data import PromptSampler
    from megatron_entropy.trainer.checkpoint import CheckpointManager
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    init_megatron()
    for run_dir, (arch, prompts) in checkpoints.items():
        arch = ModelArch.from_dict(arch)
        chunks = build_trainable_model(
            arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64),
            ParallelConfig())
        optimizer, _ = build_optimizer(chunks, TrainerConfig(lr=1e-2, steps=1))
        CheckpointManager(run_dir).save(
            1, chunks, optimizer, {"step": 1, "sampler": PromptSampler(prompts).state_dict()},
            arch, str(MODEL))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_resume_mistakes_are_one_line_and_write_nothing(tmp_path):
    runs = tmp_path / "runs"
    other = arch_from_hf_config(tiny_hf_config("qwen2"))
    run_distributed(_save, 1, {str(runs / "other_model"): (other.to_dict(), 20000),
                               str(runs / "other_data"): (load_arch(MODEL).to_dict(), 7)})
    damaged = runs / "damaged"  # the run's own folder: resumed from by default
    (damaged / "checkpoints").mkdir(parents=True)
    (damaged / "checkpoints" / "latest").write_bytes(b"\x80\xffstep\x00\x13")
    before = _files(runs)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({
        "model": {"hf_path": str(MODEL)},
        "logging": {"runs_dir": str(runs), "progress_bar": False}}))
    ckpt = runs / "{}" / "checkpoints" / "step_00000001"
    # (Run at once, each in a run folder of its own.)
    cases = {"other_model": (["trainer.resume=" + str(runs / "other_model"), "logging.name=a"],
                             f"checkpoint {str(ckpt).format('other_model')} holds another model "
                             f"than model.hf_path={MODEL}: vocab_size 1000 (the model's 321), "
                             "hidden_size 64 (the model's 128)"),
             "other_data": (["trainer.resume=" + str(runs / "other_data"), "logging.name=b"],
                            f"checkpoint {str(ckpt).format('other_data')}: the checkpoint's data "
                            "position is for a dataset of 7 prompts, this one has 20000: the "
                            "training data changed"),
             "damaged": (["logging.name=damaged"],
                         f"no intact checkpoint in {damaged / 'checkpoints'} to resume from: "
                         f"{damaged / 'checkpoints' / 'latest'} is damaged: it holds no "
                         "checkpoint name")}
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    started = {name: subprocess.Popen(
        [sys.executable, "-m", "megatron_entropy.cli", "train", str(tmp_path / "c.yaml"),
         *overrides], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for name, (overrides, _) in cases.items()}
    for name, run in started.items():
        _, err = run.communicate(timeout=600)
        lines = err.strip().splitlines()
        assert run.returncode == 2 and len(lines) == 1, (name, err[-3000:])
        assert lines[0].startswith(f"megatron-entropy train: error: {cases[name][1]}"), \
            (name, lines[0])
    assert _files(runs) == before  # a and b were not left behind; the others are as they were
