"""The RL loop. Every rank runs ``train(cfg)`` (SPMD, under torchrun, srun or ``--nproc``):

    for step:
        rollout      prompts -> engine (DP leaders) -> rewards -> dynamic sampling -> advantages
        recompute    old log-probs, entropies (and reference log-probs) with the Megatron actor
        update       ppo_epochs x mini-batches of Clip-Cov / KL-Cov / PPO-clip
        [entropy change: the step's tokens scored again after the update]
        sync         Megatron weights -> HF names -> rollout engine (weight_sync/)
        log, validate, checkpoint
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
from megatron_entropy.data import PromptSampler, data_notes, load_prompt_dataset, load_tokenizer
from megatron_entropy.models.arch import load_arch
from megatron_entropy.models.bridge import load_hf_weights
from megatron_entropy.models.builder import build_gpt_model
from megatron_entropy.models.megatron_checkpoint import load_model_weights, read_arch
from megatron_entropy.rewards import RewardScorer
from megatron_entropy.rollout import build_engine, engine_is_shared
from megatron_entropy.rollout.base import SamplingParams
from megatron_entropy.runtime import init_distributed, set_seed, shutdown
from megatron_entropy.runtime.roles import Roles
from megatron_entropy.runtime.seeds import rollout_step_seed, validation_seed
from megatron_entropy.trainer import preemption
from megatron_entropy.trainer.actor import Actor
from megatron_entropy.trainer.async_rollouts import AsyncRollouts
from megatron_entropy.trainer.checkpoint import CheckpointManager, resume_checkpoint
from megatron_entropy.trainer.drift import DriftTrend, drift_metrics
from megatron_entropy.trainer.entropy_control import (build_controller, controller_state,
                                                      loss_knobs, restore_controller,
                                                      update_controller)
from megatron_entropy.trainer.metrics import MetricsLogger, PhaseTimer
from megatron_entropy.trainer.model_setup import (build_optimizer, build_trainable_model,
                                                  gather_params)
from megatron_entropy.trainer.moe_routing import engine_notes
from megatron_entropy.trainer.preemption import PREEMPTED_EXIT_CODE
from megatron_entropy.trainer.rollouts import (collect_step_groups, generate_round,
                                               groups_to_samples, rollout_metrics)
from megatron_entropy.trainer.run_folder import save_run_config
from megatron_entropy.trainer.step_metrics import (LOSS_METRIC_NAMES, device,
                                                    every_engines_tokens, reduce_token_metrics,
                                                    summed_over_ranks)
from megatron_entropy.trainer.weight_check import (check_engine_weights, check_rollout_weights,
                                                   probe_sampling, tolerances)
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
    (trainer/preemption.py) is installed again here for callers of train() that did not install
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
    """Builds every part from the config; ``run()`` is the loop."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.run_dir = cfg.run_dir
        started = time.time()
        init_distributed(cfg.parallel.tensor, cfg.parallel.pipeline, cfg.parallel.backend,
                         cfg.parallel.timeout_minutes, socket_ifname=cfg.parallel.socket_ifname,
                         expert=cfg.parallel.expert)
        set_seed(cfg.trainer.seed)
        self.signals = _SignalFlag()
        self.ps = ps
        self.roles = Roles.here(shared_engine=engine_is_shared(cfg.rollout.engine))
        self.reward = RewardScorer(cfg.reward)
        self.rank0 = self.roles.rank0
        if self.rank0:
            self.run_dir.mkdir(parents=True, exist_ok=True)

        # The model: architecture, tokenizer and initial weights from an HF folder or a converted
        # Megatron checkpoint (whose hf/ folder holds config and tokenizer).
        m = cfg.model
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
        n, ep = dist.get_world_size(), cfg.parallel.expert
        self._starting(f"{n} rank{'s' * (n > 1)} joined (TP={cfg.parallel.tensor}, "
                       f"PP={cfg.parallel.pipeline}, DP={ps.get_data_parallel_world_size()}"
                       f"{f', EP={ep}' if ep > 1 else ''}); loading the tokenizer and the prompts")
        self.tokenizer = load_tokenizer(self.hf_dir)

        self.train_data = load_prompt_dataset(cfg.data, self.tokenizer,
                                              cfg.rollout.max_prompt_tokens, "train")
        self.val_data = load_prompt_dataset(cfg.data, self.tokenizer,
                                            cfg.rollout.max_prompt_tokens, "val")
        self.sampler = PromptSampler(len(self.train_data), cfg.data.shuffle, cfg.data.seed)
        self._stop_if_asked()
        self._starting(f"{len(self.train_data):,} train and {len(self.val_data):,} validation "
                       "prompts; building the policy and loading its weights")

        self.ckpt = CheckpointManager(self.run_dir, cfg.trainer.keep_last)
        resume_from = resume_checkpoint(cfg.trainer.resume, self.ckpt)
        sharded_optimizer = cfg.trainer.uses_distributed_optimizer(
            ps.get_data_parallel_world_size())
        replay = cfg.rollout.routing_replay if self.arch.is_moe else "none"
        self.model = build_trainable_model(
            self.arch, m, cfg.parallel, sharded_optimizer,
            overlap=cfg.trainer.uses_overlap(on_gpu=dist.get_backend() == "nccl"),
            routing_replay=replay != "none")
        if resume_from is None:
            self._load_initial_weights(self.model[0])
        optimizer, scheduler = build_optimizer(self.model, cfg.trainer, m.dtype,
                                               sharded_optimizer)
        ref_model = None
        if cfg.algorithm.kl_coef > 0:
            ref_model = build_gpt_model(self.arch, cfg.parallel.tensor, cfg.parallel.pipeline,
                                        m.dtype, m.transformer_impl, m.seq_length,
                                        cfg.parallel.sequence_parallel,
                                        expert=cfg.parallel.expert)
            self._load_initial_weights(ref_model)
            ref_model.requires_grad_(False)
        # seq-mean-token-sum-norm's constant defaults to the longest response the rollout allows.
        self.actor = Actor(self.arch, self.model, optimizer, scheduler,
                           cfg.algorithm.with_response_budget(cfg.rollout.max_new_tokens),
                           cfg.trainer, cfg.rollout.temperature, ref_model=ref_model,
                           routing_replay=replay)
        self.controller = build_controller(cfg.algorithm, self.arch.vocab_size)
        self.drift = DriftTrend()

        self.state = RunState(rollout_seed=cfg.rollout.seed)
        if resume_from is not None:
            saved = self.ckpt.load(resume_from, self.model, optimizer)
            scheduler.load_state_dict(saved["scheduler"])
            self.state = RunState(step=saved["step"], rollout_seed=saved["rollout_seed"])
            self.sampler.load_state_dict(saved["sampler"])
            restore_controller(self.controller, saved)
            self.drift.restore(saved)

        self._stop_if_asked()
        self._starting(f"starting the rollout engine ({cfg.rollout.engine})")
        self.async_rollouts: Optional[AsyncRollouts] = None  # made by run() if max_staleness > 0
        # Rollout engine: per DP leader (in-process) or one set of servers for the job.
        self.engine = build_engine(cfg.rollout, self.hf_dir, self.run_dir) \
            if self.roles.talks_to_engine else None
        self.weight_sync = build_weight_sync(cfg.rollout, self.engine, self.hf_dir, self.run_dir)
        # The weight check's tolerances, from the dtype the engine says it computes log-probs
        # in (ranks without an engine learn it from those with one).
        dtypes: list = [None] * dist.get_world_size()
        dist.all_gather_object(dtypes, self.engine.logprob_dtype if self.engine else None)
        w = cfg.rollout.weight_check
        self.weight_check_limits = tolerances(next((d for d in dtypes if d), m.dtype), m.dtype,
                                              w.tolerance, w.quantile_tolerance)
        self.logger = MetricsLogger(self.run_dir, cfg.trainer.steps, self.rank0, cfg.logging,
                                    cfg.to_dict(), start_step=self.state.step)
        if resume_from is not None:
            self.logger.write(f"resumed from {resume_from} at step {self.state.step}")
            if self.state.step >= cfg.trainer.steps:  # the same command run again, say
                self.logger.write(f"the run is at step {self.state.step} of trainer.steps="
                                  f"{cfg.trainer.steps}: no step to run (raise trainer.steps "
                                  "to train on; another logging.name starts a new run)")
        asked = (f"trainer.val_interval={cfg.trainer.val_interval}" if cfg.trainer.val_interval
                 else "trainer.val_before_train=true" if cfg.trainer.val_before_train else "")
        notes, self.data_metrics = data_notes(self.train_data, self.val_data,
                                              cfg.data.prompts_per_step,
                                              cfg.rollout.max_prompt_tokens, asked)
        for note in notes + engine_notes(cfg.rollout.engine, self.arch):
            self.logger.write(f"warning: {note}")
        # The engine loaded hf_path's weights; anything else (a checkpoint, a converted
        # Megatron checkpoint) is pushed to it before the first rollout.
        if resume_from is not None or m.megatron_ckpt:
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
        self.clock = preemption.job_clock(cfg.trainer.exit_duration_minutes,
                                          cfg.trainer.exit_margin_s, started, self.rank0)
        self.saved_step = self.state.step if resume_from is not None else None
        if self.rank0:  # the run has started: record its config (an earlier one is kept)
            save_run_config(cfg, self.run_dir)

    # ------------------------------------------------------------------ setup helpers

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

    def _starting(self, part: str) -> None:
        """What the start-up does next, on the console (it runs for minutes on a large model)."""
        if self.rank0:
            print(f"start-up: {part}", flush=True)

    def _load_initial_weights(self, model) -> None:
        if self.cfg.model.megatron_ckpt:
            load_model_weights(model, self.cfg.model.megatron_ckpt)
        else:
            load_hf_weights(model, self.hf_dir, self.arch)

    # ------------------------------------------------------------------ the phases

    def sampling_params(self, step: int, validation: bool = False):
        r = self.cfg.rollout
        if validation:
            greedy = r.val_temperature == 0
            return SamplingParams(n=1 if greedy else r.val_n_samples,
                                  temperature=1.0 if greedy else r.val_temperature,
                                  top_p=1.0 if greedy else r.top_p, top_k=1 if greedy else r.top_k,
                                  max_new_tokens=r.max_new_tokens, stop=tuple(r.stop),
                                  stop_token_ids=tuple(r.stop_token_ids),
                                  seed=validation_seed(self.state.rollout_seed, step))
        return SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, max_new_tokens=r.max_new_tokens, stop=tuple(r.stop),
                              stop_token_ids=tuple(r.stop_token_ids),
                              seed=rollout_step_seed(self.state.rollout_seed, step))

    def rollout(self, step: int):
        d = self.cfg.data
        if self.async_rollouts is not None:
            return self.async_rollouts.take(step, self._check_inside_step)
        return collect_step_groups(
            self.engine, lambda n: [self.train_data[i] for i in self.sampler.next_indices(n)],
            self.sampling_params(step), self.reward, self.roles.shared_engine, d.prompts_per_step,
            d.dynamic_sampling, d.max_refill_rounds, between_rounds=self._check_inside_step,
            greedy_baseline=self.cfg.algorithm.advantage == "remax")

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
        w = self.cfg.rollout.weight_check
        if not w.enabled or len(self.train_data) == 0:
            return {}
        prompts = [self.train_data[i].prompt_ids
                   for i in range(min(w.prompts, len(self.train_data)))]
        with self._engine_free():
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

    def _engine_free(self):
        """No background rollout uses the engine during the body."""
        return (self.async_rollouts.engine_free() if self.async_rollouts is not None
                else contextlib.nullcontext())

    def validate(self, step: int) -> dict[str, float]:
        if len(self.val_data) == 0:
            return {}
        with self._engine_free():
            _, groups, _ = generate_round(self.engine, list(self.val_data),
                                          self.sampling_params(step, validation=True),
                                          self.reward, self.roles.shared_engine)
        return {**rollout_metrics(groups, prefix="val/"),
                "val/reward/failures": summed_over_ranks(self.reward.take_failures())}

    def save(self, step: int) -> None:
        gather_params(self.model)
        self.ckpt.save(step, self.model, self.actor.optimizer,
                       {"step": step, "sampler": self.sampler.state_dict(),
                        "rollout_seed": self.state.rollout_seed,
                        "scheduler": self.actor.scheduler.state_dict(),
                        **controller_state(self.controller), **self.drift.state()},
                       self.arch, self.hf_dir)
        self.saved_step = step

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict[str, float]:
        cfg, t = self.cfg, self.cfg.trainer
        dp_group = self.ps.get_data_parallel_group()
        metrics: dict[str, float] = {}
        if t.val_before_train and self.state.step == 0:
            self.logger.log(0, self.validate(0))
        if cfg.rollout.max_staleness > 0:
            d = cfg.data
            self.async_rollouts = AsyncRollouts(
                self.engine, self.train_data, self.sampler, self.sampling_params, self.reward,
                d.prompts_per_step, d.dynamic_sampling, d.max_refill_rounds,
                cfg.rollout.max_staleness, self.state.step + 1, t.steps, self.rank0,
                cfg.rollout.inflight_at_sync, cfg.algorithm.advantage == "remax")
        for step in range(self.state.step + 1, t.steps + 1):
            timer = PhaseTimer()
            started = time.perf_counter()
            sampler_state = self.sampler.state_dict()
            try:
                with timer("rollout"):
                    rolled = self.rollout(step)
                self._check_inside_step()  # before the update
            except _StepAbandoned as stop:
                self._leave_inside_step(step, sampler_state, str(stop))
            mine = groups_to_samples(rolled, cfg.algorithm.advantage,
                                     cfg.algorithm.norm_adv_by_std)
            metrics = {**rollout_metrics(rolled.generated), **rolled.metrics}
            if "reward/failures" not in metrics:  # async: the rollout thread counted its step's
                metrics["reward/failures"] = summed_over_ranks(self.reward.take_failures())
            if rolled.kept:
                with timer("recompute"):
                    self.actor.recompute(mine)
                with timer("update"):
                    actor_metrics = self.actor.update(mine, step, loss_knobs(self.controller))
                # After the update: its first mini-batch may have scored its own samples.
                metrics.update(reduce_token_metrics(mine, dp_group))
                if cfg.algorithm.old_logprobs == "recompute":  # else nothing to compare with
                    metrics.update(drift_metrics(mine, dp_group))
                    metrics.update(self.check_rollout_weights(mine, dp_group, step))
                    metrics.update(self.drift.observe(step, metrics, self.logger.write))
                metrics.update(update_controller(self.controller, metrics))
                metrics.update({LOSS_METRIC_NAMES.get(k, k): v for k, v in actor_metrics.items()})
                if cfg.analysis.entropy_change:
                    with timer("entropy_change"):
                        metrics.update(self.actor.entropy_change(mine))
                with timer("sync"):
                    metrics.update(self.sync_weights(version=step))
                metrics.update(self.check_engine_weights(f"after the weight sync of step {step}"))
            else:
                self.logger.write(f"step {step}: no group with reward variance after "
                                  f"{cfg.data.max_refill_rounds} refills; update skipped")
            self.state.step = step
            if t.val_interval and step % t.val_interval == 0:
                with timer("validate"):
                    metrics.update(self.validate(step))
            if self.engine is not None:
                metrics.update(self.engine.metrics())
                busy = metrics.pop("rollout/engine_busy_s", None)
                if busy is not None:  # server engines
                    metrics["time/engine_idle"] = max(0.0, time.perf_counter() - started - busy)
            metrics.update(every_engines_tokens(metrics))
            metrics["time/trainer_idle"] = (self.async_rollouts.pop_idle_seconds()
                                            if self.async_rollouts is not None
                                            else timer.seconds["rollout"])
            tokens = rolled.tokens
            metrics.update(timer.as_metrics())
            metrics["time/step"] = time.perf_counter() - started
            metrics["perf/tokens_per_s"] = tokens / max(metrics["time/step"], 1e-9)
            metrics["data/epoch"] = float(self.sampler.epoch)
            metrics.update(self.data_metrics)
            self.clock.step_took(metrics["time/step"])
            preempt = self.signals.any_rank(self.clock.stop_before_next_step())
            last = step == t.steps
            if preempt or last or (t.save_interval and step % t.save_interval == 0):
                try:
                    with timer("checkpoint"):
                        self.save(step)
                except BaseException:
                    # The step is complete: its metrics are kept (the failed save removed its
                    # partial files, which may have been what filled the disk).
                    with contextlib.suppress(OSError):
                        self.logger.log(step, metrics)
                    raise
                metrics["time/checkpoint"] = timer.seconds["checkpoint"]
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
        return metrics

    def close(self) -> None:
        self.logger.close()
        self.reward.close()
        if self.async_rollouts is not None:
            self.async_rollouts.close()
        if self.engine is not None:
            self.engine.shutdown()  # also ends a background rollout in flight
        if self.async_rollouts is not None:
            self.async_rollouts.join()


def train(cfg: Config) -> dict[str, float]:
    """Run (or resume) the RL job ``cfg`` on this rank; returns the last step's metrics."""
    with preemption.interruptible():  # a stop request ends start-up wherever it waits
        trainer = Trainer(cfg)
    try:
        return trainer.run()
    finally:
        trainer.close()
        shutdown()
