"""Serving the control app on Waitress, on a thread of its own.

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
from typing import TYPE_CHECKING, Any

from waitress import wasyncore
from waitress.server import create_server

from spliceway.errors import ApiError

if TYPE_CHECKING:
    from spliceway.api.app import ControlApp

logger = logging.getLogger(__name__)

_SPARE_THREADS = 8
_JOIN_S = 10.0
_DRAIN_S = 2.0
_OUTBUF_HIGH_WATERMARK = 1 << 20


class ControlServer:
    """The control app listening on one address."""

    def __init__(self, app: ControlApp, address: str, port: int) -> None:
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
            self._server = self._create(app, sock, threads)
        except BaseException:
            sock.close()
            raise
        self.address: tuple[str, int] = (
            self._server.effective_host,  # type: ignore[union-attr]
            int(self._server.effective_port),  # type: ignore[union-attr]
        )
        # The app's keyless Host check accepts the address and port actually bound
        # (port 0 in the config becomes the port the kernel chose).
        self._state.listen = self.address
        self._accepting = True
        self._thread = threading.Thread(
            target=self._server.run, name="spliceway-control-http", daemon=True
        )

    @staticmethod
    def _create(app: ControlApp, sock: socket.socket, threads: int) -> Any:
        return create_server(
            app,
            sockets=[sock],
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
            asyncore_use_poll=True,
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
        server.trigger.pull_trigger(lambda: wasyncore.dispatcher.close(server))  # type: ignore[union-attr]

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
        server.trigger.pull_trigger(lambda: _close_all(server))  # type: ignore[union-attr]
        self._thread.join(_JOIN_S)
        if self._thread.is_alive():
            logger.warning("control API loop did not stop within %.0f s", _JOIN_S)
        server.task_dispatcher.shutdown(timeout=_JOIN_S)


def _unflushed(server: object) -> bool:
    channels = list(server._map.values())  # type: ignore[attr-defined]
    return any(getattr(ch, "total_outbufs_len", 0) for ch in channels)


def _close_all(server: object) -> None:
    # Runs on the loop thread: closing dispatchers there cannot race its poll().
    channel_map = server._map  # type: ignore[attr-defined]
    for dispatcher in list(channel_map.values()):
        dispatcher.close()
