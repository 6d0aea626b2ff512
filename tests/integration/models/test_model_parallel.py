"""TP, PP and DP layouts of a Megatron GPTModel built from HF configs compute the same thing."""

from __future__ import annotations

import pytest
import torch

from actor_updates import weights_after
from harness import init_megatron, run_distributed
from tiny_models import tiny_hf_config
from tolerance import grad_terms, rounding_tol, transformer_terms, update_tol

from megatron_entropy.models.arch import arch_from_hf_config

B, S = 2, 24


def _batch(vocab: int, batch: int = B, seq: int = S, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    mask = torch.ones(batch, seq)
    mask[0, seq - 5:] = 0  # some padding
    return tokens, labels, mask


def _gather_tp(t: torch.Tensor, dim: int) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    group = ps.get_tensor_model_parallel_group()
    parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
    torch.distributed.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _full_param_grads(model) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    out = {}
    for name, p in model.named_parameters():
        g = p.grad.detach()
        if "linear_fc1" in name:
            # SwiGLU's fc1 holds [gate; up] per TP shard: regroup to the unsharded [gate; up].
            gate, up = g.chunk(2, dim=0)
            g = torch.cat([_gather_tp(gate, 0), _gather_tp(up, 0)], dim=0)
        elif getattr(p, "tensor_model_parallel", False):
            g = _gather_tp(g, p.partition_dim)
        elif "q_layernorm" in name or "k_layernorm" in name:
            # Per-head norms see only this rank's heads: the full grad is the sum over TP.
            torch.distributed.all_reduce(g, group=ps.get_tensor_model_parallel_group())
        out[name] = g
    return out


def _tp_worker(family: str, tp: int):
    from megatron_entropy.models.builder import build_gpt_model

    init_megatron(tensor=tp)
    arch = arch_from_hf_config(tiny_hf_config(family))
    model = build_gpt_model(arch, tensor=tp, dtype="fp32", transformer_impl="local", seq_length=64)
    tokens, labels, mask = _batch(arch.vocab_size)
    pos = torch.arange(S).expand(B, S)
    with torch.no_grad():
        logits = _gather_tp(model(tokens, pos, None), dim=-1)
    ce = model(tokens, pos, None, labels=labels)
    ((ce * mask).sum() / mask.sum()).backward()
    return logits, _full_param_grads(model)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_tp2_logits_and_grads_equal_tp1(family):
    (ref_logits, ref_grads), = run_distributed(_tp_worker, 1, family, 1)
    r0, r1 = run_distributed(_tp_worker, 2, family, 2)
    assert ref_logits.shape == (B, S, 1024)
    # TP splits the row-parallel sums (attention output, fc2) and the vocab of the loss in two:
    # the same math in another order, so within the rounding bound of its path.
    arch = arch_from_hf_config(tiny_hf_config(family))
    logit_terms = transformer_terms(arch, S)
    grad_path = grad_terms(transformer_terms(arch, S, log_softmax=True), B * S)
    for logits, grads in (r0, r1):
        torch.testing.assert_close(logits, ref_logits, rtol=0,
                                   atol=rounding_tol(ref_logits, logit_terms))
        assert grads.keys() == ref_grads.keys()
        for name, g in grads.items():
            torch.testing.assert_close(g, ref_grads[name], rtol=0,
                                       atol=rounding_tol(ref_grads[name], grad_path), msg=name)
    # The test can fail: the grads are not trivially zero.
    assert max(g.abs().max() for g in ref_grads.values()) > 1e-3


def _initial_weights_worker():
    from megatron_entropy.models.builder import build_gpt_model
    from megatron_entropy.models.sharding import full_state_dict

    init_megatron()
    arch = arch_from_hf_config(tiny_hf_config("qwen2", num_hidden_layers=4))
    return full_state_dict(build_gpt_model(arch, dtype="fp32", transformer_impl="local",
                                           seq_length=64))


# adam_eps = 1: the update is proportional to the gradient (lr m / (sqrt(v) + 1) ~ lr m), so the
# gradients' rounding differences stay that small in the weights (tolerance.update_tol); lr 1 makes
# the two steps lower the loss by far more than rounding.
OPTIM = dict(lr=1.0, adam_eps=1.0, weight_decay=0.01)


def _ce_train_worker(tp: int, pp: int, batches: list, weights: dict, steps: int = 2,
                     grad_clip: float = 0.05):
    """Two optimizer steps with Megatron's DDP/optimizer/pipeline schedule from the given full
    weights; returns per-step losses, the loss of a final forward pass, and this rank's full
    (TP-gathered) weights by global name."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
    from megatron_entropy.trainer.model_setup import (build_optimizer, build_trainable_model,
                                                      optimizer_step)
    from megatron_entropy.models.sharding import full_state_dict, load_full_state_dict

    init_megatron(tensor=tp, pipeline=pp)
    arch = arch_from_hf_config(tiny_hf_config("qwen2", num_hidden_layers=4))
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64),
        ParallelConfig(tensor=tp, pipeline=pp))
    load_full_state_dict(chunks[0], weights)
    optimizer, scheduler = build_optimizer(
        chunks, TrainerConfig(grad_clip=grad_clip, steps=steps, **OPTIM))
    dp_rank, dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    # This DP rank's share of every micro-batch list; the normaliser is the whole step's tokens.
    mine = [mb for i, mb in enumerate(batches) if i % dp_size == dp_rank]
    n_total = sum(float(m.sum()) for _, _, m in batches)

    def forward_step(data_iter, model):
        tokens, labels, mask = next(data_iter)
        pos = torch.arange(tokens.shape[1]).expand_as(tokens)
        out = model(tokens, pos, None, labels=labels)

        def loss_func(ce):
            loss = (ce * mask).sum() / n_total
            return loss, torch.tensor(int(mask.sum())), {"loss": loss.detach().clone()}

        return out, loss_func

    fb = get_forward_backward_func()
    losses = []
    for step in range(steps + 1):
        forward_only = step == steps
        out = fb(forward_step_func=forward_step, data_iterator=iter(mine), model=chunks,
                 num_microbatches=len(mine), seq_length=S, micro_batch_size=B,
                 forward_only=forward_only)
        local = torch.tensor(sum(float(o["loss"]) for o in out)) if out else torch.tensor(0.0)
        # Sum over DP; only the last PP stage has a loss, so sum over PP too.
        torch.distributed.all_reduce(local, group=ps.get_data_parallel_group())
        torch.distributed.all_reduce(local, group=ps.get_pipeline_model_parallel_group())
        losses.append(float(local))
        if not forward_only:
            stats = optimizer_step(optimizer, scheduler, chunks)
            assert stats["update_successful"]
            # Clipping must be active for the test to cover it (TP/PP norms counted right).
            assert stats["grad_norm"] > grad_clip, stats
    return losses, full_state_dict(chunks[0])


def _batches(n: int, vocab: int = 1000) -> list:
    return [_batch(vocab, seed=i) for i in range(n)]


def _assert_same_training(results: list, ref: tuple, initial: dict, n_batches: int) -> None:
    """Each layout's losses and its weights after two steps are the reference's up to rounding.
    Losses: the forward's path with the loss's vocab, at the loss's magnitude. Weights: the
    gradient path (forward, backward, every token of the step) plus the path of the grad norm,
    which scales every update through clipping: a sum of squares per tensor, then over tensors."""
    ref_losses, ref_weights = ref
    assert ref_losses[0] > ref_losses[2] + 1e-2, "training must lower the loss"
    loss_path = transformer_terms(arch_from_hf_config(tiny_hf_config("qwen2", num_hidden_layers=4)),
                                  S, log_softmax=True)
    for losses, _ in results:
        assert losses == pytest.approx(ref_losses, abs=rounding_tol(ref_losses, loss_path))
    terms = (grad_terms(loss_path, n_batches * B * S) + max(t.numel() for t in initial.values())
             + len(initial))
    weights = weights_after(results)
    assert weights.keys() == ref_weights.keys()
    for name, w in weights.items():
        torch.testing.assert_close(w, ref_weights[name], rtol=0, msg=name, atol=update_tol(
            ref_weights[name], initial[name], 2, terms))


def test_pp2_and_tp2pp2_match_pp1_after_two_steps():
    batches = _batches(2)
    (weights,) = run_distributed(_initial_weights_worker, 1)
    (ref,) = run_distributed(_ce_train_worker, 1, 1, 1, batches, weights)
    _assert_same_training(run_distributed(_ce_train_worker, 2, 1, 2, batches, weights), ref,
                          weights, 2)
    _assert_same_training(run_distributed(_ce_train_worker, 4, 2, 2, batches, weights), ref,
                          weights, 2)


def test_dp2_halves_equal_dp1_whole_batch():
    batches = _batches(4)
    (weights,) = run_distributed(_initial_weights_worker, 1)
    (ref,) = run_distributed(_ce_train_worker, 1, 1, 1, batches, weights)
    _assert_same_training(run_distributed(_ce_train_worker, 2, 1, 1, batches, weights), ref,
                          weights, 4)
