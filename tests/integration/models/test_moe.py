"""Qwen3-MoE on Megatron-Core's MoE layer: HF weights give transformers' logits at EP=1 and EP=2
(the all-to-all token dispatcher over gloo), conversion to a dist checkpoint and back is bit for
bit whatever the EP size of the saving run, and what Megatron cannot express is refused naming
the key."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from harness import run_distributed
from bridge_checks import S, forward_logits, hf_reference, run_conversions, tokens_for
from tiny_models import save_tiny_hf_model, write_config
from tolerance import rounding_tol, transformer_terms

from megatron_entropy.models.arch import UnsupportedModelError, load_arch
from megatron_entropy.models.megatron_checkpoint import write_checkpoint_metadata
from megatron_entropy.testing.ranks import init_megatron

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def moe_hf(tmp_path_factory):
    """(HF folder, tokens, transformers' fp32 logits, the saved HF tensors)."""
    hf_dir = save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"))
    tokens = tokens_for(1000)
    return (hf_dir, tokens, *hf_reference(hf_dir, tokens))


@pytest.fixture(scope="module")
def moe_ckpt(moe_hf, tmp_path_factory):
    """The tiny MoE converted to a dist checkpoint (fp32)."""
    out = tmp_path_factory.mktemp("moe_mcore") / "ckpt"
    run_distributed(run_conversions, 1, [("to_mcore", moe_hf[0], out, {})])
    return out


def _logits(hf_dir: Path, expert: int, tokens: torch.Tensor, source: str = "hf",
            ckpt_dir=None, save_to=None, pipeline: int = 1):
    """Worker: the model at EP=``expert`` x PP=``pipeline`` from HF weights or a dist checkpoint:
    its logits on ``tokens`` (every DP rank the same batch; None off the last stage), its EP rank
    and the experts it holds; with ``save_to`` Megatron's own dist_checkpointing.save of it (the
    trainer's model layout)."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.megatron_checkpoint import (load_model_weights,
                                                             model_sharded_state_dict)
    from megatron_entropy.models.sharding import full_state_dict

    init_megatron(pipeline=pipeline, expert=expert, seed=5)
    arch = load_arch(hf_dir)
    model = build_gpt_model(arch, 1, pipeline, dtype="fp32", transformer_impl="local",
                            seq_length=64, expert=expert)
    if source == "hf":
        load_hf_weights(model, hf_dir, arch)
    else:
        load_model_weights(model, ckpt_dir)
    if save_to is not None:
        dist_checkpointing.save(model_sharded_state_dict(model), str(save_to))
    experts = sorted({n.split(".local_experts.")[1].split(".")[0]
                      for n in full_state_dict(model) if ".local_experts." in n}, key=int)
    return forward_logits(model, tokens), ps.get_expert_model_parallel_rank(), experts


def _check_logits(results, ref_logits, hf_dir: Path, expert: int) -> None:
    arch = load_arch(hf_dir)
    tol = rounding_tol(ref_logits, transformer_terms(arch, S))
    per_rank = arch.num_experts // expert
    assert sorted({r[1] for r in results}) == list(range(expert))
    assert any(r[0] is not None for r in results)
    for logits, ep_rank, experts in results:
        # Each EP rank holds its own consecutive experts (the global names of load_hf_weights).
        assert experts == [str(e) for e in range(ep_rank * per_rank, (ep_rank + 1) * per_rank)]
        if logits is not None:
            torch.testing.assert_close(logits[..., :arch.vocab_size], ref_logits, rtol=0,
                                       atol=tol)


def test_router_spreads_tokens_over_experts(moe_hf):
    """The tiny model routes every expert (a router of zeros would tie all of them and make the
    logits tests blind to a misplaced expert)."""
    import transformers

    hf_dir, tokens, *_ = moe_hf
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model(tokens, output_router_logits=True)
    for layer_logits in out.router_logits:
        chosen = layer_logits.topk(2, dim=-1).indices.flatten()
        assert torch.bincount(chosen, minlength=4).min() > 0


@pytest.mark.parametrize("expert,pipeline", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_hf_weights_give_transformers_logits(moe_hf, expert, pipeline):
    hf_dir, tokens, ref_logits, _ = moe_hf
    results = run_distributed(_logits, expert * pipeline, hf_dir, expert, tokens,
                              pipeline=pipeline)
    _check_logits(results, ref_logits, hf_dir, expert)


def test_top_k_of_the_full_softmax_gives_transformers_logits(tmp_path):
    """norm_topk_prob=false: the top-k of the softmax over all experts, not renormalised
    (Megatron's pre-softmax routing), at EP=2."""
    hf_dir = save_tiny_hf_model("qwen3_moe", tmp_path, norm_topk_prob=False)
    tokens = tokens_for(1000)
    ref_logits, _ = hf_reference(hf_dir, tokens)
    _check_logits(run_distributed(_logits, 2, hf_dir, 2, tokens), ref_logits, hf_dir, 2)


def test_tensor_parallel_moe_needs_sequence_parallel(moe_hf):
    from megatron_entropy.models.builder import transformer_config

    with pytest.raises(UnsupportedModelError, match="parallel.sequence_parallel=true"):
        transformer_config(load_arch(moe_hf[0]), tensor=2)


@pytest.mark.parametrize("expert", [1, 2, 4])
def test_converted_checkpoint_loads_at_any_ep(moe_hf, moe_ckpt, expert):
    hf_dir, tokens, ref_logits, _ = moe_hf
    results = run_distributed(_logits, expert, hf_dir, expert, tokens, "ckpt", moe_ckpt)
    _check_logits(results, ref_logits, hf_dir, expert)


def _assert_same_hf(out_dir: Path, ref: dict) -> None:
    from safetensors.torch import load_file

    out = load_file(out_dir / "model.safetensors")
    assert out.keys() == ref.keys()
    for name, t in ref.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name


def test_round_trip_is_bit_identical(moe_hf, moe_ckpt, tmp_path):
    [[stats]] = run_distributed(run_conversions, 1, [("to_hf", moe_ckpt, tmp_path / "hf", {})])
    _assert_same_hf(tmp_path / "hf", moe_hf[3])
    assert stats["tensors"] == len(moe_hf[3])


def test_the_convert_command_round_trips_an_moe_in_a_fresh_process(moe_hf, tmp_path):
    """`megatron-entropy convert` as a user runs it on a CPU node: its own process, where no
    CPU compatibility layer is applied (the forked ranks above inherit the test process's); the
    MoE comes back bit for bit."""
    ckpt, out = tmp_path / "ckpt", tmp_path / "hf"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for args in (["hf-to-mcore", "--hf-dir", str(moe_hf[0]), "--out", str(ckpt)],
                 ["mcore-to-hf", "--ckpt", str(ckpt), "--out", str(out)]):
        done = subprocess.run([sys.executable, "-m", "megatron_entropy.cli", "convert", *args,
                               "--quiet"], capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_hf(out, moe_hf[3])


@pytest.mark.parametrize("save_ep,load_ep", [(2, 1), (4, 2)])
def test_checkpoint_saved_at_one_ep_reloads_at_another(moe_hf, tmp_path, save_ep, load_ep):
    """A run at EP=``save_ep`` saves (Megatron's own save: each rank its experts); the checkpoint
    loads at EP=``load_ep`` with transformers' logits and converts to HF bit for bit."""
    hf_dir, tokens, ref_logits, ref_tensors = moe_hf
    ckpt = tmp_path / "saved"
    ckpt.mkdir()
    run_distributed(_logits, save_ep, hf_dir, save_ep, tokens, save_to=ckpt)
    write_checkpoint_metadata(ckpt, load_arch(hf_dir), hf_dir)
    results = run_distributed(_logits, load_ep, hf_dir, load_ep, tokens, "ckpt", ckpt)
    _check_logits(results, ref_logits, hf_dir, load_ep)
    run_distributed(run_conversions, 1, [("to_hf", ckpt, tmp_path / "hf", {})])
    _assert_same_hf(tmp_path / "hf", ref_tensors)


@pytest.mark.parametrize("override,key", [
    (dict(mlp_only_layers=[1]), "mlp_only_layers"),
    (dict(decoder_sparse_step=2), "decoder_sparse_step"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok"),
])
def test_what_megatron_cannot_express_is_refused_naming_the_key(tmp_path, override, key):
    with pytest.raises(UnsupportedModelError, match=key):
        load_arch(write_config("qwen3_moe", tmp_path, **override))


def test_expert_parallel_size_is_checked_against_the_model(tmp_path):
    arch = load_arch(write_config("qwen3_moe", tmp_path))
    with pytest.raises(UnsupportedModelError, match="parallel.expert=3 does not divide"):
        arch.check_parallel(1, 1, expert=3)
    dense = load_arch(write_config("qwen3", tmp_path / "dense"))
    with pytest.raises(UnsupportedModelError, match="parallel.expert=2 needs a mixture"):
        dense.check_parallel(1, 1, expert=2)
