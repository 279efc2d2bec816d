"""Serving the Clash API's ASGI app on uvicorn, on a thread of its own.

WebSocket upgrades (``/connections``, ``/traffic``, ``/memory``, ``/logs``) are what
dashboards use first, and a WSGI server cannot do them; so this listener is an
asyncio server beside the control API's Waitress, which keeps its own contract.
The socket is bound here, before the thread starts, so a taken port is the same
``conflict`` error as for the other listeners and nothing is left running.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import uvicorn
from starlette.types import ASGIApp

from spliceway.errors import ApiError

__all__ = ["ClashServer"]

logger = logging.getLogger(__name__)

#: uvicorn's log lines that are not errors here: the first follows every WebSocket
#: upgrade the guard or a stream answers with an HTTP refusal (401, 403, 400) through
#: the ``websocket.http.response`` extension, which uvicorn's sans-I/O implementation
#: misreports; the second follows a chunked stream whose slow reader was dropped.
_EXPECTED_UVICORN_ERRORS = frozenset(
    {
        "ASGI callable returned without completing handshake.",
        "ASGI callable returned without completing response.",
    }
)


class _ExpectedErrors(logging.Filter):
    """Drops :data:`_EXPECTED_UVICORN_ERRORS` from ``uvicorn.error``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in _EXPECTED_UVICORN_ERRORS


_FILTER = _ExpectedErrors()
logging.getLogger("uvicorn.error").addFilter(_FILTER)

_START_S = 10.0
_JOIN_S = 10.0


class ClashServer:
    """uvicorn serving ``app`` on ``address:port`` from a daemon thread."""

    def __init__(self, app: ASGIApp, address: str, port: int) -> None:
        self._app = app
        self._address = address
        self._port = port
        self._sock: socket.socket | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def bound(self) -> tuple[str, int]:
        """The bound ``(address, port)`` (the chosen port when configured as 0)."""
        if self._sock is None:
            raise RuntimeError("ClashServer.bound before start")
        name = self._sock.getsockname()
        return str(name[0]), int(name[1])

    @property
    def base_url(self) -> str:
        """``http://host:port`` of the running listener."""
        address, port = self.bound
        host = f"[{address}]" if ":" in address else address
        return f"http://{host}:{port}"

    def bind(self) -> tuple[str, int]:
        """Bind the listening socket (ApiError ``conflict`` when the port is taken)."""
        family = socket.AF_INET6 if ":" in self._address else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self._address, self._port))
            sock.listen(socket.SOMAXCONN)
        except OSError as ex:
            sock.close()
            raise ApiError(
                "conflict",
                f"the Clash API cannot listen on {self._address}:{self._port}: {ex.strerror or ex}",
                field_path="api.clash.listen",
            ) from ex
        self._sock = sock
        return self.bound

    def start(self) -> None:
        """Serve on the bound socket (binding first if :meth:`bind` was not called) and
        wait until uvicorn accepts."""
        if self._sock is None:
            self.bind()
        sock = self._sock
        assert sock is not None
        config = uvicorn.Config(
            self._app,
            lifespan="off",
            log_config=None,
            access_log=False,
            ws="websockets-sansio",
            ws_max_size=1 << 20,
            # No permessage-deflate, as mihomo: compressing a /connections frame of 10,000
            # flows (5.8 MB) costs 50-100 ms of CPU on the event loop per subscriber and
            # frame (each connection compresses with a context of its own); sent plain it
            # is one copy (docs/clash-api.md, "Cost").
            ws_per_message_deflate=False,
            # The app's streams send pings of their own cadence; uvicorn's keepalive
            # pings also find a dashboard that went away without closing.
            ws_ping_interval=20.0,
            ws_ping_timeout=20.0,
            timeout_graceful_shutdown=2,
            server_header=False,
        )
        server = uvicorn.Server(config)
        self._server = server
        thread = threading.Thread(
            target=self._run, args=(server, sock), name="spliceway-clash-api", daemon=True
        )
        self._thread = thread
        thread.start()
        deadline = time.monotonic() + _START_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise ApiError("internal", "the Clash API server did not start (see the log)")
            time.sleep(0.01)

    @staticmethod
    def _run(server: uvicorn.Server, sock: socket.socket) -> None:
        try:
            asyncio.run(server.serve(sockets=[sock]))
        except Exception:
            logger.exception("the Clash API server stopped with an error")

    def stop(self) -> None:
        """Stop accepting, end open streams and join the thread (idempotent)."""
        server, thread = self._server, self._thread
        self._server = self._thread = None
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(_JOIN_S)
            if thread.is_alive():
                logger.warning("the Clash API server did not stop within %.0f s", _JOIN_S)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
