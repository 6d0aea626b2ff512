"""The event loop the servers' calls run on: a private one per call from sync code, or, once
``run_in_background()`` was called, one loop in a thread of its own that runs every call from
any thread (a rollout in flight while another thread pushes weights)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from typing import Any, Optional

from megatron_entropy.rollout.server.errors import ServerError


class EventLoopRunner:
    """Runs coroutines to completion for sync callers; ``stop`` cancels what runs and refuses
    later calls."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self.stopped = False

    def run_in_background(self) -> None:
        if self.loop is not None:
            return
        loop = asyncio.new_event_loop()
        self.loop = loop
        self._thread = threading.Thread(target=loop.run_forever, name=f"{self.name}-pool",
                                        daemon=True)
        self._thread.start()

    def stop_loop(self) -> None:
        """Cancel whatever runs on the background loop (a caller blocked on it gets
        CancelledError) and end its thread."""
        loop, thread = self.loop, self._thread
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
        self.loop = self._thread = None

    def stop(self) -> None:
        self.stopped = True
        self.stop_loop()

    def run(self, coro: Any) -> Any:
        """Run a coroutine to completion from sync code: on the background loop when there is
        one, else here (also when a loop already runs here)."""
        if self.stopped:
            coro.close()
            raise ServerError(f"the {self.name} servers were stopped")
        if self.loop is not None:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result()
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return asyncio.run(coro)
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(asyncio.run, coro).result()
