"""The multi-turn rollout loop: any rollout engine (in-process, vLLM, SGLang) wrapped so that a
response may call tools and go on after their results.

One ``generate`` runs rounds. In each, every trajectory that is not done generates one turn on the
wrapped engine (all of them in one request, token ids in: the prompt and the trajectory so far),
up to the end of sequence, a call's end (the format's stop) or the trajectory's token budget
(``rollout.max_new_tokens`` for the whole response: generated and inserted tokens). A turn whose
text holds tool calls has them run, all trajectories' calls of the round in parallel in the tool
workers (pool.py); their results, wrapped as the format writes them (formats.py), are tokenised
and appended as inserted tokens, and the trajectory goes on in the next round. A trajectory ends
on a turn without calls, at ``rollout.tools.max_turns`` turns (a last turn's calls are not run)
or when its budget is spent. Token in, token out: the trajectory's ids are the engine's ids and the
inserted ones, never decoded and encoded again; each generated token keeps the engine's log-prob
(and entropy, from engines that give it) and the weight version that generated it; inserted
tokens have log-prob 0 and ``loss_mask`` 0.

The first round samples with the step's seed exactly as a one-turn rollout does (sample j of
prompt i: ``sample_seed(seed, i, j)``); round r uses ``turn_seed(seed, r)`` over the trajectories
still going, in (prompt, sample) order: deterministic, so a resumed step rolls out the same.
Partial rollouts come from the wrapped engine: a turn aborted at a weight push is resumed there
with the same prefix. Entropy-aware branching (branching.py) adds samples from the points where
the entropy after a tool result rises.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Union

from megatron_entropy.config import ConfigError
from megatron_entropy.data.dataset import load_tokenizer
from megatron_entropy.models.lora_settings import LoraSettings
from megatron_entropy.rollout import build_engine
from megatron_entropy.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_entropy.rollout.server.partial import eos_token_ids, merge_runs, version_runs
from megatron_entropy.runtime.seeds import turn_seed
from megatron_entropy.tool_use.branching import Branching
from megatron_entropy.tool_use.formats import ToolFormat, make_format
from megatron_entropy.tool_use.pool import ToolCall, ToolPool, ToolResult
from megatron_entropy.config.tools import ToolSettings
from megatron_entropy.tool_use.sandbox import probe_isolation
from megatron_entropy.tool_use.tools import PythonTool, load_tools

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrajectoryStats:
    """What a trajectory did, for the step's metrics (``Completion.meta["trajectory"]``)."""

    turns: int  # turns the policy generated
    calls: int  # tool calls it wrote (those over the limit included)
    errors: int  # calls answered with an error (malformed, unknown tool, failed, over the limit)
    timeouts: int  # calls that ran out of time
    tool_seconds: float  # the calls' own time
    tool_tokens: int  # inserted tokens
    branched: bool = False  # rolled out from another sample's prefix (branching.py)


@dataclass(eq=False)  # two branches of one prefix are two trajectories
class Trajectory:
    """One response being rolled out."""

    prompt: int  # index of its prompt in the request
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    entropies: Optional[list[float]] = field(default_factory=list)  # None: the engine gives none
    mask: list[int] = field(default_factory=list)
    runs: list = field(default_factory=list)  # (weight version, tokens) of every token
    meta: dict = field(default_factory=dict)  # the first turn's (server, log-prob kind)
    turns: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    tool_seconds: float = 0.0
    branched: bool = False
    finish: str = "stop"
    done: bool = False
    start_entropy: Optional[float] = None  # of the first turn's first tokens (branching)
    pending: list[ToolCall] = field(default_factory=list)
    ended_turn: bool = True  # the last turn ended on the end of sequence

    def generated(self, c: Completion) -> None:
        self.ids += c.token_ids
        self.logprobs += c.logprobs
        self.entropies = None if self.entropies is None or c.entropies is None else \
            self.entropies + list(c.entropies)
        self.mask += [1] * len(c.token_ids)
        self.runs += version_runs(c)
        if not self.meta:
            self.meta = {k: v for k, v in c.meta.items() if k in ("server", "logprobs")}
        elif "logprobs" in c.meta:
            self.meta["logprobs"] = c.meta["logprobs"]
        self.turns += 1

    def inserted(self, ids: list[int]) -> None:
        """Tokens the policy did not generate; they count as the last version's."""
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        if self.entropies is not None:
            self.entropies += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.runs.append((self.runs[-1][0] if self.runs else None, len(ids)))

    def copy_before(self, length: int, turns: int) -> "Trajectory":
        """The trajectory as it was with ``length`` tokens and ``turns`` turns (a branch point:
        its tool counts stay, as the prefix made those calls)."""
        runs, left = [], length
        for version, n in self.runs:
            if left <= 0:
                break
            runs.append((version, min(n, left)))
            left -= n
        return replace(self, ids=self.ids[:length], logprobs=self.logprobs[:length],
                       entropies=None if self.entropies is None else self.entropies[:length],
                       mask=self.mask[:length], runs=runs, meta=dict(self.meta), turns=turns,
                       branched=True, finish="stop", done=False, pending=[])

    def stats(self) -> TrajectoryStats:
        return TrajectoryStats(self.turns, self.calls, self.errors, self.timeouts,
                               self.tool_seconds, self.mask.count(0), self.branched)


class MultiTurnEngine(RolloutEngine):
    """``inner`` in the tool-calling loop (module docstring). Anything else an engine offers (the
    weight-sync endpoints, the server pool, the weight version) is ``inner``'s own."""

    def __init__(self, inner: RolloutEngine, settings: ToolSettings, tokenizer: Any,
                 tool_format: ToolFormat, eos_ids: set[int]) -> None:
        self.inner = inner
        self.shared = inner.shared
        self.settings = settings
        self.tokenizer = tokenizer
        self.format = tool_format
        self.eos_ids = set(eos_ids)
        self.tool_pool = ToolPool(settings)
        self.branching = Branching(settings.branching) if settings.branching.enabled else None
        self._tool_wall = 0.0
        self._generate_wall = 0.0
        self._warned: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class lacks: the wrapped engine's endpoints.
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def logprob_dtype(self) -> str:
        return self.inner.logprob_dtype

    def generate_on_each_replica(self, prompts: list[list[int]], sampling: SamplingParams
                                 ) -> dict[str, list[list[Completion]]]:
        """One turn, as the wrapped engine generates it: the weight check compares generated
        tokens only."""
        return self.inner.generate_on_each_replica(prompts, sampling)

    # ------------------------------------------------------------------ the loop

    def generate(self, prompts: list[list[int]], sampling: SamplingParams
                 ) -> list[list[Completion]]:
        started = time.monotonic()
        tools_before = self._tool_wall
        budget = sampling.max_new_tokens
        turn = replace(sampling, stop=tuple(sampling.stop) + self.format.stop,
                       max_new_tokens_per_prompt=None)
        first_n = self.branching.initial(sampling.n) if self.branching else sampling.n
        trajectories: list[list[Trajectory]] = [[] for _ in prompts]
        todo: list[Trajectory] = []
        for i, outputs in enumerate(self.inner.generate(prompts, replace(turn, n=first_n))):
            for c in outputs:
                t = Trajectory(prompt=i)
                trajectories[i].append(t)
                self._after_turn(t, c, budget)
                todo.append(t)
        round_index = 0
        while True:
            waiting = [t for t in todo if t.pending]
            if waiting:
                self._run_tools(waiting, budget)
            todo = [t for t in todo if not t.done]
            if self.branching:
                todo += self.branching.fill(trajectories, sampling.n, Trajectory) \
                    if not todo else []
            if not todo:
                break
            round_index += 1
            todo.sort(key=lambda t: (t.prompt, trajectories[t.prompt].index(t)))
            contexts = [list(prompts[t.prompt]) + t.ids for t in todo]
            outputs = self.inner.generate(contexts, replace(
                turn, n=1, seed=turn_seed(sampling.seed, round_index),
                max_new_tokens_per_prompt=tuple(budget - len(t.ids) for t in todo)))
            branched: list[Trajectory] = []
            for t, (c,) in zip(todo, outputs):
                start, turns = len(t.ids), t.turns
                self._after_turn(t, c, budget)
                if self.branching and turns >= 1:
                    new = self.branching.branches(t, start, turns, trajectories, sampling.n,
                                                  self._token_entropies(c))
                    branched += new
            todo += branched
        self._generate_wall += time.monotonic() - started - (self._tool_wall - tools_before)
        return [[self._completion(t) for t in group] for group in trajectories]

    def _token_entropies(self, c: Completion) -> list[float]:
        """Each generated token's entropy, or its surprisal (-log-prob, whose mean estimates the
        entropy) from engines that give no entropies."""
        return list(c.entropies) if c.entropies is not None else [-lp for lp in c.logprobs]

    def _after_turn(self, t: Trajectory, c: Completion, budget: int) -> None:
        """``c``, one turn of ``t``: appended; then whether ``t`` is done or has calls to run."""
        t.generated(c)
        if self.branching and t.start_entropy is None:
            t.start_entropy = self.branching.window_mean(self._token_entropies(c))
        t.finish = c.finish_reason
        if c.finish_reason == "length" or len(t.ids) >= budget:
            t.finish, t.done = "length", True
            return
        calls = self.format.calls(self.tokenizer.decode(c.token_ids, skip_special_tokens=False))
        if not calls or t.turns >= self.settings.max_turns:
            t.done = True
            return
        t.pending = calls
        t.ended_turn = bool(c.token_ids) and c.token_ids[-1] in self.eos_ids

    def _run_tools(self, waiting: list[Trajectory], budget: int) -> None:
        """Every waiting trajectory's calls, in parallel; each gets its results inserted."""
        limit = self.settings.max_calls
        calls: list[ToolCall] = []
        owners: list[Trajectory] = []
        for t in waiting:
            for call in t.pending:
                t.calls += 1
                if t.calls > limit and not call.error:
                    call = ToolCall(call.name, call.arguments, f"the limit of {limit} tool "
                                                               "calls per response is reached")
                calls.append(call)
                owners.append(t)
        started = time.monotonic()
        results = self.tool_pool.run(calls)
        self._tool_wall += time.monotonic() - started
        by_owner: dict[int, list[ToolResult]] = {}
        for t, r in zip(owners, results):
            by_owner.setdefault(id(t), []).append(r)
            t.tool_seconds += r.seconds
            t.errors += r.status == "error"
            t.timeouts += r.status == "timeout"
            if r.status != "ok":
                self._warn_once(r)
        cap = self.settings.max_result_chars
        for t in waiting:
            texts = [r.text if len(r.text) <= cap else r.text[:cap] + "[cut]"
                     for r in by_owner[id(t)]]
            ids = self.tokenizer.encode(self.format.results(texts, t.ended_turn),
                                        add_special_tokens=False)
            room = budget - len(t.ids)
            t.inserted(ids[:room])
            t.pending = []
            if len(ids) >= room:  # no room left to answer
                t.finish, t.done = "length", True

    def _warn_once(self, r: ToolResult) -> None:
        kind = r.detail.split(" (")[0] or r.status
        if kind not in self._warned:
            self._warned.add(kind)
            log.warning("a tool call failed (%s: %s); the response reads the error and the "
                        "rollout goes on; later ones are counted in tools/errors and "
                        "tools/timeouts", r.status, r.detail or r.text[:200])

    def _completion(self, t: Trajectory) -> Completion:
        runs = merge_runs(t.runs)
        return Completion(
            token_ids=t.ids, logprobs=t.logprobs,
            text=self.tokenizer.decode(t.ids, skip_special_tokens=True),
            finish_reason=t.finish, entropies=t.entropies, loss_mask=t.mask,
            meta={**t.meta, "version_runs": runs,
                  "weight_version": runs[0][0] if runs else None, "trajectory": t.stats()})

    # ------------------------------------------------------------------ the rest

    def metrics(self) -> dict[str, float]:
        out = self.inner.metrics()
        out["time/tools"] = self._tool_wall
        out["time/generate"] = self._generate_wall
        self._tool_wall = self._generate_wall = 0.0
        return out

    def shutdown(self) -> None:
        self.tool_pool.close()
        self.inner.shutdown()


def build_rollout_engine(rollout_cfg, hf_dir: Union[str, Path], run_dir: Union[str, Path],
                         lora: Optional[LoraSettings] = None) -> RolloutEngine:
    """The engine ``rollout.engine`` names (rollout.build_engine, serving the adapters of
    ``lora`` where the weight sync sends them alone), in the tool-calling loop when
    ``rollout.tools.names`` lists tools."""
    engine = build_engine(rollout_cfg, hf_dir, run_dir, lora)
    settings = rollout_cfg.tools
    if not settings.enabled:
        return engine
    try:
        tokenizer = load_tokenizer(hf_dir)
        tools = {t.name: t for t in load_tools(settings)}
        if any(isinstance(t, PythonTool) for t in tools.values()):
            check_isolation(settings.sandbox.isolation)
        eos = eos_token_ids(str(hf_dir)) | ({tokenizer.eos_token_id}
                                            if tokenizer.eos_token_id is not None else set())
        return MultiTurnEngine(engine, settings, tokenizer,
                               make_format(settings.format, tools, tokenizer), eos)
    except BaseException:
        engine.shutdown()  # it may have launched servers
        raise


def check_isolation(isolation: str) -> None:
    """Whether the code sandbox gets its namespaces here: ``required`` stops the run without
    them, ``auto`` warns once."""
    why = probe_isolation() if isolation != "off" else ""
    if why and isolation == "required":
        raise ConfigError(f"rollout.tools.sandbox.isolation=required: the code sandbox cannot "
                          f"enter network and PID namespaces on this machine ({why})")
    if why:
        log.warning("the code sandbox runs without network and PID namespaces on this machine "
                    "(%s): its code can reach the network and a process it starts may outlive "
                    "it; rollout.tools.sandbox.isolation=required refuses to run so", why)


def prompt_tools(rollout_cfg, tokenizer: Any) -> Optional[list[dict]]:
    """The tools as the prompts' chat template lists them, where the format has the template
    list them (None: no tools, or the plain format)."""
    settings = rollout_cfg.tools
    if not settings.enabled or settings.format != "chat_template":
        return None
    tools = {t.name: t for t in load_tools(settings)}
    return make_format(settings.format, tools, tokenizer).prompt_tools()
