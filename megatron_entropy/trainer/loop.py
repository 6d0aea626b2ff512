"""The RL loop. Every rank runs ``train(cfg)`` (SPMD, under torchrun, srun or ``--nproc``):

    for step:
        rollout      prompts -> engine (DP leaders) -> rewards -> dynamic sampling -> advantages
        recompute    old log-probs, entropies (and reference log-probs) with the Megatron actor
        update       ppo_epochs x mini-batches of Clip-Cov / KL-Cov / PPO-clip
        [entropy change: the step's tokens scored again after the update]
        sync         Megatron weights -> HF names -> rollout engine (weight_sync/)
        log, validate, checkpoint

``Trainer.step`` is the body of that loop and returns the step's metrics, each part giving its
own (trainer/step_rollouts.py the rollouts', the actor the loss's); ``Trainer.run`` steps with
checkpoints and stops.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_entropy.config import Config, ConfigError
from megatron_entropy.data import PromptSampler, load_prompt_dataset, load_tokenizer
from megatron_entropy.models.arch import load_arch
from megatron_entropy.models.bridge import load_hf_weights
from megatron_entropy.models.builder import build_gpt_model
from megatron_entropy.models.megatron_checkpoint import (CheckpointError, check_same_model,
                                                         load_model_weights, read_arch)
from megatron_entropy.models.run_checkpoints import verify_checkpoint
from megatron_entropy.rewards import RewardScorer
from megatron_entropy.rollout import engine_is_shared
from megatron_entropy.runtime import init_distributed, set_seed, shutdown
from megatron_entropy.runtime.roles import Roles
from megatron_entropy.runtime import preemption
from megatron_entropy.trainer.actor import Actor
from megatron_entropy.trainer.batch import Sample
from megatron_entropy.trainer.checkpoint import CheckpointManager, resume_checkpoint
from megatron_entropy.trainer.drift import DriftTrend, drift_metrics
from megatron_entropy.trainer.entropy_control import (build_controller, controller_state,
                                                      loss_knobs, methods_state,
                                                      restore_controller, restore_methods,
                                                      update_controller)
from megatron_entropy.trainer.lora_run import STATE_KEY, base_identity, check_resume
from megatron_entropy.trainer.metrics import MetricsLogger, PhaseTimer
from megatron_entropy.trainer.model_setup import (build_optimizer, build_trainable_model,
                                                  gather_params)
from megatron_entropy.trainer.moe_routing import engine_notes
from megatron_entropy.runtime.preemption import PREEMPTED_EXIT_CODE
from megatron_entropy.trainer.rollouts import StepGroups, groups_to_samples
from megatron_entropy.trainer.run_folder import save_run_config
from megatron_entropy.trainer.step_metrics import (LOSS_METRIC_NAMES, device,
                                                    reduce_token_metrics)
from megatron_entropy.trainer.step_rollouts import Prompts, StepRollouts
from megatron_entropy.trainer.weight_check import (check_engine_weights, check_rollout_weights,
                                                   probe_sampling, tolerances)
from megatron_entropy.tool_use.engine import build_rollout_engine, prompt_tools
from megatron_entropy.tool_use.metrics import turn_entropy_metrics
from megatron_entropy.weight_sync import build_weight_sync


class Preempted(SystemExit):
    def __init__(self) -> None:
        super().__init__(PREEMPTED_EXIT_CODE)


@dataclass
class RunState:
    """Everything besides weights and optimizer that a resumed run needs."""

    step: int = 0
    rollout_seed: int = 0


class _SignalFlag:
    """SIGUSR1/SIGTERM/SIGINT ask for a checkpoint, then exit 75. The handler
    (runtime/preemption.py) is installed again here for callers of train() that did not install
    it first thing; a request it recorded during start-up is kept."""

    def __init__(self) -> None:
        preemption.install()

    def any_rank(self, time_up: bool = False) -> Optional[str]:
        """Why the run must stop (a signal on some rank, or the job's clock on some rank), or
        None; every rank gets the same answer."""
        flag = torch.tensor([float(preemption.requested()), float(time_up)], device=device())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        signalled, late = flag.tolist()
        return "signal received" if signalled else "the job's end is near" if late else None


class _StepAbandoned(Exception):
    """A stop request inside a step: nothing of the step is applied."""


class Trainer:
    """Builds every part from the config (``__init__``: the builders below, in order);
    ``step(n)`` is one RL step and returns its metrics; ``run()`` steps to ``trainer.steps``
    with validation, checkpoints and stops."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        started = time.time()
        self._join_ranks()
        self._read_model_and_prompts()
        resume_from = self._build_policy()
        self._stop_if_asked()
        self._starting(f"micro-batches: {self.actor.layouts.note}; starting the rollout "
                       f"engine ({cfg.rollout.engine})")
        self._build_rollouts()
        self._open_log(resume_from)
        self._first_contact(resume_from)
        self.clock = preemption.job_clock(cfg.trainer.exit_duration_minutes,
                                          cfg.trainer.exit_margin_s, started, self.rank0)
        self.saved_step = self.state.step if resume_from is not None else None
        if self.rank0:  # the run has started: record its config (an earlier one is kept)
            save_run_config(cfg, self.run_dir)

    # ------------------------------------------------------------------ builders

    def _join_ranks(self) -> None:
        """torch.distributed and Megatron's parallel state, the seed, the stop signals, each
        rank's roles, the reward."""
        cfg, p = self.cfg, self.cfg.parallel
        init_distributed(p.tensor, p.pipeline, p.backend, p.timeout_minutes,
                         socket_ifname=p.socket_ifname, expert=p.expert, context=p.context)
        set_seed(cfg.trainer.seed)
        self.signals = _SignalFlag()
        self.ps = ps
        self.roles = Roles.here(shared_engine=engine_is_shared(cfg.rollout.engine))
        self.reward = RewardScorer(cfg.reward)
        self.rank0 = self.roles.rank0
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)

    def _read_model_and_prompts(self) -> None:
        """The model's architecture and tokenizer from an HF folder or a converted Megatron
        checkpoint (whose hf/ folder holds config and tokenizer); the prompts."""
        cfg, m = self.cfg, self.cfg.model
        if m.megatron_ckpt:
            self.arch = read_arch(m.megatron_ckpt)
            self.hf_dir = m.hf_path or str(Path(m.megatron_ckpt) / "hf")
        else:
            if not m.hf_path:
                raise ValueError("set model.hf_path (an HF model folder) or model.megatron_ckpt")
            self.arch = load_arch(m.hf_path)
            self.hf_dir = m.hf_path
        self.arch.check_parallel(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.expert)
        if self.arch.is_moe and cfg.algorithm.old_logprobs == "engine":
            raise ConfigError("algorithm.old_logprobs=engine: a mixture-of-experts policy's "
                              "updates replay the routing its recompute records; use "
                              "algorithm.old_logprobs=recompute")
        n, ep, cp = dist.get_world_size(), cfg.parallel.expert, cfg.parallel.context
        self._starting(f"{n} rank{'s' * (n > 1)} joined (TP={cfg.parallel.tensor}, "
                       f"PP={cfg.parallel.pipeline}, {f'CP={cp}, ' if cp > 1 else ''}"
                       f"DP={ps.get_data_parallel_world_size()}"
                       f"{f', EP={ep}' if ep > 1 else ''}); loading the tokenizer and the prompts")
        self.tokenizer = load_tokenizer(self.hf_dir)
        tools = prompt_tools(cfg.rollout, self.tokenizer)  # listed in each prompt
        train_data, val_data = (load_prompt_dataset(cfg.data, self.tokenizer,
                                                    cfg.rollout.max_prompt_tokens, split, tools)
                                for split in ("train", "val"))
        self.prompts = Prompts(train_data, val_data,
                               PromptSampler(len(train_data), cfg.data.shuffle, cfg.data.seed))
        self._stop_if_asked()
        self._starting(f"{len(train_data):,} train and {len(val_data):,} validation "
                       "prompts; building the policy and loading its weights")

    def _build_policy(self) -> Optional[Path]:
        """The Megatron policy, its optimizer, the frozen reference (``algorithm.kl_coef`` >
        0), the actor, the entropy controller and the drift trend, restored from the checkpoint
        to resume (returned; None for a new run)."""
        cfg, m = self.cfg, self.cfg.model
        self.ckpt = CheckpointManager(self.run_dir, cfg.trainer.keep_last)
        resume_from = resume_checkpoint(cfg.trainer.resume, self.ckpt)
        if resume_from is not None:
            self._check_resumable(resume_from)
        sharded_optimizer = cfg.trainer.uses_distributed_optimizer(
            ps.get_data_parallel_world_size(with_context_parallel=True))
        replay = cfg.rollout.routing_replay if self.arch.is_moe else "none"
        self.model = build_trainable_model(
            self.arch, m, cfg.parallel, sharded_optimizer,
            overlap=cfg.trainer.uses_overlap(on_gpu=dist.get_backend() == "nccl"),
            routing_replay=replay != "none", seed=cfg.trainer.seed)
        if resume_from is None or m.lora.enabled:  # a LoRA checkpoint holds the adapters only
            self._load_initial_weights(self.model[0])
        self.base_identity = base_identity(self.model, m, self.hf_dir)
        optimizer, scheduler = build_optimizer(self.model, cfg.trainer, m.dtype,
                                               sharded_optimizer)
        # seq-mean-token-sum-norm's constant defaults to the longest response the rollout allows.
        self.actor = Actor(self.arch, self.model, optimizer, scheduler,
                           cfg.algorithm.with_response_budget(cfg.rollout.max_new_tokens),
                           cfg.trainer, cfg.rollout.temperature,
                           ref_model=self._reference_model(), routing_replay=replay,
                           entropy_lemma=cfg.analysis.entropy_lemma)
        self.controller = build_controller(cfg.algorithm, self.arch.vocab_size)
        self.drift = DriftTrend()
        self.state = RunState(rollout_seed=cfg.rollout.seed)
        if resume_from is not None:
            check_resume(verify_checkpoint(resume_from), self.base_identity, resume_from)
            saved = self.ckpt.load(resume_from, self.model, optimizer)
            scheduler.load_state_dict(saved["scheduler"])
            self.state = RunState(step=saved["step"], rollout_seed=saved["rollout_seed"])
            restore_controller(self.controller, saved)
            restore_methods(self.actor.methods, saved)
            self.drift.restore(saved)
        return resume_from

    def _reference_model(self) -> Optional[torch.nn.Module]:
        """The frozen reference policy of the KL penalty (None without one)."""
        cfg, m = self.cfg, self.cfg.model
        if cfg.algorithm.kl_coef <= 0:
            return None
        if m.lora.enabled:  # the base itself: the Actor turns the adapters off for it
            return self.model[0]
        ref_model = build_gpt_model(self.arch, cfg.parallel.tensor, cfg.parallel.pipeline,
                                    m.dtype, m.transformer_impl, m.seq_length,
                                    cfg.parallel.sequence_parallel, expert=cfg.parallel.expert)
        self._load_initial_weights(ref_model)
        ref_model.requires_grad_(False)
        return ref_model

    def _build_rollouts(self) -> None:
        """The rollout engine (per DP leader in-process, or one set of servers for the job),
        the weight sync into it, the weight check's tolerances and the rollout side."""
        cfg, lora = self.cfg, self.cfg.model.lora
        self.engine = build_rollout_engine(cfg.rollout, self.hf_dir, self.run_dir, lora) \
            if self.roles.talks_to_engine else None
        self.weight_sync = build_weight_sync(cfg.rollout, self.engine, self.hf_dir, self.run_dir,
                                             lora)
        # The weight check's tolerances, from the dtype the engine says it computes log-probs
        # in (ranks without an engine learn it from those with one).
        dtypes: list = [None] * dist.get_world_size()
        dist.all_gather_object(dtypes, self.engine.logprob_dtype if self.engine else None)
        w = cfg.rollout.weight_check
        self.weight_check_limits = tolerances(next((d for d in dtypes if d), cfg.model.dtype),
                                              cfg.model.dtype, w.tolerance, w.quantile_tolerance)
        self.rollouts = StepRollouts(cfg, self.prompts, self.engine, self.reward, self.roles,
                                     self.state.rollout_seed)

    def _open_log(self, resume_from: Optional[Path]) -> None:
        """metrics.jsonl and the console, with what the start found worth saying."""
        cfg = self.cfg
        self.logger = MetricsLogger(self.run_dir, cfg.trainer.steps, self.rank0, cfg.logging,
                                    cfg.to_dict(), start_step=self.state.step)
        if resume_from is not None:
            self.logger.write(f"resumed from {resume_from} at step {self.state.step}")
            if self.state.step >= cfg.trainer.steps:  # the same command run again, say
                self.logger.write(f"the run is at step {self.state.step} of trainer.steps="
                                  f"{cfg.trainer.steps}: no step to run (raise trainer.steps "
                                  "to train on; another logging.name starts a new run)")
        for note in (*cfg.deprecations, *self.rollouts.notes,
                     *engine_notes(cfg.rollout.engine, self.arch)):
            self.logger.write(f"warning: {note}")

    def _first_contact(self, resume_from: Optional[Path]) -> None:
        """The engine loaded hf_path's weights; anything else (a checkpoint, a converted
        Megatron checkpoint) is pushed to it before the first rollout. Then the first weight
        check."""
        if resume_from is not None or self.cfg.model.megatron_ckpt:
            self.sync_weights(version=self.state.step)
        try:
            self._stop_if_asked()
            first = self.check_engine_weights("at the first contact")
        except BaseException:
            if self.engine is not None:  # stop what it launched: no one else will
                self.engine.shutdown()
            raise
        if first:
            self.logger.write(f"weight check at the first contact: mean |engine - trainer| "
                              f"{first['weight_check/drift_mean']:.2e} nats")

    @property
    def sampler(self) -> PromptSampler:
        """The run's data position."""
        return self.prompts.sampler

    def _stop_if_asked(self) -> None:
        """During start-up, between its long parts (every rank at the same points): a stop
        request (a signal, Ctrl-C) ends the start now, with exit 75; there is nothing to
        checkpoint yet."""
        reason = self.signals.any_rank()
        if reason:
            if dist.get_rank() == 0:
                print(f"{reason} during start-up: nothing to checkpoint; exiting with "
                      f"{PREEMPTED_EXIT_CODE} to be resumed", flush=True)
            raise Preempted()

    def _check_resumable(self, checkpoint: Path) -> None:
        """Before anything loads, a checkpoint of another model or of other training data is
        one error naming it and what differs; restores the data position."""
        m = self.cfg.model
        check_same_model(checkpoint, self.arch, f"model.megatron_ckpt={m.megatron_ckpt}"
                         if m.megatron_ckpt else f"model.hf_path={m.hf_path}")
        try:
            self.sampler.load_state_dict(verify_checkpoint(checkpoint)["sampler"])
        except ValueError as e:
            raise CheckpointError(f"checkpoint {checkpoint}: {e} (resume from a checkpoint of "
                                  "this data, or set trainer.resume=none to start over)") from None

    def _starting(self, part: str) -> None:
        """What the start-up does next, on the console (it runs for minutes on a large model)."""
        if self.rank0:
            print(f"start-up: {part}", flush=True)

    def _load_initial_weights(self, model) -> None:
        if self.cfg.model.megatron_ckpt:
            load_model_weights(model, self.cfg.model.megatron_ckpt)
        else:
            load_hf_weights(model, self.hf_dir, self.arch)

    # ------------------------------------------------------------------ the step

    def step(self, step: int) -> dict[str, float]:
        """One RL step on every rank: rollouts, then (if a group was kept) recompute, update,
        weight sync and checks, then validation when due. Returns the step's metrics."""
        timer, started = PhaseTimer(), time.perf_counter()
        rolled = self._roll_out(step, timer)
        samples = groups_to_samples(rolled, self.cfg.algorithm.advantage,
                                    self.cfg.algorithm.norm_adv_by_std)
        metrics = self.rollouts.metrics(rolled)
        if rolled.kept:
            metrics.update(self._learn(samples, step, timer))
        else:
            self.logger.write(f"step {step}: no group with reward variance after "
                              f"{self.cfg.data.max_refill_rounds} refills; update skipped")
        self.state.step = step
        val_interval = self.cfg.trainer.val_interval
        if val_interval and step % val_interval == 0:
            with timer("validate"):
                metrics.update(self.validate(step))
        metrics.update(self.rollouts.engine_metrics(started, timer.seconds["rollout"]))
        metrics.update(timer.as_metrics())
        metrics["time/step"] = time.perf_counter() - started
        metrics["perf/tokens_per_s"] = rolled.tokens / max(metrics["time/step"], 1e-9)
        metrics.update(self.rollouts.data_metrics())
        return metrics

    def rollout(self, step: int) -> StepGroups:
        return self.rollouts.take(step, self._check_inside_step)

    def _roll_out(self, step: int, timer: PhaseTimer) -> StepGroups:
        """The step's rollouts; a stop request meanwhile abandons the step."""
        sampler_state = self.sampler.state_dict()
        try:
            with timer("rollout"):
                rolled = self.rollout(step)
            self._check_inside_step()  # before the update
        except _StepAbandoned as stop:
            self._leave_inside_step(step, sampler_state, str(stop))
        return rolled

    def _learn(self, samples: list[Sample], step: int, timer: PhaseTimer) -> dict[str, float]:
        """Recompute, update and weight sync on this rank's samples, with the metrics of each:
        entropy, drift and weight checks, the entropy controller, the loss, the entropy change."""
        dp_group = self.ps.get_data_parallel_group()
        with timer("recompute"):
            self.actor.recompute(samples)
        knobs = loss_knobs(self.controller, self.cfg.algorithm, step, self.cfg.trainer.steps)
        with timer("update"):
            actor_metrics = self.actor.update(samples, step, knobs)
        # After the update: its first mini-batch may have scored its own samples.
        metrics = reduce_token_metrics(samples, dp_group)
        if "clip_ratio_high" in knobs:
            metrics["clip_schedule/clip_ratio_high"] = knobs["clip_ratio_high"]
        if self.cfg.rollout.tools.enabled:
            tools = self.cfg.rollout.tools
            metrics.update(turn_entropy_metrics(samples, dp_group, tools.after_tool_tokens,
                                                tools.max_turns))
        if self.cfg.algorithm.old_logprobs == "recompute":  # else nothing to compare with
            metrics.update(drift_metrics(samples, dp_group))
            metrics.update(self.check_rollout_weights(samples, dp_group, step))
            metrics.update(self.drift.observe(step, metrics, self.logger.write))
        metrics.update(update_controller(self.controller, metrics))
        metrics.update({LOSS_METRIC_NAMES.get(k, k): v for k, v in actor_metrics.items()})
        if self.cfg.analysis.entropy_change:
            with timer("entropy_change"):
                metrics.update(self.actor.entropy_change(samples))
        with timer("sync"):
            metrics.update(self.sync_weights(version=step))
        metrics.update(self.check_engine_weights(f"after the weight sync of step {step}"))
        return metrics

    def _check_inside_step(self) -> None:
        """Between refill rounds and before the update: a signal, or a job end that leaves only
        a checkpoint's time, abandons the step."""
        reason = self.signals.any_rank(self.clock.stop_inside_step())
        if reason:
            raise _StepAbandoned(reason)

    def _leave_inside_step(self, step: int, sampler_state: dict, reason: str) -> None:
        """Checkpoint the last completed step (unless it is saved; with its data position, not
        the abandoned step's) and exit 75. Nothing of ``step`` was applied."""
        done = step - 1
        if done > 0 and self.saved_step != done:
            self.sampler.load_state_dict(sampler_state)
            self.save(done)
        dist.barrier()
        what = f"checkpointed step {done}" if done > 0 else "no step to checkpoint"
        self.logger.write(f"{reason} during step {step} (not applied): {what}; exiting with "
                          f"{PREEMPTED_EXIT_CODE} to be resumed ({self.clock.describe()})")
        raise Preempted()

    def sync_weights(self, version: int) -> dict[str, float]:
        """Megatron weights -> the engine through the sync strategy (weight_sync/): every rank of a
        replica that feeds an engine takes part; each pipeline stage's leader sends its stage.
        Returns the engine's ``weight_sync/*`` metrics (the step's whole sync is ``time/sync``)."""
        stats: dict[str, float] = {}
        gather_params(self.model)  # an overlapped param all-gather still in flight
        if self.roles.feeds_engine:
            stats = self.weight_sync.sync(self.model[0], self.arch, version,
                                          relay_only=self.roles.relays_experts)
        dist.barrier()
        return {k: float(v) for k, v in stats.items()}

    def check_engine_weights(self, when: str) -> dict[str, float]:
        """The engine's log-probs on a fixed probe against the actor's; raises if they disagree
        (trainer/weight_check.py). Returns its ``weight_check/*`` metrics."""
        w, train = self.cfg.rollout.weight_check, self.prompts.train
        if not w.enabled or len(train) == 0:
            return {}
        prompts = [train[i].prompt_ids for i in range(min(w.prompts, len(train)))]
        with self.rollouts.engine_free():
            return check_engine_weights(self.engine, self.actor, prompts,
                                        probe_sampling(self.cfg.rollout.temperature, w.tokens),
                                        self.weight_check_limits, when, w.quantile)

    def check_rollout_weights(self, samples: list, dp_group, step: int) -> dict[str, float]:
        """The actor's old log-probs of this step's rollout tokens against the engine's, after
        the update and before the weight sync; raises if they disagree (trainer/weight_check.py):
        the engine never gets weights trained on such a step, nor does a checkpoint."""
        w = self.cfg.rollout.weight_check
        if not w.enabled:
            return {}
        # Asynchronous rollouts mix weight versions: only the tokens generated on the weights
        # the trainer holds (synced after the previous step) show whether the engine has them.
        version = str(step - 1) if self.cfg.rollout.max_staleness > 0 else None
        return check_rollout_weights(samples, dp_group, self.weight_check_limits, w.quantile,
                                     version, f"at step {step}", self.actor.device)

    def validate(self, step: int) -> dict[str, float]:
        return self.rollouts.validate(step)

    def save(self, step: int) -> None:
        gather_params(self.model)
        self.ckpt.save(step, self.model, self.actor.optimizer,
                       {"step": step, "sampler": self.sampler.state_dict(),
                        "rollout_seed": self.state.rollout_seed,
                        "scheduler": self.actor.scheduler.state_dict(),
                        **controller_state(self.controller), **self.drift.state(),
                        **methods_state(self.actor.methods),
                        **({STATE_KEY: self.base_identity} if self.base_identity else {})},
                       self.arch, self.hf_dir)
        self.saved_step = step

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, float]:
        """The steps from the one after the last checkpoint to ``trainer.steps``; returns the
        last step's metrics. A stop request or the job's end checkpoints and exits 75."""
        t = self.cfg.trainer
        metrics: dict[str, float] = {}
        if t.val_before_train and self.state.step == 0:
            self.logger.log(0, self.validate(0))
        self.rollouts.start(self.state.step + 1, t.steps)
        for step in range(self.state.step + 1, t.steps + 1):
            metrics = self.step(step)
            self._close_step(step, metrics)
        return metrics

    def _close_step(self, step: int, metrics: dict[str, float]) -> None:
        """After the step: checkpoint (at the interval, the last step, or to stop), log its
        metrics, and exit 75 if a stop was asked for."""
        t = self.cfg.trainer
        self.clock.step_took(metrics["time/step"])
        preempt = self.signals.any_rank(self.clock.stop_before_next_step())
        last = step == t.steps
        if preempt or last or (t.save_interval and step % t.save_interval == 0):
            started = time.perf_counter()
            try:
                self.save(step)
            except BaseException:
                # The step is complete: its metrics are kept (the failed save removed its
                # partial files, which may have been what filled the disk).
                with contextlib.suppress(OSError):
                    self.logger.log(step, metrics)
                raise
            metrics["time/checkpoint"] = time.perf_counter() - started
            self.clock.checkpoint_took(metrics["time/checkpoint"])
        self.logger.log(step, metrics)
        if preempt or last:
            # Leave together: a launcher that kills the job when one task exits (srun
            # --kill-on-bad-exit) must not cut rank 0 off before its metrics are written.
            dist.barrier()
        if preempt and not last:
            self.logger.write(f"{preempt}: checkpointed step {step}; exiting with "
                              f"{PREEMPTED_EXIT_CODE} to be resumed ({self.clock.describe()})")
            raise Preempted()

    def close(self) -> None:
        self.logger.close()
        self.reward.close()
        self.rollouts.stop()
        if self.engine is not None:
            self.engine.shutdown()  # also ends a background rollout in flight
        self.rollouts.join()


def train(cfg: Config) -> dict[str, float]:
    """Run (or resume) the RL job ``cfg`` on this rank; returns the last step's metrics."""
    with preemption.interruptible():  # a stop request ends start-up wherever it waits
        trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.close()
        shutdown()
