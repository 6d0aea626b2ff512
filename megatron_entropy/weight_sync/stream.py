"""What every sync strategy moves: one pipeline stage's HF tensors, planned into buckets.

A ``StageStream`` is this rank's part of one sync: its stage's tensor specs (known up front) and
the stream of the tensors themselves (full on the stage's leader, TP rank 0; None on its other TP
ranks, which iterate only to take part in the TP gathers). The stage leaders of one replica are
its pipeline group at TP rank 0; the first stage's leader is the rank that holds the engine.

Buckets are planned from the specs alone, so a sender and a receiver agree on them without
talking: consecutive tensors while they fit in ``bucket_bytes``; a tensor bigger than that goes
alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_entropy.models.bridge import export_stage_hf_weights
from megatron_entropy.models.hf_io import TensorSpec

Bucket = list[tuple[str, torch.Tensor]]


def spec_bytes(spec: TensorSpec) -> int:
    _, shape, dtype = spec
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass
class StageStream:
    """This rank's share of one weight sync (see the module docstring)."""

    stage: int
    stages: int
    specs: list[TensorSpec]
    tensors: Iterator[tuple[str, Optional[torch.Tensor]]]
    leader: bool  # TP rank 0 of the stage: holds the full tensors
    group: Optional[dist.ProcessGroup] = None  # the stage leaders; None: one process, one stage
    leader_ranks: Sequence[int] = (0,)  # global rank of each stage's leader
    device: torch.device = torch.device("cpu")

    @property
    def first(self) -> bool:
        """The first stage's leader: it talks to the engine."""
        return self.leader and self.stage == 0

    def drain(self) -> None:
        """Walk the rest of the stream (the TP gathers of the other TP ranks wait on it)."""
        for _ in self.tensors:
            pass


def model_stage_stream(model, arch, relay_only: bool = False,
                       export: Callable = export_stage_hf_weights) -> StageStream:
    """This rank's stage of a built Megatron model (parallel state initialised): the tensors
    ``export`` gives (its HF weights; a LoRA policy's PEFT adapters); a ``relay_only`` rank
    walks the stream for its collectives and leads nothing."""
    specs, tensors = export(model, arch)
    group = ps.get_pipeline_model_parallel_group()
    return StageStream(stage=ps.get_pipeline_model_parallel_rank(),
                       stages=ps.get_pipeline_model_parallel_world_size(), specs=specs,
                       tensors=tensors,
                       leader=ps.get_tensor_model_parallel_rank() == 0 and not relay_only,
                       group=group, leader_ranks=dist.get_process_group_ranks(group),
                       device=next(model.parameters()).device)


def single_stream(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> StageStream:
    """Whole-model tensors held by one process (tests, benchmarks, tools): one stage."""
    items = list(named_tensors)
    specs = [(name, tuple(t.shape), t.dtype) for name, t in items]
    device = items[0][1].device if items else torch.device("cpu")
    return StageStream(stage=0, stages=1, specs=specs, tensors=iter(items), leader=True,
                       device=device)


def plan_buckets(specs: Sequence[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive specs grouped while they fit in ``bucket_bytes`` (a bigger one goes alone)."""
    buckets: list[list[TensorSpec]] = []
    size = 0
    for spec in specs:
        nbytes = spec_bytes(spec)
        if not buckets or (buckets[-1] and size + nbytes > bucket_bytes):
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += nbytes
    return buckets


def fill_buckets(tensors: Iterator[tuple[str, torch.Tensor]], plan: list[list[TensorSpec]]
                 ) -> Iterator[Bucket]:
    """The stream cut along the plan; a tensor that is not the planned one raises."""
    for specs in plan:
        bucket: Bucket = []
        for name, shape, _ in specs:
            got, tensor = next(tensors)
            if got != name or tuple(tensor.shape) != tuple(shape):
                raise ValueError(f"weight stream gave {got} {tuple(tensor.shape)} where the plan "
                                 f"has {name} {tuple(shape)}")
            bucket.append((got, tensor))
        yield bucket


def stage_plans(stream: StageStream, bucket_bytes: int) -> list[list[list[TensorSpec]]]:
    """Every stage's bucket plan, on every stage leader (one small object all-gather)."""
    specs: list = [stream.specs]
    if stream.group is not None and stream.stages > 1:
        specs = [None] * stream.stages
        dist.all_gather_object(specs, stream.specs, group=stream.group)
    return [plan_buckets(s, bucket_bytes) for s in specs]


def buckets_at_first_stage(stream: StageStream, bucket_bytes: int
                           ) -> Iterator[tuple[int, Bucket]]:
    """(stage, bucket) of every stage in stage order, yielded on the first stage's leader: its own
    stage's from its stream, the others' received from their leaders one bucket at a time. Every
    other rank yields nothing (a stage leader sends its buckets when the first stage asks for
    them, in order). No rank holds more than its own stage and one bucket."""
    if not stream.leader:
        stream.drain()
        return
    plans = stage_plans(stream, bucket_bytes)
    first_rank = stream.leader_ranks[0]
    for stage, plan in enumerate(plans):
        if stage == stream.stage:
            for bucket in fill_buckets(stream.tensors, plan):
                if stream.first:
                    yield stage, bucket
                else:
                    for _, t in bucket:
                        dist.send(t.contiguous(), dst=first_rank, group=stream.group)
                del bucket
        elif stream.first:
            src = stream.leader_ranks[stage]
            for specs in plan:
                bucket = []
                for name, shape, dtype in specs:
                    t = torch.empty(shape, dtype=dtype, device=stream.device)
                    dist.recv(t, src=src, group=stream.group)
                    bucket.append((name, t))
                yield stage, bucket
                del bucket
