"""One step's rollouts: prompts -> engine -> rewards -> dynamic sampling -> samples with advantages.

Who generates: a per-rank engine (in-process) runs on every data-parallel leader, each on its share
of the prompts; a shared engine (servers) is driven by global rank 0 alone, with every request in
flight at once. Either way the scored groups are gathered to every rank, so every rank takes the same
dynamic-sampling decisions and computes the same advantages, then keeps its DP share.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_entropy.algorithms.advantages import compute_advantages
from megatron_entropy.data import GroupFilter, PromptItem
from megatron_entropy.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_entropy.trainer.batch import Sample


@dataclass
class Group:
    """One prompt with its n scored completions."""

    item: PromptItem
    completions: list[Completion]
    rewards: list[float]


def _dp_layout() -> tuple[int, int, bool]:
    from megatron.core import parallel_state as ps

    leader = (ps.get_tensor_model_parallel_rank() == 0 and ps.get_pipeline_model_parallel_rank() == 0)
    return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size(), leader


def generate_groups(engine: Optional[RolloutEngine], items: Sequence[PromptItem],
                    sampling: SamplingParams, reward_fn: Callable[[list[str], list[str]], list[float]],
                    shared: bool) -> list[Group]:
    """Generate and score ``sampling.n`` completions for each item; every rank gets all groups,
    in item order. ``engine`` is None on ranks that do not talk to it. Sample seeds derive from
    (sampling.seed, the item's index in this rank's request, sample index): the same layout
    resumes to the same samples."""
    dp_rank, dp_size, leader = _dp_layout()
    if shared:
        mine = list(range(len(items))) if dist.get_rank() == 0 else []
    else:
        mine = list(range(dp_rank, len(items), dp_size)) if leader else []
    local: list[tuple[int, Group]] = []
    if mine:
        outputs = engine.generate([items[i].prompt_ids for i in mine], sampling)
        texts = [c.text for out in outputs for c in out]
        answers = [items[i].answer for i, out in zip(mine, outputs) for _ in out]
        rewards = reward_fn(texts, answers)
        k = 0
        for i, out in zip(mine, outputs):
            local.append((i, Group(items[i], out, rewards[k:k + len(out)])))
            k += len(out)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, local)
    groups = dict(pair for part in gathered for pair in part)
    return [groups[i] for i in range(len(items))]


def collect_step_groups(engine: Optional[RolloutEngine], next_items: Callable[[int], list[PromptItem]],
                        sampling: SamplingParams, reward_fn, shared: bool, target_groups: int,
                        dynamic_sampling: bool, max_refill_rounds: int,
                        between_rounds: Callable[[], None] = lambda: None
                        ) -> tuple[list[Group], list[Group], dict[str, float]]:
    """Roll out until ``target_groups`` groups with reward variance are kept (or the refill
    rounds run out). Returns (kept groups, every generated group, sampling metrics).
    ``between_rounds`` runs before each refill round (the trainer's stop check; it may raise)."""
    keep = GroupFilter(target_groups, max_refill_rounds, enabled=dynamic_sampling)
    generated: list[Group] = []
    while not keep.done:
        if keep.rounds:
            between_rounds()
        round_sampling = SamplingParams(**{**vars(sampling),
                                           "seed": (sampling.seed or 0) * 31 + keep.rounds})
        groups = generate_groups(engine, next_items(keep.prompts_needed()), round_sampling,
                                 reward_fn, shared)
        generated += groups
        keep.add(groups, [g.rewards for g in groups])
    return keep.take(), generated, keep.metrics()


def groups_to_samples(groups: Sequence[Group], estimator: str, norm_by_std: bool) -> list[Sample]:
    """Every completion as a Sample, with its group's advantage."""
    samples = [Sample(prompt_ids=list(g.item.prompt_ids), response_ids=list(c.token_ids),
                      engine_logprobs=list(c.logprobs), reward=r, group=gi, source=g.item.source,
                      finish_reason=c.finish_reason, answer=g.item.answer, text=c.text)
               for gi, g in enumerate(groups) for c, r in zip(g.completions, g.rewards)]
    if samples:
        adv = compute_advantages(estimator, torch.tensor([s.reward for s in samples]),
                                 torch.tensor([s.group for s in samples]), norm_by_std=norm_by_std)
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a
    return samples


def dp_share(samples: list[Sample]) -> list[Sample]:
    """This DP rank's samples: whole groups, round-robin over DP ranks."""
    dp_rank, dp_size, _ = _dp_layout()
    return [s for s in samples if s.group % dp_size == dp_rank]


def rollout_metrics(groups: Sequence[Group], prefix: str = "") -> dict[str, float]:
    """Reward, accuracy (overall and per data source), response length, truncation."""
    out: dict[str, float] = {}
    if not groups:
        return out
    by_source: dict[str, list[float]] = defaultdict(list)
    lengths, truncated = [], []
    for g in groups:
        by_source[g.item.source] += g.rewards
        lengths += [len(c.token_ids) for c in g.completions]
        truncated += [c.finish_reason == "length" for c in g.completions]
    rewards = [r for g in groups for r in g.rewards]
    out[f"{prefix}reward/mean"] = sum(rewards) / len(rewards)
    # pass@1 averaged over the k samples of each prompt = mean of 0/1 rewards
    out[f"{prefix}acc/mean"] = sum(r > 0 for r in rewards) / len(rewards)
    for src, rs in sorted(by_source.items()):
        out[f"{prefix}acc/{src}"] = sum(r > 0 for r in rs) / len(rs)
    out[f"{prefix}response/length_mean"] = sum(lengths) / len(lengths)
    out[f"{prefix}response/length_max"] = float(max(lengths))
    out[f"{prefix}response/truncated_frac"] = sum(truncated) / len(truncated)
    return out
