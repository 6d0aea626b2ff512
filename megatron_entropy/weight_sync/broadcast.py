"""Broadcast: the engine's servers and the first stage's leader form one process group (the
engine's, rollout/server/sglang.py); buckets of at most ``bucket_bytes`` go out in stage order, each
announced to the servers and then broadcast from the leader. Later stages' buckets reach the
leader one at a time (stream.buckets_at_first_stage): no rank holds more than its own stage and
one bucket."""

from __future__ import annotations

import time

from megatron_entropy.rollout.base import TakesBroadcasts
from megatron_entropy.weight_sync.base import BucketSync, with_last
from megatron_entropy.weight_sync.stream import StageStream


class BroadcastSync(BucketSync):
    ENDPOINTS = TakesBroadcasts

    def sync_stream(self, stream: StageStream, version: int) -> dict[str, float]:
        engine = self._engine_here(stream)
        relayed = self._relayed_to_first(stream)
        if relayed is None:
            return {}
        start = time.monotonic()
        sent = 0
        with engine.weight_update(version) as targets:
            for (_, bucket), last in with_last(relayed):
                engine.broadcast_bucket(targets, bucket, last, version)
                sent += sum(t.numel() * t.element_size() for _, t in bucket)
        return {"weight_sync/seconds": time.monotonic() - start, "weight_sync/bytes": float(sent)}
