"""Publishing a sink's events to NATS JetStream (``type: nats``), from the sink's thread.

Each event is one message on the sink's subject with the header ``Nats-Msg-Id: <event_id>``,
so JetStream's duplicate window stores it once however often a retry or a restart sends it
again; an event counts as delivered only on its PubAck (a duplicate's PubAck included).
The engine never creates streams: until one captures the subject, every attempt fails with
an error saying so and the events wait in the outbox.

nats-py is asyncio; a sink actor is a thread. Each publisher runs its own event loop on a
thread of its own and the actor hands it one batch at a time. Batches are pipelined
(``publish_async``: every message of a batch is sent before the first PubAck is awaited),
so throughput does not pay one round trip per event. The client does not reconnect by
itself: a lost connection fails the batch, and the sink's delivery policy (backoff,
retries) decides when the next attempt reconnects, as for a webhook.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js.client import JetStreamContext

__all__ = ["NatsPublisher", "parse_credentials"]

#: Messages one batch may have awaiting their PubAck (nats-py allows 4,000 pending).
MAX_BATCH = 1024


def parse_credentials(value: str) -> dict[str, Any]:
    """``nats.connect`` keyword arguments for a ``credentials_env`` value.

    ``@/path/file.creds``: a JWT and NKey credentials file; ``user:password``; else a token.
    """
    if value.startswith("@"):
        path = Path(value[1:])
        if not path.is_file():
            raise ValueError(f"credentials file {str(path)!r} does not exist")
        return {"user_credentials": str(path)}
    if ":" in value:
        user, password = value.split(":", 1)
        return {"user": user, "password": password}
    return {"token": value}


class NatsPublisher:
    """Publishes envelopes to one JetStream subject; one sink thread calls :meth:`publish`.

    :meth:`abort` may be called from any thread; it is final.
    """

    def __init__(
        self,
        servers: Sequence[str],
        subject: str,
        timeout_ms: int,
        credentials: dict[str, Any] | None = None,
    ) -> None:
        """Prepare a publisher; nothing connects until the first :meth:`publish`."""
        self.servers = list(servers)
        self.subject = subject
        self._timeout_s = timeout_ms / 1000
        self._credentials = credentials or {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None
        self._stream: str | None = None
        self._running: concurrent.futures.Future[Any] | None = None
        self._aborted = False
        self._lock = threading.Lock()

    # -- the sink thread's calls --------------------------------------------------------

    def publish(self, messages: Sequence[tuple[str, bytes]]) -> tuple[int, str | None]:
        """Publish ``(event_id, body)`` pairs in order.

        Returns how many from the head were acknowledged, and the error of the first
        that was not (None when all were).
        """
        if self._aborted:
            return 0, "aborted"
        loop = self._start_loop()
        future = asyncio.run_coroutine_threadsafe(self._publish(messages), loop)
        with self._lock:
            self._running = future
        try:
            # The coroutine keeps its own deadlines; this bound only guards against a hang.
            return future.result(timeout=3 * self._timeout_s + 1)
        except (concurrent.futures.CancelledError, concurrent.futures.TimeoutError):
            future.cancel()
            self._reset()
            return 0, "aborted" if self._aborted else "timed out"
        finally:
            with self._lock:
                self._running = None

    def close(self) -> None:
        """Close the connection and stop the publisher's loop thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError, concurrent.futures.TimeoutError):
            asyncio.run_coroutine_threadsafe(self._disconnect(), loop).result(self._timeout_s)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=self._timeout_s + 1)
        self._loop = self._thread = None

    def abort(self) -> None:
        """Make a :meth:`publish` blocked in another thread return promptly, and every later
        one fail (engine stop, sink removal)."""
        self._aborted = True
        with self._lock:
            running = self._running
        if running is not None:
            running.cancel()

    # -- the loop thread ---------------------------------------------------------------

    def _start_loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            loop = asyncio.new_event_loop()
            thread = threading.Thread(
                target=loop.run_forever, name=f"nats-sink {self.subject}", daemon=True
            )
            thread.start()
            self._loop, self._thread = loop, thread
        return self._loop

    async def _publish(self, messages: Sequence[tuple[str, bytes]]) -> tuple[int, str | None]:
        try:
            js = await self._connected()
        except _Unavailable as ex:
            return 0, str(ex)
        futures: list[asyncio.Future[Any]] = []
        error: str | None = None
        try:
            for event_id, body in messages:
                futures.append(
                    # No wait_stall: with one, nats-py wraps every message's semaphore
                    # acquire in wait_for (a task, a timer and a loop pass each, measured
                    # at a third of the throughput); a batch never exceeds its pending cap.
                    await js.publish_async(self.subject, body, headers={"Nats-Msg-Id": event_id})
                )
        except (nats.errors.Error, nats.js.errors.Error, OSError) as ex:
            error = _describe(ex)
        if futures:
            _done, pending = await asyncio.wait(futures, timeout=self._timeout_s)
            for future in pending:
                future.cancel()
        acked = 0
        for future in futures:
            if future.cancelled():
                error = f"no PubAck within {self._timeout_s * 1000:.0f} ms"
                break
            exc = future.exception()
            if exc is not None:
                error = _describe(exc)
                break
            acked += 1
        if acked < len(messages):
            # The next attempt starts from a new connection and looks for the stream again
            # (it may have been deleted, or the server restarted without it).
            await self._disconnect()
            error = error or "not published"
        return acked, error

    async def _connected(self) -> JetStreamContext:
        nc, js = self._nc, self._js
        if nc is not None and js is not None and nc.is_connected and self._stream is not None:
            return js
        await self._disconnect()
        seen: list[BaseException] = []

        async def remember(ex: Exception) -> None:
            # The client's own default handler would log every failed attempt with its
            # traceback; the batch that meets the failure reports it once.
            seen.append(ex)

        try:
            nc = await nats.connect(
                self.servers,
                connect_timeout=max(1, round(self._timeout_s)),
                # Each server is tried twice at most (nats-py's count starts at 0); the
                # sink's backoff, not the client, paces what follows.
                allow_reconnect=False,
                max_reconnect_attempts=1,
                reconnect_time_wait=0.05,
                error_cb=remember,
                disconnected_cb=_quiet,
                closed_cb=_quiet,
                **self._credentials,
            )
        except (TimeoutError, nats.errors.Error, OSError) as ex:
            cause = seen[-1] if seen and isinstance(ex, nats.errors.NoServersError) else ex
            raise _Unavailable(
                f"cannot connect to {', '.join(self.servers)}: {_describe(cause)}"
            ) from None
        self._nc = nc
        js = nc.jetstream(timeout=self._timeout_s)
        try:
            self._stream = await js.find_stream_name_by_subject(self.subject)
        except nats.js.errors.NotFoundError:
            await self._disconnect()
            raise _Unavailable(
                f"no JetStream stream captures subject {self.subject!r}: create one "
                f"(nats stream add --subjects {self.subject!r}); events wait in the outbox"
            ) from None
        except (TimeoutError, nats.errors.Error, nats.js.errors.Error) as ex:
            await self._disconnect()
            raise _Unavailable(f"JetStream is not available: {_describe(ex)}") from None
        self._js = js
        return js

    async def _disconnect(self) -> None:
        nc, self._nc, self._js, self._stream = self._nc, None, None, None
        if nc is not None and not nc.is_closed:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), self._timeout_s)

    def _reset(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            asyncio.run_coroutine_threadsafe(self._disconnect(), loop)


class _Unavailable(Exception):
    """No usable connection or stream; ``str()`` is the sink's ``last_error``."""


def _describe(ex: BaseException) -> str:
    if isinstance(ex, nats.js.errors.NoStreamResponseError):
        return "no JetStream stream captures the subject (no responders)"
    if isinstance(ex, TimeoutError | nats.errors.TimeoutError):
        return "timeout"
    if isinstance(ex, nats.errors.ConnectionClosedError):
        return "connection closed"
    if isinstance(ex, nats.errors.NoServersError):
        return "no server reachable"
    if isinstance(ex, nats.js.errors.APIError):
        return f"JetStream error {ex.err_code or ex.code}: {ex.description}"
    text = str(ex) or type(ex).__name__
    return text.removeprefix("nats: ")


async def _quiet() -> None:
    return None
