"""Requests spread over an engine's servers with ``asyncio``/``aiohttp``: each goes to the usable
server with the fewest requests in flight, at most ``max_concurrency`` per server, and only to
servers holding the expected weight version. A request whose server dies or hangs is issued
again elsewhere; every result is stored once, by its index, so no sample is lost or duplicated.
Retries are bounded (``max_retries``). An answer the engine's parser calls aborted
(``RequestAborted``) is issued again, or resumed from its partial output (partial.py). The gate
(``gate_open``, closed by the control plane around weight syncs) lets no request start.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from typing import Any, Callable, Optional

import aiohttp

from megatron_entropy.rollout.base import Completion
from megatron_entropy.rollout.server.errors import RequestRejected, ServerError, one_line
from megatron_entropy.rollout.server.partial import AbortApi, RequestAborted, join_completions
from megatron_entropy.rollout.server.supervisor import Server, Supervisor, say_progress

log = logging.getLogger(__name__)

ParseResponse = Callable[[Any, Server], Any]


class _ServerDied(Exception):
    pass


async def post(session: aiohttp.ClientSession, server: Server, path: str, payload: dict,
               timeout: float) -> Any:
    """POST ``payload`` to ``server``: its JSON answer (or text); 4xx raises RequestRejected,
    another error status ClientResponseError."""
    async with session.post(server.url + path, json=payload,
                            timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        text = await r.text()
        if 400 <= r.status < 500:
            raise RequestRejected(f"{server.describe()} rejected POST {path} with HTTP "
                                  f"{r.status}: {one_line(text)}")
        if r.status != 200:
            raise aiohttp.ClientResponseError(r.request_info, (), status=r.status,
                                              message=one_line(text))
        try:
            return await r.json(content_type=None)
        except ValueError:
            return text


class Dispatcher:
    """Least-loaded dispatch over the supervisor's servers, with retries and resumes."""

    def __init__(self, supervisor: Supervisor) -> None:
        self.sup = supervisor
        self.cfg = supervisor.cfg
        supervisor.on_change = self.notify
        # The weight version every dispatched request must be served with (None: any).
        self.expected_version: Optional[str] = None
        self.retries = 0
        self.aborted = 0  # completions answered as aborted, and issued again
        self.resumed = 0  # aborted requests resumed from their partial output
        # "abort": the control plane aborts our requests in flight at a sync, which then resume
        # (engines that give ``aborts``); "finish": they finish on the weights they started with.
        self.inflight_at_sync = "finish"
        self.aborts: Optional[AbortApi] = None
        self._request_ids = itertools.count()
        self._id_base = f"me-{os.getpid()}-{id(self):x}"
        self.inflight_ids: dict[str, Server] = {}  # our request id -> the server running it
        self.aborting: set[str] = set()  # ids the control plane aborted
        self._cond: Optional[asyncio.Condition] = None
        self.gate_open = True
        # Requests in flight on all servers; seconds with at least one (since pop_busy_s).
        self.inflight_total = 0
        self._busy_since: Optional[float] = None
        self._busy_s = 0.0

    @property
    def aborting_enabled(self) -> bool:
        return self.aborts is not None and self.inflight_at_sync == "abort"

    def notify(self) -> None:
        """Wake the requests waiting for a server (one came up, died, or the gate opened)."""
        cond = self._cond
        if cond is None:
            return

        async def wake() -> None:
            async with cond:
                cond.notify_all()
        try:
            asyncio.get_running_loop().create_task(wake())
        except RuntimeError:
            pass

    def serves_current(self, server: Server) -> bool:
        return self.expected_version is None or server.weight_version == self.expected_version

    def _usable(self, server: Server) -> bool:
        return (self.gate_open and server.state == "up"
                and server.inflight < self.cfg.max_concurrency and self.serves_current(server))

    async def _acquire(self, targets: list[Server]) -> Server:
        assert self._cond is not None
        async with self._cond:
            while True:
                usable = [s for s in targets if self._usable(s)]
                if usable:
                    server = min(usable, key=lambda s: (s.inflight, s.index))
                    server.inflight += 1
                    if self.inflight_total == 0:
                        self._busy_since = time.monotonic()
                    self.inflight_total += 1
                    return server
                if self.gate_open and not any(
                        s.state == "starting" or (s.state == "up" and self.serves_current(s))
                        for s in targets):
                    held = ("" if self.expected_version is None else
                            f" with weight version {self.expected_version}")
                    raise ServerError(f"no {self.sup.kind} server{held} left to send requests "
                                      f"to: {self.sup.status()}")
                await self._cond.wait()

    async def _release(self, server: Server) -> None:
        assert self._cond is not None
        async with self._cond:
            server.inflight -= 1
            self.inflight_total -= 1
            if self.inflight_total == 0 and self._busy_since is not None:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
            self._cond.notify_all()

    def pop_busy_s(self) -> float:
        """Seconds with at least one request in flight since the last call."""
        busy, self._busy_s = self._busy_s, 0.0
        if self._busy_since is not None:
            now = time.monotonic()
            busy += now - self._busy_since
            self._busy_since = now
        return busy

    async def open_gate(self) -> None:
        self.gate_open = True
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

    async def _one(self, session: aiohttp.ClientSession, index: int, path: str, payload: dict,
                   parse: ParseResponse, targets: list[Server]) -> Any:
        attempts = 0
        body = payload  # what is sent: the payload, or the rest of a sample after ``prefix``
        prefix: Optional[Completion] = None  # what aborts at weight pushes left of the sample
        while True:
            server = await self._acquire(targets)
            rid = None  # our id for the request: only when a push may abort it
            if self.aborting_enabled:
                # Ended by a dot: SGLang aborts every rid the given one is a prefix of, and
                # "x-1" would be one of "x-10".
                rid = f"{self._id_base}-{next(self._request_ids)}."
                self.inflight_ids[rid] = server
            t0 = time.monotonic()
            died = asyncio.ensure_future(server.died.wait())
            http = asyncio.ensure_future(post(
                session, server, path, body if rid is None else self.aborts.with_id(body, rid),
                self.cfg.request_timeout_s))
            try:
                done, _ = await asyncio.wait({http, died}, return_when=asyncio.FIRST_COMPLETED)
                if http not in done:
                    http.cancel()
                    raise _ServerDied(server.last_error)
                result = parse(http.result(), server)
                server.alive_at, server.warm = time.monotonic(), True
                server.requests += 1
                server.latency_s += time.monotonic() - t0
                return result if prefix is None else join_completions(prefix, result)
            except RequestRejected:
                raise
            except RequestAborted as e:
                server.alive_at = time.monotonic()
                ours = rid in self.aborting  # aborted by our own drained(), not a fault
                if not ours:
                    attempts += 1
                    self.retries += 1
                    self.aborted += 1
                kept = e.partial is not None and (e.partial.token_ids or prefix is not None)
                if self.aborting_enabled and kept:  # an empty first partial: sent again whole
                    prefix = e.partial if prefix is None else join_completions(prefix, e.partial)
                    rest = self.aborts.resume(payload, prefix)
                    if isinstance(rest, str):  # it had already finished
                        prefix.finish_reason = rest
                        return prefix
                    body = rest
                    self.resumed += 1
                elif ours:
                    body, prefix = payload, None  # nothing usable: generated again whole
                if attempts > self.cfg.max_retries:
                    raise ServerError(f"request {index} was aborted {attempts} times; last: "
                                      f"{e}") from e
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, _ServerDied) as e:
                server.failures += 1
                attempts += 1
                self.retries += 1
                why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
                await self.sup.on_failure(session, server, why)
                if attempts > self.cfg.max_retries:
                    self.sup.log_tail(server)
                    raise ServerError(
                        f"request {index} failed {attempts} times; last on {server.describe()}: "
                        f"{why}") from e
            finally:
                died.cancel()
                if not http.done():
                    http.cancel()
                if rid is not None:
                    self.inflight_ids.pop(rid, None)
                    self.aborting.discard(rid)
                await self._release(server)

    def map(self, path: str, payloads: list[dict], parse: ParseResponse,
            targets: Optional[list[Server]] = None) -> list[Any]:
        """POST every payload to ``path`` on the servers, concurrently; results in order."""
        if not payloads:
            return []
        return self.sup.runner.run(self._map(path, payloads, parse, targets))

    async def _progress(self, path: str, jobs: list[asyncio.Future],
                        targets: list[Server]) -> None:
        """Every PROGRESS_S while requests are unanswered: how many, and the servers' states
        (each request is bounded by request_timeout_s, a silent server by the health rules)."""
        def say(waited: float) -> None:
            log.warning("waiting for %d of %d %s requests to the %s servers (%.0f s so far; "
                        "each bounded by rollout.server.request_timeout_s=%g):\n%s",
                        sum(not j.done() for j in jobs), len(jobs), path, self.sup.kind,
                        waited, self.cfg.request_timeout_s,
                        "\n".join(f"  {s.describe()}: {s.state}, {s.inflight} in flight"
                                  for s in targets))
        await say_progress(say)

    async def _map(self, path: str, payloads: list[dict], parse: ParseResponse,
                   targets: Optional[list[Server]]) -> list[Any]:
        targets = self.sup.servers if targets is None else targets
        # The first map on a loop sets up the dispatch state; one running beside it (on the
        # background loop) shares it.
        first = self._cond is None
        if first:
            self._cond = asyncio.Condition()
            self.sup.tasks = set()
            for server in targets:  # events belong to one loop: fresh ones for this run
                server.died = asyncio.Event()
                if server.state == "dead":
                    server.died.set()
        connector = aiohttp.TCPConnector(limit=self.cfg.max_connections)
        async with aiohttp.ClientSession(connector=connector) as session:
            monitor = asyncio.ensure_future(self.sup.monitor(session, targets))
            jobs = [asyncio.ensure_future(self._one(session, i, path, p, parse, targets))
                    for i, p in enumerate(payloads)]
            progress = asyncio.ensure_future(self._progress(path, jobs, targets))
            try:
                return await asyncio.gather(*jobs)
            finally:
                owned = [monitor, progress, *jobs, *(self.sup.tasks if first else ())]
                for task in owned:
                    task.cancel()
                await asyncio.gather(*owned, return_exceptions=True)
                if first:
                    self._cond = None
