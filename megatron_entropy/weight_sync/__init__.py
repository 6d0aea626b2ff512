"""Weight sync: the trainer's weights into the rollout engine, one strategy per kind of engine.

- ``in_place`` (in-process engine): tensors copied into the engine's model in the leader's own
  process;
- ``disk`` (vLLM, SGLang with ``rollout.server.weight_sync=disk``): each pipeline stage's leader
  writes its own stage into one HF folder, which the servers reload;
- ``broadcast`` (SGLang with ``weight_sync=distributed``): buckets broadcast to the servers'
  ranks from the first stage's leader, in stage order.

Each stage's leader (TP rank 0 of the stage) gathers only its own stage's TP shards; buckets are
``rollout.weight_sync_bucket_mb``. Engines expose the endpoints the strategies call (reload this
folder, take this bucket, load these tensors) and keep pause/drain/version bookkeeping;
nothing in rollout/ or models/ imports this package.
"""

from __future__ import annotations

from pathlib import Path
from typing import Union

from megatron_entropy.weight_sync.base import WeightSync
from megatron_entropy.weight_sync.broadcast import BroadcastSync
from megatron_entropy.weight_sync.disk import DiskSync
from megatron_entropy.weight_sync.in_place import InPlaceSync

__all__ = ["BroadcastSync", "DiskSync", "InPlaceSync", "WeightSync", "build_weight_sync",
           "strategy_name"]


def strategy_name(rollout_cfg) -> str:
    """The strategy the config implies: the engine's kind, then ``rollout.server.weight_sync``."""
    if rollout_cfg.engine == "inprocess":
        return "in_place"
    return "broadcast" if rollout_cfg.server.weight_sync == "distributed" else "disk"


def build_weight_sync(rollout_cfg, engine, hf_dir: Union[str, Path], run_dir: Union[str, Path]
                      ) -> WeightSync:
    """The strategy for ``rollout_cfg`` (``engine`` is None on ranks that hold none: they only
    send their stage's weights)."""
    bucket_bytes = rollout_cfg.weight_sync_bucket_mb * 1024**2
    name = strategy_name(rollout_cfg)
    if name == "in_place":
        return InPlaceSync(engine, bucket_bytes)
    if name == "broadcast":
        return BroadcastSync(engine, bucket_bytes)
    sync_root = rollout_cfg.server.weight_sync_dir or Path(run_dir) / "weight_sync"
    return DiskSync(engine, bucket_bytes, sync_root, hf_dir)
