"""A LoRA run's checkpoint leaves Megatron the way a user runs it (``megatron-entropy convert``
in a fresh process): as a PEFT adapter folder that ``peft`` loads onto the HF base, and merged
into the base as an HF folder; both give the trainer's log-probs up to rounding."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bridge_checks import tokens_for
from harness import run_distributed
from lora_checks import lora_terms, random_adapters_worker, save_lora_checkpoint_worker
from tiny_models import save_tiny_hf_model
from tolerance import logprob_tol

from megatron_entropy.models.arch import load_arch


def _convert(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "convert", *args],
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(HF base, a LoRA checkpoint saved at TP=2 with random adapters, the trainer's logits)."""
    root = tmp_path_factory.mktemp("lora_export")
    hf_dir = save_tiny_hf_model("qwen2", root / "base")
    (adapters,) = run_distributed(random_adapters_worker, 1, hf_dir)
    tokens = tokens_for(1000)
    logits = run_distributed(save_lora_checkpoint_worker, 2, hf_dir, adapters, root / "run", 2,
                             tokens)[0]
    return hf_dir, root / "run" / "checkpoints", tokens, logits


def _logprobs(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.log_softmax(logits[..., :vocab].double(), -1).float()


def _check(logits: torch.Tensor, trainer_logits: torch.Tensor, arch, tokens) -> None:
    want = _logprobs(trainer_logits, arch.vocab_size)
    got = _logprobs(logits, arch.vocab_size)
    tol = logprob_tol(trainer_logits, want, lora_terms(arch, tokens.shape[1], log_softmax=True))
    torch.testing.assert_close(got, want, rtol=0, atol=tol)


def test_peft_export_gives_the_trainers_logprobs(lora_run, tmp_path):
    import transformers
    from peft import PeftModel

    hf_dir, ckpts, tokens, trainer_logits = lora_run
    out = tmp_path / "peft"
    done = _convert("mcore-to-peft", "--ckpt", str(ckpts), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json",
                                                     "adapter_model.safetensors"]
    base = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        plain = base(tokens).logits
    model = PeftModel.from_pretrained(base, out)
    with torch.no_grad():
        logits = model(tokens).logits
    arch = load_arch(hf_dir)
    _check(logits, trainer_logits, arch, tokens)
    # The adapters matter: without them the base is far from the trainer's policy.
    assert (_logprobs(plain, arch.vocab_size) - _logprobs(trainer_logits, arch.vocab_size)
            ).abs().max() > 0.1


def test_merged_export_equals_the_adapter_forward(lora_run, tmp_path):
    import transformers

    hf_dir, ckpts, tokens, trainer_logits = lora_run
    out = tmp_path / "merged"
    done = _convert("mcore-to-hf", "--ckpt", str(ckpts), "--out", str(out))
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens).logits
    _check(logits, trainer_logits, load_arch(hf_dir), tokens)


def _eval_model_logits(ckpts, scratch, tokens) -> torch.Tensor:
    """Worker: the logits of the HF folder `megatron-entropy eval` serves for ``ckpts``."""
    import transformers

    from megatron_entropy.evaluation.command import model_folder

    folder, converted = model_folder(ckpts, scratch)
    assert converted is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model(tokens).logits


def test_eval_serves_the_runs_policy_not_its_base(lora_run, tmp_path):
    """`eval` of a LoRA run's checkpoint (adapters only) serves the base with the adapters merged
    in: the trainer's log-probs."""
    hf_dir, ckpts, tokens, trainer_logits = lora_run
    (logits,) = run_distributed(_eval_model_logits, 1, ckpts, tmp_path, tokens)
    _check(logits, trainer_logits, load_arch(hf_dir), tokens)


def test_exports_refuse_what_they_cannot_do(lora_run, tmp_path):
    """One line naming the problem, exit 2, no output: another base than the run's (same
    architecture), and a PEFT export of a checkpoint without adapters."""
    hf_dir, ckpts, _, _ = lora_run
    other = save_tiny_hf_model("qwen2", tmp_path / "other", seed=1)
    done = _convert("mcore-to-hf", "--ckpt", str(ckpts), "--out", str(tmp_path / "m"),
                    "--base", str(other))
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--base" in done.stderr, done.stderr
    assert not (tmp_path / "m").exists()
    full = tmp_path / "full"
    assert _convert("hf-to-mcore", "--hf-dir", str(hf_dir), "--out", str(full),
                    "--quiet").returncode == 0
    done = _convert("mcore-to-peft", "--ckpt", str(full), "--out", str(tmp_path / "p"))
    assert done.returncode == 2 and "not a LoRA run's checkpoint" in done.stderr, done.stderr
    assert not (tmp_path / "p").exists()
