"""Rollouts from vLLM's OpenAI-compatible server (``/v1/completions`` with token-id prompts).

Log-probs: vLLM's default ``raw_logprobs`` are log-softmax of the logits before temperature. The
servers we launch run with ``--logprobs-mode processed_logprobs``: log-softmax after temperature
(and after top-k/top-p masking). With top_k = -1 and top_p = 1 (the RL default) that is exactly
``Completion.logprobs``'s definition; with top-k/top-p on, vLLM renormalises over the kept tokens,
and the completions say so in ``meta["logprobs"]``. Servers started by hand must use the same
flag (and ``VLLM_SERVER_DEV_MODE=1`` for the weight reload).

Weight sync (the disk strategy of megatron_entropy/weight_sync writes the HF folder): every server
loads the folder with ``/collective_rpc reload_weights`` between ``/pause?mode=wait`` and
``/resume``, then drops its prefix cache. A server restarted later starts from the newest
folder. Each completion is tagged with the version its server held (a sync waits for our
requests in flight: ``ServerPool.drained``). A failed reload is reported as itself (a resume
that then fails too is a note on it). A completion answered with finish reason ``abort`` is
issued again, never returned.

A LoRA policy that syncs its adapters alone (``rollout.weight_sync.strategy=adapters``,
weight_sync/adapters.py) runs servers with vLLM's LoRA serving on (``lora_serving``: the flags and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``; servers started by hand need the same). Each sync loads
the PEFT folder with ``/v1/load_lora_adapter`` (in place, under one name, ``LORA_NAME``), and
from the first one on every request asks for that adapter; a server restarted later loads the
newest folder at its start (``--lora-modules``).

Abort and resume (``rollout.inflight_at_sync: abort``): each request carries our
``request_id``; a weight push aborts ours with ``/abort_requests {request_ids}`` (vLLM 0.32,
dev mode; other clients' requests run on), and vLLM answers each with finish reason ``abort``
and the token ids and log-probs it had; the pool resumes it with ``prompt`` = prompt + those
tokens and ``max_tokens`` what is left.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Optional

import torch

from megatron_entropy.config import ServerConfig
from megatron_entropy.config.validation import VLLM_LORA_RANKS
from megatron_entropy.rollout.base import Completion, SamplingParams
from megatron_entropy.rollout.server.engine import ServerEngine
from megatron_entropy.rollout.server.errors import ServerError
from megatron_entropy.rollout.server.partial import (AbortApi, RequestAborted, eos_token_ids,
                                                     finished_before_resume)
from megatron_entropy.rollout.server.pool import Server
from megatron_entropy.rollout.server.process import compose_argv, parse_extra_env
from megatron_entropy.runtime.dtypes import long_name

log = logging.getLogger(__name__)

SERVED_NAME = "policy"  # constant across restarts from new weight folders
LORA_NAME = "policy-lora"  # the policy's adapters, loaded in place at every sync
FINISH_REASONS = ("stop", "length", "abort")
# A sitecustomize that asks Linux for AMX permission in every process of a CPU server (its
# docstring says why).
CPU_SITE = Path(__file__).resolve().parent / "vllm_cpu_site"


def server_env(extra_env: dict[str, str], on_cpu: Optional[bool] = None) -> dict[str, str]:
    """The environment a vLLM server gets beyond ours, from ``rollout.server.extra_env``: the
    weight reload endpoints on (dev mode) and, on a CPU server (``on_cpu``; default: no CUDA
    here), CPU_SITE first on its PYTHONPATH (before extra_env's own, or else ours)."""
    env = {**extra_env, "VLLM_SERVER_DEV_MODE": "1"}
    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    if on_cpu:
        rest = extra_env.get("PYTHONPATH", os.environ.get("PYTHONPATH", ""))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CPU_SITE), rest) if p)
    return env


def server_argv(c: ServerConfig, model_dir: str, port: int,
                weight_version: Optional[str] = None) -> list[str]:
    """The command line of one vLLM server (also used by slurm/ to start servers itself): the
    flags the engine relies on (processed log-probs, a stable served name) are always there."""
    argv = [c.server_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
            "--served-model-name", SERVED_NAME, "--host", c.host, "--port", str(port),
            "--dtype", long_name(c.dtype), "--logprobs-mode", "processed_logprobs", "--seed", "0"]
    return compose_argv(c, argv, "--max-model-len", model_dir, port, weight_version)


def lora_serving(c: ServerConfig, rank: int) -> ServerConfig:
    """The server settings with vLLM's LoRA serving on, for adapters of ``rank``, loaded and
    replaced while it serves."""
    # The config refuses a rank above vLLM's largest (config/validation.py).
    fits = next(r for r in VLLM_LORA_RANKS if r >= rank)
    return dataclasses.replace(
        c, extra_args=[*c.extra_args, "--enable-lora", "--max-lora-rank", str(fits),
                       "--max-loras", "1"],
        extra_env=[*c.extra_env, "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"])


class VLLMEngine(ServerEngine):
    """vLLM servers: ``/v1/completions`` per sample, weights from disk."""

    kind = "vllm"
    generate_path = "/v1/completions"
    _server_argv = staticmethod(server_argv)

    def __init__(self, server_cfg: ServerConfig, hf_dir: str, run_dir: str):
        # The newest adapter folder (strategy adapters), before the servers start.
        self.adapter_dir: Optional[str] = None
        super().__init__(server_cfg, hf_dir, run_dir,
                         env=server_env(parse_extra_env(server_cfg.extra_env)))
        self.model_name = self._served_name()
        self._eos = eos_token_ids(self.hf_dir)
        # /v1/completions runs our request_id R as "cmpl-R-0" (one prompt); /abort_requests
        # (dev mode) aborts those ids only.
        self.pool.aborts = AbortApi(
            with_id=lambda payload, rid: {**payload, "request_id": rid},
            abort_calls=lambda rids: [("/abort_requests",
                                       {"request_ids": [f"cmpl-{rid}-0" for rid in rids]})],
            resume=self._resume)
        self._warned_renormalised = False

    def _command(self, port: int, model_dir: str) -> list[str]:
        """A (re)started server also loads the newest adapters, if there are any."""
        argv = super()._command(port, model_dir)
        return argv + ["--lora-modules", f"{LORA_NAME}={self.adapter_dir}"] \
            if self.adapter_dir else argv

    def _served_name(self) -> str:
        names = {i: r["data"][0]["id"] for i, r in
                 self.pool.call_all("/v1/models", method="GET", timeout=60).items()}
        if len(set(names.values())) != 1:
            raise ServerError(f"vLLM servers serve different models: {names}")
        return next(iter(names.values()))

    # ------------------------------------------------------------------------- generation

    def _payload(self, prompt: list[int], sampling: SamplingParams, seed: Optional[int]) -> dict:
        p: dict[str, Any] = {
            "model": self.model_name, "prompt": prompt, "n": 1,
            "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k,
            "logprobs": 0, "return_token_ids": True, "skip_special_tokens": True,
        }
        if sampling.stop:
            p["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            p["stop_token_ids"] = list(sampling.stop_token_ids)
        if seed is not None:
            p["seed"] = seed
        return p

    def _resume(self, payload: dict, prefix: Completion) -> "dict | str":
        """The request that generates the rest of a sample aborted after ``prefix``."""
        finished = finished_before_resume(prefix, payload["max_tokens"],
                                          self._eos | set(payload.get("stop_token_ids", [])),
                                          payload.get("stop", []))
        if finished is not None:
            return finished
        return {**payload, "prompt": payload["prompt"] + prefix.token_ids,
                "max_tokens": payload["max_tokens"] - len(prefix.token_ids)}

    def _parse(self, response: Any, server: Server) -> Completion:
        try:
            choice = response["choices"][0]
            ids = [int(t) for t in choice["token_ids"]]
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            reason = choice["finish_reason"]
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ServerError(f"{server.describe()}: unexpected /v1/completions answer "
                              f"({type(e).__name__}: {e}): {str(response)[:500]}") from e
        completion = Completion(token_ids=ids, logprobs=logprobs, text=choice.get("text", ""),
                                finish_reason=reason,
                                meta={"server": server.index,
                                      "weight_version": None if server.weight_version is None
                                      else int(server.weight_version)})
        if reason == "abort":  # truncated: resumed from what it holds, or issued again
            raise RequestAborted(f"{server.describe()} aborted the request after {len(ids)} "
                                 "tokens", completion if len(ids) == len(logprobs) else None)
        if len(ids) != len(logprobs):
            raise ServerError(f"{server.describe()}: {len(ids)} token ids but {len(logprobs)} "
                              "log-probs in one completion")
        if reason not in FINISH_REASONS:
            raise ServerError(f"{server.describe()}: unknown finish_reason {reason!r}")
        return completion

    def _sampling_meta(self, sampling: SamplingParams) -> dict:
        """With top-p/top-k on, vLLM's log-probs are renormalised over the kept tokens: the
        completions say so (and a warning, once)."""
        if not (sampling.temperature > 0 and (sampling.top_p < 1.0 or sampling.top_k > 0)):
            return {}
        if not self._warned_renormalised:
            log.warning("vLLM log-probs are renormalised over the top-p/top-k set "
                        "(top_p=%s, top_k=%s), not over the full vocabulary",
                        sampling.top_p, sampling.top_k)
            self._warned_renormalised = True
        return {"logprobs": "renormalised_top_p_top_k"}

    # ------------------------------------------------------------------------ weight sync

    def reload_from_folder(self, folder: Path, version: int) -> None:
        """Every server takes the HF weights in ``folder`` as version ``version``; raises if one
        does not."""
        # A dead launched server restarts from the new folder and so needs no reload.
        self.pool.model_dir = str(folder)
        self._update_servers(version, "/collective_rpc", {
            "method": "reload_weights", "kwargs": {"weights_path": str(folder)}}, dict)

    def load_adapter(self, folder: Path, version: int) -> None:
        """Every server takes the PEFT adapter folder ``folder`` (on its base) as version
        ``version``, and every request asks for it from now on; raises if one does not."""
        self.adapter_dir = str(folder)  # what a restarted server loads
        self._update_servers(version, "/v1/load_lora_adapter", {
            "lora_name": LORA_NAME, "lora_path": str(folder), "load_inplace": True}, str)
        self.model_name = LORA_NAME

    def _update_servers(self, version: int, path: str, payload: dict, answer: type) -> None:
        """Call ``path`` on every server that does not hold ``version`` yet, paused, and mark
        them as holding it; an answer that is not of type ``answer`` raises."""
        self.pool.launch_version = str(version)
        self.pool.ensure_up()
        # Our own requests in flight (a rollout in another thread) finish on the old weights.
        with self.pool.drained():
            targets = [s for s in self.pool.servers if s.state == "up"]
            # Only servers that do not already hold these weights (restarted ones do) reload.
            stale = [s for s in targets if s.weight_version != str(version)]
            # mode=wait: in-flight requests (other clients' too) finish first, none is aborted.
            with self.pool.paused(("/pause?mode=wait", None), ("/resume", None), stale):
                results = self.pool.call_all(path, payload, targets=stale)
                self.pool.call_all("/reset_prefix_cache", targets=stale)
            # A server that died under the reload is dead now, left out (pool.call_all).
            up = [s for s in targets if s.state == "up"]
            for server in stale:
                if server in up and not isinstance(results.get(server.index), answer):
                    raise ServerError(f"{server.describe()}: {path} answered "
                                      f"{results.get(server.index)!r}")
            for server in up:
                server.weight_version = str(version)
            self.version = version
            self.pool.expected_version = str(version)
