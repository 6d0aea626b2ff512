"""Adapters: a LoRA policy's adapters alone, to an engine that serves LoRA on its base
(``rollout.weight_sync.strategy=adapters``; vLLM, SGLang). The base never changes, so only the adapters move:
megabytes where a merged sync moves the whole model.

Each stage streams its own adapters (TP-gathered, as PEFT names them: models/lora_export.py) to
the first stage's leader a bucket at a time (stream.buckets_at_first_stage); it writes them as
a PEFT adapter folder ``adapters-v{N}`` (complete or absent: written beside it and renamed) and
has the engine load it in place of the previous version, whose folder is then removed.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Union

from megatron_entropy.models.arch import load_arch
from megatron_entropy.models.lora_export import (export_stage_adapters, peft_config,
                                                 write_peft_adapter)
from megatron_entropy.models.lora_settings import LoraSettings, check_lora_model
from megatron_entropy.rollout.base import LoadsAdapters
from megatron_entropy.weight_sync.base import BucketSync, VersionFolders
from megatron_entropy.weight_sync.stream import StageStream, model_stage_stream


class AdapterSync(BucketSync):
    ENDPOINTS = LoadsAdapters

    def __init__(self, engine, bucket_bytes: int, sync_root: Union[str, Path],
                 hf_dir: Union[str, Path], lora: LoraSettings):
        super().__init__(engine, bucket_bytes)
        check_lora_model(lora, load_arch(hf_dir).is_moe, adapter_sync=True)
        self.folders = VersionFolders(sync_root, "adapters")
        self.config = peft_config(lora.rank, lora.alpha, lora.targets,
                                  str(Path(hf_dir).resolve()))

    def sync(self, model, arch, version: int, relay_only: bool = False) -> dict[str, float]:
        return self.sync_stream(model_stage_stream(model, arch, relay_only,
                                                   export=export_stage_adapters), version)

    def sync_stream(self, stream: StageStream, version: int) -> dict[str, float]:
        relayed = self._relayed_to_first(stream)
        if relayed is None:
            return {}
        start = time.monotonic()
        folder, partial = self.folders.fresh(version)
        tensors = {name: t for _, bucket in relayed for name, t in bucket}
        try:
            nbytes = write_peft_adapter(partial, tensors, self.config)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return {**self.folders.deliver(partial, folder, version,
                                       self._engine_here(stream).load_adapter, start),
                "weight_sync/bytes": float(nbytes), "weight_sync/tensors": float(len(tensors))}
