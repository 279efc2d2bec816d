"""A minimal blocking SOCKS5 client for tests (independent of the engine's parsers)."""

from __future__ import annotations

import contextlib
import socket
import struct


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (ConnectionError, with what came, if it closes)."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes: {data!r}")
        data += chunk
    return data


def recv_all(sock: socket.socket) -> bytes:
    """Everything ``sock`` receives until the peer closes."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def recv_to_eof(sock: socket.socket) -> bytes:
    """What ``sock`` receives until the peer closes it or resets it."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def socks5_connect(
    proxy: tuple[str, int],
    host: str,
    port: int,
    *,
    auth: tuple[str, str] | None = None,
    timeout: float = 10,
) -> socket.socket:
    """Open a tunnel through a SOCKS5 proxy; raises ConnectionError with the reply code."""
    sock = socket.create_connection(proxy, timeout=timeout)
    try:
        sock.sendall(b"\x05\x01\x02" if auth else b"\x05\x01\x00")
        _, method = recv_exact(sock, 2)
        if auth:
            if method != 2:
                raise ConnectionError(f"method {method}")
            u, p = auth[0].encode(), auth[1].encode()
            sock.sendall(b"\x01" + bytes([len(u)]) + u + bytes([len(p)]) + p)
            if recv_exact(sock, 2)[1] != 0:
                raise ConnectionError("auth rejected")
        elif method != 0:
            raise ConnectionError(f"method {method}")
        name = host.encode()
        sock.sendall(b"\x05\x01\x00\x03" + bytes([len(name)]) + name + struct.pack("!H", port))
        head = recv_exact(sock, 4)
        if head[1] != 0:
            raise ConnectionError(f"socks reply {head[1]}")
        atyp = head[3]
        extra = {1: 4, 4: 16}.get(atyp)
        if extra is None:
            extra = recv_exact(sock, 1)[0]
        recv_exact(sock, extra + 2)
        return sock
    except BaseException:
        sock.close()
        raise
