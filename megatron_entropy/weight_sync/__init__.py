"""Weight sync: the trainer's weights into the rollout engine, one strategy per kind of engine,
named as ``rollout.weight_sync.strategy`` names it:

- ``in_place`` (in-process engine): tensors copied into the engine's model in the leader's own
  process;
- ``disk`` (vLLM, SGLang): each pipeline stage's leader writes its own stage into one HF folder,
  which the servers reload;
- ``broadcast`` (SGLang): buckets broadcast to the servers' ranks from the first stage's
  leader, in stage order;
- ``adapters`` (vLLM, SGLang; ``model.lora``): a LoRA policy's adapters alone, as a PEFT folder the
  servers load on their base. Every other strategy sends a LoRA policy's weights with its
  adapters merged in (the bridge's export merges them).

Each stage's leader (TP rank 0 of the stage) gathers only its own stage's TP shards; buckets are
``rollout.weight_sync.bucket_mb``. Each strategy calls only the engine endpoints of its protocol
(rollout/base.py: ``LoadsTensors``, ``ReloadsFolders``, ``TakesBroadcasts``, ``LoadsAdapters``);
the engines keep
pause/drain/version bookkeeping. Above rollout/ (whose protocols it uses), below the trainer,
which alone imports it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from megatron_entropy.config import RolloutConfig
from megatron_entropy.models.lora_settings import LoraSettings
from megatron_entropy.rollout.base import RolloutEngine
from megatron_entropy.weight_sync.adapters import AdapterSync
from megatron_entropy.weight_sync.base import WeightSync
from megatron_entropy.weight_sync.broadcast import BroadcastSync
from megatron_entropy.weight_sync.disk import DiskSync
from megatron_entropy.weight_sync.in_place import InPlaceSync

__all__ = ["AdapterSync", "BroadcastSync", "DiskSync", "InPlaceSync", "STRATEGIES",
           "WeightSync", "build_weight_sync"]

# ``rollout.weight_sync.strategy`` -> the class (the config's choices are these names).
STRATEGIES: dict[str, type[WeightSync]] = {"in_place": InPlaceSync, "disk": DiskSync,
                                           "broadcast": BroadcastSync, "adapters": AdapterSync}


def build_weight_sync(rollout_cfg: RolloutConfig, engine: Optional[RolloutEngine],
                      hf_dir: Union[str, Path], run_dir: Union[str, Path],
                      lora: Optional[LoraSettings] = None) -> WeightSync:
    """The strategy ``rollout.weight_sync`` names (``engine`` is None on ranks that hold none:
    they only send their stage's weights), for a policy with the adapters of ``lora``."""
    w = rollout_cfg.weight_sync
    name = w.strategy_for(rollout_cfg.engine)
    cls = STRATEGIES[name]
    if engine is not None and not isinstance(engine, cls.ENDPOINTS):
        raise TypeError(f"rollout.weight_sync.strategy={name}: {type(engine).__name__} lacks "
                        f"the endpoints of {cls.ENDPOINTS.__name__}")
    folder = w.dir or Path(run_dir) / "weight_sync"
    if cls is DiskSync:  # each stage writes its own files: no buckets
        return DiskSync(engine, folder, hf_dir)
    bucket_bytes = w.bucket_mb * 1024**2
    if cls is AdapterSync:
        return AdapterSync(engine, bucket_bytes, folder, hf_dir, lora)
    return cls(engine, bucket_bytes)
