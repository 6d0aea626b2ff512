"""The errors of the server modules (process, pool, engines), in one place so that each can raise
them without importing the others."""

from __future__ import annotations


class ServerError(RuntimeError):
    """A server failed in a way the pool could not recover from; the message names it."""


class RequestRejected(ServerError):
    """The server answered 4xx: the request itself is wrong, so it is not retried."""
