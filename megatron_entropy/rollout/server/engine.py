"""``ServerEngine``: the rollout engine over a ``ServerPool``, with the one generate loop.

Generation is the same for every serving stack: one request per sample (prompt i, sample j,
with seed ``sample_seed(seed, i, j)``), each sent on its own to the least-loaded server (or the
router), answers regrouped by prompt, each tagged with the server and the weight version that
produced it. The vLLM and SGLang engines supply only what differs: the launch command, the
payload, the answer's parser, the generate endpoint, their weight-sync and abort endpoints.
"""

from __future__ import annotations

import abc
import atexit
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any, Optional

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.base import Completion, RolloutEngine, SamplingParams
from megatron_entropy.rollout.server.errors import RequestRejected, ServerError
from megatron_entropy.rollout.server.pool import Server, ServerPool
from megatron_entropy.runtime.seeds import sample_seed

log = logging.getLogger(__name__)


def vocab_size(hf_dir: str) -> Optional[int]:
    """The model's vocabulary size (config.json of its HF folder; None if it does not say)."""
    path = Path(hf_dir) / "config.json"
    return json.loads(path.read_text()).get("vocab_size") if path.is_file() else None


def check_token_ids(prompts: list[list[int]], vocab: Optional[int]) -> None:
    """Every prompt id inside [0, vocab): an SGLang server's scheduler crashes on one outside
    it, and the whole server with it, so none is sent."""
    if vocab is None:
        return
    for i, prompt in enumerate(prompts):
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise RequestRejected(f"prompt {i} holds token ids {bad[:5]} outside the model's "
                                  f"vocabulary [0, {vocab}): not sent (the tokenizer does not "
                                  "belong to the served model)")


class ServerEngine(RolloutEngine):
    """A rollout engine whose pool (``self.pool``) serves the whole job. Subclasses name their
    ``kind`` and ``generate_path`` and implement ``_server_argv``, ``_payload`` and ``_parse``;
    the throughput counters (``_tokens``/``_seconds``) count every ``generate``."""

    shared = True
    kind: str  # the pool's name for its servers (and their logs): "vllm", "sglang"
    generate_path: str  # the endpoint that generates one sample
    # A router that picks the server of each request (None: the pool picks): where requests to
    # every server go.
    router: Optional[Server] = None

    def __init__(self, server_cfg: ServerConfig, hf_dir: str, run_dir: str,
                 env: Optional[dict[str, str]] = None,
                 launch_version: Optional[str] = None) -> None:
        """Launch or connect to the servers of ``server_cfg``, serving ``hf_dir``; a launched
        server holds ``launch_version`` until the first weight sync."""
        self.cfg = server_cfg
        self.hf_dir = str(hf_dir)
        self.pool = ServerPool(server_cfg, run_dir, self.kind, self.hf_dir, self._command,
                               env=env)
        self.pool.launch_version = launch_version
        self.pool.start()
        atexit.register(self.shutdown)
        self.version: Optional[int] = None  # the weight version last synced
        self.vocab_size = vocab_size(self.hf_dir)
        self._tokens = 0
        self._seconds = 0.0

    @property
    def logprob_dtype(self) -> str:
        """The servers' dtype; ``auto`` (the checkpoint's) counts as bf16, the coarsest it can
        be."""
        return "bf16" if self.cfg.dtype == "auto" else self.cfg.dtype

    def _command(self, port: int, model_dir: str) -> list[str]:
        return self._server_argv(self.cfg, model_dir, port, self.pool.launch_version)

    @staticmethod
    @abc.abstractmethod
    def _server_argv(cfg: ServerConfig, model_dir: str, port: int,
                     weight_version: Optional[str]) -> list[str]:
        """The command line of one server on ``port`` loading ``model_dir``."""

    @abc.abstractmethod
    def _payload(self, prompt: list[int], sampling: SamplingParams, seed: Optional[int]
                 ) -> dict:
        """The request body that generates one sample of ``prompt`` with ``seed``."""

    @abc.abstractmethod
    def _parse(self, response: Any, server: Server) -> Completion:
        """The completion in ``server``'s answer; raises ``RequestAborted`` for an aborted one,
        ``ServerError`` for one that breaks the API."""

    def _sampling_meta(self, sampling: SamplingParams) -> dict:
        """What every completion generated with ``sampling`` adds to its ``meta`` (how its
        log-probs differ from ``Completion.logprobs``'s definition, if they do)."""
        return {}

    def _generate(self, prompts: list[list[int]], sampling: SamplingParams,
                  targets: Optional[list[Server]]) -> list[list[Completion]]:
        """``generate`` on ``targets`` (None: every server, or the router)."""
        extra_meta = self._sampling_meta(sampling)
        check_token_ids(prompts, self.vocab_size)
        self.pool.ensure_up()
        seed = sampling.seed
        each = [sampling if sampling.max_new_tokens_per_prompt is None else
                dataclasses.replace(sampling, max_new_tokens=sampling.budget(i))
                for i in range(len(prompts))]
        payloads = [self._payload(prompt, each[i],
                                  None if seed is None else sample_seed(seed, i, j))
                    for i, prompt in enumerate(prompts) for j in range(sampling.n)]
        if targets is None and self.router is not None:
            targets = [self.router]
        t0 = time.monotonic()
        flat = self.pool.map(self.generate_path, payloads, self._parse, targets=targets)
        self._seconds += time.monotonic() - t0
        self._tokens += sum(len(c.token_ids) for c in flat)
        for c in flat:
            c.meta.update(extra_meta)
        n = sampling.n
        return [flat[i * n:(i + 1) * n] for i in range(len(prompts))]

    def generate(self, prompts: list[list[int]], sampling: SamplingParams
                 ) -> list[list[Completion]]:
        return self._generate(prompts, sampling, None)

    def generate_on_each_replica(self, prompts: list[list[int]], sampling: SamplingParams
                                 ) -> dict[str, list[list[Completion]]]:
        """On each server that is up and holds the current weights. One that dies under its
        probe is left out while another answered (the check covers the replicas that serve);
        with none left its error is raised, and with none to ask at all a ServerError: a check
        of no replica would pass with nothing checked."""
        self.pool.ensure_up()
        out: dict[str, list[list[Completion]]] = {}
        lost: Optional[ServerError] = None
        # Servers kept from requests until a sync gives them the current weights are skipped.
        serving = [s for s in self.pool.servers if s.state == "up" and self.pool.serves_current(s)]
        if not serving:
            raise ServerError(f"no {self.kind} server to check: none that is up holds weight "
                              f"version {self.pool.expected_version} (one that came back after "
                              "a fault gets it at the next sync): "
                              + self.pool.supervisor.status())
        with self._not_counted():
            for s in serving:
                try:
                    out[s.describe()] = self._generate(prompts, sampling, [s])
                except ServerError as e:
                    if s.state == "up":
                        raise
                    # It died under the probe (a node lost): left out, as a rollout drops it.
                    log.warning("%s died under the weight check's probe and is left out: %s",
                                s.describe(), s.last_error)
                    lost = e
        if not out and lost is not None:
            raise lost
        return out

    def generate_in_background(self, inflight_at_sync: str) -> None:
        """Rollouts may run in another thread while weights are pushed (GeneratesAhead)."""
        self.pool.run_in_background()
        self.pool.inflight_at_sync = inflight_at_sync

    def take_drain_wait_seconds(self) -> float:
        waited, self.pool.drain_wait_s = self.pool.drain_wait_s, 0.0
        return waited

    def metrics(self) -> dict[str, float]:
        out = self.pool.pop_metrics()
        if self._seconds > 0:
            out["rollout/tokens_per_s"] = self._tokens / self._seconds
        out["rollout/response_tokens"] = float(self._tokens)
        self._tokens, self._seconds = 0, 0.0
        return out

    def shutdown(self) -> None:
        self.pool.stop()
