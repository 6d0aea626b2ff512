"""The pool's metrics since the last read: retries, aborts, servers up and restarted, per-server
latency, requests and failures, and the seconds the engine had a request in flight."""

from __future__ import annotations

from megatron_entropy.rollout.server.dispatch import Dispatcher
from megatron_entropy.rollout.server.supervisor import Server


def pop_metrics(servers: list[Server], dispatch: Dispatcher) -> dict[str, float]:
    """The ``rollout/*`` metrics of ``servers`` since the last call; the counters restart."""
    out: dict[str, float] = {"rollout/retries": float(dispatch.retries),
                             "rollout/aborted_reissued": float(dispatch.aborted),
                             "rollout/aborted_resumed": float(dispatch.resumed),
                             "rollout/servers_up": float(sum(s.state == "up" for s in servers)),
                             "rollout/server_restarts": float(sum(s.restarts for s in servers))}
    for s in servers:
        if s.requests:
            out[f"rollout/server{s.index}/latency_s"] = s.latency_s / s.requests
            out[f"rollout/server{s.index}/requests"] = float(s.requests)
        if s.failures:
            out[f"rollout/server{s.index}/failures"] = float(s.failures)
        s.requests, s.latency_s, s.failures = 0, 0.0, 0
    dispatch.retries = dispatch.aborted = dispatch.resumed = 0
    out["rollout/engine_busy_s"] = dispatch.pop_busy_s()
    return out
