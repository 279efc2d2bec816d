"""Servers run inside a test network namespace: ``python -m tests.helpers.netns_servers KIND PORT``.

KIND is ``http`` (the origin of tests.helpers.servers: ``/``, ``/bytes/N``,
``/host``), ``echo`` (TCP echo), ``sink`` (TCP: counts bytes until EOF, answers
``<count> <sha256>\\n``) or ``udp-echo`` (replies from the address it was sent to).
Each listens on every address of both families (``::`` with IPV6_V6ONLY off) and
prints ``ready <port>`` on stdout once it accepts, then serves until killed.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import socket
import sys
import threading

from tests.helpers.servers import _OriginHandler


class _DualStackHTTP(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6
    daemon_threads = True

    def server_bind(self) -> None:
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _listener(port: int, kind: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6, kind)
    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("::", port))
    if kind == socket.SOCK_STREAM:
        sock.listen(128)
    return sock


def _echo(conn: socket.socket) -> None:
    with conn, contextlib.suppress(OSError):
        while data := conn.recv(65536):
            conn.sendall(data)


def _sink(conn: socket.socket) -> None:
    digest = hashlib.sha256()
    total = 0
    with conn, contextlib.suppress(OSError):
        while chunk := conn.recv(1 << 20):
            total += len(chunk)
            digest.update(chunk)
        conn.sendall(f"{total} {digest.hexdigest()}\n".encode())


def main(argv: list[str]) -> int:
    kind, port = argv[0], int(argv[1])
    if kind == "http":
        server = _DualStackHTTP(("::", port), _OriginHandler)
        print(f"ready {server.server_address[1]}", flush=True)
        server.serve_forever()
        return 0
    if kind == "udp-echo":
        sock = _listener(port, socket.SOCK_DGRAM)
        # Reply from the address the datagram was sent to, as a well-behaved server on
        # a host with several addresses does (a client's connected socket, or a NAT,
        # takes replies from that address only); IPv4 arrives v4-mapped here.
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVPKTINFO, 1)
        print(f"ready {sock.getsockname()[1]}", flush=True)
        while True:
            data, ancdata, _, peer = sock.recvmsg(65535, socket.CMSG_SPACE(20))
            reply_from = [
                (socket.IPPROTO_IPV6, socket.IPV6_PKTINFO, cdata[:16] + bytes(4))
                for level, ctype, cdata in ancdata
                if (level, ctype) == (socket.IPPROTO_IPV6, socket.IPV6_PKTINFO)
            ]
            sock.sendmsg([data], reply_from, 0, peer)
    handler = {"echo": _echo, "sink": _sink}[kind]
    sock = _listener(port, socket.SOCK_STREAM)
    print(f"ready {sock.getsockname()[1]}", flush=True)
    while True:
        conn, _ = sock.accept()
        threading.Thread(target=handler, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
