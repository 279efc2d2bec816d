"""Serving the control app on Waitress, on a thread of its own.

The server is ``api.http_guard``'s hardened Waitress (deadlines, pending-connection
caps, the accept backoff, refusals that close); :class:`ControlHeadPolicy` is the
control API's part of it: a request's key is checked, and failed authentication
rate-limited, on its head, before any of its body is read, with the same answers
as the app's gate (docs/security.md).

Waitress gets more worker threads than the SSE cap, so five open streams never
starve queries and commands; ``channel_request_lookahead`` lets it read ahead on
a connection and so notice a client that went away while its stream was idle.
Stop order: close the listener (on Waitress's own loop thread, like every
close), end every SSE stream, let running requests finish and their output
flush, close every channel, join the loop, then the workers.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any

from waitress import wasyncore

from spliceway.api.app import (
    MAX_BODY_BYTES,
    ControlApp,
    ControlState,
    body_too_large,
    envelope_error,
)
from spliceway.api.http_guard import (
    GuardLimits,
    Refusal,
    RequestHead,
    create_guarded_server,
)
from spliceway.api.limits import RateLimited
from spliceway.api.ui_files import is_ui_path
from spliceway.errors import ApiError
from spliceway.support.fdlimit import AcceptBackoff, warning_emitter

logger = logging.getLogger(__name__)

_SPARE_THREADS = 8
_JOIN_S = 10.0
_DRAIN_S = 2.0
_OUTBUF_HIGH_WATERMARK = 1 << 20
#: What every response carries (the app's gate sets the same on its own answers).
_CORS = (
    ("Access-Control-Allow-Origin", "*"),
    ("Access-Control-Expose-Headers", "Retry-After, WWW-Authenticate"),
)


class ControlHeadPolicy:
    """The control API's decisions on a request head (``http_guard.HeadPolicy``).

    The same rules as the app's gate: preflights (``OPTIONS``) and the dashboard's
    files need no key, nor does anything when no key is configured (the gate's
    browser protection then applies, in the app). Any other request with a missing
    or wrong key is answered 401 ``unauthenticated``, or 429 ``rate_limited`` once
    its source or the engine is over the failed-authentication limits, and a
    declared body over 16 MiB is 413, all before the body is read.
    """

    def __init__(self, state: ControlState) -> None:
        self._state = state

    def check_head(self, head: RequestHead) -> Refusal | None:
        """A refusal for this head, or None to let the app run."""
        state = self._state
        if state.keys.required and head.method != "OPTIONS" and not is_ui_path(head.path):
            try:
                state.authenticate(
                    head.headers.get("AUTHORIZATION"),
                    head.headers.get("X_SERVICE_API_KEY"),
                    head.source,
                )
            except ApiError as ex:
                return _refusal(ex)
        if head.content_length is not None and head.content_length > MAX_BODY_BYTES:
            return self.too_large(MAX_BODY_BYTES)
        return None

    def too_large(self, limit: int) -> Refusal:
        """413 for a body over ``limit`` bytes."""
        return _refusal(body_too_large(limit))


def _refusal(error: ApiError) -> Refusal:
    headers = list(_CORS)
    if isinstance(error, RateLimited):
        headers.append(("Retry-After", str(error.retry_after)))
    if error.code == "unauthenticated":
        headers.append(("WWW-Authenticate", 'Bearer realm="spliceway"'))
    return Refusal(error.http_status, envelope_error(error), headers)


class ControlServer:
    """The control app listening on one address."""

    def __init__(
        self, app: ControlApp, address: str, port: int, limits: GuardLimits | None = None
    ) -> None:
        """Bind ``address:port`` (port 0: any free port); ``limits`` default to the
        documented ones."""
        self._state = app.state
        threads = self._state.limits.sse_streams + _SPARE_THREADS
        # Bound here, before Waitress builds anything: if the port is taken, no worker
        # thread, trigger pipe or socket of a half-made server is left behind.
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        try:
            sock = socket.create_server((address, port), family=family, backlog=1024)
        except OSError as ex:
            raise ApiError(
                "conflict",
                f"control API cannot listen on {address}:{port}: "
                f"{os.strerror(ex.errno) if ex.errno else ex}",
                field_path="api.control.listen",
            ) from ex
        try:
            self._server = self._create(app, sock, threads, limits or GuardLimits())
        except BaseException:
            sock.close()
            raise
        self.address: tuple[str, int] = (
            self._server.effective_host,
            int(self._server.effective_port),
        )
        # The app's keyless Host check accepts the address and port actually bound
        # (port 0 in the config becomes the port the kernel chose).
        self._state.listen = self.address
        self._accepting = True
        self._thread = threading.Thread(
            target=self._server.run, name="spliceway-control-http", daemon=True
        )

    @staticmethod
    def _create(
        app: ControlApp, sock: socket.socket, threads: int, limits: GuardLimits
    ) -> Any:
        host, port = sock.getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        backoff = AcceptBackoff(
            f"control API ({shown}:{port})", warning_emitter(app.state.plane.log)
        )
        return create_guarded_server(
            app,
            sock,
            ControlHeadPolicy(app.state),
            limits=limits,
            backoff=backoff,
            threads=threads,
            channel_request_lookahead=1,
            # A slow SSE reader blocks its own worker after 1 MiB instead of
            # buffering up to Waitress's default 16 MiB per connection.
            outbuf_high_watermark=_OUTBUF_HIGH_WATERMARK,
            # Past outbuf_overflow (1 MiB by default) Waitress spills a channel's
            # buffer into a temporary file: a busy SSE stream sat at that edge and
            # paid for file writes on every event burst. The watermark bounds it.
            outbuf_overflow=2 * _OUTBUF_HIGH_WATERMARK,
            ident="spliceway",
            expose_tracebacks=False,
            clear_untrusted_proxy_headers=True,
        )

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the listener."""
        host, port = self.address
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"

    def start(self) -> None:
        """Start serving."""
        self._thread.start()

    def stop_accepting(self) -> None:
        """Close the listening socket; open connections (and event streams) go on.
        Idempotent."""
        if not self._accepting:
            return
        self._accepting = False
        server = self._server
        # dispatcher.close, not server.close, which would also close the trigger.
        server.trigger.pull_trigger(lambda: wasyncore.dispatcher.close(server))

    def stop(self) -> None:
        """Stop serving and join every thread the server started.

        Open SSE streams end cleanly (their final chunk is flushed before the
        connection closes), so a client sees the end of the stream, not a reset.
        """
        server = self._server
        self.stop_accepting()
        self._state.close_streams()
        deadline = time.monotonic() + _DRAIN_S
        while (server.task_dispatcher.active_count or _unflushed(server)) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.01)
        server.trigger.pull_trigger(lambda: _close_all(server))
        self._thread.join(_JOIN_S)
        if self._thread.is_alive():
            logger.warning("control API loop did not stop within %.0f s", _JOIN_S)
        server.task_dispatcher.shutdown(timeout=_JOIN_S)
        server.release_reserve()


def _unflushed(server: object) -> bool:
    channels = list(server._map.values())  # type: ignore[attr-defined]
    return any(getattr(ch, "total_outbufs_len", 0) for ch in channels)


def _close_all(server: object) -> None:
    # Runs on the loop thread: closing dispatchers there cannot race its poll().
    channel_map = server._map  # type: ignore[attr-defined]
    for dispatcher in list(channel_map.values()):
        dispatcher.close()
