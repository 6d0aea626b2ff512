"""What this rank does in the job, worked out once from Megatron's parallel state and the rollout
engine's kind: who leads a data-parallel replica, who talks to the engine, who feeds it weights.

A shared engine (servers) serves the whole job: global rank 0 drives it and DP replica 0 gathers
the weights it is sent. A per-replica engine (in-process) lives on each replica's leader, and
every replica gathers weights for its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from megatron.core import parallel_state as ps


def is_replica_leader() -> bool:
    """TP rank 0 of the first PP stage (and CP rank 0): the rank that holds its DP replica's
    rollouts and full weights (the others take part in the collectives that bring them there)."""
    return (ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0
            and ps.get_context_parallel_rank() == 0)


@dataclass(frozen=True)
class Roles:
    rank: int  # global rank
    dp_rank: int
    dp_size: int
    replica_leader: bool  # see is_replica_leader
    shared_engine: bool  # one engine (servers) for the job, else one per DP replica
    # Rank among the replicas that share out the experts (expert parallelism); = dp_rank at EP=1
    # and CP=1.
    expert_dp_rank: int = 0
    # Context parallelism: the CP ranks of a replica hold the same weights; CP rank 0's send them.
    cp_rank: int = 0
    # Expert parallelism under CP: Megatron carves the EP groups out of DP x CP, so a CP rank
    # other than 0 may hold experts that a CP rank 0 of its EP group needs; whether its EP group
    # holds a CP rank 0 (which then gathers the experts over it).
    ep_group_has_cp_leader: bool = False

    @classmethod
    def here(cls, shared_engine: bool) -> Roles:
        """This rank's roles (parallel state initialised) with a shared or per-replica engine."""
        cp_rank = ps.get_context_parallel_rank()
        return cls(rank=dist.get_rank(), dp_rank=ps.get_data_parallel_rank(),
                   dp_size=ps.get_data_parallel_world_size(), replica_leader=is_replica_leader(),
                   shared_engine=shared_engine,
                   expert_dp_rank=ps.get_expert_data_parallel_rank(),
                   cp_rank=cp_rank, ep_group_has_cp_leader=_ep_group_has_cp_leader(cp_rank))

    @property
    def rank0(self) -> bool:
        return self.rank == 0

    @property
    def talks_to_engine(self) -> bool:
        """Builds and calls an engine: rank 0 for a shared one, each replica leader else."""
        return self.rank0 if self.shared_engine else self.replica_leader

    @property
    def feeds_engine(self) -> bool:
        """Takes part in gathering the full weights an engine is sent: every model-parallel rank
        of DP replica 0 for a shared engine (and, with expert parallelism, of the replicas that
        hold the rest of its experts: ``relays_experts``), of every replica else; of CP rank 0
        (the other CP ranks hold the same dense weights; with expert parallelism those whose EP
        group holds a CP rank 0 relay their experts)."""
        if self.cp_rank != 0 and not self.ep_group_has_cp_leader:
            return False
        return self.expert_dp_rank == 0 if self.shared_engine else True

    @property
    def relays_experts(self) -> bool:
        """Feeds an engine only by handing its experts to other ranks of its EP group (DP
        replica 0's for a shared engine; its EP group's CP rank 0 under CP)."""
        return self.feeds_engine and (self.cp_rank != 0
                                      or self.shared_engine and self.dp_rank != 0)


def _ep_group_has_cp_leader(cp_rank: int) -> bool:
    """Whether this rank's expert-parallel group holds a CP rank 0 (EP x CP > 1: one small
    all-gather over the EP group; else whether this rank is one)."""
    group = ps.get_expert_model_parallel_group()
    if ps.get_context_parallel_world_size() == 1 or dist.get_world_size(group) == 1:
        return cp_rank == 0
    ranks: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(ranks, cp_rank, group=group)
    return 0 in ranks
