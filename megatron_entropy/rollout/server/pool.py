"""The servers of one engine (vLLM or SGLang): dispatch, health, faults, drains, metrics.

A ``ServerPool`` either launches its servers (one command per server, in the serving stack's
own Python environment, logs in the run folder: process.py) or connects to URLs that already
serve. Requests run concurrently with ``asyncio``/``aiohttp``: each goes to the usable server
with the fewest requests in flight, at most ``max_concurrency`` per server. A server that dies
(process exit, refused connection) or hangs is marked dead; its unfinished requests are issued
again elsewhere, and it is restarted if we launched it. Hung means no sign of life (a health
probe answered, a request completed) for ``health_timeout_s``; a server that came up but has
not completed a request yet is still warming up, on a busy machine slowly, and is governed by
``startup_timeout_s`` like its start, so that a slow fresh server is not killed and restarted
over and over. Every request's result is stored once, by its index, so no sample is lost or
duplicated. Retries and restarts are bounded (``max_retries``); the error then names the server
and the tail of its log. An answer the engine's parser calls aborted (``RequestAborted``) is
issued again, or resumed from its partial output (partial.py).

``run_in_background()`` gives the pool one event loop in a thread of its own that runs every
call, from any thread: a rollout can be in flight while another thread pushes weights.
``drained()`` (around each weight sync) lets no request start and waits until those in flight
have finished, so each completion comes from the weights its server held when it was sent; with
``inflight_at_sync = "abort"`` it first aborts ours, which then resume (partial.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import aiohttp

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.base import Completion
from megatron_entropy.rollout.server.errors import RequestRejected, ServerError
from megatron_entropy.rollout.server.partial import AbortApi, RequestAborted, join_completions
from megatron_entropy.rollout.server.process import (LaunchCommand, free_port,
                                                     kill_process_group, log_tail,
                                                     parse_extra_env, port_is_free,
                                                     start_process)
from megatron_entropy.runtime.launch_env import read_urls_file

log = logging.getLogger(__name__)

ParseResponse = Callable[[Any, "Server"], Any]


class _ServerDied(Exception):
    pass


@dataclass
class Server:
    """One server as the pool sees it: where it is, its process (if launched), its state, the
    weights it holds, and its metrics."""

    url: str
    index: int
    launched: bool = False
    port: int = 0
    process: Optional[subprocess.Popen] = None
    log_path: Optional[Path] = None
    state: str = "up"  # up | starting | dead
    weight_version: Optional[str] = None  # what the server holds, as far as we know
    inflight: int = 0
    restarts: int = 0
    last_error: str = ""
    probe_error: str = ""  # what the last failed health probe saw, in words
    # Liveness (time.monotonic()): when it last came up, its last sign of life (came up, answered
    # a probe, completed a request), and whether it has completed a request since it came up.
    up_at: float = 0.0
    alive_at: float = 0.0
    warm: bool = False
    # Metrics since the last ``ServerPool.pop_metrics``.
    requests: int = 0
    failures: int = 0
    latency_s: float = 0.0
    died: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def describe(self) -> str:
        where = f"server {self.index} ({self.url}"
        if self.process is not None:
            where += f", pid {self.process.pid}"
        where += ")"
        if self.log_path is not None:
            where += f"; log {self.log_path}"
        return where


class ServerPool:
    """Servers of one engine: the configured URLs, plus ``launch`` servers it starts (and
    restarts) itself, with their logs in ``run_dir/servers/``."""

    def __init__(self, cfg: ServerConfig, run_dir: str | Path, kind: str, model_dir: str,
                 launch_command: LaunchCommand, env: Optional[dict[str, str]] = None,
                 health_path: str = "/health"):
        self.cfg = cfg
        self.kind = kind
        self.model_dir = model_dir  # folder a (re)started server loads: the latest weights
        self.launch_command = launch_command
        self.env = {**(env or {}), **parse_extra_env(cfg.extra_env)}
        self.health_path = health_path
        self.dir = Path(run_dir) / "servers"
        self.dir.mkdir(parents=True, exist_ok=True)
        # The weight version every dispatched request must be served with (None: any).
        self.expected_version: Optional[str] = None
        self.servers: list[Server] = []
        # The version a freshly launched server holds: the engine moves it with disk syncs.
        self.launch_version: Optional[str] = None
        self.retries = 0
        self.aborted = 0  # completions answered as aborted, and issued again
        # "abort": drained() aborts our requests in flight, which then resume (engines that
        # give ``aborts``); "finish": they finish on the weights they started with.
        self.inflight_at_sync = "finish"
        self.aborts: Optional[AbortApi] = None
        self.resumed = 0  # aborted requests resumed from their partial output
        self._request_ids = itertools.count()
        self._id_base = f"me-{os.getpid()}-{id(self):x}"
        self._inflight_ids: dict[str, Server] = {}  # our request id -> the server running it
        self._aborting: set[str] = set()  # ids drained() aborted
        self._cond: Optional[asyncio.Condition] = None
        self._tasks: set[asyncio.Future] = set()
        # run_in_background(): the loop every call runs on, and its thread.
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._loop_thread: Optional[threading.Thread] = None
        self._gate_open = True  # closed by drained(): no request starts
        # Requests in flight on all servers; seconds with at least one (since pop_metrics).
        self._inflight_total = 0
        self._busy_since: Optional[float] = None
        self._busy_s = 0.0
        self._stopped = False  # stop() was called: no call runs, no server starts again
        self.drain_wait_s = 0.0  # seconds drained() waited for requests in flight, in all

    # ------------------------------------------------------------------------- life cycle

    def start(self) -> None:
        """Launch the ``launch`` servers and wait until every server answers. When one does
        not, the servers launched so far are stopped before the error goes up: none outlives a
        pool that failed to start."""
        cfg = self.cfg
        urls = list(cfg.urls) + (read_urls_file(cfg.urls_file) if cfg.urls_file else [])
        self.servers = [Server(url=u.rstrip("/"), index=i) for i, u in enumerate(urls)]
        try:
            taken: set[int] = set()
            for k in range(cfg.launch):
                port = free_port(cfg.host, cfg.base_port + k, taken)
                taken.add(port)
                server = Server(url=f"http://{cfg.host}:{port}", index=len(self.servers),
                                launched=True, port=port, state="dead",
                                log_path=self.dir / f"{self.kind}-{k}.log")
                self.servers.append(server)
                self._launch(server)
            if not self.servers:
                raise ServerError("no rollout servers: set rollout.server.urls, urls_file or "
                                  "launch")
            self._run(self._wait_all_up(self.cfg.startup_timeout_s))
        except BaseException:
            self.stop()
            raise

    def _launch(self, server: Server) -> None:
        why = (f"restart {server.restarts} of at most {self.cfg.max_retries}, after: "
               f"{server.last_error}" if server.restarts else "restart 0")
        server.process = start_process(self.launch_command(server.port, self.model_dir),
                                       self.env, server.log_path, why, server.describe())
        server.state = "starting"
        server.died = asyncio.Event()

    def run_in_background(self) -> None:
        """From now on every call runs on one event loop in a thread of its own, so calls from
        different threads (a rollout, a weight sync) run concurrently; ``stop`` ends it."""
        if self._loop is not None:
            return
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._loop_thread = threading.Thread(target=loop.run_forever, name=f"{self.kind}-pool",
                                             daemon=True)
        self._loop_thread.start()

    def _stop_loop(self) -> None:
        """Cancel whatever runs on the background loop (a caller blocked on it gets
        CancelledError) and end its thread."""
        loop, thread = self._loop, self._loop_thread
        if loop is None or thread is None:
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            asyncio.run_coroutine_threadsafe(cancel_all(), loop).result(timeout=30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        if not thread.is_alive():
            loop.close()
        self._loop = self._loop_thread = None

    def stop(self) -> None:
        self._stopped = True
        self._stop_loop()
        for server in self.servers:
            if server.launched:
                kill_process_group(server.process)
                server.state = "dead"

    # ------------------------------------------------------------------------------ health

    async def _probe(self, session: aiohttp.ClientSession, server: Server) -> str:
        """"up" (answered 200), "dead" (exited, nothing listens, or an error answer) or "silent"
        (no answer within health_timeout_s: hung, or only busy). A failed probe leaves what it
        saw in ``server.probe_error``."""
        if server.process is not None and server.process.poll() is not None:
            server.probe_error = f"process exited with code {server.process.returncode}"
            return "dead"
        url = server.url + self.health_path
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(
                    total=self.cfg.health_timeout_s)) as r:
                status, text = r.status, (await r.text())[:300]
        except (aiohttp.ClientConnectorError, ConnectionRefusedError) as e:
            cause = getattr(e, "os_error", e)
            # Reset while connecting: the listening socket closed under us (a server exiting).
            gone = {ConnectionRefusedError: "refused", ConnectionResetError: "reset"}
            how = next((w for kind, w in gone.items() if isinstance(cause, kind)), None)
            server.probe_error = (f"connection {how} at {server.url}: nothing listens there"
                                  if how else f"cannot connect to {server.url}: {cause}")
            return "dead"
        except asyncio.TimeoutError:
            server.probe_error = f"GET {url} unanswered for {self.cfg.health_timeout_s:g} s"
            return "silent"
        except (aiohttp.ClientError, OSError) as e:
            server.probe_error = f"GET {url} failed: {type(e).__name__}: {e}"
            return "silent"
        if status != 200:
            server.probe_error = f"GET {url} answered HTTP {status}: {text}"
            return "dead"
        server.alive_at = time.monotonic()
        server.probe_error = ""
        return "up"

    def _hung(self, server: Server) -> bool:
        """No sign of life for health_timeout_s; before its first completed request a server is
        still warming up and gets until startup_timeout_s after it came up."""
        now = time.monotonic()
        if now - server.alive_at <= self.cfg.health_timeout_s:
            return False
        return server.warm or now - server.up_at > self.cfg.startup_timeout_s

    def _why_dead(self, server: Server, probe: str) -> Optional[str]:
        """Why a server that was up is dead after a probe, or None while it still counts as up."""
        if server.process is not None and server.process.poll() is not None:
            return f"exited with code {server.process.returncode}"
        if probe == "dead":
            return f"failed its health probe ({server.probe_error})"
        if probe == "silent" and self._hung(server):
            return (f"no sign of life for {time.monotonic() - server.alive_at:.0f} s "
                    f"({server.probe_error}; no request completed)")
        return None

    async def _wait_up(self, session: aiohttp.ClientSession, server: Server,
                       timeout: float) -> None:
        """Poll a starting server until it answers; a clear error with its log tail if not."""
        deadline = time.monotonic() + timeout
        while True:
            if server.process is not None and server.process.poll() is not None:
                self._mark_dead(server, f"exited with code {server.process.returncode} while "
                                        "starting")
                raise ServerError(f"{server.describe()} {server.last_error}; log tail:\n"
                                  f"{log_tail(server.log_path)}")
            if await self._probe(session, server) == "up":
                server.state = "up"
                server.up_at, server.warm = server.alive_at, False
                server.died = asyncio.Event()
                if server.launched:
                    server.weight_version = self.launch_version
                self._notify()
                return
            if time.monotonic() > deadline:
                self._mark_dead(server, f"not healthy after {timeout:.0f} s: "
                                        f"{server.probe_error or 'no answer'}")
                if server.launched:
                    kill_process_group(server.process, grace_s=2.0)
                raise ServerError(f"{server.describe()} {server.last_error}; log tail:\n"
                                  f"{log_tail(server.log_path)}")
            await asyncio.sleep(0.5)

    async def _wait_all_up(self, timeout: float) -> None:
        async with aiohttp.ClientSession() as session:
            waits = [self._wait_up(session, s, timeout) for s in self.servers
                     if s.state != "up" or not s.launched]
            results = await asyncio.gather(*waits, return_exceptions=True)
        errors = [str(e) for e in results if isinstance(e, BaseException)]
        if errors:
            raise ServerError(f"{len(errors)} of {len(self.servers)} {self.kind} servers did not "
                              "come up:\n" + "\n".join(errors))

    def ensure_up(self) -> None:
        """Before a rollout or an update: restart launched servers that died, re-probe dropped
        ones, and wait for those still starting (each bounded by ``startup_timeout_s``)."""
        async def go() -> None:
            async with aiohttp.ClientSession() as session:
                for server in self.servers:
                    if server.state == "up":
                        why = self._why_dead(server, await self._probe(session, server))
                        if why:
                            self._mark_dead(server, why)
                    if server.state == "dead" and server.launched:
                        self._restart(server)
                waits = []
                for server in self.servers:
                    if server.state == "starting":
                        waits.append(self._wait_up(session, server, self.cfg.startup_timeout_s))
                    elif server.state == "dead" and not server.launched:
                        if await self._probe(session, server) == "up":  # back, unknown weights
                            server.state, server.weight_version = "up", None
                            server.up_at, server.warm = server.alive_at, False
                results = await asyncio.gather(*waits, return_exceptions=True)
            if all(s.state != "up" for s in self.servers):
                raise ServerError(f"no {self.kind} server is up:\n" + self._status()) from next(
                    (e for e in results if isinstance(e, BaseException)), None)
        self._run(go())

    def _status(self) -> str:
        return "\n".join(f"  {s.describe()}: {s.state}, weights {s.weight_version}"
                         + (f" ({s.last_error})" if s.last_error else "") for s in self.servers)

    def _mark_dead(self, server: Server, why: str) -> None:
        if server.state != "dead":
            server.state = "dead"
            server.last_error = why
            server.died.set()
            self._notify()

    def _restart(self, server: Server) -> bool:
        """Launch a dead server again, at most ``max_retries`` times over the run."""
        if server.restarts >= self.cfg.max_retries or self._stopped:
            return False
        kill_process_group(server.process, grace_s=2.0)
        server.restarts += 1
        if server.port and not port_is_free(self.cfg.host, server.port):
            server.port = free_port(self.cfg.host, server.port + 1, set())
            server.url = f"http://{self.cfg.host}:{server.port}"
        self._launch(server)
        return True

    # ---------------------------------------------------------------------------- dispatch

    def _notify(self) -> None:
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
        return (self._gate_open and server.state == "up"
                and server.inflight < self.cfg.max_concurrency and self.serves_current(server))

    async def _acquire(self, targets: list[Server]) -> Server:
        assert self._cond is not None
        async with self._cond:
            while True:
                usable = [s for s in targets if self._usable(s)]
                if usable:
                    server = min(usable, key=lambda s: (s.inflight, s.index))
                    server.inflight += 1
                    if self._inflight_total == 0:
                        self._busy_since = time.monotonic()
                    self._inflight_total += 1
                    return server
                if self._gate_open and not any(
                        s.state == "starting" or (s.state == "up" and self.serves_current(s))
                        for s in targets):
                    raise ServerError(f"no {self.kind} server with weight version "
                                      f"{self.expected_version} left to send requests to:\n"
                                      + self._status())
                await self._cond.wait()

    async def _release(self, server: Server) -> None:
        assert self._cond is not None
        async with self._cond:
            server.inflight -= 1
            self._inflight_total -= 1
            if self._inflight_total == 0 and self._busy_since is not None:
                self._busy_s += time.monotonic() - self._busy_since
                self._busy_since = None
            self._cond.notify_all()

    async def _post(self, session: aiohttp.ClientSession, server: Server, path: str,
                    payload: dict, timeout: float) -> Any:
        async with session.post(server.url + path, json=payload,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            text = await r.text()
            if 400 <= r.status < 500:
                raise RequestRejected(f"{server.describe()} rejected POST {path} with HTTP "
                                      f"{r.status}: {text[:2000]}")
            if r.status != 200:
                raise aiohttp.ClientResponseError(r.request_info, (), status=r.status,
                                                  message=text[:2000])
            try:
                return await r.json(content_type=None)
            except ValueError:
                return text

    async def _one(self, session: aiohttp.ClientSession, index: int, path: str, payload: dict,
                   parse: ParseResponse, targets: list[Server]) -> Any:
        attempts = 0
        body = payload  # what is sent: the payload, or the rest of a sample after ``prefix``
        prefix: Optional[Completion] = None  # what aborts at weight pushes left of the sample
        while True:
            server = await self._acquire(targets)
            rid = None  # our id for the request: only when a push may abort it
            if self.aborts is not None and self.inflight_at_sync == "abort":
                rid = f"{self._id_base}-{next(self._request_ids)}"
                self._inflight_ids[rid] = server
            t0 = time.monotonic()
            died = asyncio.ensure_future(server.died.wait())
            http = asyncio.ensure_future(self._post(
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
                ours = rid in self._aborting  # aborted by our own drained(), not a fault
                if not ours:
                    attempts += 1
                    self.retries += 1
                    self.aborted += 1
                if (self.inflight_at_sync == "abort" and self.aborts is not None
                        and e.partial is not None):
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
                await self._on_failure(session, server, why)
                if attempts > self.cfg.max_retries:
                    raise ServerError(
                        f"request {index} failed {attempts} times; last on {server.describe()}: "
                        f"{why}; log tail:\n{log_tail(server.log_path)}") from e
            finally:
                died.cancel()
                if not http.done():
                    http.cancel()
                if rid is not None:
                    self._inflight_ids.pop(rid, None)
                    self._aborting.discard(rid)
                await self._release(server)

    async def _on_failure(self, session: aiohttp.ClientSession, server: Server,
                          why: str) -> None:
        if server.state != "up":
            return
        probe = "dead" if server.process is not None and server.process.poll() is not None \
            else await self._probe(session, server)
        if server.state != "up":
            return  # another failed request handled it while we probed
        dead = self._why_dead(server, probe)
        if dead is None:
            return  # a transient error (or only busy): the request is simply retried
        self._mark_dead(server, f"{dead}; a request failed with {why}")
        self._restart_in_background(session, server)

    def _restart_in_background(self, session: aiohttp.ClientSession, server: Server) -> None:
        if not (server.launched and self._restart(server)):
            return

        async def wait() -> None:
            try:
                await self._wait_up(session, server, self.cfg.startup_timeout_s)
            except ServerError:
                self._notify()
        self._tasks.add(asyncio.ensure_future(wait()))

    async def _monitor(self, session: aiohttp.ClientSession, targets: list[Server]) -> None:
        """Notice servers that die or hang while requests wait on them."""
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            busy = [s for s in targets if s.state == "up" and s.inflight > 0]
            probes = await asyncio.gather(*(self._probe(session, s) for s in busy))
            for server, probe in zip(busy, probes):
                why = self._why_dead(server, probe) if server.state == "up" else None
                if why:
                    self._mark_dead(server, why)
                    self._restart_in_background(session, server)

    def map(self, path: str, payloads: list[dict], parse: ParseResponse,
            targets: Optional[list[Server]] = None) -> list[Any]:
        """POST every payload to ``path`` on the servers, concurrently; results in order."""
        if not payloads:
            return []
        return self._run(self._map(path, payloads, parse, targets))

    async def _map(self, path: str, payloads: list[dict], parse: ParseResponse,
                   targets: Optional[list[Server]]) -> list[Any]:
        targets = self.servers if targets is None else targets
        # The first map on a loop sets up the dispatch state; one running beside it (on the
        # background loop) shares it.
        first = self._cond is None
        if first:
            self._cond = asyncio.Condition()
            self._tasks = set()
            for server in targets:  # events belong to one loop: fresh ones for this run
                server.died = asyncio.Event()
                if server.state == "dead":
                    server.died.set()
        connector = aiohttp.TCPConnector(limit=self.cfg.max_connections)
        async with aiohttp.ClientSession(connector=connector) as session:
            monitor = asyncio.ensure_future(self._monitor(session, targets))
            jobs = [asyncio.ensure_future(self._one(session, i, path, p, parse, targets))
                    for i, p in enumerate(payloads)]
            try:
                return await asyncio.gather(*jobs)
            finally:
                owned = [monitor, *jobs, *(self._tasks if first else ())]
                for task in owned:
                    task.cancel()
                await asyncio.gather(*owned, return_exceptions=True)
                if first:
                    self._cond = None

    # ------------------------------------------------------------------------ control plane

    def call_all(self, path: str, payload: Optional[dict] = None, method: str = "POST",
                 timeout: Optional[float] = None, targets: Optional[list[Server]] = None
                 ) -> dict[int, Any]:
        """One control request (weight update, pause, ...) to each target server, concurrently.
        A server that dies under it (its process exited, nothing listens) is marked dead and
        left out of the answers, as a rollout drops it, while another server is still up;
        otherwise raises one ServerError naming every server that failed."""
        return self._run(self._call_all(path, payload, method, timeout, targets))

    def call_all_async(self, path: str, payload: Optional[dict] = None, method: str = "POST",
                       timeout: Optional[float] = None, targets: Optional[list[Server]] = None
                       ) -> concurrent.futures.Future:
        """``call_all`` in a background thread, for calls that block until this process acts
        (joining a process group, broadcasting tensors)."""
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        future = pool.submit(self.call_all, path, payload, method, timeout, targets)
        pool.shutdown(wait=False)
        return future

    async def _call_all(self, path: str, payload: Optional[dict], method: str,
                        timeout: Optional[float], targets: Optional[list[Server]]
                        ) -> dict[int, Any]:
        targets = [s for s in (self.servers if targets is None else targets)
                   if s.state == "up"]
        timeout = timeout or self.cfg.request_timeout_s

        async def one(session: aiohttp.ClientSession, server: Server) -> Any:
            try:
                if method == "POST":
                    return await self._post(session, server, path, payload or {}, timeout)
                async with session.get(server.url + path,
                                       timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise ServerError(f"{server.describe()}: GET {path} -> HTTP {r.status}: "
                                          f"{text[:2000]}")
                    try:
                        return await r.json(content_type=None)
                    except ValueError:
                        return text
            except ServerError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                # Did it die under the call? Say so (connected servers have no log here).
                probe = await self._probe(session, server)
                after = ("it still answers its health probe" if probe == "up" else
                         f"afterwards: {server.probe_error}")
                error = ServerError(f"{server.describe()}: {method} {path} failed: "
                                    f"{type(e).__name__}: {e} ({after}); log tail:\n"
                                    f"{log_tail(server.log_path)}")
                why = self._why_dead(server, probe)
                if why:
                    self._mark_dead(server, f"{why}; {method} {path} failed")
                raise error from e

        async with aiohttp.ClientSession() as session:
            results = await asyncio.gather(*(one(session, s) for s in targets),
                                           return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        gone = [s for s, r in zip(targets, results)
                if isinstance(r, BaseException) and s.state == "dead"]
        if failures and len(gone) == len(failures) and any(s.state == "up"
                                                           for s in self.servers):
            # Only servers that died under the call failed: the others go on without them (a
            # launched one restarts from the newest weights at the next ensure_up).
            for server in gone:
                log.warning("%s died under %s %s and is left out: %s", server.describe(),
                            method, path, server.last_error)
            return {s.index: r for s, r in zip(targets, results)
                    if not isinstance(r, BaseException)}
        if failures:
            # Every server refused the request itself (4xx): say so by the type.
            kind = (RequestRejected if all(isinstance(r, RequestRejected) for r in failures)
                    else ServerError)
            raise kind(f"{path} failed on {len(failures)} of {len(targets)} {self.kind} "
                       "servers:\n" + "\n".join(str(r) for r in failures))
        return {s.index: r for s, r in zip(targets, results)}

    @contextlib.contextmanager
    def drained(self) -> Iterator[None]:
        """For the body (a weight sync): no request starts, and those in flight (a rollout
        running in another thread) have finished, on the weights they started with."""
        self._run(self._close_gate())
        try:
            yield
        finally:
            self._run(self._open_gate())

    ABORT_AGAIN_S = 1.0  # an abort that found no request (not there yet) is sent again

    async def _close_gate(self) -> None:
        self._gate_open = False
        started = time.monotonic()
        abort = self.inflight_at_sync == "abort" and self.aborts is not None
        sent_at = -self.ABORT_AGAIN_S
        while self._inflight_total > 0:
            if abort and time.monotonic() - sent_at >= self.ABORT_AGAIN_S:
                sent_at = time.monotonic()
                await self._abort_ours()
            await asyncio.sleep(0.02)
        self.drain_wait_s += time.monotonic() - started

    async def _abort_ours(self) -> None:
        """Abort our requests in flight, each on its server (theirs are left alone). A failed
        call is only logged: a server that died fails its requests, which are issued again."""
        by_server: dict[int, tuple[Server, list[str]]] = {}
        for rid, server in list(self._inflight_ids.items()):
            by_server.setdefault(server.index, (server, []))[1].append(rid)
            self._aborting.add(rid)
        async with aiohttp.ClientSession() as session:
            calls = [self._post(session, server, path, body, self.cfg.health_timeout_s)
                     for server, rids in by_server.values()
                     for path, body in self.aborts.abort_calls(rids)]
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, BaseException):
                    log.warning("aborting our requests before a weight push failed: %s: %s",
                                type(result).__name__, str(result).splitlines()[0][:300])

    async def _open_gate(self) -> None:
        self._gate_open = True
        if self._cond is not None:
            async with self._cond:
                self._cond.notify_all()

    @contextlib.contextmanager
    def paused(self, pause: tuple[str, Optional[dict]], resume: tuple[str, Optional[dict]],
               targets: list[Server]) -> Iterator[None]:
        """Pause ``targets`` (path, payload) for the body, then resume them. When the body
        fails, its error is what is raised: a resume that then fails too (the server died under
        the body) is only added to it as a note."""
        self.call_all(pause[0], pause[1], targets=targets)
        try:
            yield
        except BaseException as first:
            try:
                self.call_all(resume[0], resume[1], targets=targets)
            except ServerError as e:
                first.add_note(f"then {resume[0]} failed too: {str(e).splitlines()[0]}")
            raise
        self.call_all(resume[0], resume[1], targets=targets)

    # ----------------------------------------------------------------------------- metrics

    def pop_metrics(self) -> dict[str, float]:
        out: dict[str, float] = {"rollout/retries": float(self.retries),
                                 "rollout/aborted_reissued": float(self.aborted),
                                 "rollout/aborted_resumed": float(self.resumed),
                                 "rollout/servers_up": float(sum(s.state == "up"
                                                                 for s in self.servers)),
                                 "rollout/server_restarts": float(sum(s.restarts
                                                                      for s in self.servers))}
        for s in self.servers:
            if s.requests:
                out[f"rollout/server{s.index}/latency_s"] = s.latency_s / s.requests
                out[f"rollout/server{s.index}/requests"] = float(s.requests)
            if s.failures:
                out[f"rollout/server{s.index}/failures"] = float(s.failures)
            s.requests, s.latency_s, s.failures = 0, 0.0, 0
        self.retries = self.aborted = self.resumed = 0
        now = time.monotonic()
        busy, self._busy_s = self._busy_s, 0.0
        if self._busy_since is not None:
            busy += now - self._busy_since
            self._busy_since = now
        out["rollout/engine_busy_s"] = busy
        return out

    def _run(self, coro: Any) -> Any:
        """Run a coroutine to completion from sync code: on the background loop when there is
        one, else here (also when a loop already runs here)."""
        if self._stopped:
            coro.close()
            raise ServerError(f"the {self.kind} servers were stopped")
        if self._loop is not None:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, coro).result()
