"""Training checkpoints: model and optimizer saved at one layout load exactly at another; a
checkpoint is complete or absent ("latest" never names a partial one)."""

from __future__ import annotations

import zlib
from typing import Optional

import pytest
import torch

from harness import init_megatron, run_distributed
from resume_steps import resumed_optimizer
from tiny_models import tiny_hf_config

from megatron_entropy.models.arch import arch_from_hf_config


def _worker(tensor: int, pipeline: int, run_dir: str, mode: str):
    from megatron_entropy.models.sharding import full_state_dict
    from megatron_entropy.trainer.checkpoint import CheckpointManager
    from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
    from megatron_entropy.trainer.model_setup import build_optimizer, build_trainable_model

    init_megatron(tensor=tensor, pipeline=pipeline)
    arch = arch_from_hf_config(tiny_hf_config("qwen2", num_hidden_layers=4))
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64),
        ParallelConfig(tensor=tensor, pipeline=pipeline))
    optimizer, _ = build_optimizer(chunks, TrainerConfig(lr=1e-2, steps=1, weight_decay=0.0))
    manager = CheckpointManager(run_dir, keep_last=1)
    if mode == "save":
        for step in (1, 2):
            for p in chunks[0].parameters():
                p.main_grad.normal_(generator=torch.Generator().manual_seed(step))
            optimizer.step()
            manager.save(step, chunks, optimizer, {"step": step}, arch, "unused")
    else:
        state = manager.load(manager.latest(), chunks, optimizer)
        assert state["step"] == 2
    # Adam's moments as full tensors, by parameter name, to compare across layouts.
    moments = {}
    module = chunks[0].module
    from megatron_entropy.models.sharding import layer_offset, tp_gather, to_global_name

    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states = {}
    for opt in inner:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                states[id(p)] = opt.optimizer.state[p]
    for name, param in module.named_parameters():
        state = states[id(param)]
        moments[to_global_name(name, layer_offset(module))] = tp_gather(
            name, state["exp_avg_sq"], param)
    return full_state_dict(chunks[0]), moments


def _union(results):
    weights, moments = {}, {}
    for w, m in results:
        weights.update(w)
        moments.update(m)
    return weights, moments


@pytest.mark.parametrize("save_layout,load_layout", [((2, 1), (1, 2)), ((1, 2), (2, 1))])
def test_checkpoint_reshards_model_and_optimizer(tmp_path, save_layout, load_layout):
    saved = _union(run_distributed(_worker, 2, *save_layout, str(tmp_path), "save"))
    loaded = _union(run_distributed(_worker, 2, *load_layout, str(tmp_path), "load"))
    for a, b in zip(saved, loaded):
        assert a.keys() == b.keys()
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=0, atol=0, msg=k)
    assert max(m.abs().max() for m in saved[1].values()) > 0  # real optimizer state
    ckpts = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert ckpts == ["latest", "step_00000002"]  # keep_last=1, no temporary left


def _resumed_worker(run_dir: str, dtype: str, distributed: bool, first: int, last: int,
                    save_at: Optional[int], family: str = "qwen2", expert: int = 1
                    ) -> tuple[dict[str, torch.Tensor], bool]:
    """Steps ``first``..``last`` of the tiny ``family`` model's optimizer at EP=``expert``
    (resuming from the latest checkpoint when ``first`` > 1), saving after step ``save_at``.
    Each parameter's grads are drawn from its global name and the step: the same on every rank
    and in every layout (an expert whichever EP rank holds it). Returns this rank's full weights
    and this checkpoint's recorded optimizer format."""
    import json

    from megatron_entropy.config import ModelConfig, ParallelConfig
    from megatron_entropy.models.sharding import (expert_offset, full_state_dict, layer_offset,
                                                  to_global_name)
    from megatron_entropy.trainer.checkpoint import TRAINER_STATE
    from megatron_entropy.trainer.model_setup import build_trainable_model

    init_megatron(expert=expert)
    arch = arch_from_hf_config(tiny_hf_config(family))
    chunks = build_trainable_model(
        arch, ModelConfig(dtype=dtype, transformer_impl="local", seq_length=64),
        ParallelConfig(expert=expert), distributed_optimizer=distributed)
    optimizer, manager = resumed_optimizer(chunks, run_dir, dtype, distributed, first)
    module = chunks[0].module
    names = {p: to_global_name(n, layer_offset(module), expert_offset(module))
             for n, p in module.named_parameters()}
    for step in range(first, last + 1):
        for p, name in names.items():
            seed = zlib.crc32(f"{name}:{step}".encode())
            p.main_grad.normal_(generator=torch.Generator().manual_seed(seed))
        optimizer.step()
        if step == save_at:
            manager.save(step, chunks, optimizer, {"step": step}, arch, "unused")
    saved = json.loads((manager.latest() / TRAINER_STATE).read_text())
    return full_state_dict(chunks[0]), saved["distributed_optimizer"]


@pytest.mark.parametrize("dtype,runs", [
    ("fp32", [(2, False), (2, True), (2, False)]),
    ("bf16", [(2, True), (2, False), (2, True)]),
    ("bf16", [(2, True), (1, True), (2, True)])],
    ids=["fp32-plain-distributed-plain", "bf16-distributed-plain-distributed",
         "bf16-distributed-dp2-dp1-dp2"])
def test_resumed_optimizer_converts_and_reshards_bit_identical(tmp_path, dtype, runs):
    """Six updates in one run against the same six in three runs (2 + 2 + 2) that resume from
    each other's checkpoints with trainer.distributed_optimizer switched (the state converted
    between the plain and the sharded format), or with the DP size changed (resharded): the
    weights after are the same bit for bit, so were the main weights, Adam's moments and step
    after each resume (bias correction makes a wrong step show)."""
    (world, distributed), middle, last = runs
    ref = run_distributed(_resumed_worker, world, str(tmp_path), dtype, distributed, 1, 6, 2)
    assert ref[0][1] is distributed  # the checkpoint is in the format of the run that wrote it
    out = run_distributed(_resumed_worker, middle[0], str(tmp_path), dtype, middle[1], 3, 4, 4)
    assert out[0][1] is middle[1]
    out = run_distributed(_resumed_worker, last[0], str(tmp_path), dtype, last[1], 5, 6, None)
    (want, _), (got, _) = ref[0], out[0]
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("dtype,distributed", [("bf16", True), ("fp32", False)],
                         ids=["bf16-distributed", "fp32-plain"])
def test_moe_resume_reshards_experts_and_their_optimizer_state(tmp_path, dtype, distributed):
    """Six updates of the tiny MoE at EP=2 in one run against the same six in three runs at
    EP=2, EP=1, EP=2 resuming from each other's checkpoints. At EP=2 each rank holds 2 of the 4
    experts whole and Megatron chains two optimizers (dense, experts); at EP=1 one optimizer
    holds every parameter (the distributed one shards each expert over DP=2): each resume
    reshards the experts' main weights and Adam's moments into another chain. Adam is
    elementwise and every parameter gets the same grads in every layout, so the weights after
    are the same bit for bit (a misplaced expert or moment, or a reset step, would show)."""
    def run(expert: int, first: int, last: int, save_at: Optional[int]) -> dict:
        return _union_weights(run_distributed(
            _resumed_worker, 2, str(tmp_path), dtype, distributed, first, last, save_at,
            family="qwen3_moe", expert=expert))

    want = run(2, 1, 6, 2)
    run(1, 3, 4, 4)
    got = run(2, 5, 6, None)
    assert want.keys() == got.keys() and sum(".local_experts." in n for n in want) == 2 * 4 * 2
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def _union_weights(results: list[tuple[dict[str, torch.Tensor], bool]]
                   ) -> dict[str, torch.Tensor]:
    """The full weights over all ranks (each EP rank adds its experts)."""
    out: dict[str, torch.Tensor] = {}
    for weights, _ in results:
        out.update(weights)
    return out
