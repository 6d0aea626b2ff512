"""An optimizer checkpoint written by another chain of optimizers, as a change of expert
parallelism makes one.

Megatron-Core 0.16.1 gives a mixture-of-experts model one optimizer at EP = 1 (its experts are
ordinary data-parallel parameters then: ``allreduce`` is True) and a chain of two at EP > 1 (dense
parameters, then the experts, whose grads reduce over DP / EP: ``get_megatron_optimizer``).
``ChainedOptimizer.sharded_state_dict`` prefixes each member's keys with ``chained_<i>.``, so a
checkpoint saved at EP = 2 names Adam's moments ``chained_1.optimizer.state.exp_avg.<param>`` where
a run at EP = 1 asks for ``optimizer.state.exp_avg.<param>``: dist_checkpointing refuses the load
("... from model not in state dict"). The tensors themselves are per parameter in the full model's
layout (``fully_reshardable``), so they reshard across EP as across TP, PP and DP: loading them
under the saved keys into this run's chain, with the saved Adam step, is the whole conversion.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Callable, Optional

# ChainedOptimizer's prefix of member i's sharded keys.
_CHAIN_PREFIX = re.compile(r"^chained_\d+\.")


def _unchained(key: str) -> str:
    return _CHAIN_PREFIX.sub("", key, count=1)


def with_keys(tree: Any, new_key: Callable[[str], Optional[str]]) -> Any:
    """``tree`` (a sharded state dict) with each sharded entry for which ``new_key`` gives a key
    copied under that key; the rest as it is."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(tree, ShardedBase):
        key = new_key(tree.key)
        if key is None:
            return tree
        renamed = copy.copy(tree)
        renamed.key = key
        return renamed
    if isinstance(tree, dict):
        return {k: with_keys(v, new_key) for k, v in tree.items()}
    if isinstance(tree, list):
        return [with_keys(v, new_key) for v in tree]
    return tree


def rekeyed_to_saved(request: Any, saved_keys: set[str]) -> Optional[Any]:
    """``request`` (an optimizer's load request) with each sharded key that the checkpoint lacks
    renamed to the saved key that differs from it only by its chain prefix; None when the
    checkpoint holds every key already (the same chain saved it)."""
    by_param = {_unchained(k): k for k in saved_keys if k.startswith(("optimizer.", "chained_"))}
    renamed: list[str] = []

    def saved_key(key: str) -> Optional[str]:
        saved = by_param.get(_unchained(key))
        if key in saved_keys or saved is None:
            return None  # a key missing either way: the load names it
        renamed.append(key)
        return saved

    out = with_keys(request, saved_key)
    return out if renamed else None


def members(state: Any, optimizer) -> list[tuple[Any, Any]]:
    """(member optimizer, its part of ``state``) for each optimizer of a chain, or the one: a
    chain of several keeps its members' states under their indices."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    if len(inner) == 1:
        return [(inner[0], state)]
    return [(opt, state[i]) for i, opt in enumerate(inner)]


def saved_members(saved: Any) -> list[Any]:
    """The member states of a saved optimizer state (one, or a chain's under their indices)."""
    if isinstance(saved, dict) and saved and all(isinstance(k, int) for k in saved):
        return [saved[k] for k in sorted(saved)]
    return [saved]
