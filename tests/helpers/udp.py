"""SOCKS5 UDP ASSOCIATE from the client side, and a UDP echo server, on loopback."""

from __future__ import annotations

import socket
import struct
import threading
from typing import Self

from spliceway.protocols import socks5
from tests.helpers.socks import recv_exact


class UdpEcho:
    """A UDP server on 127.0.0.1 that sends every datagram back to its sender."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = 0
        # close() does not wake a recvfrom blocked in another thread: poll a flag.
        self.sock.settimeout(0.05)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                data, peer = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            self.received += 1
            self.sock.sendto(data, peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Association:
    """A UDP ASSOCIATE through a SOCKS5 proxy: its TCP control connection and a UDP
    socket that speaks the RFC 1928 datagram header."""

    def __init__(self, proxy: tuple[str, int], *, declare_port: bool = True) -> None:
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.settimeout(5)
        self.control = socket.create_connection(proxy, timeout=10)
        self.control.sendall(b"\x05\x01\x00")
        if recv_exact(self.control, 2) != b"\x05\x00":
            raise ConnectionError("method refused")
        port = self.udp.getsockname()[1] if declare_port else 0
        self.control.sendall(
            b"\x05\x03\x00\x01" + socket.inet_aton("0.0.0.0") + struct.pack("!H", port)
        )
        head = recv_exact(self.control, 4)
        if head[1] != 0:
            raise ConnectionError(f"socks reply {head[1]}")
        assert head[3] == 1
        addr = socket.inet_ntoa(recv_exact(self.control, 4))
        (bport,) = struct.unpack("!H", recv_exact(self.control, 2))
        self.relay = (addr, bport)

    def send(self, host: str, port: int, payload: bytes) -> int:
        """Send ``payload`` to ``host:port`` through the relay; the datagram's size."""
        wire = socks5.build_udp_datagram(host, port, payload)
        self.udp.sendto(wire, self.relay)
        return len(wire)

    def recv(self) -> tuple[str, int, bytes, int]:
        """The next datagram from the relay: (source host, port, payload, wire size)."""
        data, _ = self.udp.recvfrom(65535)
        d = socks5.parse_udp_datagram(data)
        return d.host, d.port, d.payload, len(data)

    def close(self) -> None:
        self.control.close()
        self.udp.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
