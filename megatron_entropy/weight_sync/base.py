"""The interface every weight-sync strategy implements (in_place.py, disk.py, broadcast.py,
adapters.py), and what several of them share."""

from __future__ import annotations

import abc
import os
import shutil
import time
from pathlib import Path
from typing import Callable, ClassVar, Iterable, Iterator, Optional, TypeVar, Union

import torch

from megatron_entropy.weight_sync.stream import (Bucket, StageStream, buckets_at_first_stage,
                                                 model_stage_stream, single_stream)

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

    def _relayed_to_first(self, stream: StageStream) -> Optional[Iterator[tuple[int, Bucket]]]:
        """Every stage's buckets, in stage order, on the first stage's leader
        (stream.buckets_at_first_stage); None on the other ranks, once they have sent theirs."""
        relayed = buckets_at_first_stage(stream, self.bucket_bytes)
        if stream.first:
            return relayed
        for _ in relayed:
            pass
        return None


class VersionFolders:
    """Weight versions as folders ``<stem>-v<N>`` under ``root``: each written as
    ``.<stem>-v<N>.partial`` and renamed whole (a reader sees a complete folder or none), the
    previous version's removed once the engine holds the next one."""

    def __init__(self, root: Union[str, Path], stem: str) -> None:
        self.root, self.stem = Path(root), stem
        self.previous: Optional[Path] = None

    def paths(self, version: int) -> tuple[Path, Path]:
        """(the version's folder, the partial one it is written as)."""
        return self.root / f"{self.stem}-v{version}", self.root / f".{self.stem}-v{version}.partial"

    def fresh(self, version: int) -> tuple[Path, Path]:
        """``paths``, the partial folder emptied of what a killed writer of this version left."""
        folder, partial = self.paths(version)
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        return folder, partial

    def deliver(self, partial: Path, folder: Path, version: int,
                load: Callable[[Path, int], None], start: float) -> dict[str, float]:
        """Rename the written ``partial`` folder to ``folder``, have the engine load it
        (``load(folder, version)``) and remove the previous version's; the seconds since
        ``start`` until the folder was complete and until the engine held it."""
        try:
            if folder.exists():
                shutil.rmtree(folder)
            os.replace(partial, folder)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        written = time.monotonic() - start
        load(folder, version)
        if self.previous is not None and self.previous != folder:
            shutil.rmtree(self.previous, ignore_errors=True)
        self.previous = folder
        return {"weight_sync/seconds": time.monotonic() - start,
                "weight_sync/write_seconds": written}
