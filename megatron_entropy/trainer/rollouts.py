"""One step's rollouts: prompts -> engine -> rewards -> dynamic sampling -> this DP rank's samples.

Who generates: a per-rank engine (in-process) runs on every data-parallel leader, each on its share
of the prompts; a shared engine (servers) is driven by global rank 0 alone, with every request in
flight at once. The ranks that generated a group hold it. Every rank learns only each group's
small statistics (rewards, lengths, source: `GroupStats`), so every rank takes the same
dynamic-sampling decisions, logs the same metrics and computes the same advantages; the kept
groups themselves (token ids, log-probs, text) then go from their holders to the DP rank that
trains on them (whole groups, as many per DP rank as round-robin dealing gives, chosen so that the
ranks' tokens and attention work (sum of len^2) are even: `dp_owners`), and from that rank's
leader to its TP/PP peers. No rank receives another rank's share.

Asynchronous rollouts (trainer/async_rollouts.py) split the shared-engine path in two:
`generate_step_local` (rank 0 alone, no collectives: it may run in a background thread) and
`distribute_step` (every rank, on the main thread).
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_entropy.algorithms.advantages import compute_advantages
from megatron_entropy.data import GroupFilter, PromptItem
from megatron_entropy.data.task_metrics import mode_shares, response_modes
from megatron_entropy.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_entropy.rollout.server.partial import version_runs
from megatron_entropy.runtime.roles import Roles
from megatron_entropy.runtime.seeds import refill_round_seed
from megatron_entropy.tool_use.engine import TrajectoryStats
from megatron_entropy.tool_use.metrics import trajectory_metrics
from megatron_entropy.trainer.batch import Sample
from megatron_entropy.trainer.packing import balance_groups, group_cost


@dataclass
class Group:
    """One prompt with its n scored completions."""

    item: PromptItem
    completions: list[Completion]
    rewards: list[float]
    baseline: Optional[float] = None  # ReMax: the reward of the prompt's greedy response


@dataclass(frozen=True)
class GroupStats:
    """What every rank knows of every group: enough for dynamic sampling, advantages and metrics."""

    source: str
    rewards: list[float]
    prompt_tokens: int
    response_tokens: list[int]
    truncated: list[bool]
    baseline: Optional[float] = None
    # Each response's solution mode, for tasks whose responses have modes (data/task_metrics.py).
    modes: tuple[str, ...] = ()
    # Each response's turns and tool calls, in multi-turn rollouts with tools (tool_use/).
    trajectories: tuple[TrajectoryStats, ...] = ()

    @classmethod
    def of(cls, group: Group) -> "GroupStats":
        source = group.item.source
        return cls(source, list(group.rewards), len(group.item.prompt_ids),
                   [len(c.token_ids) for c in group.completions],
                   [c.finish_reason == "length" for c in group.completions], group.baseline,
                   response_modes(source, [c.text for c in group.completions]),
                   tuple(c.meta["trajectory"] for c in group.completions
                         if "trajectory" in c.meta))


@dataclass
class StepGroups:
    """One step's rollouts as this rank sees them."""

    share: list[tuple[int, Group]]  # (index among the kept groups, group) this DP rank trains on
    kept: list[GroupStats]  # every kept group, in order
    generated: list[GroupStats]  # every generated group (all refill rounds)
    bytes_received: int = 0  # rollout data this rank received from the others
    metrics: dict[str, float] = field(default_factory=dict)
    # (kept index, sample index) of samples not trained on (too stale: async_rollouts.py)
    dropped: frozenset[tuple[int, int]] = frozenset()

    @property
    def tokens(self) -> int:
        """Prompt and response tokens of every kept sample (all DP ranks)."""
        return sum(s.prompt_tokens * len(s.rewards) + sum(s.response_tokens) for s in self.kept)


def _holder(item_index: int, dp_size: int, shared: bool) -> int:
    """The DP rank whose leader generated item ``item_index`` of a round (rank 0 drives a shared
    engine)."""
    return 0 if shared else item_index % dp_size


def dp_owners(kept: Sequence[GroupStats], dp_size: int) -> list[int]:
    """The DP rank that trains on each kept group (trainer/packing.py's ``balance_groups``)."""
    return balance_groups([group_cost([g.prompt_tokens + n for n in g.response_tokens])
                           for g in kept], dp_size)


def generate_round(engine: Optional[RolloutEngine], items: Sequence[PromptItem],
                   sampling: SamplingParams,
                   reward_fn: Callable[[list[str], list[str], list[str]], list[float]],
                   shared: bool, greedy_baseline: bool = False
                   ) -> tuple[dict[int, Group], list[GroupStats], int]:
    """Generate and score ``sampling.n`` completions for each item (and with
    ``greedy_baseline`` one greedy response more, whose reward is the group's ReMax
    baseline). Returns the groups this rank
    generated (by item index), every item's `GroupStats` (on every rank, in item order) and the
    bytes this rank received from the others.
    ``engine`` is None on ranks that do not talk to it. Sample seeds derive from
    (sampling.seed, the item's index in this rank's request, sample index): the same layout
    resumes to the same samples."""
    roles = Roles.here(shared)
    if not roles.talks_to_engine:
        mine = []
    elif shared:
        mine = list(range(len(items)))
    else:
        mine = list(range(roles.dp_rank, len(items), roles.dp_size))
    local = _generate_groups(engine, items, mine, sampling, reward_fn, greedy_baseline)
    payload = pickle.dumps({i: GroupStats.of(g) for i, g in local.items()})
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, payload)
    stats: dict[int, GroupStats] = {}
    for part in gathered:
        stats.update(pickle.loads(part))
    received = sum(len(part) for r, part in enumerate(gathered) if r != dist.get_rank())
    return local, [stats[i] for i in range(len(items))], received


def _generate_groups(engine: Optional[RolloutEngine], items: Sequence[PromptItem],
                     mine: list[int], sampling: SamplingParams,
                     reward_fn: Callable[[list[str], list[str], list[str]], list[float]],
                     greedy_baseline: bool = False) -> dict[int, Group]:
    """Items ``mine`` generated on ``engine`` and scored, by item index (no collectives); with
    ``greedy_baseline`` each also gets the reward of one greedy response (ReMax)."""
    local: dict[int, Group] = {}
    if mine:
        prompts = [items[i].prompt_ids for i in mine]
        outputs = engine.generate(prompts, sampling)
        if greedy_baseline:
            greedy = engine.generate(prompts, SamplingParams(**{**vars(sampling), "n": 1,
                                                                 "temperature": 0.0}))
            outputs = [[*out, *g] for out, g in zip(outputs, greedy)]
        texts = [c.text for out in outputs for c in out]
        answers = [items[i].answer for i, out in zip(mine, outputs) for _ in out]
        sources = [items[i].source for i, out in zip(mine, outputs) for _ in out]
        rewards = reward_fn(texts, answers, sources)  # one scoring pass for both
        if hasattr(reward_fn, "shape"):  # length shaping (rewards/overlong.py)
            rewards = reward_fn.shape(rewards, [len(c.token_ids) for out in outputs for c in out])
        k = 0
        for i, out in zip(mine, outputs):
            scored, k = rewards[k:k + len(out)], k + len(out)
            if greedy_baseline:  # the last one is the greedy response: not trained on
                local[i] = Group(items[i], out[:-1], scored[:-1], baseline=scored[-1])
            else:
                local[i] = Group(items[i], out, scored)
    return local


def _round_sampling(sampling: SamplingParams, round_index: int) -> SamplingParams:
    """Refill round ``round_index``'s sampling: its own seed."""
    return SamplingParams(**{**vars(sampling), "seed": refill_round_seed(sampling.seed, round_index)})


def _send_shares(held: dict[tuple[int, int], Group], kept: list[tuple[int, int]], shared: bool,
                 owners: list[int]) -> tuple[list[tuple[int, Group]], int]:
    """Each kept group from the leader that holds it to the leader of the DP rank that owns it
    (``owners``; a scatter per holding rank over the leaders' DP group), then to that leader's TP, PP and
    CP peers (broadcasts). Returns this rank's (kept index, group) pairs in kept order and the
    bytes it received."""
    roles = Roles.here(shared)
    dp_rank, dp_size = roles.dp_rank, roles.dp_size
    share: list[tuple[int, Group]] = []
    received = 0
    if roles.replica_leader:
        group = ps.get_data_parallel_group()
        for src in sorted({_holder(i, dp_size, shared) for _, i in kept}):
            parts = [pickle.dumps([(gi, held[key]) for gi, key in enumerate(kept)
                                   if owners[gi] == dst
                                   and _holder(key[1], dp_size, shared) == src])
                     for dst in range(dp_size)] if src == dp_rank else None
            out: list = [None]
            dist.scatter_object_list(out, parts, src=dist.get_global_rank(group, src),
                                     group=group)
            if src != dp_rank:
                received += len(out[0])
            share += pickle.loads(out[0])
        share.sort(key=lambda pair: pair[0])
    cp_group = ps.get_context_parallel_group()
    cp_first = ps.get_context_parallel_rank() == 0
    for group, src, first in (
            (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_src_rank(),
             ps.get_pipeline_model_parallel_rank() == 0 and cp_first),
            (ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_first_rank(),
             cp_first),
            (cp_group, dist.get_process_group_ranks(cp_group)[0], True)):
        if dist.get_world_size(group) == 1 or not first:
            continue
        box = [pickle.dumps(share) if dist.get_rank() == src else None]
        dist.broadcast_object_list(box, src=src, group=group)
        if dist.get_rank() != src:
            received += len(box[0])
            share = pickle.loads(box[0])
    return share, received


def _refill_rounds(keep: GroupFilter, next_items: Callable[[int], list[PromptItem]],
                   sampling: SamplingParams, between_rounds: Callable[[], None],
                   generate: Callable[[list[PromptItem], SamplingParams],
                                      tuple[dict[int, Group], list[GroupStats]]]
                   ) -> tuple[dict[tuple[int, int], Group], dict[tuple[int, int], GroupStats],
                              list[GroupStats]]:
    """Dynamic sampling's rounds until ``keep`` is done: each draws the prompts still needed,
    with the round's own seed, and ``generate`` returns the groups this rank generated (by item
    index) and every item's statistics. ``between_rounds`` runs before each refill round (the
    trainer's stop check; it may raise). Returns the groups held here and every group's
    statistics, by (round, item index), and every generated group's statistics in order."""
    held: dict[tuple[int, int], Group] = {}
    stats_of: dict[tuple[int, int], GroupStats] = {}
    generated: list[GroupStats] = []
    while not keep.done:
        if keep.rounds:
            between_rounds()
        local, stats = generate(next_items(keep.prompts_needed()),
                                _round_sampling(sampling, keep.rounds))
        keys = [(keep.rounds, i) for i in range(len(stats))]
        held.update({(keep.rounds, i): g for i, g in local.items()})
        stats_of.update(zip(keys, stats))
        generated += stats
        keep.add(keys, [s.rewards for s in stats])
    return held, stats_of, generated


def collect_step_groups(engine: Optional[RolloutEngine], next_items: Callable[[int], list[PromptItem]],
                        sampling: SamplingParams, reward_fn, shared: bool, target_groups: int,
                        dynamic_sampling: bool, max_refill_rounds: int,
                        between_rounds: Callable[[], None] = lambda: None,
                        greedy_baseline: bool = False) -> StepGroups:
    """Roll out until ``target_groups`` groups with reward variance are kept (or the refill
    rounds run out), then give each DP rank its share of the kept groups.
    ``between_rounds`` runs before each refill round (the trainer's stop check; it may raise).
    ``rollout/bytes_received`` is the most rollout data any rank received from the others."""
    keep = GroupFilter(target_groups, max_refill_rounds, enabled=dynamic_sampling)
    received = 0

    def generate(items: list[PromptItem], round_sampling: SamplingParams
                 ) -> tuple[dict[int, Group], list[GroupStats]]:
        nonlocal received
        local, stats, nbytes = generate_round(engine, items, round_sampling, reward_fn, shared,
                                              greedy_baseline)
        received += nbytes
        return local, stats

    held, stats_of, generated = _refill_rounds(keep, next_items, sampling, between_rounds,
                                               generate)
    kept = keep.take()
    share, nbytes = _send_shares(held, kept, shared, dp_owners(
        [stats_of[k] for k in kept], ps.get_data_parallel_world_size()))
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, received + nbytes)
    return StepGroups(share, [stats_of[k] for k in kept], generated, received + nbytes,
                      {**keep.metrics(), "rollout/bytes_received": float(max(per_rank))})


@dataclass
class LocalStep:
    """One step's rollouts on rank 0 (shared engine), before `distribute_step`."""

    held: dict[tuple[int, int], Group]  # (round, item index) -> group
    kept: list[tuple[int, int]]  # the kept groups' keys, in order
    stats_of: dict[tuple[int, int], GroupStats]
    generated: list[GroupStats]  # every generated group (all refill rounds)
    metrics: dict[str, float]  # dynamic sampling's
    sampler_state: dict = field(default_factory=dict)  # the data position after its draws


def generate_step_local(engine: RolloutEngine, next_items: Callable[[int], list[PromptItem]],
                        sampling: SamplingParams, reward_fn, target_groups: int,
                        dynamic_sampling: bool, max_refill_rounds: int,
                        between_rounds: Callable[[], None] = lambda: None,
                        greedy_baseline: bool = False) -> LocalStep:
    """`collect_step_groups`'s rounds with a shared engine, on rank 0 alone and without
    collectives: the same prompts, seeds and dynamic-sampling decisions."""
    keep = GroupFilter(target_groups, max_refill_rounds, enabled=dynamic_sampling)

    def generate(items: list[PromptItem], round_sampling: SamplingParams
                 ) -> tuple[dict[int, Group], list[GroupStats]]:
        local = _generate_groups(engine, items, list(range(len(items))), round_sampling,
                                 reward_fn, greedy_baseline)
        return local, [GroupStats.of(local[i]) for i in range(len(items))]

    held, stats_of, generated = _refill_rounds(keep, next_items, sampling, between_rounds,
                                               generate)
    return LocalStep(held, keep.take(), stats_of, generated, keep.metrics())


def distribute_step(local: Optional[LocalStep], extra: Optional[dict] = None
                    ) -> tuple[StepGroups, dict]:
    """Rank 0's ``local`` step (None on the other ranks) to every rank as `collect_step_groups`
    gives it: every group's statistics to all ranks, each kept group to its owner. ``extra``
    (rank 0's) travels with the statistics and is returned on every rank."""
    box = [pickle.dumps(None if local is None else (
        local.kept, [local.stats_of[k] for k in local.kept], local.generated, local.metrics,
        extra or {}))]
    dist.broadcast_object_list(box, src=0)
    received = len(box[0]) if dist.get_rank() != 0 else 0
    kept, kept_stats, generated, metrics, extra = pickle.loads(box[0])
    share, nbytes = _send_shares(local.held if local is not None else {}, kept, True,
                                 dp_owners(kept_stats, ps.get_data_parallel_world_size()))
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, received + nbytes)
    return StepGroups(share, kept_stats, generated, received + nbytes,
                      {**metrics, "rollout/bytes_received": float(max(per_rank))}), extra


def groups_to_samples(step: StepGroups, estimator: str, norm_by_std: bool) -> list[Sample]:
    """This DP rank's completions as Samples, each with its group's advantage computed over
    every kept group of the step (all ranks hold every kept group's rewards); ``step.dropped``
    samples are left out (after the advantages: their group's baseline is unchanged)."""
    rewards = [r for s in step.kept for r in s.rewards]
    if not rewards:
        return []
    baselines = None
    if estimator == "remax":
        if any(s.baseline is None for s in step.kept):
            raise ValueError("algorithm.advantage=remax needs each group's greedy baseline; "
                             "these rollouts were generated without it")
        baselines = torch.tensor([s.baseline for s in step.kept for _ in s.rewards])
    adv = compute_advantages(estimator, torch.tensor(rewards),
                             torch.tensor([gi for gi, s in enumerate(step.kept) for _ in s.rewards]),
                             norm_by_std=norm_by_std,
                             lengths=torch.tensor([n for s in step.kept
                                                   for n in s.response_tokens]),
                             baselines=baselines).tolist()
    first = [0]
    for s in step.kept:
        first.append(first[-1] + len(s.rewards))
    return [Sample(prompt_ids=list(g.item.prompt_ids), response_ids=list(c.token_ids),
                   engine_logprobs=list(c.logprobs), engine_entropies=c.entropies,
                   loss_mask=c.loss_mask,
                   reward=r, group=gi, source=g.item.source,
                   advantage=adv[first[gi] + j], engine_routing=c.meta.get("routing"),
                   **served_by(c))
            for gi, g in step.share for j, (c, r) in enumerate(zip(g.completions, g.rewards))
            if (gi, j) not in step.dropped]


def served_by(c: Completion) -> dict[str, Any]:
    """The ``Sample`` fields that say who generated ``c`` and on which weights."""
    versions = {v for v, n in version_runs(c) if n}
    return {"server": c.meta.get("server"),
            "weight_version": str(versions.pop()) if len(versions) == 1 else None,
            "exact_logprobs": "logprobs" not in c.meta}


def dp_share(samples: list[Sample]) -> list[Sample]:
    """This DP rank's samples out of a whole step's (``Sample.group`` numbering the kept
    groups in order): whole groups, as `collect_step_groups` deals them (``dp_owners``)."""
    groups: dict[int, list[Sample]] = defaultdict(list)
    for s in samples:
        groups[s.group].append(s)
    order = sorted(groups)
    owners = balance_groups([group_cost([s.length for s in groups[g]]) for g in order],
                            ps.get_data_parallel_world_size())
    mine = {g for g, o in zip(order, owners) if o == ps.get_data_parallel_rank()}
    return [s for s in samples if s.group in mine]


def rollout_metrics(groups: Sequence[GroupStats], prefix: str = "") -> dict[str, float]:
    """Reward, accuracy (overall and per data source), response length, truncation."""
    out: dict[str, float] = {}
    if not groups:
        return out
    by_source: dict[str, list[float]] = defaultdict(list)
    lengths, truncated = [], []
    for g in groups:
        by_source[g.source] += g.rewards
        lengths += g.response_tokens
        truncated += g.truncated
    rewards = [r for g in groups for r in g.rewards]
    out[f"{prefix}reward/mean"] = sum(rewards) / len(rewards)
    # pass@1 averaged over the k samples of each prompt = mean of 0/1 rewards
    out[f"{prefix}acc/mean"] = sum(r > 0 for r in rewards) / len(rewards)
    for src, rs in sorted(by_source.items()):
        out[f"{prefix}acc/{src}"] = sum(r > 0 for r in rs) / len(rs)
    out[f"{prefix}response/length_mean"] = sum(lengths) / len(lengths)
    out[f"{prefix}response/length_max"] = float(max(lengths))
    out[f"{prefix}response/truncated_frac"] = sum(truncated) / len(truncated)
    out.update(mode_metrics(groups, prefix))
    out.update(trajectory_metrics(
        [(g.trajectories, g.rewards, g.response_tokens) for g in groups], prefix))
    return out


def mode_metrics(groups: Sequence[GroupStats], prefix: str = "") -> dict[str, float]:
    """Share of each solution mode among the responses that have one, and its accuracy (only
    where some response is in it)."""
    with_modes = [g for g in groups if g.modes]
    shares = mode_shares([m for g in with_modes for m in g.modes],
                         [r for g in with_modes for r in g.rewards])
    out: dict[str, float] = {}
    for mode, (share, accuracy) in shares.items():
        out[f"{prefix}modes/{mode}_frac"] = share
        if accuracy is not None:
            out[f"{prefix}modes/{mode}_acc"] = accuracy
    return out
