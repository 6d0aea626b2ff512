"""The trainable Megatron model: GPTModel wrapped in Megatron's DDP, its optimizer and LR schedule.

Loss normalisation contract: the loss a micro-batch returns is already divided by the size of the
whole optimizer step (tokens or sequences over every DP rank and micro-batch, see
``algorithms.aggregation``). So the pipeline schedule must not divide by the number of
micro-batches and DDP must sum over DP instead of averaging: ``calculate_per_token_loss=True`` does
both, and ``finalize_model_grads`` is called without a token count so that it does not rescale.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                       finalize_model_grads)
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from megatron_entropy.config import ModelConfig, ParallelConfig, TrainerConfig
from megatron_entropy.models.arch import ModelArch
from megatron_entropy.models.builder import DTYPES, MoeOptions, build_gpt_model
from megatron_entropy.models.lora import add_adapters


def _finalize_without_rescale(model, num_tokens=None, *args, **kwargs):
    # Losses arrive normalised by the whole step already (module docstring).
    return finalize_model_grads(model, None, *args, **kwargs)


def build_trainable_model(arch: ModelArch, model_cfg: ModelConfig, parallel: ParallelConfig,
                          distributed_optimizer: bool = False, overlap: bool = False,
                          routing_replay: bool = False, seed: int = 0) -> list:
    """GPTModel in Megatron's DDP (one chunk: no virtual pipeline), ready for the schedules, as
    the ``model`` and ``parallel`` sections say (dtype, layer spec, seq_length, recompute; TP, PP,
    sequence parallel). ``distributed_optimizer`` lays the grad buffer out for Megatron's
    distributed optimizer (grads reduce-scattered over DP, each rank updating its shard); pass
    the same to `build_optimizer`. ``overlap``: the DP grad reduce runs bucket by bucket during the
    backward, and (distributed optimizer) the param all-gather after an update during the next
    forward; `gather_params` completes it before anything reads the weights directly.
    A mixture-of-experts model takes ``parallel.expert`` and the ``model.moe_*`` router losses;
    ``routing_replay`` builds Megatron's router replay into it (rollout.routing_replay).
    With ``model.lora`` the base is frozen and only its adapters (drawn from ``seed``) are in
    DDP and the optimizer; they sit on the local spec's layers ('auto' picks it)."""
    lora = model_cfg.lora
    impl = "local" if lora.enabled and model_cfg.transformer_impl == "auto" \
        else model_cfg.transformer_impl
    model = build_gpt_model(arch, parallel.tensor, parallel.pipeline, model_cfg.dtype,
                            impl, model_cfg.seq_length,
                            parallel.sequence_parallel, model_cfg.recompute_activations,
                            expert=parallel.expert, moe=MoeOptions(
                                model_cfg.moe_aux_loss_coeff, model_cfg.moe_z_loss_coeff,
                                routing_replay=routing_replay))
    if lora.enabled:
        add_adapters(model, lora, seed)
    config = model.config
    config.calculate_per_token_loss = True
    config.finalize_model_grads_func = _finalize_without_rescale
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, overlap_grad_reduce=overlap,
        overlap_param_gather=overlap and distributed_optimizer,
        use_distributed_optimizer=distributed_optimizer, check_for_nan_in_grad=True)
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    if overlap:
        # The schedules then hold the reduce back until the last micro-batch's backward and
        # start it stage by stage (Megatron-LM's wiring).
        config.no_sync_func = ddp.no_sync
        config.grad_sync_func = ddp.start_grad_sync
    return [ddp]


def gather_params(model_chunks: list) -> None:
    """Complete a param all-gather the last update left in flight (overlapped with the next
    forward): before weights are read other than by a forward (weight sync, checkpoint)."""
    for chunk in model_chunks:
        if chunk.ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


def build_optimizer(model_chunks: list, settings: TrainerConfig, dtype: str = "fp32",
                    distributed_optimizer: bool = False):
    """Megatron's AdamW (fp32 master weights for bf16/fp16 params) and its LR/WD schedule over
    the run's ``settings.total_updates``, from the ``trainer`` section; with
    ``distributed_optimizer`` the main weights and Adam moments are sharded over DP."""
    opt_config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, min_lr=settings.min_lr,
        weight_decay=settings.weight_decay, adam_beta1=settings.adam_beta1,
        adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
        clip_grad=settings.grad_clip, bf16=dtype == "bf16", fp16=dtype == "fp16",
        params_dtype=DTYPES[dtype], use_distributed_optimizer=distributed_optimizer)
    # init_distributed creates no gloo DP groups; Megatron's optimizer would look them up.
    optimizer = get_megatron_optimizer(opt_config, model_chunks, use_gloo_process_groups=False)
    decay_steps = max(settings.total_updates, settings.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if settings.warmup_steps else settings.lr, max_lr=settings.lr,
        min_lr=settings.min_lr if settings.lr_schedule == "cosine" else settings.lr,
        lr_warmup_steps=settings.warmup_steps, lr_decay_steps=decay_steps,
        lr_decay_style="cosine" if settings.lr_schedule == "cosine" else "constant",
        start_wd=settings.weight_decay, end_wd=settings.weight_decay, wd_incr_steps=decay_steps,
        wd_incr_style="constant")
    return optimizer, scheduler


def optimizer_step(optimizer, scheduler, model_chunks: list) -> dict[str, Optional[float]]:
    """Step the optimizer and the schedule; zero the grad buffers for the next step."""
    lr = float(optimizer.param_groups[0]["lr"])  # the rate this update uses
    update_successful, grad_norm, _ = optimizer.step()
    scheduler.step(increment=1)
    for chunk in model_chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    return {"grad_norm": None if grad_norm is None else float(grad_norm),
            "update_successful": bool(update_successful),
            "lr": lr}
