"""LoRA on the tiny models, as forked ranks run it: one training step through Megatron's DDP,
optimizer and pipeline schedule at any TP x PP x EP x DP layout, from HF base weights and full
adapters given by global name, and what the tests compare (the step's loss, the adapters' full
gradients, what the optimizer holds)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from harness import init_megatron

B, S = 2, 16
RANK = 4


def batches(n: int, vocab: int = 1000) -> list:
    """``n`` micro-batches of (tokens, labels, mask) [B, S], some positions masked."""
    out = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        tokens = torch.randint(0, vocab, (B, S), generator=g)
        mask = torch.ones(B, S)
        mask[0, S - 3:] = 0
        out.append((tokens, torch.roll(tokens, -1, dims=1), mask))
    return out


def lora_model(hf_dir: Path, tensor: int = 1, pipeline: int = 1, expert: int = 1,
               adapters: Optional[dict] = None, distributed_optimizer: bool = False,
               rank: int = RANK, dtype: str = "fp32", seed: int = 0, dropout: float = 0.0):
    """Inside a rank: parallel state, the HF model with adapters (``adapters``: full tensors by
    global name, else their initialisation), in Megatron's DDP; (chunks, arch)."""
    from megatron_entropy.config import ModelConfig, ParallelConfig
    from megatron_entropy.models.arch import load_arch
    from megatron_entropy.models.bridge import load_hf_weights
    from megatron_entropy.models.lora_settings import LoraSettings
    from megatron_entropy.models.sharding import load_full_state_dict
    from megatron_entropy.trainer.model_setup import build_trainable_model

    init_megatron(tensor, pipeline, expert=expert)
    arch = load_arch(hf_dir)
    chunks = build_trainable_model(
        arch, ModelConfig(dtype=dtype, transformer_impl="local", seq_length=64,
                          moe_aux_loss_coeff=0.0, lora=LoraSettings(rank=rank, dropout=dropout)),
        ParallelConfig(tensor=tensor, pipeline=pipeline, expert=expert),
        distributed_optimizer=distributed_optimizer, seed=seed)
    load_hf_weights(chunks[0], hf_dir, arch)
    if adapters is not None:
        load_full_state_dict(chunks[0], adapters, strict=False)
    return chunks, arch


def random_adapters_worker(hf_dir: Path, seed: int = 0, scale: float = 0.2) -> dict:
    """Inside one rank: full adapters of every target, random (B too, so that A has gradients
    and the adapters move the outputs), by global name."""
    from megatron_entropy.models.lora import is_adapter_param
    from megatron_entropy.models.sharding import full_state_dict

    chunks, _ = lora_model(hf_dir)
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(t.shape, generator=g) * scale
            for n, t in full_state_dict(chunks[0]).items() if is_adapter_param(n)}


def full_adapter_grads(module) -> dict[str, torch.Tensor]:
    """The adapters' main grads of this rank, full over TP, by global name."""
    from megatron_entropy.models.lora import is_adapter_param
    from megatron_entropy.models.sharding import (expert_offset, layer_offset, to_global_name,
                                                  tp_gather)

    offset, experts = layer_offset(module), expert_offset(module)
    return {to_global_name(n, offset, experts): tp_gather(n, p.main_grad.detach().clone(), p)
            for n, p in module.named_parameters() if is_adapter_param(n)}


def step_worker(hf_dir: Path, tensor: int, pipeline: int, expert: int, mbs: list,
                adapters: dict, distributed_optimizer: bool = False) -> dict:
    """Inside a rank: one training step on this DP rank's share of ``mbs`` (the loss divided
    by the whole step's tokens), then one optimizer step. Returns the step's loss (summed over
    the ranks), the adapters' full gradients before the update, the base weights before and
    after, and the parameters the optimizer holds, with their state."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_entropy.config import TrainerConfig
    from megatron_entropy.models.lora import is_adapter_param
    from megatron_entropy.models.sharding import unwrap_model
    from megatron_entropy.trainer.model_setup import build_optimizer, optimizer_step

    chunks, _ = lora_model(hf_dir, tensor, pipeline, expert, adapters, distributed_optimizer)
    module = unwrap_model(chunks)
    base = {n: p.detach().clone() for n, p in module.named_parameters()
            if not is_adapter_param(n)}
    optimizer, scheduler = build_optimizer(chunks, TrainerConfig(lr=0.1, adam_eps=1.0, steps=1),
                                           distributed_optimizer=distributed_optimizer)
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    mine = [mb for i, mb in enumerate(mbs) if i % dp_size == dp_rank]
    n_total = sum(float(m.sum()) for _, _, m in mbs)

    def forward_step(data_iter, model):
        tokens, labels, mask = next(data_iter)
        out = model(tokens, torch.arange(S).expand_as(tokens), None, labels=labels)

        def loss_func(ce):
            loss = (ce * mask).sum() / n_total
            return loss, torch.tensor(int(mask.sum())), {"loss": loss.detach().clone()}

        return out, loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(mine), model=chunks,
        num_microbatches=len(mine), seq_length=S, micro_batch_size=B, forward_only=False)
    loss = torch.tensor(sum((float(o["loss"]) for o in out), 0.0))
    torch.distributed.all_reduce(loss, group=ps.get_data_parallel_group())
    torch.distributed.all_reduce(loss, group=ps.get_pipeline_model_parallel_group())
    grads = full_adapter_grads(module)
    stats = optimizer_step(optimizer, scheduler, chunks)
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return {"loss": float(loss), "grads": grads, "base_before": base,
            "base_after": {n: p.detach().clone() for n, p in module.named_parameters()
                           if not is_adapter_param(n)},
            "frozen_without_grad": all(p.grad is None and not hasattr(p, "main_grad")
                                       for n, p in module.named_parameters()
                                       if not is_adapter_param(n)),
            # Adam's moments: as many numbers as the adapters this rank (or, distributed, this
            # DP rank's shard of them) holds.
            "state_numel": sum(s["exp_avg"].numel() for o in inner
                               for s in o.optimizer.state.values() if "exp_avg" in s),
            "adapter_numel": sum(p.numel() for n, p in module.named_parameters()
                                 if is_adapter_param(n)),
            "stats": stats}



def lora_terms(arch, seq: int, rank: int = RANK, log_softmax: bool = False) -> int:
    """Terms along one logit's path with adapters on every linear (tolerance.transformer_terms):
    each adapter sums its input (hidden, or the FFN before fc2) into A x and its rank into B h."""
    from tolerance import transformer_terms

    ffn = arch.moe_ffn_hidden_size if arch.is_moe else arch.ffn_hidden_size
    per_layer = 3 * arch.hidden_size + ffn + 4 * rank
    return transformer_terms(arch, seq, log_softmax) + arch.num_layers * per_layer


def save_lora_checkpoint_worker(hf_dir: Path, adapters: dict, run_dir: Path, tensor: int,
                                tokens: torch.Tensor):
    """Inside a rank: the LoRA policy at TP=``tensor`` with ``adapters``, saved as a training
    checkpoint (with the run's base identity, as the trainer saves it); its full-vocab logits
    on ``tokens`` (the trainer's forward)."""
    from bridge_checks import forward_logits

    from megatron_entropy.config import ModelConfig, TrainerConfig
    from megatron_entropy.models.lora_settings import LoraSettings
    from megatron_entropy.trainer.checkpoint import CheckpointManager
    from megatron_entropy.trainer.lora_run import STATE_KEY, base_identity
    from megatron_entropy.trainer.model_setup import build_optimizer

    chunks, arch = lora_model(hf_dir, tensor, adapters=adapters)
    logits = forward_logits(chunks[0], tokens)
    optimizer, _ = build_optimizer(chunks, TrainerConfig(steps=1))
    identity = base_identity(chunks, ModelConfig(hf_path=str(hf_dir), dtype="fp32",
                                                 lora=LoraSettings(rank=RANK)), str(hf_dir))
    CheckpointManager(run_dir).save(1, chunks, optimizer, {"step": 1, STATE_KEY: identity}, arch,
                                    str(hf_dir))
    return logits
