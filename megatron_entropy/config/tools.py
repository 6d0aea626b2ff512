"""The ``rollout.tools`` section of the config tree: which tools the policy may call, how calls
are written, their limits, the code sandbox's and adaptive branching's settings (the multi-turn
loop, megatron_entropy/tool_use, takes it as it is).

Torch-free, as the whole config tree is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron_entropy.settings import SettingError, Settings
from megatron_entropy.settings import setting as _f


@dataclass
class SandboxSettings(Settings):
    """Limits of the ``python`` tool's sandbox (tool_use/sandbox.py)."""

    cpu_seconds: float = _f(5.0, ge=1, help="CPU seconds of one run (RLIMIT_CPU)")
    memory_mb: int = _f(1024, ge=64, help="address space of one run, MiB (RLIMIT_AS)")
    file_mb: int = _f(4, ge=1, help="largest file one run may write, its output included, MiB "
                                    "(RLIMIT_FSIZE)")
    processes: int = _f(16, ge=1, help="processes (threads) one run may add (RLIMIT_NPROC)")
    isolation: Literal["auto", "required", "off"] = _f(
        "auto", help="network and PID namespaces: auto = where the machine allows them (a "
                     "warning otherwise), required = the run stops without them, off = none")


@dataclass
class BranchingSettings(Settings):
    """Entropy-aware branching after tool results (ARPO's adaptive rollout)."""

    enabled: bool = _f(False, help="branch extra samples where the entropy after a tool "
                                   "result rises; off: every sample is rolled out from its "
                                   "prompt")
    initial_samples: int = _f(0, ge=0, help="samples per prompt rolled out from the prompt "
                                            "first; the rest of rollout.n_samples are branches "
                                            "(or, unused, more samples from the prompt); 0 = "
                                            "half")
    window: int = _f(8, ge=1, help="generated tokens after a tool result whose mean entropy "
                                   "is compared with the trajectory's first tokens")
    threshold: float = _f(0.3, ge=0, help="nats the entropy after a tool result must rise "
                                          "above the trajectory's start to branch there")
    branches: int = _f(2, ge=1, help="samples branched at one point")


@dataclass
class ToolSettings(Settings):
    """Multi-turn rollouts with tools (docs/multi_turn.md): with tools named, a response may
    call them and go on after their results, up to max_turns turns in rollout.max_new_tokens
    tokens (generated and inserted); the inserted tokens are out of the loss."""

    names: list[str] = _f(default_factory=list, help=(
        "tools the policy may call: calculator, python (code in a sandbox), "
        "package.module:attr or path/to/file.py:attr (a Tool, a Tool class or a function); "
        "empty = one-turn rollouts"))
    format: Literal["chat_template", "plain"] = _f(
        "chat_template", help="how calls and results are written: chat_template = "
                              "<tool_call>{json}</tool_call> and the tokenizer's chat "
                              "template's tool messages (Qwen2.5/Qwen3); plain = "
                              "<call>name: argument</call> answered by <result>...</result> "
                              "(models without a tool format)")
    max_turns: int = _f(4, ge=1, help="turns the policy generates in one response, each after "
                                      "the previous turn's tool results (a last turn's calls "
                                      "are not run)")
    timeout_s: float = _f(10.0, gt=0, help="wall-clock limit of one tool call")
    max_calls: int = _f(8, ge=1, help="tool calls of one trajectory; later ones are answered "
                                      "with an error")
    workers: int = _f(4, ge=1, help="processes that run tool calls in parallel")
    max_result_chars: int = _f(1000, ge=16, help="longest tool result put into the "
                                                 "trajectory (longer ones are cut)")
    after_tool_tokens: int = _f(8, ge=1, help="k of the metrics entropy/after_tool (the "
                                              "first k generated tokens after each tool "
                                              "result) against entropy/not_after_tool")
    sandbox: SandboxSettings = _f(default_factory=SandboxSettings)
    branching: BranchingSettings = _f(default_factory=BranchingSettings)

    @property
    def enabled(self) -> bool:
        return bool(self.names)

    def validate(self) -> None:
        super().validate()
        if len(set(self.names)) != len(self.names):
            raise SettingError("names", f"{self.names} names a tool twice")
        if self.names and self.max_turns < 2:
            raise SettingError("max_turns", f"{self.max_turns} with tools: no turn would read a "
                                            "tool's result; set it >= 2 (or no tools)")
