"""A streaming SSE reader for tests: http.client underneath, sseclient-py parsing on top."""

from __future__ import annotations

import http.client
import socket
import urllib.parse
from collections.abc import Iterator
from typing import Any

import orjson
import sseclient


class Stream:
    """One open ``GET /api/v1/events/stream``; iterate ``events()`` for parsed frames."""

    def __init__(
        self,
        base_url: str,
        params: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 10.0,
    ) -> None:
        url = urllib.parse.urlsplit(base_url)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout)
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        self.conn.request("GET", f"/api/v1/events/stream{query}", headers=headers or {})
        self.response = self.conn.getresponse()
        self.status = self.response.status
        self._events: Iterator[Any] | None = None

    def _chunks(self) -> Iterator[bytes]:
        while True:
            chunk = self.response.read1(65536)
            if not chunk:
                return
            yield chunk

    def events(self) -> Iterator[Any]:
        """Parsed events (sseclient-py ``Event``: ``id``, ``event``, ``data``); one shared
        iterator, so frames that arrived in one chunk are never dropped between calls."""
        if self._events is None:
            self._events = sseclient.SSEClient(self._chunks()).events()
        return self._events

    def next_envelope(self) -> tuple[Any, dict[str, Any]]:
        """The next event and its decoded envelope."""
        event = next(self.events())
        return event, orjson.loads(event.data)

    def error_body(self) -> dict[str, Any]:
        """The JSON body of a refused stream."""
        body: dict[str, Any] = orjson.loads(self.response.read())
        return body

    def abort(self) -> None:
        """Drop the connection abruptly, as a crashed client would."""
        sock = self.conn.sock
        if sock is not None:
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
            )
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self.response.close()
        self.conn.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
