"""The interface every weight-sync strategy implements (in_place.py, disk.py, broadcast.py)."""

from __future__ import annotations

import abc
from typing import ClassVar, Iterable, Iterator, Optional, TypeVar

import torch

from megatron_entropy.weight_sync.stream import StageStream, model_stage_stream, single_stream

T = TypeVar("T")


def with_last(items: Iterator[T]) -> Iterator[tuple[T, bool]]:
    """Each item with whether it is the last one (one item of look-ahead)."""
    pending = next(items, None)
    while pending is not None:
        following = next(items, None)
        yield pending, following is None
        pending = following


class WeightSync(abc.ABC):
    """Moves the trainer's weights into a rollout engine: ``sync`` from a Megatron model (every
    model-parallel rank of a replica that feeds an engine calls it; the engine lives on the
    first stage's leader), ``push`` from whole tensors one process holds. Returns the
    ``weight_sync/*`` metrics on the engine's rank, {} elsewhere; raises if the engine did not
    take the weights (training must not go on against stale ones)."""

    # The engine endpoints this strategy calls (a protocol of rollout/base.py).
    ENDPOINTS: ClassVar[type]

    def __init__(self, engine):
        self.engine = engine

    def sync(self, model, arch, version: int, relay_only: bool = False) -> dict[str, float]:
        """This rank's part of syncing ``model``; ``relay_only``: a rank that only takes part in
        the stream's expert gathers (Roles.relays_experts) and leads nothing."""
        return self.sync_stream(model_stage_stream(model, arch, relay_only), version)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
             ) -> dict[str, float]:
        return self.sync_stream(single_stream(named_tensors), version)

    @abc.abstractmethod
    def sync_stream(self, stream: StageStream, version: int) -> dict[str, float]:
        """This rank's part of the sync of ``stream`` (stream.py) as weight version ``version``."""

    def _engine_here(self, stream: StageStream) -> Optional[object]:
        if stream.first and self.engine is None:
            raise RuntimeError("weight sync: the first pipeline stage's leader has no rollout "
                               "engine to send the weights to")
        return self.engine


class BucketSync(WeightSync):
    """A strategy whose first stage's leader gets every stage's tensors, later stages' relayed
    in buckets of at most ``bucket_bytes`` (stream.buckets_at_first_stage)."""

    def __init__(self, engine, bucket_bytes: int):
        super().__init__(engine)
        self.bucket_bytes = bucket_bytes
