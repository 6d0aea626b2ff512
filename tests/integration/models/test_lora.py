"""LoRA adapters on Megatron's parallel linear layers (models/lora.py): initialised to change
nothing, switched off to give the base model, the same loss and adapter gradients at every
TP / PP / DP / EP layout as in one process, and nothing but the adapters trained."""

from __future__ import annotations

import pytest
import torch

from bridge_checks import forward_logits, tokens_for
from harness import run_distributed
from lora_checks import B, S, batches, lora_model, random_adapters_worker, step_worker
from tiny_models import save_tiny_hf_model
from tolerance import grad_terms, rounding_tol, transformer_terms

from megatron_entropy.models.arch import load_arch


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(tiny qwen2 HF folder, random full adapters of every target)."""
    hf_dir = save_tiny_hf_model("qwen2", tmp_path_factory.mktemp("lora_qwen2"))
    (adapters,) = run_distributed(random_adapters_worker, 1, hf_dir)
    return hf_dir, adapters


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    hf_dir = save_tiny_hf_model("qwen3_moe", tmp_path_factory.mktemp("lora_moe"))
    (adapters,) = run_distributed(random_adapters_worker, 1, hf_dir)
    return hf_dir, adapters


def _logits_worker(hf_dir, adapters):
    """Logits of the model without adapters, with freshly initialised ones, with ``adapters``
    and with those switched off."""
    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.lora import adapters_disabled
    from megatron_entropy.models.sharding import load_full_state_dict, unwrap_model

    chunks, arch = lora_model(hf_dir)
    tokens = tokens_for(arch.vocab_size)
    plain = build_gpt_model(arch, dtype="fp32", transformer_impl="local", seq_length=64)
    load_hf_weights(plain, hf_dir, arch)
    out = {"plain": forward_logits(plain, tokens), "fresh": forward_logits(chunks[0], tokens)}
    load_full_state_dict(chunks[0], adapters, strict=False)
    out["trained"] = forward_logits(chunks[0], tokens)
    with adapters_disabled(chunks[0]):
        out["off"] = forward_logits(chunks[0], tokens)
    out["a_nonzero"] = all(float(a.a.abs().min()) > 0 for a in
                           unwrap_model(chunks).modules() if hasattr(a, "delta"))
    return out


def test_zero_initialised_adapters_change_no_output_and_switch_off(dense):
    hf_dir, adapters = dense
    (out,) = run_distributed(_logits_worker, 1, hf_dir, adapters)
    # B = 0: the adapters add exact zeros; A is drawn (its gradient is not zero once B moves).
    assert torch.equal(out["fresh"], out["plain"])
    assert out["a_nonzero"]
    # Trained adapters move the output; switched off, the model is the base bit for bit.
    assert (out["trained"] - out["plain"]).abs().max() > 1e-2
    assert torch.equal(out["off"], out["plain"])


def _merge(results: list[dict], key: str) -> dict:
    """One dict of every rank's entries (ranks that hold the same entry must agree exactly)."""
    merged: dict = {}
    for r in results:
        for name, value in r[key].items():
            if name in merged:
                torch.testing.assert_close(value, merged[name], rtol=0, atol=0, msg=name)
            merged[name] = value
    return merged


def _check_layout(hf_dir, adapters, world, tensor=1, pipeline=1, expert=1,
                  distributed_optimizer=False):
    mbs = batches(4)
    (ref,) = run_distributed(step_worker, 1, hf_dir, 1, 1, 1, mbs, adapters)
    results = run_distributed(step_worker, world, hf_dir, tensor, pipeline, expert, mbs,
                              adapters, distributed_optimizer)
    arch = load_arch(hf_dir)
    loss_path = transformer_terms(arch, S, log_softmax=True)
    grads = _merge(results, "grads")
    assert grads.keys() == ref["grads"].keys() == adapters.keys()
    for r in results:
        assert r["loss"] == pytest.approx(ref["loss"], abs=rounding_tol(ref["loss"], loss_path))
    for name, g in grads.items():
        want = ref["grads"][name]
        torch.testing.assert_close(g, want, rtol=0, msg=name, atol=rounding_tol(
            want, grad_terms(loss_path, len(mbs) * B * S)))
    # The test can fail: every adapter has a gradient (A's too: B is not zero).
    assert min(float(g.abs().max()) for g in ref["grads"].values()) > 1e-6
    return results


@pytest.mark.parametrize("tensor,pipeline", [(2, 1), (1, 2), (1, 1)])
def test_dense_layouts_give_the_loss_and_adapter_grads_of_one_process(dense, tensor, pipeline):
    """TP=2, PP=2 and DP=2 (the third: two ranks, one model-parallel group each)."""
    hf_dir, adapters = dense
    _check_layout(hf_dir, adapters, 2, tensor, pipeline)


def test_expert_adapters_at_ep2_give_the_grads_of_one_process(moe):
    """Each expert its own adapter; EP=2 places them on the two ranks (DP=2 for the rest)."""
    hf_dir, adapters = moe
    assert any(".local_experts.3.linear_fc1_lora.b" in n for n in adapters)
    results = _check_layout(hf_dir, adapters, 2, expert=2)
    held = [{n for n in r["grads"] if ".local_experts." in n} for r in results]
    assert held[0] and held[1] and not held[0] & held[1]  # each rank its own experts


@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_only_adapters_are_trained(dense, distributed_optimizer):
    """The base weights get no gradient and no optimizer state and do not move; Adam's
    moments cover the adapters only (sharded over DP by the distributed optimizer)."""
    hf_dir, adapters = dense
    results = run_distributed(step_worker, 2, hf_dir, 1, 1, 1, batches(2), adapters,
                              distributed_optimizer)
    for r in results:
        assert r["stats"]["update_successful"]
        assert r["frozen_without_grad"]
        for name, before in r["base_before"].items():
            assert torch.equal(r["base_after"][name], before), name
    held = [r["state_numel"] for r in results]
    numel = results[0]["adapter_numel"]
    assert numel == sum(t.numel() for t in adapters.values())
    if distributed_optimizer:
        assert sum(held) == numel and max(held) < numel
    else:
        assert held == [numel, numel]


def _base_from_checkpoint_worker(hf_dir, ckpt, adapters):
    """Logits of the LoRA policy whose base is read from HF, then from a converted dist
    checkpoint (model.megatron_ckpt), with the same adapters."""
    from megatron_entropy.models.megatron_checkpoint import load_model_weights
    from megatron_entropy.models.sharding import load_full_state_dict

    chunks, arch = lora_model(hf_dir, adapters=adapters)
    tokens = tokens_for(arch.vocab_size)
    from_hf = forward_logits(chunks[0], tokens)
    with torch.no_grad():
        for p in chunks[0].parameters():
            p.zero_()
    load_model_weights(chunks[0], ckpt)  # the base only: the adapters stay zero
    zeroed = all(float(p.abs().max()) == 0 for n, p in chunks[0].named_parameters()
                 if "_lora." in n)
    load_full_state_dict(chunks[0], adapters, strict=False)
    return from_hf, forward_logits(chunks[0], tokens), zeroed


def test_the_base_loads_from_a_converted_checkpoint(dense, tmp_path):
    """model.megatron_ckpt holds the base: it loads into a LoRA policy (its adapters are not
    in it and are left alone) and gives the same policy as the HF folder."""
    from bridge_checks import run_conversions

    hf_dir, adapters = dense
    run_distributed(run_conversions, 1, [("to_mcore", hf_dir, tmp_path / "ckpt", {})])
    (from_hf, from_ckpt, zeroed), = run_distributed(_base_from_checkpoint_worker, 1, hf_dir,
                                                    tmp_path / "ckpt", adapters)
    assert zeroed
    assert torch.equal(from_ckpt, from_hf)


def _dropout_worker(hf_dir, adapters):
    chunks, arch = lora_model(hf_dir, adapters=adapters, dropout=0.5)
    plain, _ = lora_model(hf_dir, adapters=adapters)
    tokens = tokens_for(arch.vocab_size)
    pos = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        train = [chunks[0](tokens, pos, None) for _ in range(2)]
        chunks[0].eval()
        plain[0].eval()
        return train, chunks[0](tokens, pos, None), plain[0](tokens, pos, None)


def test_adapter_dropout_acts_while_training_only(dense):
    hf_dir, adapters = dense
    (train, evaluated, plain), = run_distributed(_dropout_worker, 1, hf_dir, adapters)
    assert torch.equal(evaluated, plain)  # eval (recompute, reference, weight check): none
    assert not torch.equal(train[0], plain) and not torch.equal(train[0], train[1])
