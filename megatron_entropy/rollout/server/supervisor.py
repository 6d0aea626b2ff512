"""The life of an engine's servers: launched (process.py) or connected, probed for health,
marked dead, restarted, stopped.

Hung means no sign of life (a health probe answered, a request completed) for
``health_timeout_s``; a server that came up but has not completed a request yet is still
warming up, on a busy machine slowly, and is governed by ``startup_timeout_s`` like its start,
so that a slow fresh server is not killed and restarted over and over. Restarts are bounded
(``max_retries``); the error then names the server and its log, whose tail is logged. Every
error is one line.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import aiohttp

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.server.errors import ServerError
from megatron_entropy.rollout.server.eventloop import EventLoopRunner
from megatron_entropy.rollout.server.process import (LaunchCommand, free_port,
                                                     kill_process_group, log_tail,
                                                     parse_extra_env, port_is_free,
                                                     start_orphan_watch, start_process)
from megatron_entropy.runtime.launch_env import read_urls_file

log = logging.getLogger(__name__)

PROGRESS_S = 30.0  # a wait on servers says what it waits for at least this often


async def say_progress(say: Callable[[float], None]) -> None:
    """Until cancelled, ``say(seconds waited)`` every PROGRESS_S: what a wait on servers runs
    beside it, so that no wait is silent."""
    started = time.monotonic()
    while True:
        await asyncio.sleep(PROGRESS_S)
        say(time.monotonic() - started)


@dataclass
class Server:
    """One server as the pool sees it: where it is, its process (if launched), its state, the
    weights it holds, and its metrics."""

    url: str
    index: int
    launched: bool = False
    port: int = 0
    process: Optional[subprocess.Popen] = None
    # orphan_watch.py beside a launched server: stops it if this process is killed hard.
    watcher: Optional[subprocess.Popen] = None
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


class Supervisor:
    """The configured URLs, plus ``launch`` servers it starts (and restarts) itself, with their
    logs in ``run_dir/servers/``; ``on_change`` is called when a server comes up or dies."""

    def __init__(self, cfg: ServerConfig, run_dir: str | Path, kind: str, model_dir: str,
                 launch_command: LaunchCommand, env: Optional[dict[str, str]],
                 health_path: str, runner: EventLoopRunner):
        self.cfg = cfg
        self.kind = kind
        self.model_dir = model_dir  # folder a (re)started server loads: the latest weights
        self.launch_command = launch_command
        # The engine's own (built from extra_env), or extra_env as it is.
        self.env = parse_extra_env(cfg.extra_env) if env is None else env
        self.health_path = health_path
        self.dir = Path(run_dir) / "servers"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.runner = runner
        self.servers: list[Server] = []
        # The version a freshly launched server holds: the engine moves it with disk syncs.
        self.launch_version: Optional[str] = None
        self.on_change: Callable[[], None] = lambda: None
        # Restarts waited for in the background, owned by the rollout running now.
        self.tasks: set[asyncio.Future] = set()

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
            self.runner.run(self._wait_all_up(self.cfg.startup_timeout_s))
        except BaseException:
            self.stop()
            raise

    def _launch(self, server: Server) -> None:
        why = (f"restart {server.restarts} of at most {self.cfg.max_retries}, after: "
               f"{server.last_error}" if server.restarts else "restart 0")
        server.process = start_process(self.launch_command(server.port, self.model_dir),
                                       self.env, server.log_path, why, server.describe())
        server.watcher = start_orphan_watch(server.process, server.log_path)
        server.state = "starting"
        server.died = asyncio.Event()

    def stop(self) -> None:
        self.runner.stop()
        for server in self.servers:
            if server.launched:
                self._kill(server)
                server.state = "dead"

    @staticmethod
    def _kill(server: Server, grace_s: float = 10.0) -> None:
        """Stop a launched server's process group, then its orphan watch (whose work is done)."""
        kill_process_group(server.process, grace_s=grace_s)
        if server.watcher is not None:
            server.watcher.kill()
            server.watcher.wait()

    # ------------------------------------------------------------------------------ health

    async def probe(self, session: aiohttp.ClientSession, server: Server) -> str:
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

    def why_dead(self, server: Server, probe: str) -> Optional[str]:
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
        """Poll a starting server until it answers; a clear error (its log tail logged) if not.
        A server we did not launch should already serve: when nothing listens there (or it
        answers with an error) for ``health_timeout_s`` it is dead, not starting. Says what it
        waits for at the first failed probe and every ``PROGRESS_S`` after."""
        started = time.monotonic()
        deadline = started + timeout
        dead_since: Optional[float] = None
        told = -PROGRESS_S
        while True:
            if server.process is not None and server.process.poll() is not None:
                self.mark_dead(server, f"exited with code {server.process.returncode} while "
                                       "starting")
                self.log_tail(server)
                raise ServerError(f"{server.describe()} {server.last_error}")
            probe = await self.probe(session, server)
            if probe == "up":
                server.state = "up"
                server.up_at, server.warm = server.alive_at, False
                server.died = asyncio.Event()
                if server.launched:
                    server.weight_version = self.launch_version
                self.on_change()
                return
            now = time.monotonic()
            dead_since = (dead_since or now) if probe == "dead" else None
            if not server.launched and dead_since is not None \
                    and now - dead_since >= self.cfg.health_timeout_s:
                self.mark_dead(server, f"is not serving: {server.probe_error} for "
                                       f"{now - dead_since:.0f} s (rollout.server."
                                       "health_timeout_s)")
                raise ServerError(f"{server.describe()} {server.last_error}")
            if now > deadline:
                self.mark_dead(server, f"not healthy after {timeout:.0f} s: "
                                       f"{server.probe_error or 'no answer'}")
                if server.launched:
                    self._kill(server, grace_s=2.0)
                self.log_tail(server)
                raise ServerError(f"{server.describe()} {server.last_error}")
            if now - told >= PROGRESS_S:
                told = now
                log.warning("waiting for %s to answer %s: %.0f s of at most %.0f s (%s)",
                            server.describe(), self.health_path, now - started, timeout,
                            server.probe_error or "no answer yet")
            await asyncio.sleep(0.5)

    async def _wait_all_up(self, timeout: float) -> None:
        async with aiohttp.ClientSession() as session:
            waits = [self._wait_up(session, s, timeout) for s in self.servers
                     if s.state != "up" or not s.launched]
            results = await asyncio.gather(*waits, return_exceptions=True)
        errors = [str(e) for e in results if isinstance(e, BaseException)]
        if errors:
            raise ServerError(f"{len(errors)} of {len(self.servers)} {self.kind} servers did not "
                              "come up: " + "; ".join(errors))

    def ensure_up(self) -> None:
        """Before a rollout or an update: restart launched servers that died, re-probe dropped
        ones, and wait for those still starting (each bounded by ``startup_timeout_s``)."""
        async def go() -> None:
            async with aiohttp.ClientSession() as session:
                for server in self.servers:
                    if server.state == "up":
                        why = self.why_dead(server, await self.probe(session, server))
                        if why:
                            self.mark_dead(server, why)
                    if server.state == "dead" and server.launched:
                        self._restart(server)
                waits = []
                for server in self.servers:
                    if server.state == "starting":
                        waits.append(self._wait_up(session, server, self.cfg.startup_timeout_s))
                    elif server.state == "dead" and not server.launched:
                        if await self.probe(session, server) == "up":  # back, unknown weights
                            server.state, server.weight_version = "up", None
                            server.up_at, server.warm = server.alive_at, False
                results = await asyncio.gather(*waits, return_exceptions=True)
            if all(s.state != "up" for s in self.servers):
                raise ServerError(f"no {self.kind} server is up: {self.status()}") from next(
                    (e for e in results if isinstance(e, BaseException)), None)
        self.runner.run(go())

    def status(self) -> str:
        """Every server's state, on one line (errors that quote it stay one line)."""
        return "; ".join(f"{s.describe()}: {s.state}, weights {s.weight_version}"
                         + (f" ({s.last_error})" if s.last_error else "") for s in self.servers)

    def log_tail(self, server: Server) -> None:
        """The end of a launched server's log, into the trainer's log: errors stay one line and
        name the log file (``Server.describe``)."""
        tail = log_tail(server.log_path)
        if tail:
            log.error("last lines of %s:\n%s", server.log_path, tail)

    def mark_dead(self, server: Server, why: str) -> None:
        if server.state != "dead":
            server.state = "dead"
            server.last_error = why
            server.died.set()
            self.on_change()

    def _restart(self, server: Server) -> bool:
        """Launch a dead server again, at most ``max_retries`` times over the run."""
        if server.restarts >= self.cfg.max_retries or self.runner.stopped:
            return False
        self._kill(server, grace_s=2.0)
        server.restarts += 1
        if server.port and not port_is_free(self.cfg.host, server.port):
            server.port = free_port(self.cfg.host, server.port + 1, set())
            server.url = f"http://{self.cfg.host}:{server.port}"
        self._launch(server)
        return True

    def restart_in_background(self, session: aiohttp.ClientSession, server: Server) -> None:
        if not (server.launched and self._restart(server)):
            return

        async def wait() -> None:
            try:
                await self._wait_up(session, server, self.cfg.startup_timeout_s)
            except ServerError:
                self.on_change()
        self.tasks.add(asyncio.ensure_future(wait()))

    async def on_failure(self, session: aiohttp.ClientSession, server: Server,
                         why: str) -> None:
        """A request to ``server`` failed with ``why``: dead (marked so, restarted if launched)
        or a transient error (the request is simply retried)?"""
        if server.state != "up":
            return
        probe = "dead" if server.process is not None and server.process.poll() is not None \
            else await self.probe(session, server)
        if server.state != "up":
            return  # another failed request handled it while we probed
        dead = self.why_dead(server, probe)
        if dead is None:
            return
        self.mark_dead(server, f"{dead}; a request failed with {why}")
        self.restart_in_background(session, server)

    async def monitor(self, session: aiohttp.ClientSession, targets: list[Server]) -> None:
        """Notice servers that die or hang while requests wait on them."""
        while True:
            await asyncio.sleep(self.cfg.health_check_interval_s)
            busy = [s for s in targets if s.state == "up" and s.inflight > 0]
            probes = await asyncio.gather(*(self.probe(session, s) for s in busy))
            for server, probe in zip(busy, probes):
                why = self.why_dead(server, probe) if server.state == "up" else None
                if why:
                    self.mark_dead(server, why)
                    self.restart_in_background(session, server)
