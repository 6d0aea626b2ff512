"""Bounded-staleness asynchronous rollouts (``rollout.max_staleness`` = k > 0, server engines).

With a shared engine global rank 0 alone talks to the servers. A background thread on rank 0
(`RolloutPrefetcher`) generates whole steps ahead, `generate_step_local`: generation, rewards and
dynamic sampling, HTTP only, never a torch.distributed collective (those stay on the main thread,
in the same order on every rank). Step s is started once the trainer has taken step s - k, so
while step t trains the rollouts of steps up to t + k are generated, on the weights of the last
push (version t - 1 at the oldest: `ServerPool.drained` lets requests in flight at a push finish
on the old weights, and tags each completion with the version it was generated on; with
``rollout.inflight_at_sync: abort`` it aborts them instead, and they resume on the new weights
as partial rollouts, each token tagged with its own version: a partial sample counts as its
oldest token's version). The main
thread takes step t when it is ready (`AsyncRollouts.take`, polling every rank's stop check while
it waits), drops samples more than k versions older than the trained weights (never the case when
the pushes keep up; a safeguard) and distributes the rest as the synchronous path does.

Data position: the producer draws prompts from its own copy of the sampler; the trainer's sampler
takes the position after each step it takes, and checkpoints save that. The prefetched rollouts of
unfinished steps are not saved: a resumed run generates them again from there (on newer weights),
so no step is lost and no prompt is trained on twice.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import torch.distributed as dist

from megatron_entropy.data import PromptSampler
from megatron_entropy.rollout.base import Completion
from megatron_entropy.rollout.server.partial import version_runs
from megatron_entropy.trainer.rollouts import (Group, LocalStep, StepGroups, distribute_step,
                                               generate_step_local)

if TYPE_CHECKING:  # the trainer's rollout side, which makes this part (a type only)
    from megatron_entropy.trainer.step_rollouts import StepRollouts


class RolloutProducerError(RuntimeError):
    """The background rollout thread failed; the cause is chained."""


class _Stopped(Exception):
    """The prefetcher was closed while it produced a step."""


def version_number(tag) -> int:
    """A weight version tag as engines give it (None or SGLang's "initial": the starting
    weights, version 0; else the steps applied)."""
    return 0 if tag in (None, "initial") else int(tag)


def weight_version_of(completion: Completion) -> int:
    """The weight version (steps applied) a completion was generated with, from
    ``meta["weight_version"]``: for a partial rollout (aborted at a push, resumed on newer
    weights) its oldest token's, the conservative choice for ``max_staleness``."""
    return version_number(completion.meta.get("weight_version"))


def stale_samples(kept: Sequence[Group], trained_version: int, max_staleness: int
                  ) -> tuple[frozenset[tuple[int, int]], dict[str, float]]:
    """(kept index, sample index) of the samples more than ``max_staleness`` versions older than
    ``trained_version`` (not trained on), and the step's ``async/*`` metrics over every kept
    sample: staleness, and the partial rollouts (tokens from more than one version) with
    their tokens generated after the first version (``async/resumed_tokens``)."""
    ages = [(gi, j, trained_version - weight_version_of(c))
            for gi, g in enumerate(kept) for j, c in enumerate(g.completions)]
    dropped = frozenset((gi, j) for gi, j, age in ages if age > max_staleness)
    runs = [version_runs(c) for g in kept for c in g.completions]
    metrics = {"async/dropped_samples": float(len(dropped)),
               "async/partial_samples": float(sum(len(r) > 1 for r in runs)),
               "async/resumed_tokens": float(sum(n for r in runs for _, n in r[1:]))}
    if ages:
        metrics["async/staleness_mean"] = sum(a for *_, a in ages) / len(ages)
        metrics["async/staleness_max"] = float(max(a for *_, a in ages))
    return dropped, metrics


class RolloutPrefetcher:
    """Rank 0's background thread: ``produce(step)`` for steps ``first..last`` in order, step s
    once step s - ``depth`` is taken; `take` hands a step over, `held` pauses production."""

    def __init__(self, produce: Callable[[int, Callable[[], None]], LocalStep], first: int,
                 last: int, depth: int) -> None:
        self._produce = produce
        self._next, self._last, self._depth = first, last, depth
        self._taken = first - 1
        self._ready: dict[int, LocalStep] = {}
        self._error: Optional[BaseException] = None
        self._holds = 0
        self._busy = False
        self._stopped = False
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._work, name="rollout-prefetch", daemon=True)
        self._thread.start()

    def _may_start(self) -> bool:
        return (self._stopped or self._error is not None
                or (self._holds == 0 and self._next <= min(self._last,
                                                           self._taken + self._depth)))

    def _check_stopped(self) -> None:
        if self._stopped:
            raise _Stopped()

    def _work(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(self._may_start)
                if self._stopped or self._error is not None:
                    return
                step, self._busy = self._next, True
            try:
                local = self._produce(step, self._check_stopped)
            except BaseException as e:  # noqa: BLE001 - handed to the main thread
                with self._cv:
                    self._busy = False
                    if not self._stopped:
                        self._error = e
                    self._cv.notify_all()
                return
            with self._cv:
                self._busy = False
                self._ready[step] = local
                self._next += 1
                self._cv.notify_all()

    def take(self, step: int, timeout: float) -> Optional[LocalStep]:
        """Step ``step``'s rollouts if they are ready within ``timeout`` seconds, else None;
        raises `RolloutProducerError` if the thread failed."""
        with self._cv:
            self._cv.wait_for(lambda: step in self._ready or self._error is not None, timeout)
            if step in self._ready:
                self._taken = step
                self._cv.notify_all()
                return self._ready.pop(step)
            if self._error is not None:
                raise RolloutProducerError(
                    f"the background rollout thread failed while generating step {self._next}: "
                    f"{type(self._error).__name__}: {self._error}") from self._error
            return None

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """No rollout is generated during the body (validation, weight checks use the engine)."""
        with self._cv:
            self._holds += 1
            self._cv.wait_for(lambda: not self._busy)
        try:
            yield
        finally:
            with self._cv:
                self._holds -= 1
                self._cv.notify_all()

    def stop(self) -> None:
        """Ask the thread to end (it stops between refill rounds; a round in flight ends when
        the engine's pool is stopped)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class AsyncRollouts:
    """The trainer's side: every rank calls `take(step)` in step order; rank 0 also owns the
    prefetcher."""

    POLL_S = 0.2  # how often the ranks look at the stop flags while they wait

    def __init__(self, rollouts: StepRollouts, first: int, last: int) -> None:
        engine = rollouts.engine
        self.sampler = rollouts.prompts.sampler
        self.engine = engine
        self.max_staleness = rollouts.rollout.max_staleness
        self.prefetcher: Optional[RolloutPrefetcher] = None
        self._idle_s = 0.0  # the trainer's wait for rollouts in this step (rank 0's)
        if not rollouts.roles.rank0:
            return
        # A weight push may run while a rollout is in flight.
        engine.generate_in_background(rollouts.rollout.inflight_at_sync)
        draws = PromptSampler(self.sampler.num_items, self.sampler.shuffle, self.sampler.seed)
        draws.load_state_dict(self.sampler.state_dict())
        d, reward = rollouts.data, rollouts.train_reward

        def produce(step: int, between_rounds: Callable[[], None]) -> LocalStep:
            local = generate_step_local(
                engine, lambda n: rollouts.next_items(n, draws), rollouts.sampling(step),
                reward, d.prompts_per_step, d.dynamic_sampling, d.max_refill_rounds,
                between_rounds, rollouts.greedy_baseline)
            local.sampler_state = draws.state_dict()
            # Reward failures of this step's scoring, logged with the step (validation takes
            # its own while the thread is held, so the two never mix).
            local.metrics["reward/failures"] = float(reward.take_failures())
            return local
        self.prefetcher = RolloutPrefetcher(produce, first, last, self.max_staleness)

    def take(self, step: int, stop_check: Callable[[], None]) -> StepGroups:
        """Step ``step``'s rollouts on every rank, samples more than ``max_staleness`` versions
        older than the trained weights dropped. ``stop_check`` (every rank's collective stop check;
        it may raise) runs while rank 0 waits. Adds the ``async/*`` metrics."""
        started = time.perf_counter()
        while True:
            local, failure = None, None
            if self.prefetcher is not None:
                try:
                    local = self.prefetcher.take(step, self.POLL_S)
                except RolloutProducerError as e:
                    failure = e
            box = [("failed" if failure else "ready" if local is not None else "waiting")]
            dist.broadcast_object_list(box, src=0)
            if box[0] == "failed":
                if failure is not None:
                    raise failure
                raise RolloutProducerError("rank 0's background rollout thread failed (its "
                                           "error is in rank 0's log)")
            if box[0] == "ready":
                break
            stop_check()
        self._idle_s += time.perf_counter() - started
        extra = None
        if local is not None:
            # The weights being trained are the last ones pushed (a push ends every update).
            trained_version = self.engine.version or 0
            dropped, metrics = stale_samples([local.held[k] for k in local.kept],
                                             trained_version, self.max_staleness)
            extra = {"sampler": local.sampler_state, "dropped": dropped, "metrics": metrics}
        rolled, extra = distribute_step(local, extra)
        self.sampler.load_state_dict(extra["sampler"])
        rolled.dropped = extra["dropped"]
        rolled.metrics.update(extra["metrics"])
        return rolled

    def pop_idle_seconds(self) -> float:
        """Seconds the trainer waited for rollouts since the last call: in `take`, in
        `engine_free` for the step in production, and in weight pushes for the requests in
        flight to finish (rank 0)."""
        idle, self._idle_s = self._idle_s, 0.0
        if self.prefetcher is not None:
            idle += self.engine.take_drain_wait_seconds()
        return idle

    @contextlib.contextmanager
    def engine_free(self) -> Iterator[None]:
        """For the body, rank 0's thread generates nothing (the body uses the engine). Waiting
        for the step in production counts as the trainer's idle time."""
        if self.prefetcher is None:
            yield
            return
        started = time.perf_counter()
        with self.prefetcher.held():
            self._idle_s += time.perf_counter() - started
            yield

    def close(self) -> None:
        """Stop the thread; call before the engine shuts down (which ends a round in flight),
        then `join`."""
        if self.prefetcher is not None:
            self.prefetcher.stop()

    def join(self) -> None:
        if self.prefetcher is not None:
            self.prefetcher.join(timeout=60)
