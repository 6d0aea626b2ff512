"""Rollouts from SGLang servers (0.5.x native HTTP API), with weight sync from disk, by broadcast
or of a LoRA policy's adapters alone.

Generation: one ``/generate`` request per sample (``input_ids``, ``sampling_params`` with n = 1,
``return_logprob``), so each sample has its own seed, goes to the least-loaded server and can be
re-issued alone. SGLang's default log-probs are log-softmax(logits / temperature) over the full
vocabulary before top-p/top-k, which is ``Completion.logprobs``'s definition (do not set
``SGLANG_RETURN_ORIGINAL_LOGPROB``). ``sampling_seed`` is sent to servers >= 0.5.3 (older ones
reject the key); it makes samples reproducible only on servers started with
``--enable-deterministic-inference``.

A completion answered with finish reason ``abort`` (truncated: another client paused the server
with mode ``abort``) is issued again, never returned. With ``rollout.inflight_at_sync: abort``
each request carries our ``rid`` (ended by a dot: SGLang aborts every rid the given one is a
prefix of); a weight push aborts ours with ``/abort_request {rid}`` (a running request stops
after one more decode step, a waiting one at once with no tokens, except on a server another
client paused in place: that one is not aborted and runs on after the continue, so the push
sends the abort again every second and waits until it is answered, each request bounded by
``request_timeout_s``), the answer holds the partial ``output_ids``/``output_token_logprobs``
and ``weight_version``, and the pool resumes it: ``input_ids`` = prompt + those tokens,
``max_new_tokens`` what is left; an answer that was not aborted is kept as it is, tagged with
the version that generated it.
Not behind a router (which picks the server: the abort would not find the request).

Weight sync (driven by megatron_entropy/weight_sync), between ``/pause_generation`` (mode
``rollout.server.pause_mode``: ``retract`` or ``in_place`` keep other clients' in-flight
requests, SGLang's default ``abort`` would cut them off) and ``/continue_generation``, then
``/flush_cache`` (which SGLang refuses while other clients' requests wait: a warning then, their
prefixes stay cached):
- ``disk``: the HF folder the disk strategy wrote is loaded by ``/update_weights_from_disk``
  (``reload_from_folder``).
- ``distributed``: global rank 0 and every server's TP ranks form one process group
  (``/init_weights_update_group``); each bucket the broadcast strategy hands over
  (``broadcast_bucket``) is announced by ``/update_weights_from_distributed`` (names, dtypes,
  shapes) and sent tensor by tensor with ``broadcast(src=0)``. A restarted server holds stale
  weights until the next sync re-forms the group with it; until then it gets no requests. The
  group's master listens on loopback when every server is on this host, else on the address of
  the interface that routes to the first server (``rollout.weight_sync.master_addr`` overrides).
- ``adapters`` (a LoRA policy, weight_sync/adapters.py): servers with SGLang's LoRA serving on
  (``lora_serving``: ``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``, as SGLang's
  LoRA docs ask of servers that load adapters after their start) load each version's PEFT folder
  with ``/load_lora_adapter`` {lora_name, lora_path} under a name of its own,
  ``policy-lora-v{N}``, then ``/update_weight_version`` and ``/unload_lora_adapter`` of the
  previous name. A new name per version, not unload + load of one name: SGLang refuses to load a
  name that is loaded (``LoRAManager.validate_new_adapter``), and its unload waits for the
  requests that use the name (``LoRARegistry.wait_for_unload``), so with one name a failed load
  would leave the servers with no adapter under it; with a name per version the new adapter is
  loaded next to the old, whose unload then cannot fail a request of ours (none use it). Every
  ``/generate`` names the adapter in ``lora_path`` (a loaded adapter's name, despite the key;
  one that is not loaded is answered 400). A restarted server loads the newest folder at its
  start (``--lora-paths NAME=PATH``).
Every answer's ``meta_info.weight_version`` must be the version last synced.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import logging
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator, Optional
from urllib.parse import urlsplit

import torch
from torch.distributed.distributed_c10d import (Backend, PrefixStore, _new_process_group_helper,
                                                _world, rendezvous)

from megatron_entropy.config import ServerConfig, WeightSyncConfig
from megatron_entropy.models.lora_settings import TARGETS, LoraSettings
from megatron_entropy.rollout.base import Completion, SamplingParams
from megatron_entropy.rollout.server.engine import ServerEngine
from megatron_entropy.rollout.server.errors import RequestRejected, ServerError
from megatron_entropy.rollout.server.partial import (AbortApi, RequestAborted, eos_token_ids,
                                                     finished_before_resume)
from megatron_entropy.rollout.server.pool import Server
from megatron_entropy.rollout.server.process import compose_argv, free_port
from megatron_entropy.runtime.dtypes import long_name

log = logging.getLogger(__name__)

FINISH_REASONS = ("stop", "length", "abort")
FIRST_VERSION_WITH_SEED = (0, 5, 3)
INITIAL_VERSION = "initial"  # what a launched server holds before the first sync
LORA_NAME = "policy-lora"  # the policy's adapters: version N loaded as "policy-lora-vN"


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in str(text).split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def weight_sync_address(server_urls: list[str]) -> str:
    """The address of this process as the servers reach it for the weight-sync group: loopback
    when every server is on this host, else the local address of the route to the first remote
    server (what a UDP connect picks; no packet is sent). Not the hostname's address: on Debian
    hosts that is 127.0.1.1, which no other node reaches."""
    remote = [h for h in (urlsplit(u).hostname or "" for u in server_urls)
              if not _is_loopback(h)]
    if not remote:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((remote[0], 9))
        except OSError as e:
            raise ServerError(f"no route to rollout server host {remote[0]!r} ({e}): set "
                              "rollout.weight_sync.master_addr") from e
        return s.getsockname()[0]


def init_weight_sync_group(master_address: str, master_port: int, world_size: int, rank: int,
                           group_name: str, backend: str, timeout_s: float = 600.0
                           ) -> torch.distributed.ProcessGroup:
    """A process group apart from the default one, formed the way SGLang's servers form theirs
    (TCP rendezvous at the master, store prefixed by the group name), so both sides meet."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world_size = next(rendezvous(f"tcp://{master_address}:{master_port}", rank,
                                              world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                      group_name=group_name, timeout=timeout)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def server_argv(c: ServerConfig, model_dir: str, port: int,
                weight_version: Optional[str] = INITIAL_VERSION) -> list[str]:
    """The command line of one SGLang server (also used by slurm/ to start servers itself)."""
    argv = [c.server_python, "-m", "sglang.launch_server", "--model-path", model_dir,
            "--host", c.host, "--port", str(port), "--dtype", long_name(c.dtype),
            "--weight-version", str(weight_version)]
    return compose_argv(c, argv, "--context-length", model_dir, port, weight_version)


def lora_serving(c: ServerConfig, lora: LoraSettings) -> ServerConfig:
    """The server settings with SGLang's LoRA serving on, for adapters of ``lora``'s rank on its
    targets' HF modules, loaded after the start: one adapter per batch (every request names the
    current version's), two loaded at once (the new version beside the old until its unload)."""
    modules = sorted(m for t in lora.targets for m in TARGETS[t])
    flags = ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules",
             *modules, "--max-loras-per-batch", "1", "--max-loaded-loras", "2"]
    # A launch_command replaces the whole command line, extra_args too: it gets them itself.
    if c.launch_command:
        return dataclasses.replace(c, launch_command=[*c.launch_command, *flags])
    return dataclasses.replace(c, extra_args=[*c.extra_args, *flags])


class SGLangEngine(ServerEngine):
    """SGLang servers: ``/generate`` per sample, weights from disk, by broadcast or a LoRA
    policy's adapters alone."""

    kind = "sglang"
    generate_path = "/generate"
    _server_argv = staticmethod(server_argv)

    def __init__(self, server_cfg: ServerConfig, hf_dir: str, run_dir: str,
                 weight_sync: Optional[WeightSyncConfig] = None):
        # The newest adapters (strategy adapters), name and folder: what a (re)started server
        # loads, and, once every server loaded them, what requests name.
        self.adapter: Optional[tuple[str, str]] = None
        self.adapter_served: Optional[str] = None
        super().__init__(server_cfg, hf_dir, run_dir, launch_version=INITIAL_VERSION)
        # The broadcast's process group: its backend and this node's address.
        self.weight_sync = weight_sync or WeightSyncConfig()
        self.router = (Server(url=server_cfg.router_url.rstrip("/"), index=-1)
                       if server_cfg.router_url else None)
        self._group: Optional[torch.distributed.ProcessGroup] = None
        self._group_members: tuple = ()
        self._groups_formed = 0
        self._inspect_servers()
        # Behind a router we do not know which server runs a request: nothing to abort there.
        if self.router is None:
            self._eos = eos_token_ids(self.hf_dir)
            self.pool.aborts = AbortApi(
                with_id=self._with_id,
                abort_calls=lambda rids: [("/abort_request", {"rid": rid}) for rid in rids],
                resume=self._resume)

    def _inspect_servers(self) -> None:
        """Each server's version (is sampling_seed known?) and TP size (ranks in the group)."""
        self.supports_seed: dict[int, bool] = {}
        self.tp_size: dict[int, int] = {}
        for index, info in self.pool.call_all("/get_server_info", method="GET").items():
            self.supports_seed[index] = (_version_tuple(info.get("version", "0"))
                                         >= FIRST_VERSION_WITH_SEED)
            self.tp_size[index] = int(info.get("tp_size", 1))
        # sampling_seed is sent only when every server that may answer (behind the router too)
        # knows the key.
        self._sends_seed = all(self.supports_seed.get(s.index, False) for s in self.pool.servers)

    # ------------------------------------------------------------------------- generation

    def _payload(self, prompt: list[int], sampling: SamplingParams, seed: Optional[int]
                 ) -> dict:
        params: dict[str, Any] = {
            "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k, "n": 1,
            "no_stop_trim": True, "skip_special_tokens": True,
        }
        if sampling.stop:
            params["stop"] = list(sampling.stop)
        if sampling.stop_token_ids:
            params["stop_token_ids"] = list(sampling.stop_token_ids)
        if seed is not None and self._sends_seed:
            params["sampling_seed"] = seed
        payload = {"input_ids": prompt, "sampling_params": params, "return_logprob": True,
                   "logprob_start_len": -1}
        if self.adapter_served is not None:
            payload["lora_path"] = self.adapter_served
        return payload

    def _with_id(self, payload: dict, rid: str) -> dict:
        """What is sent for ``payload`` under our id ``rid``, naming the adapters served now: a
        request aborted at a sync goes out again after it, when the previous version's adapters
        are unloaded (SGLang would refuse their name)."""
        sent = {**payload, "rid": rid}
        if self.adapter_served is not None:
            sent["lora_path"] = self.adapter_served
        return sent

    def _resume(self, payload: dict, prefix: Completion) -> "dict | str":
        """The request that generates the rest of a sample aborted after ``prefix``."""
        sp = payload["sampling_params"]
        finished = finished_before_resume(prefix, sp["max_new_tokens"],
                                          self._eos | set(sp.get("stop_token_ids", [])),
                                          sp.get("stop", []))
        if finished is not None:
            return finished
        return {**payload, "input_ids": payload["input_ids"] + prefix.token_ids,
                "sampling_params": {**sp, "max_new_tokens":
                                    sp["max_new_tokens"] - len(prefix.token_ids)}}

    def _aborted(self, response: Any, server: Server) -> RequestAborted:
        """An answer with finish reason abort: SGLang returns what the request had generated
        (nothing for one still waiting), tagged with the version it ran on; the partial is None
        if its ids and log-probs do not match."""
        meta = response.get("meta_info", {})
        try:
            ids = [int(t) for t in response.get("output_ids", [])]
            entries = meta.get("output_token_logprobs", [])
            partial = Completion(token_ids=ids, logprobs=[float(e[0]) for e in entries],
                                 text=response.get("text", ""), finish_reason="abort",
                                 meta={"server": server.index,
                                       "weight_version": meta.get("weight_version",
                                                                 server.weight_version)})
            if [int(e[1]) for e in entries] != ids:
                partial = None
        except (TypeError, ValueError, IndexError):
            partial = None
        return RequestAborted(f"{server.describe()} aborted the request after "
                              f"{len(response.get('output_ids', []))} tokens: "
                              f"{meta.get('finish_reason')!r}", partial)

    def _parse(self, response: Any, server: Server) -> Completion:
        finish = response.get("meta_info", {}).get("finish_reason") \
            if isinstance(response, dict) else None
        if (finish.get("type") if isinstance(finish, dict) else finish) == "abort":
            raise self._aborted(response, server)  # truncated: resumed or issued again
        try:
            meta = response["meta_info"]
            ids = [int(t) for t in response["output_ids"]]
            entries = meta["output_token_logprobs"]
            logprobs = [float(e[0]) for e in entries]
            logprob_ids = [int(e[1]) for e in entries]
            finish = meta["finish_reason"]
            reason = finish["type"] if isinstance(finish, dict) else finish
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ServerError(f"{server.describe()}: unexpected /generate answer "
                              f"({type(e).__name__}: {e}): {str(response)[:500]}") from e
        if logprob_ids != ids:
            raise ServerError(f"{server.describe()}: output_ids and output_token_logprobs "
                              f"disagree ({len(ids)} vs {len(logprob_ids)} tokens)")
        if reason not in FINISH_REASONS:
            raise ServerError(f"{server.describe()}: unknown finish_reason {finish!r}")
        served = meta.get("weight_version")
        if self.version is not None and served != str(self.version):
            raise ServerError(f"{server.describe()} answered with weight version {served!r}, "
                              f"expected {self.version}: it serves stale weights")
        return Completion(token_ids=ids, logprobs=logprobs, text=response.get("text", ""),
                          finish_reason=reason,
                          meta={"server": server.index, "weight_version": served})

    # ------------------------------------------------------------------------ weight sync

    @contextlib.contextmanager
    def weight_update(self, version: int) -> Iterator[list[Server]]:
        """The servers to update (all that are up), paused and drained for the body; after it,
        their caches flushed and their version ``version``."""
        v = str(version)
        self.pool.ensure_up()
        self._inspect_servers()
        # Our own requests in flight (a rollout in another thread) finish on the old weights.
        with self.pool.drained():
            targets = [s for s in self.pool.servers if s.state == "up"]
            with self.pool.paused(("/pause_generation", {"mode": self.cfg.pause_mode}),
                                  ("/continue_generation", {}), targets):
                yield targets
                self._flush_cache(targets)
            for server in targets:
                if server.state == "up":  # not one that died under the update
                    server.weight_version = v
            if self.router is not None:
                self.router.weight_version = v
            self.version = version
            self.pool.expected_version = v

    def reload_from_folder(self, folder: Path, version: int) -> None:
        """Every server that does not hold version ``version`` loads the HF folder."""
        v = str(version)
        # A launched server that restarts from now on loads this folder.
        self.pool.model_dir, self.pool.launch_version = str(folder), v
        with self.weight_update(version) as targets:
            stale = [s for s in targets if s.weight_version != v]
            self._check(self.pool.call_all("/update_weights_from_disk", {
                "model_path": str(folder), "flush_cache": True,
                "abort_all_requests": False, "weight_version": v}, targets=stale),
                "/update_weights_from_disk")

    def load_adapter(self, folder: Path, version: int) -> None:
        """Every server that does not hold version ``version`` loads the PEFT adapter folder
        ``folder`` (on its base) as ``policy-lora-v{version}``, takes ``version`` as its weight
        version and unloads the previous version's adapters; every request names the new ones
        from now on."""
        v, name = str(version), f"{LORA_NAME}-v{version}"
        previous = self.adapter_served  # "policy-lora-vM": held by servers at version M
        # A launched server that restarts from now on loads this folder (_command).
        self.adapter, self.pool.launch_version = (name, str(folder)), v
        with self.weight_update(version) as targets:
            stale = [s for s in targets if s.weight_version != v]
            self._check(self.pool.call_all("/load_lora_adapter", {
                "lora_name": name, "lora_path": str(folder)}, targets=stale),
                "/load_lora_adapter")
            self.adapter_served = name
            self._check(self.pool.call_all("/update_weight_version", {"new_version": v},
                                           targets=stale), "/update_weight_version")
            holders = [s for s in stale if previous is not None
                       and f"{LORA_NAME}-v{s.weight_version}" == previous]
            if holders:
                self._check(self.pool.call_all("/unload_lora_adapter", {"lora_name": previous},
                                               targets=holders), "/unload_lora_adapter")

    def _command(self, port: int, model_dir: str) -> list[str]:
        """A (re)started server also loads the newest adapters, if there are any."""
        argv = super()._command(port, model_dir)
        return argv + ["--lora-paths", f"{self.adapter[0]}={self.adapter[1]}"] \
            if self.adapter else argv

    FLUSH_TRIES = 3  # an idle server may refuse a flush once, right after a request returned
    FLUSH_AGAIN_S = 0.5

    def _flush_cache(self, targets: list[Server]) -> None:
        """SGLang answers 400 "Flush cache failed." while requests wait (another client's, kept
        by the pause: they keep their prefixes cached, which the next sync's flush drops), and
        once in a while on an idle server right after a request returned (its scheduler still
        held the batch). The two answers are the same (SGLang's scheduler gives no reason), so
        each server is asked up to FLUSH_TRIES times before the warning: at most 1 s lost when
        another client's requests wait."""
        for server in targets:
            for attempt in range(1, self.FLUSH_TRIES + 1):
                if server.state != "up":
                    break  # died under the update; a restart starts with an empty cache
                try:
                    self.pool.call_all("/flush_cache", targets=[server])
                    break
                except RequestRejected as e:
                    if attempt == self.FLUSH_TRIES:
                        log.warning("%s: prefix cache not flushed after the weight sync "
                                    "(%d tries): %s", server.describe(), attempt,
                                    str(e).splitlines()[-1][:300])
                    else:
                        time.sleep(self.FLUSH_AGAIN_S)

    @staticmethod
    def _check(results: dict[int, Any], path: str) -> None:
        failed = {i: r for i, r in results.items()
                  if not (isinstance(r, dict) and r.get("success"))}
        if failed:
            raise ServerError(f"{path} failed on servers {sorted(failed)}: {failed}")

    def _ensure_group(self, targets: list[Server]) -> None:
        """(Re)form the broadcast group when its members changed (first sync, a restart)."""
        members = tuple((s.index, s.url, s.process.pid if s.process else None) for s in targets)
        if self._group is not None and members == self._group_members:
            return
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None
        self._groups_formed += 1
        name = f"megatron_entropy_sync_{self._groups_formed}"
        address = self.weight_sync.master_addr or weight_sync_address(
            [s.url for s in targets])
        port = free_port(address, 29700, set())
        world = 1 + sum(self.tp_size[s.index] for s in targets)
        offsets, rank = {}, 1
        for s in targets:
            offsets[s.index], rank = rank, rank + self.tp_size[s.index]
        futures = [self.pool.call_all_async("/init_weights_update_group", {
            "master_address": address, "master_port": port, "rank_offset": offsets[s.index],
            "world_size": world, "group_name": name, "backend": self.weight_sync.backend},
            targets=[s]) for s in targets]
        try:
            group = init_weight_sync_group(address, port, world, 0, name,
                                           self.weight_sync.backend,
                                           timeout_s=self.cfg.startup_timeout_s)
        except Exception as e:
            errors = [f.exception() for f in futures if f.done() and f.exception()]
            raise ServerError(f"could not form the weight-sync group {name} at {address}:{port} "
                              f"with {len(targets)} servers: {e}; server errors: {errors}") from e
        for f in futures:
            self._check(f.result(), "/init_weights_update_group")
        self._group, self._group_members, self._group_name = group, members, name

    def broadcast_bucket(self, targets: list[Server], bucket: list[tuple[str, torch.Tensor]],
                         last: bool, version: int) -> None:
        """Inside ``weight_update``: announce one bucket to ``targets`` and broadcast its
        tensors from rank 0 of the weight-sync group (formed again when its members changed);
        the last bucket carries the version."""
        self._ensure_group(targets)
        device = (torch.device("cuda", torch.cuda.current_device())
                  if self.weight_sync.backend == "nccl" else torch.device("cpu"))
        tensors = [t.detach().to(device).contiguous() for _, t in bucket]
        future = self.pool.call_all_async("/update_weights_from_distributed", {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
            "shapes": [list(t.shape) for t in tensors],
            "group_name": self._group_name, "flush_cache": last,
            **({"weight_version": str(version)} if last else {})}, targets=targets)
        try:
            for t in tensors:
                torch.distributed.broadcast(t, src=0, group=self._group)
        except Exception as e:
            raise ServerError(f"weight broadcast to {len(targets)} servers failed: {e}") from e
        self._check(future.result(), "/update_weights_from_distributed")

    # ----------------------------------------------------------------------------- other

    def shutdown(self) -> None:
        if self._group is not None:
            torch.distributed.destroy_process_group(self._group)
            self._group = None
        super().shutdown()
