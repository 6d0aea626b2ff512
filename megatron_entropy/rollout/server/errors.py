"""The errors of the server modules (process, pool, engines), in one place so that each can raise
them without importing the others."""

from __future__ import annotations


class ServerError(RuntimeError):
    """A server failed in a way the pool could not recover from; the message names it."""


class RequestRejected(ServerError):
    """The request itself is wrong (the server answered 4xx, or the engine found it so before
    sending it), so it is not retried."""
