"""A deterministic, resumable order over a dataset's indices.

Epoch ``e`` visits every index once, in a permutation that depends only on (seed, e), so the order
never depends on how many prompts each step asked for, and a sampler restored from
``state_dict()`` continues exactly where the saved one stopped.
"""

from __future__ import annotations

import torch

from megatron_entropy.runtime.seeds import epoch_order_seed


class PromptSampler:
    def __init__(self, num_items: int, shuffle: bool = True, seed: int = 0):
        if num_items < 1:
            raise ValueError("cannot sample from an empty dataset")
        self.num_items = num_items
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_items))
        g = torch.Generator().manual_seed(epoch_order_seed(self.seed, epoch))
        return torch.randperm(self.num_items, generator=g).tolist()

    def next_indices(self, count: int) -> list[int]:
        """The next ``count`` dataset indices; an epoch boundary is crossed without a gap."""
        out: list[int] = []
        while len(out) < count:
            if self.position == self.num_items:
                self.epoch += 1
                self.position = 0
                self._order = self._epoch_order(self.epoch)
            take = min(count - len(out), self.num_items - self.position)
            out += self._order[self.position:self.position + take]
            self.position += take
        return out

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "num_items": self.num_items,
                "seed": self.seed, "shuffle": int(self.shuffle)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_items"] != self.num_items:
            raise ValueError(f"the checkpoint's data position is for a dataset of "
                             f"{state['num_items']} prompts, this one has {self.num_items}: "
                             "the training data changed")
        self.seed = int(state["seed"])
        self.shuffle = bool(state["shuffle"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = self._epoch_order(self.epoch)
