"""The actor: the Megatron policy (and optional frozen reference) that recomputes log-probs and
entropies and takes PPO-style updates through Megatron's pipeline schedules.

Data flow inside one RL step (per rank; every rank of a DP replica holds the same samples):
  recompute(samples)             forward-only: old log-probs + entropies (+ reference log-probs)
                                 of every sample, or of all but the first mini-batch's when that
                                 one scores itself (``first_update_scores_itself``)
  update(samples)                ppo_epochs x mini-batches: [entropy advantage shaping]
                                 -> [global Cov / token-rule selection] -> micro-batches
                                 through forward_backward_func -> Megatron optimizer step
  entropy_change(samples)        optional: forward-only again after the updates -> entropy/delta
Log-prob/entropy come from the vocab-parallel ops (logits path) or the fused output-layer op
(hidden-states path), at the rollout temperature, for response tokens only.

Token rules (algorithms/token_rules.py) choose with a detached per-token entropy: in the
``micro_batch``/``response`` populations the training forward's (their references); in
``global`` the one of the log-probs that select for the global Cov scope
(``global_selection_logprobs``: the recompute's, or a fresh forward-only pass), chosen before
the training forwards. Advantage shaping uses the recompute's entropy (the policy that sampled;
equal to the training forward's on the first update of an on-policy step), so the shaped
advantage exists before any selection and the Cov of either scope is computed on it.

Rollout correction (algorithms/rollout_correction.py) comes first in each mini-batch, on every
rank, from the recompute's and the engine's log-probs: ``mis`` replaces each micro-batch's mask,
so the step normalizer, the Cov population of either scope, the token rules' populations and
the loss all leave the rejected tokens out; ``tis``'s weight is merged with the token rules'
adjustments in the loss.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence

import torch
from megatron.core import parallel_state as ps
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_entropy.algorithms.aggregation import step_normalizer
from megatron_entropy.algorithms import token_rules as rules_ops
from megatron_entropy.algorithms.entropy_methods import TOP_P_ENTROPY, EntropyMethods
from megatron_entropy.algorithms.policy_loss import (TokenSelection, policy_loss,
                                                     reduce_metrics, select_tokens_global)
from megatron_entropy.algorithms.rollout_correction import RolloutCorrection, correct_rollout
from megatron_entropy.algorithms.settings import PolicyLossSettings
from megatron_entropy.config import AlgorithmConfig, TrainerConfig
from megatron_entropy.models.arch import ModelArch
from megatron_entropy.models.lora import adapters_disabled
from megatron_entropy.models.output_head import (hidden_states_instead_of_logits,
                                                 output_layer_weight)
from megatron_entropy.models.positions import token_positions
from megatron_entropy.models.sharding import unwrap_model
from megatron_entropy.ops.logprob_entropy import (fused_linear_logprob_entropy,
                                                  vocab_parallel_logprob_entropy)
from megatron_entropy.runtime.seeds import micro_batch_draw_seed, update_seed
from megatron_entropy.trainer.batch import MicroBatch, Sample, engine_token_stats, to_device
from megatron_entropy.trainer.context_parallel import gather_token_stats
from megatron_entropy.trainer.entropy_change import entropy_change_metrics
from megatron_entropy.trainer.model_setup import optimizer_step
from megatron_entropy.trainer.moe_routing import (MoeRouting, is_filler, router_padding,
                                                  with_fillers)
from megatron_entropy.trainer.packing import (SampleOrder, micro_batches, resolve_layouts,
                                              thd_params)
from megatron_entropy.trainer.step_methods import (MethodsStep, fill_token_stats,
                                                   recomputed_entropy, recomputed_stat, stats_fn)
from megatron_entropy.trainer.step_rules import StepRules


@dataclass
class MiniBatchPlan:
    """What the losses of one mini-batch's micro-batches use, decided before their forwards."""

    loss: PolicyLossSettings  # the algorithm's, with this step's knobs
    normalizer: float  # the step normalizer of the mini-batch's tokens (loss_agg_mode)
    draw_seed: int  # Clip-Cov's draws: from it and the micro-batch's index
    selections: Optional[list]  # per micro-batch: the global Cov scope's choice
    step_rules: Optional[StepRules]  # the token rules (on the last PP stage)
    shaping: dict[int, dict]  # entropy advantage shaping's metrics, per micro-batch
    corrections: dict[int, RolloutCorrection]  # the rollout correction, per micro-batch
    own_old: bool  # the old log-probs are this forward's (the step's first update)
    keeps: bool  # ... and become the samples' own (the recompute left them out)
    methods: MethodsStep  # the entropy methods' populations and terms
    # micro-batch index -> this forward's "logp" and "entropy", where it ``keeps`` them
    scored: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)


class Actor:
    """The policy's updates, configured by the ``algorithm`` section (the loss's settings, the
    token rules, the rollout correction, log-prob and Cov-scope keys) and the ``trainer``
    section (micro-batch budget, mini-batches, epochs, seed); ``temperature`` is the rollout's,
    at which log-probs and entropies are scored. A mixture-of-experts policy records the
    recompute's routing and replays it in the updates with ``routing_replay`` ``recompute`` (R2)
    or ``rollout`` (R3: the recompute replays the engine's routing first)."""

    def __init__(self, arch: ModelArch, model_chunks: list, optimizer, scheduler,
                 algorithm: AlgorithmConfig, trainer: TrainerConfig, temperature: float,
                 ref_model: Optional[torch.nn.Module] = None,
                 routing_replay: str = "none", entropy_lemma: bool = False) -> None:
        self.arch = arch
        self.model = model_chunks
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.algorithm = algorithm
        self.trainer = trainer
        self.temperature = temperature
        self.ref_model = ref_model
        self.ps = ps
        self.device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
        self.routing = (MoeRouting(model_chunks, routing_replay)
                        if arch is not None and arch.is_moe else None)
        self.context = ps.get_context_parallel_world_size()
        self.layouts = resolve_layouts(trainer.micro_batch_layout, arch, model_chunks,
                                       self.context)
        self.methods = EntropyMethods(algorithm)  # their state: checkpointed by the loop
        self.entropy_lemma = entropy_lemma  # analysis.entropy_lemma: trainer/step_methods.py
        # The lemma's probe reads the first mini-batch's recomputed old log-probs.
        self.first_update_scores_itself = first_update_scores_itself(
            algorithm, self.routing is not None) and not entropy_lemma

    # ------------------------------------------------------------------ token statistics

    def _token_stats(self, model, output: torch.Tensor, mb: MicroBatch
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob and entropy [N] of each response token from the last stage's output."""
        flat = output.reshape(-1, output.shape[-1])
        rows = flat.index_select(0, mb.flat_positions)
        kwargs = dict(vocab_size=self.arch.vocab_size,
                      group=self.ps.get_tensor_model_parallel_group(),
                      temperature=self.temperature,
                      chunk_tokens=self.algorithm.logprob_chunk_tokens)
        if self.algorithm.logprob_impl == "fused":
            logp, ent = fused_linear_logprob_entropy(rows, output_layer_weight(model),
                                                     mb.targets, **kwargs)
        else:
            logp, ent = vocab_parallel_logprob_entropy(rows, mb.targets, **kwargs)
        return gather_token_stats(logp, ent, mb, self.ps.get_context_parallel_group())

    def _model_forward(self, model, mb: MicroBatch) -> torch.Tensor:
        with contextlib.ExitStack() as stack:
            if self.algorithm.logprob_impl == "fused":
                stack.enter_context(hidden_states_instead_of_logits(model))
            if mb.attention_mask is not None:  # shared-prompt rows: positions token by token
                stack.enter_context(token_positions(model, mb.position_ids))
            packed = thd_params(mb)
            # A mixture of experts leaves padding out of its router losses; dense: as before.
            kwargs = ({"padding_mask": router_padding(model, mb)}
                      if self.routing is not None else {})
            if packed is None:
                return model(mb.tokens, mb.position_ids, mb.attention_mask, **kwargs)
            return model(mb.tokens, mb.position_ids, None, packed_seq_params=packed, **kwargs)

    def _pack(self, samples: list[Sample], ids: Optional[list[int]] = None
              ) -> list[MicroBatch]:
        return micro_batches(
            samples, ids, self.layouts, self.trainer.micro_batch_tokens,
            None if self.arch is None else self.arch.attention_pairs_per_token,
            self.ps.get_tensor_model_parallel_world_size(),
            bool(self.model) and unwrap_model(self.model).config.sequence_parallel,
            self.context, self.ps.get_context_parallel_rank())

    def _run_schedule(self, model_chunks: list, micro_batches: list[MicroBatch],
                      loss_fn: Callable[[Any, torch.Tensor, MicroBatch], tuple],
                      forward_only: bool,
                      scope: Optional[Callable[[MicroBatch], ContextManager]] = None
                      ) -> list[dict]:
        """Run micro-batches through Megatron's schedule; returns the last stage's loss dicts.
        ``scope(mb)`` is entered around each micro-batch's forward (MoE routing). With expert
        parallelism, filler micro-batches even out the EP ranks' forwards (moe_routing.py)."""
        if self.arch is not None and self.arch.is_moe:
            micro_batches = with_fillers(micro_batches)
        if not micro_batches:
            return []
        queue = iter(micro_batches)

        def forward_step(data_iterator, model):
            mb = to_device(next(data_iterator), self.device)
            if is_filler(mb):
                # Forward-only passes run in eval mode already; an update's routers need it.
                filler = (self.routing.filler(mb) if self.routing is not None and not forward_only
                          else contextlib.nullcontext())
                with filler:
                    output = self._model_forward(model, mb)
                return output, lambda out: (out.sum() * 0.0, torch.tensor(0, dtype=torch.int),
                                            {"filler": True})
            with scope(mb) if scope else contextlib.nullcontext():
                output = self._model_forward(model, mb)
            if self.routing is not None and not forward_only:
                self.routing.weigh(output, mb)
            return output, lambda out: loss_fn(model, out, mb)

        seq = max(mb.tokens.shape[1] for mb in micro_batches)
        rows = max(mb.tokens.shape[0] for mb in micro_batches)
        outs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=queue, model=model_chunks,
            num_microbatches=len(micro_batches), seq_length=seq, micro_batch_size=rows,
            forward_only=forward_only)
        return [o for o in outs if "filler" not in o]

    def _broadcast_from_last_stage(self, obj: Any) -> Any:
        """Results exist on the last PP stage only; every stage of the replica gets them."""
        if self.ps.get_pipeline_model_parallel_world_size() == 1:
            return obj
        box = [obj if self.ps.is_pipeline_last_stage() else None]
        torch.distributed.broadcast_object_list(
            box, src=self.ps.get_pipeline_model_parallel_last_rank(),
            group=self.ps.get_pipeline_model_parallel_group())
        return box[0]

    # ------------------------------------------------------------------ forward-only passes

    @torch.no_grad()
    def _forward_only(self, chunks: list, mbs: list[MicroBatch],
                      scope: Optional[Callable[[MicroBatch], ContextManager]] = None,
                      stats: Optional[Callable[..., dict]] = None) -> dict[int, dict]:
        """micro-batch index -> name -> [N] per response token (``stats(model, output, mb)``;
        default: logp and entropy); on the last PP stage only."""
        stats = stats or stats_fn(self, ())
        for c in chunks:
            c.eval()

        def loss_fn(model, output, mb):
            named = {k: v.float().cpu() for k, v in stats(model, output, mb).items()}
            return (output.new_zeros(()), torch.tensor(0, dtype=torch.int),
                    {"index": mb.index, **named})

        try:
            outs = self._run_schedule(chunks, mbs, loss_fn, forward_only=True, scope=scope)
        finally:
            for c in chunks:
                c.train()
        return {o.pop("index"): o for o in outs}

    def compute_logprobs(self, samples: list[Sample], reference: bool = False,
                         record_routing: bool = False, ids: Optional[list[int]] = None
                         ) -> list[Optional[tuple[torch.Tensor, torch.Tensor]]]:
        """(log-probs, entropies) of each sample's response tokens under the current policy (or
        the frozen reference), on every rank of the replica; only of the samples ``ids`` when
        given (None for the others); ``record_routing``: an MoE policy stores each sample's
        routing (``Sample.routing``)."""
        if reference and self.ref_model is None:
            raise RuntimeError("reference log-probs need a reference model (algorithm.kl_coef > 0)")
        mbs = self._pack(samples, ids)
        scope = None
        if record_routing and self.routing is not None:
            scope = lambda mb: self.routing.record(mb, samples)  # noqa: E731
        # A LoRA policy's reference is itself with its adapters off (no-op on another model).
        with adapters_disabled(self.ref_model) if reference else contextlib.nullcontext():
            stats = self._forward_only([self.ref_model] if reference else self.model, mbs, scope)
        by_sample = self._by_sample(mbs, stats, samples)
        return [(by_sample[i]["logp"], by_sample[i]["entropy"]) if i in by_sample else None
                for i in range(len(samples))]

    def _by_sample(self, mbs: list[MicroBatch], stats: dict[int, dict],
                   samples: Sequence[Sample]) -> dict[int, dict]:
        """Per-micro-batch named statistics ([N, ...]) of the last PP stage as sample index ->
        name -> its response tokens' rows, on every stage of the replica."""
        result: dict[int, dict] = {}
        if self.ps.is_pipeline_last_stage():
            for mb in mbs:
                lengths = [len(samples[i].response_ids) for i in mb.sample_ids]
                for name, values in stats[mb.index].items():
                    for sid, part in zip(mb.sample_ids, values.split(lengths)):
                        result.setdefault(sid, {})[name] = part
        return self._broadcast_from_last_stage(result)

    def recompute(self, samples: list[Sample]) -> None:
        """Fill old log-probs and entropies (and reference log-probs) of the samples: the
        policy's, from a forward-only pass, or with ``old_logprobs`` ``engine`` the engine's own
        of the tokens it sampled (no forward of the policy). Where the step's first update
        scores itself, the first mini-batch's samples are left to it (``update`` fills them)."""
        if self.algorithm.old_logprobs == "engine":
            for s in samples:
                s.old_logprobs, s.entropy = engine_token_stats(s)
        else:
            ids = None
            if self.first_update_scores_itself:
                first_end = self._mini_batch_bounds(len(samples))[1]
                ids = list(range(first_end, len(samples)))
                for s in samples[:first_end]:
                    s.old_logprobs = s.entropy = None
            stats = self.compute_logprobs(samples, record_routing=True, ids=ids)
            for s, st in zip(samples, stats):
                if st is not None:
                    s.old_logprobs, s.entropy = st
        fill_token_stats(self, samples)
        if self.ref_model is not None:
            for s, (lp, _) in zip(samples, self.compute_logprobs(samples, reference=True)):
                s.ref_logprobs = lp

    # ------------------------------------------------------------------ updates

    def _selection_inputs(self, mbs: list[MicroBatch], samples: Sequence[Sample]
                          ) -> Optional[tuple[list, list, dict]]:
        """The ([B, R] log-probs, entropies, name -> vocab statistics) per micro-batch that
        choose for the step's populations (``global`` scope, token rules, entropy methods), on
        the loss's device; None when nothing selects globally or off the last PP stage."""
        names = self.methods.token_stat_names()
        if self.algorithm.cov_scope != "global" and not self.methods.selects and \
                not StepRules.needs_select_entropies(self.algorithm.token_rules):
            return None
        if self.algorithm.global_selection_logprobs == "fresh":
            # An extra forward-only pass: the current policy's log-probs, exact for every update.
            fresh = self._forward_only(self.model, mbs, stats=stats_fn(self, names))
            if not self.ps.is_pipeline_last_stage():
                return None
            named = {n: [mb.scatter(fresh[mb.index][n]) for mb in mbs]
                     for n in ("logp", "entropy", *names)}
        else:
            if not self.ps.is_pipeline_last_stage():
                return None
            named = {"logp": [mb.old_logprobs for mb in mbs],
                     "entropy": [recomputed_entropy(mb, samples) for mb in mbs],
                     **{n: [recomputed_stat(mb, samples, n) for mb in mbs] for n in names}}
        named = {n: [t.to(self.device) for t in ts] for n, ts in named.items()}
        return named.pop("logp"), named.pop("entropy"), named

    def _global_selections(self, loss: PolicyLossSettings, mbs: list[MicroBatch],
                           samples: Sequence[Sample], inputs: Optional[tuple[list, list]],
                           seed: int) -> Optional[list]:
        """Clip-Cov/KL-Cov token choice over the whole optimizer step (cov_scope=global)."""
        if self.algorithm.cov_scope != "global" or inputs is None:
            return None
        # On the device of the loss (and of NCCL's collectives), in the step's order (group,
        # sample, token): the same draw whatever DP rank, micro-batch and layout hold a sample.
        dev = [to_device(mb, self.device) for mb in mbs]
        order = SampleOrder(dev)
        (chosen,) = select_tokens_global(
            loss, [order.join(inputs[0])], [order.join([mb.old_logprobs for mb in dev])],
            [order.join([mb.advantages for mb in dev])], [order.join([mb.mask for mb in dev])],
            dp_group=self.ps.get_data_parallel_group(), seed=seed,
            row_keys=[torch.tensor([samples[sid].group for sid, _, _ in order.rows])])
        return [TokenSelection(selected, cov) for selected, cov in
                zip(order.split(chosen.selected), order.split(chosen.cov))]

    def _shape_advantages(self, mbs: list[MicroBatch], samples: Sequence[Sample]
                          ) -> dict[int, dict]:
        """Entropy advantage shaping in place (``mb.advantages``); its metrics per micro-batch."""
        if not self.algorithm.token_rules.entropy_advantage:
            return {}
        metrics = {}
        for mb in mbs:
            mb.advantages, metrics[mb.index] = rules_ops.shape_advantages(
                self.algorithm.token_rules, mb.advantages, recomputed_entropy(mb, samples),
                mb.mask)
        return metrics

    def _correct_rollouts(self, mbs: list[MicroBatch], samples: Sequence[Sample]
                          ) -> dict[int, RolloutCorrection]:
        """The rollout correction of each micro-batch; ``mis``'s mask replaces ``mb.mask`` (on
        every rank, before the step normalizer). Micro-batches without (finite) engine
        log-probs are left out when the mode is ``none`` (it only logs metrics: a run without
        correction never stops for them) and an error otherwise. A micro-batch that scores
        itself (``first_update_scores_itself``; mode ``none`` only) gets its metrics in its
        forward."""
        out = {}
        for mb in mbs:
            if mb.old_logprobs is None:  # scored in its own forward (mode none): done there
                continue
            correction = self._rollout_correction(mb, mb.old_logprobs, samples)
            if correction is not None:
                out[mb.index] = correction
                mb.mask = correction.mask
        return out

    def _rollout_correction(self, mb: MicroBatch, old_logprobs: torch.Tensor,
                            samples: Sequence[Sample]) -> Optional[RolloutCorrection]:
        settings = self.algorithm.rollout_correction
        if settings.mode == "none" and (mb.engine_logprobs is None or not bool(
                torch.isfinite(mb.engine_logprobs[mb.mask.bool()]).all())):
            return None
        if mb.engine_logprobs is None:
            raise ValueError(f"algorithm.rollout_correction.mode={settings.mode} needs the "
                             "engine's log-prob of every response token; samples "
                             f"{mb.sample_ids} lack some")
        return correct_rollout(settings, old_logprobs, mb.engine_logprobs, mb.mask,
                               [samples[i].source for i in mb.sample_ids])

    def _mini_batch_bounds(self, n: int) -> list[int]:
        """Where each of the step's mini-batches of ``n`` samples starts (and the end)."""
        n_mini = self.trainer.mini_batches_per_step
        return [round(i * n / n_mini) for i in range(n_mini + 1)]

    def update(self, samples: list[Sample], step: int,
               loss_knobs: Optional[Mapping[str, float]] = None) -> dict[str, float]:
        """ppo_epochs x mini_batches_per_step optimizer steps over this rank's samples.
        ``loss_knobs`` are this step's values of loss settings that change while the run goes
        (the entropy controller's knob); the ``algorithm`` section keeps the configured ones."""
        loss = replace(self.algorithm, **loss_knobs) if loss_knobs else self.algorithm
        self.methods.begin_step([s.token_stats.get(TOP_P_ENTROPY) for s in samples],
                                self.ps.get_data_parallel_group())
        bounds = self._mini_batch_bounds(len(samples))
        all_metrics: list[dict] = []
        opt_stats: list[dict] = []
        for epoch in range(self.trainer.ppo_epochs):
            for k in range(self.trainer.mini_batches_per_step):
                mbs = self._pack(samples, list(range(bounds[k], bounds[k + 1])))
                plan = self._plan(mbs, samples, loss, step, epoch, k)
                all_metrics.extend(self._train(plan, mbs, samples))
                opt_stats.append(optimizer_step(self.optimizer, self.scheduler, self.model))
                opt_stats[-1]["lemma"] = plan.methods.after_update(self, mbs)
        return self._summarize(all_metrics, opt_stats)

    def _plan(self, mbs: list[MicroBatch], samples: list[Sample], loss: PolicyLossSettings,
              step: int, epoch: int, k: int) -> MiniBatchPlan:
        """Mini-batch ``k`` of ``epoch``: what its micro-batches' losses use, decided before
        their forwards (rollout correction, advantage shaping, the step normalizer, global
        selections, the token rules' populations)."""
        corrections = self._correct_rollouts(mbs, samples)
        shaping = self._shape_advantages(mbs, samples)
        normalizer = step_normalizer([mb.mask for mb in mbs], self.algorithm.loss_agg_mode,
                                     self.ps.get_data_parallel_group(),
                                     self.algorithm.loss_scale_factor)
        correction = self.algorithm.rollout_correction
        if normalizer == 0 and correction.mode == "mis":
            raise RuntimeError(
                f"step {step}: algorithm.rollout_correction.mode=mis rejected every "
                f"token of mini-batch {k} (ratio trainer/engine outside "
                f"[{correction.mis_low}, {correction.mis_high}]): the engine and the "
                "trainer disagree far beyond precision; check the weight sync "
                "(rollout/logprob_drift) or widen mis_low/mis_high")
        # Every draw derives from (seed, step, epoch, mini-batch, micro-batch): resumable.
        draw_seed = update_seed(self.trainer.seed, step, epoch, k)
        inputs = self._selection_inputs(mbs, samples)
        selections = self._global_selections(loss, mbs, samples, inputs, draw_seed)
        step_rules = None
        if self.ps.is_pipeline_last_stage():
            step_rules = StepRules(self.algorithm.token_rules, loss,
                                   [mb.mask.to(self.device) for mb in mbs],
                                   None if inputs is None else inputs[1],
                                   self.ps.get_data_parallel_group())
        # The step's first update runs on the weights that sampled: its own forward gives
        # their old log-probs, as the recompute would (a ratio of exactly 1; the engine's
        # differ by rounding, which KL-Cov's |logp - old logp| would turn into gradients of
        # either sign). Without the engine's, the recompute left them out and this forward's
        # are kept as the samples' own.
        own_old = self.first_update_scores_itself and epoch == 0 and k == 0
        methods = MethodsStep(self, mbs, samples, inputs, self.ps.get_data_parallel_group(),
                              epoch == k == 0)
        return MiniBatchPlan(loss, normalizer, draw_seed, selections, step_rules, shaping,
                             corrections, own_old,
                             keeps=own_old and self.algorithm.old_logprobs == "recompute",
                             methods=methods)

    def _micro_batch_loss(self, plan: MiniBatchPlan, samples: list[Sample], model,
                          output: torch.Tensor, mb: MicroBatch) -> tuple:
        """The policy loss of one micro-batch of ``plan``'s mini-batch (the schedule's loss
        function), with its metrics."""
        logp, ent = self._token_stats(model, output, mb)
        entropy = mb.scatter(ent)
        old_logp = mb.scatter(logp.detach()) if plan.own_old else mb.old_logprobs
        adjust, rule_metrics = plan.step_rules.for_micro_batch(mb.index, entropy, mb.mask)
        adjust, method_metrics = plan.methods.adjust(
            mb, adjust, entropy.detach(),
            entropy.detach() if plan.own_old else recomputed_entropy(mb, samples))
        if plan.keeps:
            plan.scored[mb.index] = {"logp": logp.detach().float().cpu(),
                                     "entropy": ent.detach().float().cpu()}
            correction = self._rollout_correction(mb, old_logp, samples)
            if correction is not None:  # mode none: its metrics only
                rule_metrics.update(correction.metrics)
        if mb.index in plan.corrections:
            adjust = plan.corrections[mb.index].merged_into(adjust, entropy.device)
            rule_metrics.update(plan.corrections[mb.index].metrics)
        gen = torch.Generator().manual_seed(micro_batch_draw_seed(plan.draw_seed, mb.index))
        value, metrics = policy_loss(
            plan.loss, mb.scatter(logp), old_logp, mb.advantages, mb.mask,
            normalizer=plan.normalizer, entropy=entropy, ref_logp=mb.ref_logprobs,
            selection=None if plan.selections is None else plan.selections[mb.index],
            generator=gen, adjust=adjust)
        value = plan.methods.add_terms(self, model, output, mb, value, metrics,
                                       mb.scatter(logp), old_logp, plan.normalizer)
        metrics.update(rule_metrics, **method_metrics, **plan.shaping.get(mb.index, {}))
        return value, torch.tensor(mb.num_tokens, dtype=torch.int), {"m": metrics}

    def _train(self, plan: MiniBatchPlan, mbs: list[MicroBatch], samples: list[Sample]
               ) -> list[dict]:
        """The forwards and backwards of one mini-batch (no optimizer step); its micro-batches'
        loss metrics. Where it scores itself, the samples' old log-probs and entropies are
        filled from its forward, on every stage."""
        scope, step_scope = None, contextlib.nullcontext()
        if self.routing is not None:
            scope = lambda mb: self.routing.update(mb, samples)  # noqa: E731
            step_scope = self.routing.schedule(mbs)
        with step_scope:
            outs = self._run_schedule(self.model, mbs,
                                      functools.partial(self._micro_batch_loss, plan, samples),
                                      forward_only=False, scope=scope)
        if plan.keeps:
            for sid, d in self._by_sample(mbs, plan.scored, samples).items():
                samples[sid].old_logprobs, samples[sid].entropy = d["logp"], d["entropy"]
        return [o["m"] for o in outs]

    def entropy_change(self, samples: list[Sample]) -> dict[str, float]:
        """After ``update``: the step's response tokens scored again with the updated weights
        (forward only, the recompute's path) against the recompute's entropies, on every rank:
        entropy/delta, cov/step and per source (``analysis.entropy_change`` for definitions)."""
        after = [s.generated(ent) for s, (_, ent) in zip(samples, self.compute_logprobs(samples))]
        return entropy_change_metrics([s.generated(s.entropy) for s in samples], after,
                                      [s.generated(s.old_logprobs) for s in samples],
                                      [s.advantage for s in samples], [s.source for s in samples],
                                      self.ps.get_data_parallel_group())

    def _summarize(self, metrics: list[dict], opt_stats: list[dict]) -> dict[str, float]:
        out = None
        if self.ps.is_pipeline_last_stage():
            out = reduce_metrics(metrics, self.ps.get_data_parallel_group())
        out = dict(self._broadcast_from_last_stage(out) or {})
        norms = [s["grad_norm"] for s in opt_stats if s["grad_norm"] is not None]
        if norms:
            out["grad_norm"] = sum(norms) / len(norms)
        out["lr"] = opt_stats[-1]["lr"] if opt_stats else 0.0
        out["update_skipped"] = float(sum(not s["update_successful"] for s in opt_stats))
        if self.routing is not None:
            out.update(self.routing.metrics())
        out.update(self.methods.metrics())
        for s in opt_stats:
            out.update(s.get("lemma", {}))
        return out


def first_update_scores_itself(algorithm: AlgorithmConfig, moe: bool) -> bool:
    """Whether the step's first update takes its old log-probs from its own forward (on the
    weights that sampled: the recompute's function). With the engine's old log-probs, always;
    with the recompute, where nothing reads the first mini-batch's before that forward: the
    global Cov scope and global token rules choose, entropy advantage shaping and a weighting or
    masking rollout correction adjust before it, and an MoE policy replays the routing its
    recompute records."""
    methods = EntropyMethods(algorithm)
    if methods.controllers or methods.selects or methods.token_stat_names():
        return False  # they read the recompute of every sample before the first update
    if algorithm.old_logprobs == "engine":
        return True
    return not (moe or algorithm.cov_scope == "global"
                or StepRules.needs_select_entropies(algorithm.token_rules)
                or algorithm.token_rules.entropy_advantage
                or algorithm.rollout_correction.mode != "none")
