"""The rollout engine interface: generate n samples per prompt, report health.

Every engine (in-process transformers, vLLM server, SGLang server) implements ``RolloutEngine``.
The trainer talks to it only from data-parallel leader ranks. New weights come through the
trainer's weight-sync strategies (megatron_entropy/weight_sync), each of which calls the
endpoints its protocol here declares: ``LoadsTensors`` (in place: the in-process engine),
``ReloadsFolders`` (disk: vLLM and SGLang servers), ``TakesBroadcasts`` (broadcast: SGLang),
``LoadsAdapters`` (adapters: a LoRA policy's, vLLM and SGLang servers).
Rollouts generated ahead of the trainer (trainer/async_rollouts.py) need ``GeneratesAhead``
(the server engines).
"""

from __future__ import annotations

import abc
import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import (ContextManager, Iterable, Iterator, Literal, Optional, Protocol,
                    runtime_checkable)

import torch

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 = off
    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: Optional[int] = None  # sample j of prompt i uses a seed derived from (seed, i, j)
    # Prompt i's own token budget instead of max_new_tokens, where given (multi-turn rollouts:
    # each trajectory's budget left).
    max_new_tokens_per_prompt: Optional[tuple[int, ...]] = None

    def budget(self, prompt_index: int) -> int:
        """The most tokens a response to prompt ``prompt_index`` may have."""
        each = self.max_new_tokens_per_prompt
        return self.max_new_tokens if each is None else each[prompt_index]


@dataclass
class Completion:
    """One sampled response.

    ``logprobs[t]`` is the log-probability of ``token_ids[t]`` under softmax(logits / temperature)
    over the full vocabulary, before top-p/top-k truncation: exactly what the actor recomputes, so
    that |actor - engine| measures train/rollout drift. (Greedy: temperature 1.) ``entropies[t]``
    is the entropy of that distribution at token t, from engines that report it (in-process).
    ``loss_mask[t]`` is 1 where the policy generated token t and 0 where it was inserted (a
    tool's result and the chat template's tokens around it, in a multi-turn rollout: its
    log-prob and entropy there are 0 and mean nothing); None: every token generated.
    """

    token_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: FinishReason
    # Filled by engines that know it: which server answered, weight version used.
    meta: dict = field(default_factory=dict)
    entropies: Optional[list[float]] = None
    loss_mask: Optional[list[int]] = None


NamedTensors = Iterable[tuple[str, torch.Tensor]]


class RolloutEngine(abc.ABC):
    """Generation backend. ``shared`` engines (servers) are updated once for the whole job, by
    global rank 0; per-rank engines (in-process) are updated by every DP leader."""

    shared: bool = False
    # Throughput counters that ``metrics`` reports (generated tokens, seconds generating).
    _tokens: int = 0
    _seconds: float = 0.0

    @property
    @abc.abstractmethod
    def logprob_dtype(self) -> str:
        """The dtype the engine computes its log-probs in (a key of runtime.dtypes.DTYPES): what
        the weight check's tolerance is derived from."""

    @abc.abstractmethod
    def generate(self, prompts: list[list[int]], sampling: SamplingParams) -> list[list[Completion]]:
        """``sampling.n`` completions for each prompt (token ids), in prompt order."""

    def generate_on_each_replica(self, prompts: list[list[int]], sampling: SamplingParams
                                 ) -> dict[str, list[list[Completion]]]:
        """The same prompts generated on every replica that serves rollouts (each server of a
        pool), by the replica's description: to check that each holds the right weights."""
        with self._not_counted():
            return {f"{type(self).__name__} (in process)": self.generate(prompts, sampling)}

    @contextlib.contextmanager
    def _not_counted(self) -> Iterator[None]:
        """Generation (a check's) that the throughput metrics leave out."""
        tokens, seconds = self._tokens, self._seconds
        try:
            yield
        finally:
            self._tokens, self._seconds = tokens, seconds

    def shutdown(self) -> None:
        """Stop whatever the engine started."""

    def metrics(self) -> dict[str, float]:
        """Engine-side metrics since the last call (tokens/s, per-server latency, ...)."""
        return {}


@runtime_checkable
class LoadsTensors(Protocol):
    """The in-place strategy's endpoint: the engine's own model takes the tensors, one at a
    time, and then serves weight version ``version``."""

    def load_weights(self, named_tensors: NamedTensors, version: int) -> None: ...


@runtime_checkable
class ReloadsFolders(Protocol):
    """The disk strategy's endpoint: every server loads the HF weights of ``folder`` and then
    serves weight version ``version``; raises if one did not."""

    def reload_from_folder(self, folder: Path, version: int) -> None: ...


@runtime_checkable
class LoadsAdapters(Protocol):
    """The adapters strategy's endpoint: every server loads the PEFT LoRA adapter folder
    ``folder`` on its base, serves it from now on as weight version ``version``; raises if
    one did not."""

    def load_adapter(self, folder: Path, version: int) -> None: ...


@runtime_checkable
class TakesBroadcasts(Protocol):
    """The broadcast strategy's endpoints: ``weight_update(version)`` holds the servers to
    update for its body (its value: them), during which each ``broadcast_bucket`` announces a
    bucket of named tensors to them and broadcasts it (the last one carries the version)."""

    def weight_update(self, version: int) -> ContextManager[list]: ...

    def broadcast_bucket(self, targets: list, bucket: list[tuple[str, torch.Tensor]],
                         last: bool, version: int) -> None: ...


@runtime_checkable
class GeneratesAhead(Protocol):
    """An engine that generates in a thread of the trainer's while the weights are pushed
    (``rollout.max_staleness`` > 0): ``version`` is the weight version last pushed (None:
    the starting weights)."""

    version: Optional[int]

    def generate_in_background(self, inflight_at_sync: str) -> None:
        """From now on rollouts may run in another thread while weights are pushed; requests
        in flight at a push finish on the old weights (``finish``) or are aborted and resumed
        on the new ones (``abort``)."""

    def take_drain_wait_seconds(self) -> float:
        """Seconds the weight pushes since the last call waited for requests in flight."""
