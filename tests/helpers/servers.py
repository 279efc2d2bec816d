"""Real loopback servers for the tests: an HTTP origin, a counting TCP peer, an echo server."""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import socket
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Self, TypeVar


class _OriginHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        parts = self.path.strip("/").split("/")
        if parts[0] == "bytes" and len(parts) == 2 and parts[1].isdigit():
            body = b"x" * int(parts[1])
        elif parts[0] == "host":
            body = (self.headers.get("Host") or "").encode()
        else:
            body = b"hello from origin\n"
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_HEAD(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        data = self.rfile.read(length)
        body = f"{len(data)} {hashlib.sha256(data).hexdigest()}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True


_S = TypeVar("_S", bound=socketserver.BaseServer)


@contextmanager
def serving(server: _S) -> Iterator[_S]:
    """``server`` answering on a thread of its own; shut down, closed and joined on exit."""
    # shutdown() waits for serve_forever's next poll: at the default 0.5 s that was half
    # a second of every test with an origin.
    thread = threading.Thread(
        target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
    )
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextmanager
def http_origin() -> Iterator[tuple[str, int]]:
    """An HTTP/1.1 origin on 127.0.0.1: /bytes/N, /host, POST echo of length+sha256."""
    with serving(_Server(("127.0.0.1", 0), _OriginHandler)) as server:
        yield server.server_address[:2]


class LoopbackServer:
    """A TCP listener on 127.0.0.1 (``::1`` for ``AF_INET6``) whose accept loop runs in
    a daemon thread.

    Subclasses set their own state, then call ``super().__init__()`` and get every
    accepted connection in :meth:`handle`. ``close()`` (or leaving a ``with`` block)
    stops accepting; connections already accepted stay open.
    """

    def __init__(self, family: int = socket.AF_INET) -> None:
        host = "::1" if family == socket.AF_INET6 else "127.0.0.1"
        self.sock = socket.create_server((host, 0), family=family)
        self.address: tuple[str, int] = self.sock.getsockname()[:2]
        #: The accept loop (joinable once ``close()`` has refused further connections).
        self.accepting = threading.Thread(target=self._serve, daemon=True)
        self.accepting.start()

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self.address[1]

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.handle(conn)

    def handle(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        # close() alone does not wake a thread blocked in accept(), which would then
        # take one more connection; shutting the listener down refuses at once.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_head(conn: socket.socket) -> bytes:
    """What ``conn`` sends up to the blank line ending an HTTP head (and whatever came
    with it), or less when it closes first: callers check for ``\\r\\n\\r\\n``."""
    head = b""
    while b"\r\n\r\n" not in head and (chunk := conn.recv(4096)):
        head += chunk
    return head


class SilentPeer(LoopbackServer):
    """A TCP server that accepts, keeps every connection open and never answers (a
    proxy that hangs its handshake, a probe that times out, a dial that must not
    happen); ``conns`` holds them in the order they came, closed by :meth:`close`."""

    def __init__(self) -> None:
        self.conns: list[socket.socket] = []
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        self.conns.append(conn)

    def close(self) -> None:
        super().close()
        for conn in self.conns:
            conn.close()


class CountingPeer(LoopbackServer):
    """A TCP server: counts every byte a client sends until EOF, then sends ``reply_bytes``.

    Each accepted connection's received byte count and sha256 are recorded.
    """

    def __init__(self, reply_bytes: int = 0) -> None:
        self.reply_bytes = reply_bytes
        self.received: list[tuple[int, str]] = []
        self.done = threading.Condition()
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._count, args=(conn,), daemon=True).start()

    def _count(self, conn: socket.socket) -> None:
        digest = hashlib.sha256()
        total = 0
        with conn:
            while chunk := conn.recv(1 << 20):
                total += len(chunk)
                digest.update(chunk)
            remaining = self.reply_bytes
            block = b"r" * min(remaining, 1 << 20)
            while remaining > 0:
                n = conn.send(block[: min(remaining, len(block))])
                remaining -= n
        with self.done:
            self.received.append((total, digest.hexdigest()))
            self.done.notify_all()

    def wait_for(self, count: int, timeout: float = 30) -> list[tuple[int, str]]:
        """Block until ``count`` connections have finished."""
        with self.done:
            self.done.wait_for(lambda: len(self.received) >= count, timeout)
            return list(self.received)


class EchoServer(LoopbackServer):
    """A TCP server that echoes every connection's bytes until the client closes."""

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            while data := conn.recv(65536):
                conn.sendall(data)
