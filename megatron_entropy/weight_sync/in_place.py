"""In place: the in-process engine (rollout/inprocess.py) lives in the replica leader's own
process; every stage's tensors reach it bucket by bucket (stream.buckets_at_first_stage) and
are copied into its model's weights one at a time."""

from __future__ import annotations

import time

from megatron_entropy.rollout.base import LoadsTensors
from megatron_entropy.weight_sync.base import BucketSync
from megatron_entropy.weight_sync.stream import StageStream


class InPlaceSync(BucketSync):
    ENDPOINTS = LoadsTensors

    def sync_stream(self, stream: StageStream, version: int) -> dict[str, float]:
        engine = self._engine_here(stream)
        start = time.perf_counter()
        relayed = self._relayed_to_first(stream)
        if relayed is None:
            return {}
        count = nbytes = 0

        def tensors():
            nonlocal count, nbytes
            for _, bucket in relayed:
                for name, tensor in bucket:
                    count += 1
                    nbytes += tensor.numel() * tensor.element_size()
                    yield name, tensor

        engine.load_weights(tensors(), version)
        return {"weight_sync/seconds": time.perf_counter() - start,
                "weight_sync/bytes": float(nbytes), "weight_sync/tensors": float(count)}
