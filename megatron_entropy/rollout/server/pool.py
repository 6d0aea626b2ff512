"""The servers of one engine (vLLM or SGLang), as one object: ``ServerPool`` puts together the
jobs that each live in a module of their own:

- supervisor.py: the servers' lives (launched by process.py or connected; health probes, dead
  and hung servers marked and restarted), on the event loop of eventloop.py;
- dispatch.py: requests to the least-loaded usable server, retried or resumed;
- control.py: control calls to every server at once, and the pause gate around weight syncs;
- metrics.py: what the pool reports each step.

``run_in_background()`` gives the pool one event loop in a thread of its own that runs every
call, from any thread: a rollout can be in flight while another thread pushes weights.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from pathlib import Path
from typing import Any, Optional

from megatron_entropy.config import ServerConfig
from megatron_entropy.rollout.server.control import ControlPlane
from megatron_entropy.rollout.server.dispatch import Dispatcher, ParseResponse
from megatron_entropy.rollout.server.eventloop import EventLoopRunner
from megatron_entropy.rollout.server.metrics import pop_metrics
from megatron_entropy.rollout.server.partial import AbortApi
from megatron_entropy.rollout.server.process import LaunchCommand
from megatron_entropy.rollout.server.supervisor import Server, Supervisor

__all__ = ["Server", "ServerPool"]


class ServerPool:
    """Servers of one engine: the configured URLs, plus ``launch`` servers it starts (and
    restarts) itself, with their logs in ``run_dir/servers/``."""

    def __init__(self, cfg: ServerConfig, run_dir: str | Path, kind: str, model_dir: str,
                 launch_command: LaunchCommand, env: Optional[dict[str, str]] = None,
                 health_path: str = "/health"):
        self.cfg = cfg
        self.kind = kind
        self.runner = EventLoopRunner(kind)
        self.supervisor = Supervisor(cfg, run_dir, kind, model_dir, launch_command, env,
                                     health_path, self.runner)
        self.dispatch = Dispatcher(self.supervisor)
        self.control = ControlPlane(self.supervisor, self.dispatch)
        self.dir = self.supervisor.dir

    # What the engines read and set, kept by the part whose job it is.
    servers = property(lambda self: self.supervisor.servers)
    model_dir = property(lambda self: self.supervisor.model_dir,
                         lambda self, v: setattr(self.supervisor, "model_dir", v))
    launch_version = property(lambda self: self.supervisor.launch_version,
                              lambda self, v: setattr(self.supervisor, "launch_version", v))
    expected_version = property(lambda self: self.dispatch.expected_version,
                                lambda self, v: setattr(self.dispatch, "expected_version", v))
    inflight_at_sync = property(lambda self: self.dispatch.inflight_at_sync,
                                lambda self, v: setattr(self.dispatch, "inflight_at_sync", v))
    aborts: Optional[AbortApi] = property(  # type: ignore[assignment]
        lambda self: self.dispatch.aborts, lambda self, v: setattr(self.dispatch, "aborts", v))
    drain_wait_s = property(lambda self: self.control.drain_wait_s,
                            lambda self, v: setattr(self.control, "drain_wait_s", v))

    def start(self) -> None:
        self.supervisor.start()

    def ensure_up(self) -> None:
        self.supervisor.ensure_up()

    def stop(self) -> None:
        self.supervisor.stop()

    def run_in_background(self) -> None:
        self.runner.run_in_background()

    def serves_current(self, server: Server) -> bool:
        return self.dispatch.serves_current(server)

    def map(self, path: str, payloads: list[dict], parse: ParseResponse,
            targets: Optional[list[Server]] = None) -> list[Any]:
        """POST every payload to ``path`` on the servers, concurrently; results in order."""
        return self.dispatch.map(path, payloads, parse, targets)

    def call_all(self, path: str, payload: Optional[dict] = None, method: str = "POST",
                 timeout: Optional[float] = None, targets: Optional[list[Server]] = None
                 ) -> dict[int, Any]:
        return self.control.call_all(path, payload, method, timeout, targets)

    def call_all_async(self, path: str, payload: Optional[dict] = None, method: str = "POST",
                       timeout: Optional[float] = None, targets: Optional[list[Server]] = None
                       ) -> concurrent.futures.Future:
        return self.control.call_all_async(path, payload, method, timeout, targets)

    def drained(self) -> contextlib.AbstractContextManager[None]:
        return self.control.drained()

    def paused(self, pause: tuple[str, Optional[dict]], resume: tuple[str, Optional[dict]],
               targets: list[Server]) -> contextlib.AbstractContextManager[None]:
        return self.control.paused(pause, resume, targets)

    def pop_metrics(self) -> dict[str, float]:
        return pop_metrics(self.servers, self.dispatch)
