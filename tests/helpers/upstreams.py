"""Real upstream proxies from Debian (microsocks, tinyproxy) and a counting forwarder."""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.helpers.servers import LoopbackServer


def free_port() -> int:
    """A loopback port free now, for a server the test is about to start on it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Sockets behind refused_port(), held for the whole test run.
_REFUSING: list[socket.socket] = []


def refused_port() -> int:
    """A loopback port where every connection is refused for the rest of the run.

    Bound and never listening, and held open: a port that was merely free when the
    test looked can since have become some socket's ephemeral port, and a connect to
    it then succeeds (a TCP self-connect, or someone else's listener).
    """
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _REFUSING.append(sock)
    return int(sock.getsockname()[1])


@contextmanager
def black_hole() -> Iterator[int]:
    """A loopback port whose full backlog drops SYNs, so connecting to it times out.

    The listener never accepts; with backlog 0 and a few pending connections filling
    it, the kernel drops further SYNs. Yields the port.
    """
    hole = socket.socket()
    fillers: list[socket.socket] = []
    try:
        hole.bind(("127.0.0.1", 0))
        hole.listen(0)
        for _ in range(4):
            s = socket.socket()
            fillers.append(s)
            s.setblocking(False)
            s.connect_ex(hole.getsockname())
        yield hole.getsockname()[1]
    finally:
        for s in fillers:
            s.close()
        hole.close()


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"upstream exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on {port}")


@contextmanager
def upstream_process(args: list[str], port: int) -> Iterator[int]:
    """Run ``args`` (skipped when not installed) until it listens on ``port``; yields the port."""
    if shutil.which(args[0]) is None:
        pytest.skip(f"{args[0]} is not installed (.ci/run installs it)")
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(port, proc)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@contextmanager
def microsocks(auth: tuple[str, str] | None = None) -> Iterator[int]:
    """Debian's microsocks on 127.0.0.1; yields its port."""
    port = free_port()
    args = ["microsocks", "-i", "127.0.0.1", "-p", str(port)]
    if auth:
        args += ["-u", auth[0], "-P", auth[1]]
    with upstream_process(args, port) as p:
        yield p


@contextmanager
def ss_server(method: str, password: str = "secret", *, udp: bool = False) -> Iterator[int]:
    """Debian's ss-server (shadowsocks-libev, TCP; and UDP with ``udp``) on 127.0.0.1;
    yields its port."""
    port = free_port()
    args = ["ss-server", "-s", "127.0.0.1", "-p", str(port), "-k", password, "-m", method]
    if udp:
        args.append("-u")
    with upstream_process(args, port) as p:
        yield p


@contextmanager
def tinyproxy(tmp: Path, auth: tuple[str, str] | None = None) -> Iterator[int]:
    """Debian's tinyproxy on 127.0.0.1 (CONNECT to any port); yields its port."""
    port = free_port()
    conf = tmp / f"tinyproxy-{port}.conf"
    lines = [
        "User nobody",
        "Group nogroup",
        f"Port {port}",
        "Listen 127.0.0.1",
        "Timeout 60",
        "MaxClients 100",
        "Allow 127.0.0.1",
    ]
    if auth:
        lines.append(f"BasicAuth {auth[0]} {auth[1]}")
    conf.write_text("\n".join(lines) + "\n")
    with upstream_process(["tinyproxy", "-d", "-c", str(conf)], port) as p:
        yield p


class CountingForwarder(LoopbackServer):
    """Forwards TCP connections to ``target`` and counts connections and bytes."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.connections = 0
        self.bytes_up = 0
        self.bytes_down = 0
        self._lock = threading.Lock()
        super().__init__()

    def handle(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        with self._lock:
            self.connections += 1
        threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
        threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, up: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                with self._lock:
                    if up:
                        self.bytes_up += len(data)
                    else:
                        self.bytes_down += len(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@contextmanager
def dante(tmp: Path) -> Iterator[int]:
    """Debian's dante-server (danted) on 127.0.0.1, no auth, CONNECT and UDP ASSOCIATE
    allowed to loopback only; yields its port."""
    port = free_port()
    conf = tmp / "danted.conf"
    conf.write_text(
        f"""logoutput: {tmp / "danted.log"}
internal: 127.0.0.1 port = {port}
external: 127.0.0.1
socksmethod: none
clientmethod: none
user.privileged: root
user.unprivileged: nobody
client pass {{ from: 127.0.0.0/8 to: 0.0.0.0/0 }}
socks pass {{ from: 127.0.0.0/8 to: 127.0.0.0/8 command: connect udpassociate udpreply }}
"""
    )
    args = ["danted", "-f", str(conf), "-p", str(tmp / "danted.pid"), "-N", "1"]
    with upstream_process(args, port) as p:
        yield p
