"""The entropy methods (algorithms/entropy_methods.py) through the actor: the vocab statistics of
the forward passes and one optimizer step's plan.

Vocab statistics beyond log-prob and entropy (SIREN's top-p entropy, Lp-Reg's min-p proxy
log-prob, the lemma's logits) come from the logits of the response tokens, this rank's vocab
shard: the model's logits on the ``chunked`` path; on the ``fused`` path (no logits) the final
hidden states times the output-layer shard, computed here for these statistics only (their
gradient reaches the hidden states through the output region's TP reduction, as the fused op's
does). The recompute stores them per sample (``Sample.token_stats``) in one more forward-only
pass, needed only by the methods that read them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch
from torch import Tensor

from megatron_entropy.algorithms.entropy_methods import (PROXY_SHIFT, TOP_P_ENTROPY,
                                                         StepPlan)
from megatron_entropy.algorithms.entropy_regularizers import difficulty_weights
from megatron_entropy.algorithms.policy_loss import TokenAdjustments
from megatron_entropy.models.output_head import output_layer_weight
from megatron_entropy.ops.vocab_stats import (vocab_parallel_entropy_change,
                                              vocab_parallel_min_p_shift,
                                              vocab_parallel_top_p_entropy)
from megatron_entropy.trainer.batch import MicroBatch, Sample
from megatron_entropy.trainer.context_parallel import gather_rows
from megatron_entropy.trainer.entropy_change import lemma_metrics

if TYPE_CHECKING:  # the actor imports this module
    from megatron_entropy.trainer.actor import Actor

LOGITS = "logits"  # this rank's vocab shard of each response token's logits (the lemma)


def recomputed_entropy(mb: MicroBatch, samples: Sequence[Sample]) -> Tensor:
    """[B, R] the recompute's entropies of the micro-batch's response tokens."""
    return mb.scatter(torch.cat([samples[i].entropy.float() for i in mb.sample_ids]))


def recomputed_stat(mb: MicroBatch, samples: Sequence[Sample], name: str) -> Tensor:
    """[B, R] a vocab statistic the recompute stored per sample (``Sample.token_stats``)."""
    return mb.scatter(torch.cat([samples[i].token_stats[name].float() for i in mb.sample_ids]))


def logit_rows(actor: "Actor", model, output: Tensor, mb: MicroBatch) -> Tensor:
    """[N, V_local] this rank's logits of the micro-batch's response tokens."""
    rows = output.reshape(-1, output.shape[-1]).index_select(0, mb.flat_positions)
    if actor.algorithm.logprob_impl == "fused":
        return torch.mm(rows, output_layer_weight(model).t())
    return rows


def vocab_token_stats(actor: "Actor", model, output: Tensor, mb: MicroBatch,
                      names: Sequence[str]) -> dict[str, Tensor]:
    """name -> [N] (the logits: [N, V_local]) of the micro-batch's response tokens."""
    z = logit_rows(actor, model, output, mb)
    kwargs = dict(vocab_size=actor.arch.vocab_size,
                  group=actor.ps.get_tensor_model_parallel_group(),
                  temperature=actor.temperature)
    a, out = actor.algorithm, {}
    for name in names:
        if name == TOP_P_ENTROPY:
            out[name] = vocab_parallel_top_p_entropy(z, top_p=a.siren.top_p, top_k=a.siren.top_k,
                                                     **kwargs)[0]
        elif name == PROXY_SHIFT:
            out[name] = vocab_parallel_min_p_shift(z, mb.targets, min_p=a.lp_reg.min_p,
                                                   **kwargs)
        elif name == LOGITS:
            out[name] = z.detach()
        else:
            raise ValueError(f"unknown vocab statistic {name!r}")
    # Context parallelism: this rank's tokens' values -> the micro-batch's.
    return {n: gather_rows(v, mb, actor.ps.get_context_parallel_group()) for n, v in out.items()}


def stats_fn(actor: "Actor", names: Sequence[str], logprobs: bool = True
             ) -> Callable[..., dict[str, Tensor]]:
    """A forward-only pass's statistics: log-prob and entropy (``logprobs``) and ``names``."""
    def fn(model, output, mb):
        out = {}
        if logprobs:
            out["logp"], out["entropy"] = actor._token_stats(model, output, mb)
        out.update(vocab_token_stats(actor, model, output, mb, names))
        return out
    return fn


def fill_token_stats(actor: "Actor", samples: list[Sample]) -> None:
    """The recompute's vocab statistics of every sample, for the methods that read them."""
    names = actor.methods.token_stat_names()
    if not names:
        return
    mbs = actor._pack(samples)
    stats = actor._forward_only(actor.model, mbs, stats=stats_fn(actor, names, logprobs=False))
    for sid, d in actor._by_sample(mbs, stats, samples).items():
        samples[sid].token_stats.update(d)


class MethodsStep:
    """One optimizer step of the entropy methods: built on every rank (the controllers move
    everywhere), planned on the last PP stage from the selecting pass's ``inputs``
    ((log-probs, entropies, vocab statistics) per micro-batch, Actor._selection_inputs). With
    ``analysis.entropy_lemma`` the step's ``first`` optimizer step is also measured
    (``LemmaProbe``): call ``after_update`` once its optimizer step is taken."""

    def __init__(self, actor: "Actor", mbs: list[MicroBatch], samples: Sequence[Sample],
                 inputs: Optional[tuple], group, first: bool = False) -> None:
        methods = actor.methods
        self.methods, self.samples = methods, samples
        self.plan: Optional[StepPlan] = None
        self.probe = LemmaProbe(actor, mbs) if first and actor.entropy_lemma else None
        if not methods.active:
            return
        masks = [mb.mask.to(actor.device) for mb in mbs]
        coefficients = methods.step_inputs(
            [recomputed_entropy(mb, samples).to(actor.device) for mb in mbs], masks, group) \
            if methods.controllers else {}
        if not actor.ps.is_pipeline_last_stage():
            return
        weights = None
        if methods.algorithm.aer.enabled:
            by_id = dict(zip(range(len(samples)), difficulty_weights(
                [s.reward for s in samples], [s.group for s in samples])))
            weights = [[by_id[i] for i in mb.sample_ids] for mb in mbs]
        self.plan = StepPlan(methods, masks, [mb.advantages.to(actor.device) for mb in mbs],
                             None if inputs is None else inputs[0],
                             {} if inputs is None else inputs[2], weights, coefficients, group)

    def adjust(self, mb: MicroBatch, adjust: Optional[TokenAdjustments], entropy: Tensor,
               old_entropy: Tensor) -> tuple[Optional[TokenAdjustments], dict]:
        """The token rules' ``adjust`` with the methods' merged in, and the methods' metrics."""
        if self.plan is None:
            return adjust, {}
        mine, metrics = self.plan.adjustments(mb.index, mb.advantages, mb.mask, entropy,
                                              old_entropy)
        if mine is None:
            return adjust, metrics
        return (mine if adjust is None else adjust.merged(mine)), metrics

    def add_terms(self, actor: "Actor", model, output: Tensor, mb: MicroBatch, value: Tensor,
                  metrics: dict, logp: Tensor, old_logp: Tensor, normalizer: float) -> Tensor:
        """The micro-batch's loss ``value`` plus the methods' terms; their metrics join
        ``metrics``."""
        if self.plan is None:
            return value
        a = self.methods.algorithm
        top_p = proxy = None
        if a.siren.enabled:  # the training forward's, with gradient
            top_p = mb.scatter(vocab_token_stats(actor, model, output, mb,
                                                 [TOP_P_ENTROPY])[TOP_P_ENTROPY])
        if a.lp_reg.enabled:
            proxy = recomputed_stat(mb, self.samples, PROXY_SHIFT).to(logp.device)
        extra, extra_metrics = self.plan.extra_loss(mb.index, logp, old_logp, mb.advantages,
                                                    mb.mask, normalizer, top_p, proxy)
        metrics.update(extra_metrics)
        return value if extra is None else value + extra

    def after_update(self, actor: "Actor", mbs: list[MicroBatch]) -> dict[str, float]:
        """After the optimizer step: the lemma's metrics of it ({} unless probed)."""
        return {} if self.probe is None else self.probe.after(actor, mbs)


class LemmaProbe:
    """The entropy lemma per token over one optimizer step (trainer/entropy_change.py,
    ``lemma_metrics``): the logits of the mini-batch's response tokens before it (this rank's
    vocab shard, forward only; kept on the CPU: N x V/TP floats) and after it."""

    def __init__(self, actor: "Actor", mbs: list[MicroBatch]) -> None:
        self.before = actor._forward_only(actor.model, mbs,
                                          stats=stats_fn(actor, [LOGITS], logprobs=False))

    def after(self, actor: "Actor", mbs: list[MicroBatch]) -> dict[str, float]:
        after = actor._forward_only(actor.model, mbs,
                                    stats=stats_fn(actor, [LOGITS], logprobs=False))
        out = None
        if actor.ps.is_pipeline_last_stage():
            parts = [vocab_parallel_entropy_change(
                self.before[mb.index][LOGITS], after[mb.index][LOGITS],
                vocab_size=actor.arch.vocab_size, group=actor.ps.get_tensor_model_parallel_group(),
                temperature=actor.temperature) for mb in mbs]
            valid = [mb.mask.bool() for mb in mbs]
            out = lemma_metrics(*(torch.cat([p[i] for p in parts]) for i in range(3)),
                                torch.cat([mb.old_logprobs[v] for mb, v in zip(mbs, valid)]),
                                torch.cat([mb.advantages[v] for mb, v in zip(mbs, valid)]),
                                actor.ps.get_data_parallel_group())
        return actor._broadcast_from_last_stage(out)
