"""A scriptable webhook receiver: a real threaded HTTP/1.1 server on 127.0.0.1 for fault tests.

Each request is answered by the next scripted :class:`Reply` (then by ``default``). A reply can
hang (read the request, never answer), reset (half an answer, then RST), or run a hook between
reading the request and answering. Requests are recorded before they are answered.

The request parser is written here by hand, independent of the client under test.
"""

from __future__ import annotations

import contextlib
import http
import json
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Self

# Reads wake this often to notice close(); a reply gets longer to drain into a slow client.
_POLL_S = 0.05
_SEND_S = 5.0
_MAX_HEAD = 64 * 1024


@dataclass(frozen=True)
class Received:
    """One request as the receiver read it; header names are lower-cased."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Reply:
    """How to answer one request."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    hang: bool = False
    reset: bool = False
    before: Callable[[Received], None] | None = None


class Receiver:
    """A threaded keep-alive HTTP/1.1 server on 127.0.0.1:<free port>; a context manager."""

    def __init__(self, path: str = "/hook") -> None:
        self.default = Reply()
        self._script: deque[Reply] = deque()
        self._received: list[Received] = []
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._connections = 0
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(_POLL_S)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}{path}"
        self._acceptor = threading.Thread(target=self._accept_loop, name="receiver", daemon=True)
        self._acceptor.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def script(self, *replies: Reply) -> None:
        """Queue replies, used one per request in order; ``default`` answers after them."""
        with self._changed:
            self._script.extend(replies)

    @property
    def requests(self) -> list[Received]:
        """A copy of every request received so far, in arrival order."""
        with self._changed:
            return list(self._received)

    @property
    def connections(self) -> int:
        """How many TCP connections were accepted so far."""
        with self._changed:
            return self._connections

    def wait_for(self, n: int, timeout: float = 10.0) -> list[Received]:
        """Wait until at least ``n`` requests arrived and return them all."""
        with self._changed:
            if not self._changed.wait_for(lambda: len(self._received) >= n, timeout):
                raise AssertionError(
                    f"receiver got {len(self._received)} of {n} requests within {timeout} s "
                    f"({self._connections} connections)"
                )
            return list(self._received)

    def bodies_by_event_id(self) -> dict[str, list[bytes]]:
        """Request bodies grouped by their JSON ``event_id``, to spot loss and duplicates."""
        return group_bodies(r.body for r in self.requests)

    def close(self) -> None:
        """Stop accepting, release hung requests, close every connection, join the threads."""
        self._stop.set()
        self._acceptor.join()
        self._listener.close()
        with self._changed:
            open_socks = list(self._open)
            threads = list(self._threads)
        for sock in open_socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for thread in threads:
            thread.join()

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(_POLL_S)
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self._changed:
                self._connections += 1
                self._open.add(conn)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            buffer = bytearray()
            while True:
                request = self._read_request(conn, buffer)
                if request is None:
                    return
                reply = self._record(request)
                if reply.before is not None:
                    reply.before(request)
                if reply.hang:
                    self._stop.wait()
                    return
                if reply.reset:
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Len")
                    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                closing = _wants_close(request, reply)
                conn.settimeout(_SEND_S)
                conn.sendall(_answer(reply, closing))
                conn.settimeout(_POLL_S)
                if closing:
                    return
        except OSError:
            return
        finally:
            with self._changed:
                self._open.discard(conn)
            conn.close()

    def _read_request(self, conn: socket.socket, buffer: bytearray) -> Received | None:
        """Read one request from ``conn``; ``None`` at EOF, on garbage, or when stopping."""
        while (end := buffer.find(b"\r\n\r\n")) < 0:
            if len(buffer) > _MAX_HEAD or not self._fill(conn, buffer):
                return None
        lines = bytes(buffer[:end]).decode("latin-1").split("\r\n")
        del buffer[: end + 4]
        try:
            method, path, _version = lines[0].split(" ")
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            length = int(headers.get("content-length", "0"))
        except ValueError:
            return None
        while len(buffer) < length:
            if not self._fill(conn, buffer):
                return None
        body = bytes(buffer[:length])
        del buffer[:length]
        return Received(method, path, headers, body, time.monotonic())

    def _fill(self, conn: socket.socket, buffer: bytearray) -> bool:
        while not self._stop.is_set():
            try:
                data = conn.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return False
            buffer += data
            return True
        return False

    def _record(self, request: Received) -> Reply:
        with self._changed:
            self._received.append(request)
            self._changed.notify_all()
            return self._script.popleft() if self._script else self.default


def group_bodies(bodies: Iterable[bytes]) -> dict[str, list[bytes]]:
    """Bodies grouped by their JSON ``event_id``."""
    grouped: dict[str, list[bytes]] = {}
    for body in bodies:
        try:
            event_id = json.loads(body)["event_id"]
        except (ValueError, KeyError, TypeError) as exc:
            raise AssertionError(f"body without an event_id: {body[:200]!r}") from exc
        grouped.setdefault(str(event_id), []).append(body)
    return grouped


def _wants_close(request: Received, reply: Reply) -> bool:
    asked = request.headers.get("connection", "").lower() == "close"
    told = any(k.lower() == "connection" and v.lower() == "close" for k, v in reply.headers.items())
    return asked or told


def _answer(reply: Reply, closing: bool) -> bytes:
    try:
        reason = http.HTTPStatus(reply.status).phrase
    except ValueError:
        reason = "Status"
    headers = {"Content-Length": str(len(reply.body))}
    headers.update(reply.headers)
    if closing:
        headers.setdefault("Connection", "close")
    head = f"HTTP/1.1 {reply.status} {reason}\r\n"
    head += "".join(f"{name}: {value}\r\n" for name, value in headers.items())
    return head.encode("latin-1") + b"\r\n" + reply.body
