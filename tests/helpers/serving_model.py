"""A tiny Qwen2 with its own tokenizer, servable by vLLM and the fake SGLang server (no hub)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

# Re-exported: the tests import the served model from here, beside the helpers below.
from megatron_entropy.testing.toy_models import (make_served_model,  # noqa: F401
                                                 save_tiny_hf_model, save_tokenizer)


def make_tp2_model(out_dir: Path) -> Path:
    """A tiny Qwen2 that TP=2 can split (4 heads, 2 KV heads) with the BPE tokenizer."""
    out = save_tiny_hf_model("qwen2", Path(out_dir), seed=3, vocab_size=512, hidden_size=64,
                             intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                             max_position_embeddings=512)
    save_tokenizer(out, 512)
    return out


def _plain_forward(model, prompt: list[int], completion: list[int], temperature: float):
    """The tempered logits [len(completion), V] before each completion token, from one plain fp32
    forward of the HF model (no padding, no cache), and the rounding terms along one log-prob's
    path of that forward (tests/helpers/tolerance.py)."""
    import torch

    from megatron_entropy.models.arch import arch_from_hf_config
    from tolerance import transformer_terms

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float() / temperature
    return logits, transformer_terms(arch_from_hf_config(model.config.to_dict()), ids.shape[1],
                                     log_softmax=True)


def reference(model, prompt: list[int], completion: list[int], temperature: float = 1.0
              ) -> tuple[list[float], float]:
    """log-softmax(logits / T) of each completion token given what precedes it, from one plain
    fp32 forward of the HF model (no padding, no cache), and the tolerance for the same log-probs
    computed another way (batched, padded, from a KV cache, by another implementation): rounding
    along one log-prob's path (tests/helpers/tolerance.py)."""
    import torch

    from tolerance import logprob_tol

    logits, terms = _plain_forward(model, prompt, completion, temperature)
    lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]
    return lp.tolist(), logprob_tol(logits, lp, terms)


def reference_entropies(model, prompt: list[int], completion: list[int],
                        temperature: float = 1.0) -> tuple[list[float], float]:
    """The entropy of softmax(logits / T) before each completion token, from ``reference``'s
    plain fp32 forward, and its tolerance: the log-probs' rounding, plus the sum over the
    vocabulary (as many terms again as the normaliser)."""
    import torch

    from tolerance import logprob_tol

    logits, terms = _plain_forward(model, prompt, completion, temperature)
    logp = torch.log_softmax(logits, -1)
    h = -(logp.exp() * logp).sum(-1)
    return h.tolist(), logprob_tol(logits, logp, terms + logits.shape[-1])


def reference_logprobs(model, prompt: list[int], completion: list[int],
                       temperature: float = 1.0) -> list[float]:
    """The log-probs of ``reference``."""
    return reference(model, prompt, completion, temperature)[0]


def probe_served_weights(engine_kind: str, hf_dir: str, urls: list[str], run_dir: str,
                         sabotage, prompts: Optional[list[list[int]]] = None
                         ) -> tuple[dict, str]:
    """Inside a worker (harness.run_distributed): a Megatron actor with ``hf_dir``'s weights runs
    the trainer's weight check (the probe of the default ``rollout.weight_check``, at the bf16
    tolerances) on the servers at ``urls`` (connected), then ``sabotage(engine)`` changes what
    they hold, and the check runs again. Returns (the first check's metrics, the second's error
    message, "" if it passed)."""
    from harness import init_megatron

    from megatron_entropy.config import (AlgorithmConfig, ModelConfig, ParallelConfig,
                                         ServerConfig, TrainerConfig, WeightCheckConfig)
    from megatron_entropy.models.arch import load_arch
    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.model_setup import build_trainable_model
    from megatron_entropy.trainer.weight_check import (WeightCheckError, check_engine_weights,
                                                       probe_sampling, tolerances)

    init_megatron()
    arch = load_arch(hf_dir)
    model = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=256),
        ParallelConfig())
    load_hf_weights(model[0], hf_dir, arch)
    actor = Actor(arch, model, None, None, AlgorithmConfig(),
                  TrainerConfig(micro_batch_tokens=1024, seed=0), 1.0)
    if engine_kind == "vllm":
        from megatron_entropy.rollout.server.vllm import VLLMEngine as Engine
    else:
        from megatron_entropy.rollout.server.sglang import SGLangEngine as Engine
    engine = Engine(ServerConfig(urls=urls, request_timeout_s=120), hf_dir, run_dir)
    defaults = WeightCheckConfig()
    prompts = (prompts or [[5, 6, 7, 8], [40, 41], [100, 7, 3, 9, 12], [9, 8]])[:defaults.prompts]
    sampling = probe_sampling(1.0, defaults.tokens)
    limits = tolerances("bf16", "fp32")
    first = check_engine_weights(engine, actor, prompts, sampling, limits,
                                 "at the first contact")
    sabotage(engine)
    try:
        check_engine_weights(engine, actor, prompts, sampling, limits, "after a sync")
    except WeightCheckError as e:
        return first, str(e)
    return first, ""


def push_weights(engine, named_tensors, version: int, run_dir, bucket_mb: int = 512
                 ) -> dict[str, float]:
    """Whole-model tensors into a server engine through the strategy the trainer would build for
    it (megatron_entropy/weight_sync), with sync folders under ``run_dir``."""
    from megatron_entropy.config import RolloutConfig, WeightSyncConfig
    from megatron_entropy.weight_sync import build_weight_sync

    kind = {"VLLMEngine": "vllm", "SGLangEngine": "sglang"}[type(engine).__name__]
    # An SGLang engine's own weight-sync settings name its strategy; vLLM's is disk.
    weight_sync = dataclasses.replace(getattr(engine, "weight_sync", WeightSyncConfig()),
                                      bucket_mb=bucket_mb)
    cfg = RolloutConfig(engine=kind, server=engine.cfg, weight_sync=weight_sync)
    return build_weight_sync(cfg, engine, engine.hf_dir, run_dir).push(named_tensors, version)


def check_adapter_syncs(run_dir, base: Path, limit: float) -> None:
    """A LoRA run's syncs with strategy adapters (its metrics): every one the same bytes, under
    a fifth of the whole model's, and the weight check and the rollouts' log-probs within
    ``limit`` of the trainer's after each."""
    import torch
    import transformers

    from harness import metrics_rows

    rows = metrics_rows(run_dir)
    adapter_bytes = rows[0]["weight_sync/bytes"]
    for r in rows:  # the run stops if a weight check fails; these are its numbers
        print(f"step {r['step']}: adapters sync {r['weight_sync/bytes'] / 2**10:.0f} KiB in "
              f"{r['weight_sync/seconds']:.2f} s; weight check drift "
              f"{r['weight_check/drift_mean']:.2e}, rollout drift {r['rollout/logprob_drift']:.2e}")
        assert r["weight_sync/bytes"] == adapter_bytes
        assert r["weight_check/drift_mean"] <= limit and r["rollout/logprob_drift"] <= limit
    model_bytes = sum(p.numel() * 4 for p in transformers.AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32).parameters())
    assert adapter_bytes < model_bytes / 5


def exported_peft(run_dir: Path, base: Path, out: Path):
    """The run's last checkpoint exported by ``convert mcore-to-peft`` (a fresh process, as a
    user runs it) into ``out``, loaded with peft on the HF base."""
    import subprocess
    import sys

    import torch
    import transformers
    from peft import PeftModel

    done = subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "convert",
                           "mcore-to-peft", "--ckpt", str(Path(run_dir) / "checkpoints"),
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return PeftModel.from_pretrained(hf, out).eval()
