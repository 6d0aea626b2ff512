"""Control calls to an engine's servers (weight updates, pause and resume, cache flushes), sent
to each target server at once, and the pause gate around weight syncs.

``drained()`` (around each weight sync) lets no request start and waits until those in flight
have finished, so each completion comes from the weights its server held when it was sent; with
``inflight_at_sync = "abort"`` it first aborts ours, which then resume (partial.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from typing import Any, Iterator, Optional

import aiohttp

from megatron_entropy.rollout.server.dispatch import Dispatcher, post
from megatron_entropy.rollout.server.errors import RequestRejected, ServerError, one_line
from megatron_entropy.rollout.server.supervisor import (PROGRESS_S, Server, Supervisor,
                                                        say_progress)

log = logging.getLogger(__name__)


class ControlPlane:
    """Fan-out control calls and the pause gate over the supervisor's servers."""

    def __init__(self, supervisor: Supervisor, dispatch: Dispatcher) -> None:
        self.sup = supervisor
        self.dispatch = dispatch
        self.cfg = supervisor.cfg
        self.drain_wait_s = 0.0  # seconds drained() waited for requests in flight, in all

    def call_all(self, path: str, payload: Optional[dict] = None, method: str = "POST",
                 timeout: Optional[float] = None, targets: Optional[list[Server]] = None
                 ) -> dict[int, Any]:
        """One control request (weight update, pause, ...) to each target server, concurrently.
        A server that dies under it (its process exited, nothing listens) is marked dead and
        left out of the answers, as a rollout drops it, while another server is still up;
        otherwise raises one ServerError naming every server that failed."""
        return self.sup.runner.run(self._call_all(path, payload, method, timeout, targets))

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
        targets = [s for s in (self.sup.servers if targets is None else targets)
                   if s.state == "up"]
        timeout = timeout or self.cfg.request_timeout_s

        async def one(session: aiohttp.ClientSession, server: Server) -> Any:
            try:
                if method == "POST":
                    return await post(session, server, path, payload or {}, timeout)
                async with session.get(server.url + path,
                                       timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                    text = await r.text()
                    if r.status != 200:
                        raise ServerError(f"{server.describe()}: GET {path} -> HTTP {r.status}: "
                                          f"{one_line(text)}")
                    try:
                        return await r.json(content_type=None)
                    except ValueError:
                        return text
            except ServerError:
                raise
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                # Did it die under the call? Say so (connected servers have no log here).
                probe = await self.sup.probe(session, server)
                after = ("it still answers its health probe" if probe == "up" else
                         f"afterwards: {server.probe_error}")
                self.sup.log_tail(server)
                error = ServerError(f"{server.describe()}: {method} {path} failed: "
                                    f"{type(e).__name__}: {e} ({after})")
                why = self.sup.why_dead(server, probe)
                if why:
                    self.sup.mark_dead(server, f"{why}; {method} {path} failed")
                raise error from e

        async with aiohttp.ClientSession() as session:
            calls = [asyncio.ensure_future(one(session, s)) for s in targets]
            # A weight update of a large model takes minutes: say what is awaited meanwhile.
            told = asyncio.ensure_future(say_progress(lambda waited: log.warning(
                "waiting for %s %s on %d of %d %s servers (%.0f s so far; each bounded by "
                "%g s): %s", method, path, sum(not c.done() for c in calls), len(calls),
                self.sup.kind, waited, timeout,
                ", ".join(s.describe() for s, c in zip(targets, calls) if not c.done()))))
            try:
                results = await asyncio.gather(*calls, return_exceptions=True)
            finally:
                told.cancel()
        failures = [r for r in results if isinstance(r, BaseException)]
        gone = [s for s, r in zip(targets, results)
                if isinstance(r, BaseException) and s.state == "dead"]
        if failures and len(gone) == len(failures) and any(s.state == "up"
                                                           for s in self.sup.servers):
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
            raise kind(f"{path} failed on {len(failures)} of {len(targets)} {self.sup.kind} "
                       "servers: " + "; ".join(str(r) for r in failures))
        return {s.index: r for s, r in zip(targets, results)}

    @contextlib.contextmanager
    def drained(self) -> Iterator[None]:
        """For the body (a weight sync): no request starts, and those in flight (a rollout
        running in another thread) have finished, on the weights they started with."""
        self.sup.runner.run(self._close_gate())
        try:
            yield
        finally:
            self.sup.runner.run(self.dispatch.open_gate())

    ABORT_AGAIN_S = 1.0  # an abort that found no request (not there yet) is sent again

    async def _close_gate(self) -> None:
        self.dispatch.gate_open = False
        started = time.monotonic()
        abort = self.dispatch.aborting_enabled
        sent_at = -self.ABORT_AGAIN_S
        told = started
        while self.dispatch.inflight_total > 0:
            now = time.monotonic()
            if abort and now - sent_at >= self.ABORT_AGAIN_S:
                sent_at = now
                await self._abort_ours()
            if now - told >= PROGRESS_S:
                told = now
                # A request waiting on a server paused in place (by another client) is not
                # aborted: it is waited for, aborted again each second, until it runs.
                log.warning("the weight push waits for %d of our requests in flight to %s "
                            "(%.0f s so far; %s each bounded by rollout.server."
                            "request_timeout_s=%g)", self.dispatch.inflight_total,
                            self.sup.kind, now - started,
                            "aborted again every second," if abort else "finishing,",
                            self.cfg.request_timeout_s)
            await asyncio.sleep(0.02)
        self.drain_wait_s += time.monotonic() - started

    async def _abort_ours(self) -> None:
        """Abort our requests in flight, each on its server (theirs are left alone). A failed
        call is only logged: a server that died fails its requests, which are issued again."""
        by_server: dict[int, tuple[Server, list[str]]] = {}
        for rid, server in list(self.dispatch.inflight_ids.items()):
            by_server.setdefault(server.index, (server, []))[1].append(rid)
            self.dispatch.aborting.add(rid)
        async with aiohttp.ClientSession() as session:
            calls = [post(session, server, path, body, self.cfg.health_timeout_s)
                     for server, rids in by_server.values()
                     for path, body in self.dispatch.aborts.abort_calls(rids)]
            for result in await asyncio.gather(*calls, return_exceptions=True):
                if isinstance(result, BaseException):
                    log.warning("aborting our requests before a weight push failed: %s: %s",
                                type(result).__name__, str(result).splitlines()[0][:300])

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
