"""An asyncio event loop in a thread of its own, that any thread can hand work to.

The engine's actors share one (``spliceway.actors.dispatcher.LoopActor``); the DNS
server runs on one of its own or on the actors'; the TUN's DNS-over-TCP hijack on the
actors'. It lives here, below all of them, because it knows nothing of actors: the
DNS and TUN packages take one without importing the actor layer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

__all__ = ["Dispatcher"]


class Dispatcher:
    """An asyncio event loop running in its own thread, shared by many actors."""

    def __init__(self, name: str = "spliceway-dispatcher") -> None:
        self.loop = asyncio.new_event_loop()
        self._name = name
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._ready = threading.Event()

    def start(self) -> None:
        """Start the loop thread; returns once the loop is running."""
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _run(self) -> None:
        self._thread_id = threading.get_ident()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self._cancel_leftover_tasks()
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
            self.loop.close()

    def _cancel_leftover_tasks(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    @property
    def in_loop_thread(self) -> bool:
        """True when called from the dispatcher's own thread."""
        return threading.get_ident() == self._thread_id

    def call_soon(self, fn: Callable[..., object], *args: object) -> None:
        """Run ``fn(*args)`` on the loop thread, from any thread."""
        if self.in_loop_thread:
            self.loop.call_soon(fn, *args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def run_sync(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any:
        """Run ``fn`` on the loop thread and wait for its result (not from the loop)."""
        if self.in_loop_thread:
            return fn()

        async def _call() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(_call(), self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start a task on the loop; must be called from the loop thread."""
        return self.loop.create_task(coro)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the loop and join its thread."""
        if self._thread is None:
            return
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        self._thread = None
