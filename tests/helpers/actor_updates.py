"""One RL step of the actor on the tiny model, as a forked rank runs it, and what the actor
tests compare it with: the step's rounding paths, the token rules' settings and their formulas,
engine log-probs that drift by a known shift, the whole model gathered from every rank's stage."""

from __future__ import annotations

from dataclasses import replace

import torch

from harness import init_megatron
from tiny_models import random_samples, tiny_hf_config
from tolerance import grad_terms, transformer_terms

from megatron_entropy.models.arch import arch_from_hf_config


def update_worker(loss: str, scope: str, selection_logprobs: str,
                   loss_agg_mode: str = "token-mean", empty_response: bool = False,
                   micro_batch_tokens: int = 24, rules: dict | None = None,
                   clip_ratio: float = 1.0, temperature: float = 1.0,
                   distributed_optimizer: bool = False, correction: dict | None = None,
                   overlap: bool = False, kl_cov_ratio: float = 0.1,
                   loss_knobs: dict | None = None, algorithm_extra: dict | None = None,
                   layout: str = "padded", shared_prompts: bool = False, lr: float = 1e-2,
                   entropy_lemma: bool = False, tensor: int = 1, inserted: bool = False,
                   inserted_shift: float = 0.0):
    """One RL step's updates (2 epochs x 2 mini-batches) of the tiny model on ``random_samples(0)`` (plus
    a sample with an empty response, last), with the token rules ``rules`` (TokenRuleSettings
    fields) and the rollout correction ``correction`` (RolloutCorrectionSettings fields; engine
    log-probs from ``drift_engine_logprobs``) and the step's ``loss_knobs`` (as the entropy
    controller passes them), ``algorithm_extra`` any other AlgorithmConfig fields, the
    micro-batch ``layout``, with ``shared_prompts`` the samples of a group sharing their prompt,
    ``lr`` the learning rate and ``entropy_lemma`` the actor's lemma probe, at TP ``tensor``,
    with ``inserted`` tokens in the responses (``random_samples``) whose old and engine
    log-probs are moved by ``inserted_shift`` after the recompute; returns the weights after,
    the metrics (and this rank's recompute entropies), the weights before."""
    from megatron_entropy.algorithms.rollout_correction import RolloutCorrectionSettings
    from megatron_entropy.algorithms.token_rules import TokenRuleSettings
    from megatron_entropy.config import (AlgorithmConfig, ModelConfig, ParallelConfig,
                                         TrainerConfig)
    from megatron_entropy.models.sharding import full_state_dict
    from megatron_entropy.trainer.actor import Actor
    from megatron_entropy.trainer.model_setup import (build_optimizer, build_trainable_model,
                                                      gather_params)
    from megatron_entropy.trainer.rollouts import dp_share

    init_megatron(tensor)
    arch = arch_from_hf_config(tiny_hf_config("qwen2"))
    chunks = build_trainable_model(
        arch, ModelConfig(dtype="fp32", transformer_impl="local", seq_length=64),
        ParallelConfig(tensor=tensor), distributed_optimizer=distributed_optimizer,
        overlap=overlap)
    initial = full_state_dict(chunks[0])
    # adam_eps = 1: updates proportional to the gradients. With a tiny eps Adam turns float noise
    # in near-zero gradients into full-size steps, and the comparison would test that noise.
    # One step of 2 epochs x 2 mini-batches: 4 updates.
    trainer = TrainerConfig(lr=lr, steps=1, grad_clip=0.0, adam_eps=1.0, weight_decay=0.0,
                            micro_batch_tokens=micro_batch_tokens, mini_batches_per_step=2,
                            ppo_epochs=2, seed=5, micro_batch_layout=layout)
    optimizer, scheduler = build_optimizer(chunks, trainer,
                                           distributed_optimizer=distributed_optimizer)
    algorithm = AlgorithmConfig(
        loss=loss, clip_cov_ratio=0.1, clip_cov_lb=0.0, clip_cov_ub=100.0, kl_cov_ratio=kl_cov_ratio,
        kl_cov_coef=1.0, clip_ratio_low=clip_ratio, clip_ratio_high=clip_ratio,
        loss_agg_mode=loss_agg_mode, logprob_impl="fused", cov_scope=scope,
        global_selection_logprobs=selection_logprobs,
        token_rules=TokenRuleSettings(**(rules or {})),
        rollout_correction=RolloutCorrectionSettings(**(correction or {})),
        **(algorithm_extra or {}))
    actor = Actor(arch, chunks, optimizer, scheduler, algorithm, trainer, temperature,
                  entropy_lemma=entropy_lemma)
    samples = random_samples(0, shared_prompts=shared_prompts, inserted=inserted)
    if empty_response:
        samples.append(replace(samples[0], response_ids=[], engine_logprobs=[]))
    mine = dp_share(samples)
    actor.recompute(mine)
    if correction:
        drift_engine_logprobs(mine)
    for smp in mine:
        if smp.loss_mask is not None and inserted_shift:
            shift = inserted_shift * (1 - torch.tensor(smp.loss_mask, dtype=torch.float64))
            smp.engine_logprobs = (torch.tensor(smp.engine_logprobs, dtype=torch.float64)
                                   + shift).tolist()
            if smp.old_logprobs is not None:  # None: the first update scores it itself
                smp.old_logprobs = smp.old_logprobs + shift.to(smp.old_logprobs.dtype)
    metrics = actor.update(mine, step=1, loss_knobs=loss_knobs)
    # The largest |log-prob| the selection saw, the scale of its rounding.
    metrics["max_abs_logp"] = float(torch.cat([s.old_logprobs for s in mine]).abs().max())
    metrics["recompute_entropies"] = [s.entropy.double() for s in mine]
    metrics["sample_indices"] = [next(i for i, x in enumerate(samples) if x is s) for s in mine]
    metrics["optimizers"] = [type(o).__name__
                             for o in getattr(optimizer, "chained_optimizers", [optimizer])]
    gather_params(chunks)
    return full_state_dict(chunks[0]), metrics, initial


UPDATES = 4  # ppo_epochs x mini_batches_per_step


# The engine's log-probs in the correction tests: the recompute minus a shift that depends on
# the token and its position only (so on no split of the step), rho = e^shift: kept and
# rejected by mis's [0.5, 2] (ln 2 = 0.69) with a margin far above rounding, capped by tis's 2.
SHIFTS = (0.0, 0.3, -0.3, 1.0, -1.0)


def drift_engine_logprobs(samples) -> None:
    for s in samples:
        shift = torch.tensor([SHIFTS[(t + i) % len(SHIFTS)] for i, t in enumerate(s.response_ids)],
                             dtype=torch.float64)
        s.engine_logprobs = (s.old_logprobs.double() - shift).tolist()


def rounding_paths(samples, seq: int | None = None) -> tuple:
    """The rounding paths (tests/helpers/tolerance.py) of one log-prob of the tiny model over
    ``seq`` tokens (the longest sample; a shared-prompt row is longer), and of one gradient (that
    path plus every response token of the step)."""
    logp_path = transformer_terms(arch_from_hf_config(tiny_hf_config("qwen2")),
                                  seq or max(s.length for s in samples), log_softmax=True)
    return logp_path, grad_terms(logp_path, sum(len(s.response_ids) for s in samples))


# The token rules through the actor. At temperature 0.1 the tiny random model's token entropies
# spread over ~1-4 nats (at 1.0 they all sit within 1e-3 of log V, and a rounding difference
# between two packings could reorder them): the selections are well separated, so they are
# compared exactly and the updates to rounding.
RULE_TEMPERATURE = 0.1


RULES = {
    "minority": ("ppo_clip", "micro_batch", 1.0,
                 dict(high_entropy_minority=True, high_entropy_scope="global")),
    "archer": ("ppo_clip", "micro_batch", 0.02,
               dict(entropy_clip=True, entropy_clip_scope="global", high_clip_ratio_low=0.2,
                    high_clip_ratio_high=0.2)),
    "shaping": ("kl_cov", "global", 1.0, dict(entropy_advantage=True,
                                              entropy_advantage_alpha=0.05)),
}


def step_entropies(rank_metrics: list[dict]) -> list[torch.Tensor]:
    """The recompute's entropies of every sample of the step, in sample order, from the metrics
    of every DP rank (each recomputed its own share)."""
    by_index = {i: h for m in rank_metrics
                for i, h in zip(m["sample_indices"], m["recompute_entropies"])}
    return [by_index[i] for i in range(len(by_index))]


def rule_reference(rule: str, entropies: list[torch.Tensor]) -> dict[str, float]:
    """The rule's metrics over the two mini-batches (samples 0-3, 4-7; each seen in both
    epochs, selected with the same recompute entropies), from its formula on one process."""
    samples = random_samples(0)
    _, _, _, rules = RULES[rule]
    if rule == "shaping":
        rows = [torch.minimum(0.05 * h, torch.full_like(h, abs(s.advantage) / 2))
                for h, s in zip(entropies, samples)]
        bonus = torch.cat(rows)
        capped = torch.cat([(0.05 * h > abs(s.advantage) / 2).double()
                            for h, s in zip(entropies, samples)])
        return {"entropy_rule/adv_bonus_mean": float(bonus.mean()),
                "entropy_rule/adv_bonus_capped_frac": float(capped.mean())}
    chosen, total = [], 0
    for part in (entropies[:4], entropies[4:]):
        h = torch.cat(part)
        total += h.numel()
        if rule == "minority":
            k = max(1, int(h.numel() * 0.2 + 0.9999))
            chosen.append(torch.sort(h, descending=True).values[:k])
        else:  # above the order statistic x_(floor(0.8 (n - 1)))
            threshold = torch.sort(h).values[int(0.8 * (h.numel() - 1))]
            chosen.append(h[h > threshold])
    chosen = torch.cat(chosen)
    if rule == "minority":
        return {"entropy_rule/pg_token_frac": chosen.numel() / total,
                "entropy_rule/pg_token_entropy_mean": float(chosen.mean())}
    return {"entropy_rule/high_entropy_frac": chosen.numel() / total}


def weights_after(results: list) -> dict[str, torch.Tensor]:
    """The whole model from every rank's stage (TP ranks of a stage hold the same full tensors)."""
    return {name: t for _, weights in results for name, t in weights.items()}


def layout_worker(tp: int, pp: int, weights: dict, args: tuple, extra: dict | None = None):
    """``update_worker(*args, **extra)`` in another layout: Megatron's parallel state and the
    model at (TP, PP), the model loaded from ``weights`` (the TP=1 run's initial weights; the
    initial shards of another layout come from other draws). Runs in a forked rank, so the two names it
    replaces stay replaced only there."""
    from megatron.core import parallel_state as ps

    from megatron_entropy.models.sharding import load_full_state_dict
    from megatron_entropy.trainer import model_setup

    build = model_setup.build_trainable_model

    def build_in_layout(arch, model_cfg, parallel, *rest, **kwargs):
        chunks = build(arch, model_cfg, replace(parallel, tensor=tp, pipeline=pp), *rest,
                       **kwargs)
        load_full_state_dict(chunks[0], weights)
        return chunks

    model_setup.build_trainable_model = build_in_layout
    global init_megatron
    base = init_megatron
    init_megatron = lambda tensor=1: base(tensor=tp, pipeline=pp)  # noqa: E731
    out = update_worker(*args, **(extra or {}))
    assert (ps.get_tensor_model_parallel_world_size(),
            ps.get_pipeline_model_parallel_world_size()) == (tp, pp)
    return out
