"""The trainer's rollout side as one part: prompts drawn from the train split, generated on the
engine (step by step, or ahead of the trainer with ``rollout.max_staleness``), scored and kept
by dynamic sampling (trainer/rollouts.py); validation; and the step's metrics these own: the
rollouts', the reward's failures, the engine's, the data position's."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Callable, ContextManager, Optional

from megatron_entropy.config import Config
from megatron_entropy.data import PromptDataset, PromptItem, PromptSampler, data_notes
from megatron_entropy.rewards import RewardScorer
from megatron_entropy.rewards.overlong import OverlongShaping
from megatron_entropy.rollout.base import RolloutEngine, SamplingParams
from megatron_entropy.runtime.roles import Roles
from megatron_entropy.runtime.seeds import rollout_step_seed, validation_seed
from megatron_entropy.trainer.async_rollouts import AsyncRollouts
from megatron_entropy.trainer.rollouts import (StepGroups, collect_step_groups, generate_round,
                                               rollout_metrics)
from megatron_entropy.trainer.step_metrics import every_engines_tokens, summed_over_ranks


@dataclass
class Prompts:
    """The run's prompts: the train split, its sampler (the data position) and the validation
    split."""

    train: PromptDataset
    val: PromptDataset
    sampler: PromptSampler


class StepRollouts:
    """Each step's rollouts on every rank (``take``), validation, and their metrics; ``engine``
    is None on ranks that do not talk to it. ``seed`` is the run's rollout seed (every step's
    and validation's sampling seeds derive from it)."""

    def __init__(self, cfg: Config, prompts: Prompts, engine: Optional[RolloutEngine],
                 reward: RewardScorer, roles: Roles, seed: int) -> None:
        self.rollout, self.data = cfg.rollout, cfg.data
        self.greedy_baseline = cfg.algorithm.advantage == "remax"  # ReMax's baseline
        self.prompts, self.engine, self.reward, self.roles = prompts, engine, reward, roles
        # The training rollouts' reward: with DAPO's overlong shaping where it is on.
        self.train_reward = reward if not cfg.reward.overlong_buffer else OverlongShaping(
            reward, cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer,
            cfg.reward.overlong_penalty)
        self.seed = seed
        self.ahead: Optional[AsyncRollouts] = None  # made by `start` if max_staleness > 0
        t = cfg.trainer
        asked = (f"trainer.val_interval={t.val_interval}" if t.val_interval
                 else "trainer.val_before_train=true" if t.val_before_train else "")
        # What the data settings changed without an error: warnings for the log, and metrics.
        self.notes, self._data_metrics = data_notes(prompts.train, prompts.val,
                                                    cfg.data.prompts_per_step,
                                                    cfg.rollout.max_prompt_tokens, asked)

    def sampling(self, step: int, validation: bool = False) -> SamplingParams:
        r = self.rollout
        if validation:
            greedy = r.val_temperature == 0
            return SamplingParams(n=1 if greedy else r.val_n_samples,
                                  temperature=1.0 if greedy else r.val_temperature,
                                  top_p=1.0 if greedy else r.top_p, top_k=1 if greedy else r.top_k,
                                  max_new_tokens=r.max_new_tokens, stop=tuple(r.stop),
                                  stop_token_ids=tuple(r.stop_token_ids),
                                  seed=validation_seed(self.seed, step))
        return SamplingParams(n=r.n_samples, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, max_new_tokens=r.max_new_tokens, stop=tuple(r.stop),
                              stop_token_ids=tuple(r.stop_token_ids),
                              seed=rollout_step_seed(self.seed, step))

    def next_items(self, n: int, sampler: Optional[PromptSampler] = None) -> list[PromptItem]:
        """The next ``n`` train prompts of ``sampler`` (the run's data position by default)."""
        indices = (sampler or self.prompts.sampler).next_indices(n)
        return [self.prompts.train[i] for i in indices]

    def start(self, first: int, last: int) -> None:
        """Before step ``first``: with ``rollout.max_staleness`` > 0, rollouts of steps up to
        ``last`` are generated ahead of the trainer from now on (trainer/async_rollouts.py)."""
        if self.rollout.max_staleness > 0:
            self.ahead = AsyncRollouts(self, first, last)

    def take(self, step: int, between_rounds: Callable[[], None]) -> StepGroups:
        """Step ``step``'s rollouts, this rank's share; ``between_rounds`` (every rank's stop
        check; it may raise) runs between refill rounds and while waiting for rollouts."""
        if self.ahead is not None:
            return self.ahead.take(step, between_rounds)
        d = self.data
        return collect_step_groups(
            self.engine, self.next_items, self.sampling(step), self.train_reward,
            self.roles.shared_engine, d.prompts_per_step, d.dynamic_sampling,
            d.max_refill_rounds, between_rounds=between_rounds,
            greedy_baseline=self.greedy_baseline)

    def metrics(self, rolled: StepGroups) -> dict[str, float]:
        """The step's rollout metrics: reward, accuracy and lengths of every generated group,
        dynamic sampling's (and the asynchronous path's), the reward's failures. A collective."""
        metrics = {**rollout_metrics(rolled.generated), **rolled.metrics}
        if "reward/failures" not in metrics:  # async: the rollout thread counted its step's
            metrics["reward/failures"] = summed_over_ranks(self.reward.take_failures())
        return metrics

    def engine_free(self) -> ContextManager[None]:
        """No rollout is generated ahead during the body (it uses the engine)."""
        return self.ahead.engine_free() if self.ahead is not None else contextlib.nullcontext()

    def validate(self, step: int) -> dict[str, float]:
        if len(self.prompts.val) == 0:
            return {}
        with self.engine_free():
            _, groups, _ = generate_round(self.engine, list(self.prompts.val),
                                          self.sampling(step, validation=True),
                                          self.reward, self.roles.shared_engine)
        return {**rollout_metrics(groups, prefix="val/"),
                "val/reward/failures": summed_over_ranks(self.reward.take_failures())}

    def engine_metrics(self, step_started: float, rollout_s: float) -> dict[str, float]:
        """The engine's metrics of the step (a collective: tokens of every engine), the time it
        and the trainer spent idle (``rollout_s``: the step's rollout phase)."""
        metrics: dict[str, float] = {}
        if self.engine is not None:
            metrics.update(self.engine.metrics())
            busy = metrics.pop("rollout/engine_busy_s", None)
            if busy is not None:  # server engines
                metrics["time/engine_idle"] = max(0.0, time.perf_counter() - step_started - busy)
        metrics.update(every_engines_tokens(metrics))
        metrics["time/trainer_idle"] = (self.ahead.pop_idle_seconds() if self.ahead is not None
                                        else rollout_s)
        return metrics

    def data_metrics(self) -> dict[str, float]:
        return {"data/epoch": float(self.prompts.sampler.epoch), **self._data_metrics}

    def stop(self) -> None:
        """Stop generating ahead; call before the engine shuts down, then `join`."""
        if self.ahead is not None:
            self.ahead.close()

    def join(self) -> None:
        if self.ahead is not None:
            self.ahead.join()
