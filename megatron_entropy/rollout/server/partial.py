"""Answers a server aborted, and the partial rollouts that resume them.

A completion the server aborted (another client paused it with mode ``abort``, or an abort
request) is truncated: the engine's parser raises ``RequestAborted`` and the pool issues the
request again, so an aborted sample is never returned.

Abort and resume (``inflight_at_sync = "abort"``, engines that give an ``AbortApi``): each
request carries an id of ours, and the pool's ``drained()`` first aborts our requests in
flight, by id, on the server that runs them (other clients' requests are left alone). An
aborted answer keeps what the request had generated (vLLM 0.32 and SGLang 0.5.x both return the
partial token ids and log-probs with finish reason ``abort``); once the gate opens again the
request is resumed as a partial rollout, prompt + kept tokens sent again for the rest of its
token budget, and the sample is the two joined (``join_completions``): each token with the
log-prob and the weight version of the call that generated it (``meta["version_runs"]``).

No HTTP here: the trainer reads ``version_runs`` without loading the pool.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from megatron_entropy.rollout.base import Completion, FinishReason
from megatron_entropy.rollout.server.errors import ServerError


class RequestAborted(ServerError):
    """The server answered a request as aborted (finish reason ``abort``): its output is
    truncated. ``partial`` is what it had generated (None: unusable); the pool issues the
    request again, or resumes it from ``partial`` (``inflight_at_sync = "abort"``)."""

    def __init__(self, message: str, partial: Optional[Completion] = None) -> None:
        super().__init__(message)
        self.partial = partial


@dataclass(frozen=True)
class AbortApi:
    """How a serving stack aborts chosen requests of ours and resumes them (engine hooks)."""

    # The payload carrying our request id.
    with_id: Callable[[dict, str], dict]
    # The control calls (path, body) that abort these ids on the server that runs them.
    abort_calls: Callable[[list[str]], list[tuple[str, dict]]]
    # The payload that generates the rest of a sample after ``prefix`` (its tokens so far),
    # or the finish reason ``prefix`` already reached (token budget spent, a stop token).
    resume: Callable[[dict, Completion], "dict | FinishReason"]


def version_runs(c: Completion) -> list[tuple[Any, int]]:
    """(weight version tag, number of tokens) of each stretch of ``c`` generated on one
    version, oldest first: one run unless the sample was aborted at a push and resumed."""
    runs = c.meta.get("version_runs")
    return ([tuple(r) for r in runs] if runs is not None
            else [(c.meta.get("weight_version"), len(c.token_ids))])


def merge_runs(runs: list[tuple[Any, int]]) -> list[tuple[Any, int]]:
    """(version, tokens) runs with the empty ones left out and neighbours of one version
    joined."""
    out: list[tuple[Any, int]] = []
    for version, n in runs:
        if n == 0:
            continue
        if out and out[-1][0] == version:
            out[-1] = (version, out[-1][1] + n)
        else:
            out.append((version, n))
    return out


def join_completions(head: Completion, tail: Completion) -> Completion:
    """A sample aborted after ``head`` and resumed as ``tail`` (prompt + head's tokens sent
    again): tokens, log-probs and text joined, each token keeping the version that generated
    it. ``meta["weight_version"]`` is the oldest (the prefix's): what staleness counts."""
    runs = merge_runs(version_runs(head) + version_runs(tail))
    meta = {**tail.meta, "weight_version": runs[0][0] if runs else tail.meta.get(
        "weight_version"), "version_runs": runs,
        "resumed": head.meta.get("resumed", 0) + 1}
    return Completion(token_ids=head.token_ids + tail.token_ids,
                      logprobs=head.logprobs + tail.logprobs, text=head.text + tail.text,
                      finish_reason=tail.finish_reason, meta=meta)


def finished_before_resume(prefix: Completion, budget: int, stop_token_ids: set[int],
                           stop: list[str]) -> Optional[FinishReason]:
    """The finish reason an aborted sample's ``prefix`` already reached, or None when it goes
    on: its token budget spent ("length"), or it ends on a stop token or holds a stop string
    (an SGLang request is aborted after one more decode step, which may have sampled EOS)."""
    if len(prefix.token_ids) >= budget:
        return "length"
    if prefix.token_ids and prefix.token_ids[-1] in stop_token_ids:
        return "stop"
    if any(s and s in prefix.text for s in stop):
        return "stop"
    return None


def eos_token_ids(hf_dir: str) -> set[int]:
    """The model's end-of-sequence ids (config.json and generation_config.json of an HF
    folder), which a server stops on by itself."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = Path(hf_dir) / name
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids |= set(value if isinstance(value, list) else [] if value is None else [value])
    return ids
