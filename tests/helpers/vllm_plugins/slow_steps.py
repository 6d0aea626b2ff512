"""A vLLM logits processor for the tests (loaded by the real server with
``--logits-processors slow_steps:SlowSteps``, this folder on its PYTHONPATH): it leaves the logits
as they are; while the file named by $SLOW_STEPS_GATE exists it counts the decoding steps, and
from the SLOW_STEPS_AFTER-th on it writes "<gate>.reached" and makes each step last at least
SLOW_STEPS_SECONDS.

Why: a test that acts on a rollout in flight (a push that aborts it, a freeze) must find it in
flight on any machine. A 240-token rollout of the tiny test model takes ~1 s on a fast machine,
so a test that only polls the server's progress can see it end before it acts (seen here: the
whole rollout finished between the progress poll and the freeze). With the gate, the rollout has
its first tokens at full speed and then crawls (240 steps x 0.05 s = 12 s) until the test has
acted and removed the gate. Without the gate the processor costs one stat() per step."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor


class SlowSteps(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        gate = os.environ.get("SLOW_STEPS_GATE")
        self.gate = Path(gate) if gate else None
        self.after = int(os.environ.get("SLOW_STEPS_AFTER", "8"))
        self.seconds = float(os.environ.get("SLOW_STEPS_SECONDS", "0.05"))
        self.steps = 0

    def is_argmax_invariant(self) -> bool:
        return False  # so that vLLM runs it for greedy requests too

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.gate is None or not self.gate.exists():
            self.steps = 0
            return logits
        self.steps += 1
        if self.steps >= self.after:
            self.gate.with_name(self.gate.name + ".reached").touch()
            time.sleep(self.seconds)
        return logits
