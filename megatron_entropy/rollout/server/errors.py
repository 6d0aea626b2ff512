"""The errors of the server modules (process, pool, engines), in one place so that each can raise
them without importing the others."""

from __future__ import annotations


class ServerError(RuntimeError):
    """A server failed in a way the pool could not recover from; the message names it."""


class RequestRejected(ServerError):
    """The request itself is wrong (the server answered 4xx, or the engine found it so before
    sending it), so it is not retried."""


def one_line(text: str, limit: int = 2000) -> str:
    """A server's answer as an error quotes it: its whitespace (newlines too) collapsed, so that
    the error stays one line, and at most ``limit`` characters."""
    return " ".join(text.split())[:limit]
