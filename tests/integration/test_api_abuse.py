"""The control API under attack (issue 26 points 1, 2, 4 and 8): real engines, real sockets.

Each test reproduces an attack that locked the API out, buffered a body before
authentication or let a stream grow without bound, and checks it no longer does.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import resource
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway.api.http_guard import GuardLimits
from spliceway.api.sse import SEND_AHEAD_BYTES
from tests.api.conftest import control_config
from tests.conftest import wait_until
from tests.helpers.proc import cpu_seconds, socks_and_keyless_api_config
from tests.helpers.sinks import EngineProcess

KEY = "abuse-test-admin-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMITS = GuardLimits()


@pytest.fixture
def keyed(make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> Any:
    """A running engine whose control API requires KEY."""
    monkeypatch.setenv("SW_ABUSE_KEY", KEY)
    return make_engine(control_config(api_key_env="SW_ABUSE_KEY"))


def _address(engine: Any) -> tuple[str, int]:
    url = urllib.parse.urlsplit(engine.control_url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def _health_within(address: tuple[str, int], limit_s: float) -> float:
    """GET /api/v1/health with the key; assert 200 within ``limit_s``; the seconds taken."""
    started = time.monotonic()
    conn = http.client.HTTPConnection(*address, timeout=limit_s)
    try:
        conn.request("GET", "/api/v1/health", headers=AUTH)
        answer = conn.getresponse()
        body = json.loads(answer.read())
    finally:
        conn.close()
    took = time.monotonic() - started
    assert answer.status == 200 and body["result"]["healthy"] is True
    assert took < limit_s
    return took


def _auth_line() -> bytes:
    return f"Authorization: Bearer {KEY}\r\n".encode()


def _closed_by_peer(sock: socket.socket) -> bool:
    """Whether the server has closed ``sock`` (EOF or reset); never blocks."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:
        return True


def _read_response(sock: socket.socket, timeout: float) -> tuple[int, dict[str, str], bytes]:
    """Read one response with a Content-Length body: status, lower-cased headers, body."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise AssertionError(f"connection closed before a response head: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _eof_within(sock: socket.socket, timeout: float) -> bool:
    """Whether the server closes ``sock`` within ``timeout`` (reading what comes)."""
    deadline = time.monotonic() + timeout
    sock.setblocking(True)
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True
    return False


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """Client sockets a test opens; all closed at the end."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def test_trickling_connections_cannot_lock_out_a_keyed_client(
    keyed: Any, sockets: list[socket.socket]
) -> None:
    """120 connections trickling a request head (Waitress alone stopped accepting at
    100 and restarted its timeout on every byte): a keyed health check answers at
    once, pending connections past the per-source cap are evicted, and the rest are
    closed by the head deadline although they keep trickling."""
    address = _address(keyed)
    head = b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    for _ in range(120):
        sock = socket.create_connection(address, timeout=5)
        sock.sendall(head[:1])
        sockets.append(sock)
    started = time.monotonic()
    _health_within(address, 1.0)
    # A kept-alive connection that goes quiet is pending too, and closed when idle.
    kept = socket.create_connection(address, timeout=5)
    sockets.append(kept)
    kept.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + _auth_line() + b"\r\n")
    assert _read_response(kept, 1.0)[0] == 200
    # The cap counts the health check's connection too while it was pending.
    wait_until(
        lambda: sum(not _closed_by_peer(s) for s in sockets) <= LIMITS.max_pending_per_source,
        5,
        "pending connections over the per-source cap evicted",
    )
    sent = 1
    while time.monotonic() - started < LIMITS.head_s + 3:
        open_now = [s for s in sockets if s is not kept and not _closed_by_peer(s)]
        if not open_now:
            break
        # One more byte each, as a trickling client does: it must not buy more time.
        for sock in open_now:
            with contextlib.suppress(OSError):
                sock.send(head[sent % len(head) : sent % len(head) + 1])
        sent += 1
        time.sleep(0.5)
    still_open = sum(not _closed_by_peer(s) for s in sockets if s is not kept)
    assert still_open == 0, f"{still_open} trickling connections outlived the head deadline"
    assert _eof_within(kept, LIMITS.idle_s + 2 - (time.monotonic() - started))
    _health_within(address, 1.0)


def test_refused_event_streams_are_closed(keyed: Any, sockets: list[socket.socket]) -> None:
    """100 SSE clients: 5 get a stream, 95 get 429 and are closed by the server (they
    stayed connected and filled Waitress's 100 connections); a keyed health check
    still answers within 1 s."""
    address = _address(keyed)
    request = (
        b"GET /api/v1/events/stream HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    )
    for _ in range(100):
        sock = socket.create_connection(address, timeout=5)
        sock.sendall(request)
        sockets.append(sock)
    statuses: dict[int, int] = {}
    refused: list[socket.socket] = []
    for sock in sockets:
        sock.settimeout(5)
        first = sock.recv(65536)
        status = int(first.split(b" ", 2)[1])
        statuses[status] = statuses.get(status, 0) + 1
        if status == 429:
            assert b"\r\nConnection: close\r\n" in first
            assert b"\r\nRetry-After: 1\r\n" in first
            refused.append(sock)
    assert statuses == {200: 5, 429: 95}
    for sock in refused:
        assert _eof_within(sock, 2.0), "a refused event stream stayed open"
    _health_within(address, 1.0)


def test_failed_authentication_is_rate_limited(keyed: Any) -> None:
    """Wrong keys in a loop are answered 429 past the per-source burst (they ran at
    2,033/s, all 401), every refusal closes its connection, and a caller with the
    valid key from the same address is never refused meanwhile."""
    address = _address(keyed)
    statuses: dict[int, int] = {}
    retry_after = set()
    started = time.monotonic()
    for attempt in range(300):
        conn = http.client.HTTPConnection(*address, timeout=5)
        conn.request("GET", "/api/v1/flows", headers={"Authorization": "Bearer wrong"})
        answer = conn.getresponse()
        body = json.loads(answer.read())
        statuses[answer.status] = statuses.get(answer.status, 0) + 1
        assert answer.getheader("Connection") == "close"
        assert answer.getheader("Access-Control-Allow-Origin") == "*"
        if answer.status == 429:
            assert body["error"]["code"] == "rate_limited"
            retry_after.add(answer.getheader("Retry-After"))
        else:
            assert answer.status == 401 and body["error"]["code"] == "unauthenticated"
            assert answer.getheader("WWW-Authenticate") == 'Bearer realm="spliceway"'
        conn.close()
        if attempt % 50 == 49:
            _health_within(address, 1.0)
    elapsed = time.monotonic() - started
    # Burst 20 plus 5 a second: every further failure from this address is refused.
    allowed = 20 + 5 * elapsed + 1
    assert statuses[401] <= allowed, (statuses, elapsed)
    assert statuses[429] >= 300 - allowed
    assert retry_after == {"1"}


def _proc_wchar() -> int:
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise AssertionError("no wchar in /proc/self/io")


def test_unauthenticated_chunked_body_is_refused_before_it_is_read(
    keyed: Any, sockets: list[socket.socket]
) -> None:
    """A 64 MiB chunked POST without a key: 401 at once, the connection closed, and
    the server reads next to nothing of it (it buffered 63 MB to a temporary file)."""
    address = _address(keyed)
    sock = socket.create_connection(address, timeout=5)
    sockets.append(sock)
    wchar_before = _proc_wchar()
    sock.sendall(
        b"POST /api/v1/commands HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = b"100000\r\n" + b"x" * 0x100000 + b"\r\n"
    sent = [0]

    def upload() -> None:
        try:
            for _ in range(64):
                sock.sendall(chunk)
                sent[0] += len(chunk)
            sock.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # the server closed: expected

    uploader = threading.Thread(target=upload, daemon=True)
    started = time.monotonic()
    uploader.start()
    status, headers, body = _read_response(sock, 5)
    took = time.monotonic() - started
    assert status == 401, body
    assert json.loads(body)["error"]["code"] == "unauthenticated"
    assert headers["connection"] == "close"
    assert took < 1.0
    assert _eof_within(sock, 2.0)
    uploader.join(10)
    # What the client got into the socket before the close: kernel buffers, not 64 MiB.
    assert sent[0] < 16 * 1024 * 1024, sent[0]
    # This process (the engine's) wrote no spilled body to any file.
    assert _proc_wchar() - wchar_before < 4 * 1024 * 1024


def test_oversized_declared_body_is_413_before_it_is_sent(
    keyed: Any, sockets: list[socket.socket]
) -> None:
    """A keyed command declaring 16 MiB + 1 is answered 413 on its head, without the
    client sending a byte of the body (Waitress waited for all of it); exactly 16 MiB
    is read; a chunked body with the key is cut off past 16 MiB."""
    address = _address(keyed)
    head = (
        "POST /api/v1/commands HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
    )
    sock = socket.create_connection(address, timeout=5)
    sockets.append(sock)
    sock.sendall(f"{head}Content-Length: {16 * 1024 * 1024 + 1}\r\n\r\n".encode())
    status, headers, body = _read_response(sock, 2)
    assert status == 413
    error = json.loads(body)["error"]
    assert error == {"code": "invalid_argument", "message": "body larger than 16777216 bytes"}
    assert headers["connection"] == "close"
    assert _eof_within(sock, 2.0)

    # With Expect: 100-continue the client is told 413 instead of "continue".
    sock = socket.create_connection(address, timeout=5)
    sockets.append(sock)
    sock.sendall(f"{head}Expect: 100-continue\r\nContent-Length: {1 << 30}\r\n\r\n".encode())
    status, _, _ = _read_response(sock, 2)
    assert status == 413

    # A chunked body with the key: cut off at the limit, not read to its end.
    sock = socket.create_connection(address, timeout=5)
    sockets.append(sock)
    sock.sendall(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode())
    chunk = b"100000\r\n" + b" " * 0x100000 + b"\r\n"

    def upload() -> None:
        try:
            for _ in range(40):
                sock.sendall(chunk)
        except OSError:
            pass

    uploader = threading.Thread(target=upload, daemon=True)
    uploader.start()
    status, headers, body = _read_response(sock, 10)
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "invalid_argument"
    uploader.join(10)


def _sse_streams_open(address: tuple[str, int]) -> int:
    conn = http.client.HTTPConnection(*address, timeout=5)
    try:
        conn.request("GET", "/metrics", headers=AUTH)
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    match = re.search(r"^spliceway_sse_streams_open (\S+)$", text, re.M)
    assert match, text
    return int(float(match.group(1)))


def test_stalled_event_stream_backlog_is_bounded_and_resumable(
    make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, sockets: list[socket.socket]
) -> None:
    """A client that stops reading while ~9 MB of events come: the stream keeps at most
    MAX_BACKLOG_BYTES for it (it kept up to twice the ring: 1.19 GB for five streams
    on a ring of 200,000), ends with the overflow comment after whole frames, gives
    its slot back at once, and a resume with Last-Event-ID delivers every event."""
    monkeypatch.setenv("SW_ABUSE_KEY", KEY)
    cfg = control_config(api_key_env="SW_ABUSE_KEY")
    cfg["runtime"]["event_ring_capacity"] = 50000
    engine = make_engine(cfg)
    address = _address(engine)
    sock = socket.socket()
    sockets.append(sock)
    # A small receive window, so the kernel holds little of what the server sends.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
    sock.connect(address)
    sock.sendall(
        b"GET /api/v1/events/stream?types=engine.warning HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b"Authorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    )
    sock.settimeout(5)
    first = b""
    while b": connected" not in first:
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200 ")
    count = 8000
    filler = "x" * 1000
    for index in range(count):
        payload = {"code": "fd_exhausted", "message": f"{index} {filler}"}
        engine.core.log.emit("engine.warning", payload)
    # The stream gave its slot back although its client has read nothing yet.
    wait_until(lambda: _sse_streams_open(address) == 0, 10, "the overflowed stream's slot back")
    # Now read what the server kept for the client: whole frames, then the comment.
    received = first
    sock.settimeout(5)
    while not received.endswith(b"\r\n0\r\n\r\n"):
        chunk = sock.recv(65536)
        assert chunk, "the stream closed without ending its response"
        received += chunk
    assert b": overflow: this client fell more than" in received
    # What reached the client: what the server's socket buffer took (Linux grows it up
    # to tcp_wmem's maximum) and what the stream let the server hold unsent (at most
    # SEND_AHEAD_BYTES plus one batch); the stream dropped the rest.
    with open("/proc/sys/net/ipv4/tcp_wmem") as wmem:
        kernel = int(wmem.read().split()[2]) + 65536
    batch = 1024 * 1200
    assert len(received) <= kernel + SEND_AHEAD_BYTES + batch, len(received)
    assert len(received) < count * 1000
    frame = rb"\nid: (\d+)\nevent: engine\.warning\ndata: "
    ids = [int(m) for m in re.findall(frame, b"\n" + received)]
    seen = {int(m) for m in re.findall(rb'"message":"(\d+) x', received)}
    assert ids and seen == set(range(len(seen)))
    # Resume exactly after the last whole frame.
    resumed: set[int] = set()
    conn = http.client.HTTPConnection(*address, timeout=10)
    conn.request(
        "GET",
        "/api/v1/events/stream?types=engine.warning",
        headers={**AUTH, "Last-Event-ID": str(ids[-1])},
    )
    answer = conn.getresponse()
    assert answer.status == 200
    buffered = b""
    while len(seen) + len(resumed) < count:
        chunk = answer.read1(65536)
        assert chunk
        buffered += chunk
        frames, _, buffered = buffered.rpartition(b"\n\n")
        resumed.update(int(m) for m in re.findall(rb'"message":"(\d+) x', frames))
    conn.close()
    assert seen.isdisjoint(resumed) and seen | resumed == set(range(count))


def _keyless_engine_process(tmp_path: Path) -> EngineProcess:
    """``spliceway run`` with a socks inbound and a keyless control API on free ports
    (a process of its own, so its descriptor limit can be lowered)."""
    cfg = socks_and_keyless_api_config()
    return EngineProcess(cfg, tmp_path, "engine")


def _api_address(engine: EngineProcess) -> tuple[str, int]:
    """Where the started engine's control API listens."""
    url = urllib.parse.urlsplit(engine.base_url)
    assert url.hostname is not None and url.port is not None
    return url.hostname, url.port


def test_api_out_of_descriptors_backs_off_and_serves_open_connections(
    tmp_path: Path, sockets: list[socket.socket]
) -> None:
    """With the engine out of file descriptors, connections to the control API wait in
    the backlog: accepting pauses (Waitress's loop spun at a full core logging every
    failed accept, 5.5 MB/s), one warning line and one ``engine.warning``
    ``fd_exhausted`` are written, and a connection already open is still served."""
    engine = _keyless_engine_process(tmp_path)
    try:
        engine.wait_started()
        address = _api_address(engine)
        host = {"Host": f"127.0.0.1:{address[1]}"}
        kept = http.client.HTTPConnection(*address, timeout=5)
        kept.request("GET", "/api/v1/health", headers=host)
        assert kept.getresponse().read()
        hard = resource.prlimit(engine.pid, resource.RLIMIT_NOFILE)[1]
        in_use = len(os.listdir(f"/proc/{engine.pid}/fd"))
        # Room for two more descriptors: two connections are accepted, then EMFILE.
        resource.prlimit(engine.pid, resource.RLIMIT_NOFILE, (in_use + 2, hard))
        for _ in range(10):
            sockets.append(socket.create_connection(address, timeout=5))
        # The first failed accept: this build's warning, or Waitress's own log line.
        wait_until(
            lambda: any(
                line in engine.log() for line in ("cannot accept connections", "accept() threw")
            ),
            5,
            "a failed accept",
        )
        log_before = len(engine.log())
        cpu_before = cpu_seconds(engine.pid)
        time.sleep(2.0)  # measuring a rate over a fixed window, not synchronising
        cpu = cpu_seconds(engine.pid) - cpu_before
        grown = len(engine.log()) - log_before
        assert cpu < 0.5, f"the engine used {cpu:.2f} s of CPU in 2 s out of descriptors"
        assert grown < 2048, engine.log()[log_before:]
        assert engine.log().count("cannot accept connections") == 1
        assert "accept() threw an exception" not in engine.log()
        # The connection opened before the outage is still served.
        started = time.monotonic()
        kept.request("GET", "/api/v1/events?types=engine.warning", headers=host)
        answer = kept.getresponse()
        events = json.loads(answer.read())["result"]["events"]
        assert answer.status == 200 and time.monotonic() - started < 1.0
        assert [e["payload"]["code"] for e in events] == ["fd_exhausted"]
        assert "control API (127.0.0.1:" in events[0]["payload"]["message"]
        kept.close()
        # Descriptors back: the waiting connections are accepted and served.
        resource.prlimit(engine.pid, resource.RLIMIT_NOFILE, (hard, hard))
        for sock in sockets[-3:]:
            sock.sendall(b"GET /api/v1/health HTTP/1.1\r\nHost: %s\r\n\r\n" % host["Host"].encode())
            status, _, _ = _read_response(sock, 5)
            assert status == 200
        wait_until(lambda: "accepts connections again" in engine.log(), 5, "the outage's end")
    finally:
        engine.close()


def test_a_new_api_connection_is_served_on_the_reserve_descriptor(tmp_path: Path) -> None:
    """Out of descriptors, the API still answers a new connection: it gives up the one
    descriptor it holds in reserve to accept it, and takes it back when that connection
    closes, so the next new connection is answered too. The outage is still one warning."""
    engine = _keyless_engine_process(tmp_path)
    try:
        engine.wait_started()
        address = _api_address(engine)
        head = f"GET /api/v1/health HTTP/1.1\r\nHost: 127.0.0.1:{address[1]}\r\n"
        hard = resource.prlimit(engine.pid, resource.RLIMIT_NOFILE)[1]
        # No descriptor left: the lowest free number is the limit.
        in_use = len(os.listdir(f"/proc/{engine.pid}/fd"))
        resource.prlimit(engine.pid, resource.RLIMIT_NOFILE, (in_use, hard))
        for _ in range(3):
            with socket.create_connection(address, timeout=5) as sock:
                sock.sendall(f"{head}Connection: close\r\n\r\n".encode())
                status, _, _ = _read_response(sock, 5)
                assert status == 200
                assert _eof_within(sock, 5)
        assert engine.log().count("cannot accept connections") == 1
        resource.prlimit(engine.pid, resource.RLIMIT_NOFILE, (hard, hard))
    finally:
        engine.close()
