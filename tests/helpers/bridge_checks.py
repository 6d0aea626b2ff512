"""The HF <-> Megatron bridge checks the conversion and model tests share: tokens, transformers'
reference, a model's full-vocab logits through the pipeline schedule, a worker that loads a model
at a TP x PP layout and exports it, the check of its results, and conversions run in a worker."""

from __future__ import annotations

from pathlib import Path

import torch

from harness import init_megatron
from tolerance import rounding_tol, transformer_terms

from megatron_entropy.models.arch import load_arch
from megatron_entropy.models.bridge import hf_tensor_specs

B, S = 2, 16
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}


def tokens_for(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(0))


def hf_reference(hf_dir: Path, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """transformers' fp32 logits and the HF tensors as ``save_pretrained`` stored them."""
    import transformers
    from safetensors.torch import load_file

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(tokens).logits
    return logits, load_file(hf_dir / "model.safetensors")


def forward_logits(model, tokens: torch.Tensor):
    """Full-vocab logits [B, S, V_pad] on the last PP stage (None elsewhere), through Megatron's
    pipeline schedule so that PP > 1 runs the real stage-to-stage path."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    outputs = []

    def step(data_iter, m):
        out = m(next(data_iter), pos, None)

        def loss_func(logits):
            outputs.append(logits.detach())
            return logits.sum() * 0, {}

        return out, loss_func

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([tokens]),
                                model=[model], num_microbatches=1, seq_length=tokens.shape[1],
                                micro_batch_size=tokens.shape[0], forward_only=True)
    if not ps.is_pipeline_last_stage():
        return None
    local = outputs[0]
    parts = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, local, group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)


def load_and_run(hf_dir: Path, tp: int, pp: int, source: str, tokens: torch.Tensor,
                 ckpt_dir=None, export: bool = True):
    """Worker: build the model at TP x PP, load it from HF (``source="hf"``) or a dist checkpoint
    (``"ckpt"``), return (logits or None, exported [(name, tensor or None)])."""
    from megatron_entropy.models.bridge import export_hf_weights, load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.megatron_checkpoint import load_model_weights

    init_megatron(tensor=tp, pipeline=pp, seed=123)
    arch = load_arch(hf_dir)
    model = build_gpt_model(arch, tp, pp, dtype="fp32", transformer_impl="local", seq_length=64)
    if source == "hf":
        load_hf_weights(model, hf_dir, arch)
    else:
        load_model_weights(model, ckpt_dir)
    logits = forward_logits(model, tokens)
    exported = [(n, None if t is None else t.clone())
                for n, t in export_hf_weights(model, arch)] if export else None
    return logits, exported


def check_results(results: list, ref_logits: torch.Tensor, ref_tensors: dict, arch):
    """Logits on every last-stage rank equal transformers' (the same math in another order: up to
    rounding along one logit's path); the leader (rank 0) exports the HF tensors bit for bit, in
    ``hf_tensor_specs`` order, and every other rank walks the same names with None."""
    vocab = arch.vocab_size
    logits = [r[0] for r in results if r[0] is not None]
    assert logits, "no rank returned logits"
    tol = rounding_tol(ref_logits, transformer_terms(arch, ref_logits.shape[1]))
    for got in logits:
        assert got.shape[-1] % 128 == 0 and got.shape[-1] >= vocab
        torch.testing.assert_close(got[..., :vocab], ref_logits, rtol=0, atol=tol)
    leader = results[0][1]
    names = [n for n, _ in leader]
    assert sorted(names) == sorted(ref_tensors)
    assert names == [n for n, _, _ in hf_tensor_specs(arch, torch.float32)]
    for name, t in leader:
        assert t is not None and t.dtype == ref_tensors[name].dtype, name
        assert torch.equal(t, ref_tensors[name]), name
    for _, exported in results[1:]:
        assert [n for n, _ in exported] == [n for n, _ in leader]
        assert all(t is None for _, t in exported)


def run_conversions(jobs: list[tuple[str, Path, Path, dict]]):
    """Worker: run conversions [(direction, src, out, kwargs)]; returns their summaries."""
    from megatron_entropy.models.conversion import (convert_checkpoint_to_hf,
                                                    convert_hf_to_checkpoint)

    fns = {"to_mcore": convert_hf_to_checkpoint, "to_hf": convert_checkpoint_to_hf}
    return [fns[direction](src, out, **kwargs) for direction, src, out, kwargs in jobs]
