"""The http inbound keeps a client connection for its next absolute-URI request (issue 25).

Each request is a flow of its own: routed by its own target, one flow.completed, exact
bytes (bytes_up: what went to the origin for it; bytes_down: what reached the client
for it). The origin here is h11 (an independent HTTP/1.1 implementation) on a real
socket, recording each connection's requests and raw byte count.
"""

from __future__ import annotations

import hashlib
import socket
import threading

import h11
import pytest

from tests.conftest import base_config, wait_until
from tests.helpers.flows import completed, flow_events
from tests.helpers.servers import LoopbackServer


class H11Origin(LoopbackServer):
    """An HTTP/1.1 origin on h11: ``/len/N``, ``/chunked/N`` (two chunks and a trailer),
    ``/close`` (Connection: close), ``/cut`` (Content-Length 100, 40 bytes, then the
    close), ``/echo`` (the request body's length and sha256), ``/host`` (its Host)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: Per accepted connection: its requests (method, target, headers) and raw bytes.
        self.conns: list[dict] = []
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        record: dict = {"requests": [], "rx": 0}
        with self.lock:
            self.conns.append(record)
        threading.Thread(target=self._serve_conn, args=(conn, record), daemon=True).start()

    def _serve_conn(self, conn: socket.socket, record: dict) -> None:
        h = h11.Connection(h11.SERVER)
        conn.settimeout(10)
        with conn:
            while True:
                try:
                    request, body = self._read_request(conn, h, record)
                except (OSError, h11.RemoteProtocolError):
                    return
                if request is None:
                    return
                target = request.target.decode()
                headers = [(k.decode().lower(), v.decode()) for k, v in request.headers]
                with self.lock:
                    record["requests"].append((request.method.decode(), target, headers))
                if target == "/cut":
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"c" * 40)
                    return
                try:
                    self._respond(conn, h, target, headers, body, request.method == b"HEAD")
                except OSError:
                    return
                if h.our_state is h11.MUST_CLOSE or h.their_state is h11.MUST_CLOSE:
                    return
                try:
                    h.start_next_cycle()
                except h11.LocalProtocolError:
                    return

    @staticmethod
    def _read_request(conn, h, record):
        request, body = None, b""
        while True:
            event = h.next_event()
            if event is h11.NEED_DATA:
                data = conn.recv(65536)
                record["rx"] += len(data)
                h.receive_data(data)
                if not data and request is None:
                    return None, b""
                continue
            if isinstance(event, h11.Request):
                request = event
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                return request, body
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    @staticmethod
    def _respond(conn, h, target, headers, body, head_only: bool = False) -> None:
        parts = target.strip("/").split("/")
        extra = []
        if parts[0] == "len":
            payload = b"a" * int(parts[1])
        elif parts[0] == "chunked":
            half = int(parts[1]) // 2
            chunks = [b"b" * half, b"b" * (int(parts[1]) - half)]
            out = h.send(h11.Response(status_code=200, headers=[("Transfer-Encoding", "chunked")]))
            for chunk in chunks:
                out += h.send(h11.Data(data=chunk))
            out += h.send(h11.EndOfMessage(headers=[("X-T", "1")]))
            conn.sendall(out)
            return
        elif parts[0] == "close":
            payload = b"bye"
            extra = [("Connection", "close")]
        elif parts[0] == "echo":
            payload = f"{len(body)} {hashlib.sha256(body).hexdigest()}".encode()
        else:
            payload = dict(headers).get("host", "").encode()
        head = [("Content-Length", str(len(payload))), *extra]
        out = h.send(h11.Response(status_code=200, headers=head))
        # A response to HEAD has its head only (h11 refuses a body there).
        if not head_only:
            out += h.send(h11.Data(data=payload))
        out += h.send(h11.EndOfMessage())
        conn.sendall(out)


@pytest.fixture
def h11_origin():
    with H11Origin() as server:
        yield server


def read_response(sock: socket.socket, buf: bytearray) -> bytes:
    """One whole response from ``sock`` (Content-Length, chunked or until the close);
    ``buf`` holds bytes read past it, for the next call."""
    while b"\r\n\r\n" not in buf:
        data = sock.recv(65536)
        assert data, f"closed before a response head: {bytes(buf)!r}"
        buf += data
    end = buf.index(b"\r\n\r\n") + 4
    head = bytes(buf[:end]).decode("latin-1").lower()
    if "transfer-encoding: chunked" in head:
        while not buf.endswith(b"0\r\nx-t: 1\r\n\r\n") and b"\r\n0\r\n" not in buf[end:]:
            data = sock.recv(65536)
            assert data
            buf += data
        marker = bytes(buf).find(b"\r\n\r\n", bytes(buf).find(b"\r\n0\r\n", end) + 3) + 4
        out = bytes(buf[:marker])
        del buf[:marker]
        return out
    if "content-length:" in head:
        length = int(head.split("content-length:")[1].split("\r\n")[0])
        while len(buf) < end + length:
            data = sock.recv(65536)
            assert data
            buf += data
        out = bytes(buf[: end + length])
        del buf[: end + length]
        return out
    while data := sock.recv(65536):
        buf += data
    out = bytes(buf)
    buf.clear()
    return out


def connect(engine, inbound: str = "http-in") -> socket.socket:
    return socket.create_connection(engine.listen_address(inbound), timeout=10)


def get(origin: H11Origin, path: str, *extra: str, method: str = "GET") -> bytes:
    lines = [f"{method} http://127.0.0.1:{origin.port}{path} HTTP/1.1", "Host: ignored", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def records_by_start(engine, count: int) -> list[dict]:
    done = completed(engine, count)
    started = [
        e["payload"]["flow_id"] for e in flow_events(engine) if e["event_type"] == "flow.started"
    ]
    done.sort(key=lambda e: started.index(e["payload"]["flow_id"]))
    return [e["payload"]["record"] for e in done]


def assert_closed(sock: socket.socket) -> None:
    sock.settimeout(5)
    assert sock.recv(1) == b""


def one_completed_each(engine) -> None:
    ids = [
        e["payload"]["flow_id"] for e in flow_events(engine) if e["event_type"] == "flow.completed"
    ]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("inbound", ["http-in", "mixed-in"])
def test_two_keep_alive_requests_are_two_flows_with_exact_bytes(make_engine, h11_origin, inbound):
    engine = make_engine()
    buf = bytearray()
    with connect(engine, inbound) as sock:
        first = get(h11_origin, "/len/1000")
        sock.sendall(first)
        answer1 = read_response(sock, buf)
        second = get(h11_origin, "/chunked/3000")
        sock.sendall(second)
        answer2 = read_response(sock, buf)
        third = get(h11_origin, "/len/5", "Connection: close")
        sock.sendall(third)
        answer3 = read_response(sock, buf)
        assert_closed(sock)
    assert answer1.endswith(b"a" * 1000) and answer1.startswith(b"HTTP/1.1 200 ")
    assert answer2.startswith(b"HTTP/1.1 200 ") and b"bbbb" in answer2
    assert b"connection: close" in answer3.lower()
    r1, r2, r3 = records_by_start(engine, 3)
    assert len({r1["flow_id"], r2["flow_id"], r3["flow_id"]}) == 3
    exchanges = ((r1, first, answer1), (r2, second, answer2), (r3, third, answer3))
    for record, request, answer in exchanges:
        t = record["traffic"]
        assert record["result"]["outcome"] == "direct_relayed"
        assert record["inbound"]["client_protocol"] == "http"
        assert t["inbound_rx_bytes"] == len(request)
        assert t["bytes_down"] == t["inbound_tx_bytes"] == len(answer)
        assert t["outbound_tx_bytes"] == t["bytes_up"]
    # One upstream connection carried all three (the same route and target each time),
    # and the origin received exactly what the three flows say went up.
    assert len(h11_origin.conns) == 1
    assert h11_origin.conns[0]["rx"] == sum(r["traffic"]["bytes_up"] for r in (r1, r2, r3))
    assert sum(r["traffic"]["outbound_rx_bytes"] for r in (r1, r2, r3)) > 0
    one_completed_each(engine)


def test_each_request_is_routed_by_its_own_host(make_engine, h11_origin):
    cfg = base_config(rules=[{"domain": ["blocked.test"], "action": "block"}])
    engine = make_engine(cfg)
    buf = bytearray()
    with connect(engine) as sock:
        sock.sendall(get(h11_origin, "/len/3"))
        assert read_response(sock, buf).endswith(b"aaa")
        blocked = b"GET http://blocked.test/x HTTP/1.1\r\nHost: blocked.test\r\n\r\n"
        sock.sendall(blocked)
        refusal = read_response(sock, buf)
        assert refusal.startswith(b"HTTP/1.1 403 ")
        assert b"connection: keep-alive" in refusal.lower()
        # The connection is still usable after the refused request.
        sock.sendall(get(h11_origin, "/len/4"))
        assert read_response(sock, buf).endswith(b"aaaa")
    r1, r2, r3 = records_by_start(engine, 3)
    assert [r["target"]["host"] for r in (r1, r2, r3)] == ["127.0.0.1", "blocked.test", "127.0.0.1"]
    assert [r["result"]["outcome"] for r in (r1, r2, r3)] == [
        "direct_relayed",
        "blocked",
        "direct_relayed",
    ]
    assert r2["route"]["matched_rule"] is not None
    assert r2["traffic"]["inbound_rx_bytes"] == len(blocked)
    assert r2["traffic"]["inbound_tx_bytes"] == len(refusal)
    assert r2["traffic"]["bytes_up"] == r2["traffic"]["bytes_down"] == 0


def test_pipelined_requests_are_answered_in_order(make_engine, h11_origin):
    engine = make_engine()
    requests = [
        get(h11_origin, "/len/7"),
        get(h11_origin, "/echo", "Content-Length: 5", method="POST") + b"hello",
        get(h11_origin, "/chunked/10"),
        get(h11_origin, "/host", "Connection: close"),
    ]
    buf = bytearray()
    with connect(engine) as sock:
        sock.sendall(b"".join(requests))  # all in one write
        answers = [read_response(sock, buf) for _ in requests]
        assert_closed(sock)
    assert answers[0].endswith(b"a" * 7)
    assert answers[1].endswith(f"5 {hashlib.sha256(b'hello').hexdigest()}".encode())
    assert answers[3].endswith(f"127.0.0.1:{h11_origin.port}".encode())
    records = records_by_start(engine, 4)
    for record, request, answer in zip(records, requests, answers, strict=True):
        assert record["traffic"]["inbound_rx_bytes"] == len(request)
        assert record["traffic"]["bytes_down"] == len(answer)
    assert [m for c in h11_origin.conns for m, _, _ in c["requests"]] == [
        "GET",
        "POST",
        "GET",
        "GET",
    ]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "in-turn"])
def test_a_request_for_another_host_never_reaches_the_first_origin(
    make_engine, h11_origin, pipelined
):
    """Issue 26 point 6: a second absolute-URI request for a different host on the same
    client connection is routed on its own and reaches its own origin, whether it arrives
    pipelined behind the first (one write) or after the first answer."""
    engine = make_engine(base_config(rules=[{"domain": ["blocked.test"], "action": "block"}]))
    blocked = b"GET http://blocked.test/x HTTP/1.1\r\nHost: blocked.test\r\n\r\n"
    with H11Origin() as other:
        requests = [
            get(h11_origin, "/len/3"),
            get(other, "/host"),
            blocked,
            get(h11_origin, "/host", "Connection: close"),
        ]
        buf = bytearray()
        with connect(engine) as sock:
            if pipelined:
                sock.sendall(b"".join(requests))
                answers = [read_response(sock, buf) for _ in requests]
            else:
                answers = []
                for request in requests:
                    sock.sendall(request)
                    answers.append(read_response(sock, buf))
            assert_closed(sock)
        records = records_by_start(engine, 4)
        other_requests = [target for c in other.conns for _, target, _ in c["requests"]]
    assert answers[0].endswith(b"aaa")
    assert answers[1].endswith(f"127.0.0.1:{other.port}".encode())
    assert answers[2].startswith(b"HTTP/1.1 403 ")
    assert answers[3].endswith(f"127.0.0.1:{h11_origin.port}".encode())
    # Each origin saw exactly its own requests; nothing of the other host's reached it.
    first_requests = [target for c in h11_origin.conns for _, target, _ in c["requests"]]
    assert first_requests == ["/len/3", "/host"]
    assert other_requests == ["/host"]
    assert [(r["target"]["host"], r["target"]["port"]) for r in records] == [
        ("127.0.0.1", h11_origin.port),
        ("127.0.0.1", other.port),
        ("blocked.test", 80),
        ("127.0.0.1", h11_origin.port),
    ]
    assert [r["result"]["outcome"] for r in records] == [
        "direct_relayed",
        "direct_relayed",
        "blocked",
        "direct_relayed",
    ]
    for record, request, answer in zip(records, requests, answers, strict=True):
        assert record["traffic"]["inbound_rx_bytes"] == len(request)
        assert record["traffic"]["inbound_tx_bytes"] == len(answer)
    one_completed_each(engine)


def test_chunked_request_body_and_content_length_both_ways(make_engine, h11_origin):
    engine = make_engine()
    body = b"z" * 70000
    chunked = b"".join(
        b"%x;ext=1\r\n%s\r\n" % (len(piece), piece) for piece in (body[:30000], body[30000:])
    )
    chunked += b"0\r\nX-Trailer: yes\r\n\r\n"
    head = get(h11_origin, "/echo", "Transfer-Encoding: chunked", method="POST")
    buf = bytearray()
    with connect(engine) as sock:
        # The head first, the body later in pieces: the proxy streams it as it comes.
        sock.sendall(head)
        for start in range(0, len(chunked), 9000):
            sock.sendall(chunked[start : start + 9000])
        answer1 = read_response(sock, buf)
        length_head = get(h11_origin, "/echo", f"Content-Length: {len(body)}", method="POST")
        sock.sendall(length_head + body)
        answer2 = read_response(sock, buf)
    digest = hashlib.sha256(body).hexdigest()
    assert answer1.endswith(f"70000 {digest}".encode())
    assert answer2.endswith(f"70000 {digest}".encode())
    r1, r2 = records_by_start(engine, 2)
    assert r1["traffic"]["inbound_rx_bytes"] == len(head) + len(chunked)
    assert r2["traffic"]["inbound_rx_bytes"] == len(length_head) + len(body)
    assert r1["traffic"]["bytes_down"] == len(answer1)
    assert r2["traffic"]["bytes_down"] == len(answer2)
    # The chunked body went up as it came in (extensions and trailer unchanged).
    assert r1["traffic"]["bytes_up"] - len(chunked) == r2["traffic"]["bytes_up"] - len(body) - (
        len("Content-Length: 70000\r\n") - len("Transfer-Encoding: chunked\r\n")
    )
    assert h11_origin.conns[0]["rx"] == r1["traffic"]["bytes_up"] + r2["traffic"]["bytes_up"]


def test_connection_close_from_the_origin_ends_the_client_connection(make_engine, h11_origin):
    engine = make_engine()
    buf = bytearray()
    with connect(engine) as sock:
        sock.sendall(get(h11_origin, "/close"))
        answer = read_response(sock, buf)
        assert answer.endswith(b"bye")
        assert b"connection: close" in answer.lower()
        assert_closed(sock)
    (record,) = records_by_start(engine, 1)
    assert record["traffic"]["bytes_down"] == len(answer)


def test_http_1_0_closes_unless_keep_alive_is_asked(make_engine, h11_origin):
    engine = make_engine()
    buf = bytearray()
    plain = f"GET http://127.0.0.1:{h11_origin.port}/len/3 HTTP/1.0\r\n\r\n".encode()
    with connect(engine) as sock:
        sock.sendall(plain)
        answer = read_response(sock, buf)
        assert answer.endswith(b"aaa")
        assert b"connection: close" in answer.lower()
        assert_closed(sock)
    kept = (
        f"GET http://127.0.0.1:{h11_origin.port}/len/2 HTTP/1.0\r\n"
        "Proxy-Connection: keep-alive\r\n\r\n"
    ).encode()
    with connect(engine) as sock:
        sock.sendall(kept)
        answer = read_response(sock, buf)
        # h11 keeps no HTTP/1.0 connection: its close ends the client's connection too.
        assert b"connection: close" in answer.lower()
        assert_closed(sock)
    records = records_by_start(engine, 2)
    assert [r["result"]["outcome"] for r in records] == ["direct_relayed"] * 2
    # The client's hop-by-hop fields never reach the origin; our own hop asks for
    # keep-alive for the HTTP/1.0 client that asked for it.
    first, second = (c["requests"][0][2] for c in h11_origin.conns)
    assert "connection" not in dict(first) and "proxy-connection" not in dict(first)
    assert dict(second)["connection"] == "keep-alive"
    assert "proxy-connection" not in dict(second)


def test_upstream_closing_mid_response_ends_only_that_flow(make_engine, h11_origin):
    engine = make_engine()
    buf = bytearray()
    with connect(engine) as sock:
        sock.sendall(get(h11_origin, "/len/10"))
        first = read_response(sock, buf)
        sock.sendall(get(h11_origin, "/cut"))
        received = bytearray(buf)
        sock.settimeout(10)
        while data := sock.recv(65536):
            received += data
    # Head and the 40 bytes the origin sent, then the close: the client sees the cut.
    assert received.endswith(b"c" * 40)
    r1, r2 = records_by_start(engine, 2)
    assert r1["result"]["outcome"] == "direct_relayed"
    assert r1["traffic"]["bytes_down"] == len(first)
    assert r2["result"]["outcome"] == "failed"
    assert r2["result"]["failure"]["stage"] == "relay"
    assert "mid-response" in r2["result"]["failure"]["message"]
    assert r2["traffic"]["bytes_down"] == len(received)
    one_completed_each(engine)


@pytest.mark.parametrize(
    "bad",
    [
        b"GET http://x/ HTTP/1.1\r\nBad Header\r\n\r\n",
        b"GET /origin-form HTTP/1.1\r\nHost: x\r\n\r\n",
        b"\x16\x03\x01garbage\r\n\r\n",
        b"POST http://x/ HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
    ],
)
def test_malformed_second_head_gets_400_and_the_close(make_engine, h11_origin, bad):
    engine = make_engine()
    buf = bytearray()
    with connect(engine) as sock:
        sock.sendall(get(h11_origin, "/len/1"))
        read_response(sock, buf)
        sock.sendall(bad)
        answer = read_response(sock, buf)
        assert answer.startswith(b"HTTP/1.1 400 ")
        assert_closed(sock)
    (record,) = records_by_start(engine, 1)
    assert record["result"]["outcome"] == "direct_relayed"
    # No flow for the refused head, and none left open.
    wait_until(lambda: not engine._core.flow_actors, what="the connection's actor to end")
    assert len([e for e in flow_events(engine) if e["event_type"] == "flow.started"]) == 1


def test_proxy_auth_is_checked_on_every_request(make_engine, h11_origin):
    cfg = base_config()
    cfg["inbounds"][1]["users"] = [{"username": "u", "password": "p", "principal_key": "alice"}]
    engine = make_engine(cfg)
    buf = bytearray()
    with connect(engine) as sock:
        sock.sendall(get(h11_origin, "/len/1", "Proxy-Authorization: Basic dTpw"))
        read_response(sock, buf)
        sock.sendall(get(h11_origin, "/len/1"))  # no credentials this time
        assert read_response(sock, buf).startswith(b"HTTP/1.1 407 ")
        assert_closed(sock)
    (record,) = records_by_start(engine, 1)
    assert record["traffic"]["bytes_up"] > 0
    sent = h11_origin.conns[0]["requests"][0][2]
    assert "proxy-authorization" not in dict(sent)


def test_bodies_match_tinyproxy(make_engine, h11_origin, tmp_path):
    """Differential: the bodies a client gets for the same requests through tinyproxy and
    through the engine are the same. (tinyproxy 1.11 closes the client connection after
    each response, so it gets one connection per request; the engine gets them all
    pipelined on one.)"""
    from tests.helpers.upstreams import tinyproxy

    requests = [get(h11_origin, "/len/300"), get(h11_origin, "/chunked/500")]
    requests.append(get(h11_origin, "/host", "Connection: close"))

    def body(answer: bytes) -> bytes:
        raw = answer.split(b"\r\n\r\n", 1)[1]
        if b"chunked" not in answer.split(b"\r\n\r\n", 1)[0].lower():
            return raw
        decoded = h11.Connection(h11.CLIENT)
        decoded.send(h11.Request(method="GET", target="/", headers=[("Host", "x")]))
        decoded.send(h11.EndOfMessage())
        decoded.receive_data(answer)
        out = b""
        while not isinstance(event := decoded.next_event(), h11.EndOfMessage):
            if isinstance(event, h11.Data):
                out += event.data
        return out

    engine = make_engine()
    buf = bytearray()
    with connect(engine) as sock:
        sock.sendall(b"".join(requests))
        ours = [body(read_response(sock, buf)) for _ in requests]
    theirs = []
    with tinyproxy(tmp_path) as port:
        for request in requests:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(request)
                theirs.append(body(read_response(sock, bytearray())))
    assert ours == theirs
    assert ours[0] == b"a" * 300 and ours[1] == b"b" * 500


def test_repeated_identical_heads_are_each_their_own_exact_flow(
    make_engine, h11_origin, monkeypatch
):
    """A client sending the same head bytes again (the Python path reuses its parse of
    them): still a flow each with exact bytes, and the same response head to a HEAD
    request is framed as HEAD's (no body), not as the GET's that came before it. Every
    request carries a Content-Length, which C leaves to Python."""
    from spliceway.protocols import NEED_MORE
    from spliceway.protocols import http as http_proto

    parsed: list[str] = []
    reference = http_proto.parse_request_head

    def counting(buf, *args):
        head = reference(buf, *args)
        if head is not NEED_MORE:
            parsed.append(head.method)
        return head

    monkeypatch.setattr(http_proto, "parse_request_head", counting)
    engine = make_engine()
    same = get(h11_origin, "/len/5", "Content-Length: 0")
    head_req = get(h11_origin, "/len/5", "Content-Length: 0", method="HEAD")
    posted = get(h11_origin, "/echo", "Content-Length: 3", method="POST")
    sequence = [same, same, head_req, same, posted + b"abc", posted + b"xyz", same]
    buf = bytearray()
    answers = []
    with connect(engine) as sock:
        for request in sequence:
            sock.sendall(request)
            if request is head_req:
                # No body follows a response to HEAD: the head alone.
                while b"\r\n\r\n" not in buf:
                    data = sock.recv(65536)
                    assert data
                    buf += data
                end = buf.index(b"\r\n\r\n") + 4
                answers.append(bytes(buf[:end]))
                del buf[:end]
            else:
                answers.append(read_response(sock, buf))
        # Pipelined: the same head twice in one write.
        sock.sendall(same + same)
        answers += [read_response(sock, buf), read_response(sock, buf)]
        sequence += [same, same]
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(1)  # nothing more: every answer was exactly one response
    assert answers[0] == answers[1] == answers[3] == answers[-1]
    assert answers[0].endswith(b"\r\n\r\naaaaa")
    assert answers[2].startswith(b"HTTP/1.1 200 ") and answers[2].endswith(b"\r\n\r\n")
    assert answers[4].endswith(f"3 {hashlib.sha256(b'abc').hexdigest()}".encode())
    assert answers[5].endswith(f"3 {hashlib.sha256(b'xyz').hexdigest()}".encode())
    records = records_by_start(engine, len(sequence))
    assert len({r["flow_id"] for r in records}) == len(sequence)
    for record, request, answer in zip(records, sequence, answers, strict=True):
        t = record["traffic"]
        assert record["result"]["outcome"] == "direct_relayed"
        assert t["inbound_rx_bytes"] == len(request)
        assert t["bytes_down"] == t["inbound_tx_bytes"] == len(answer)
    assert len(h11_origin.conns) == 1
    assert h11_origin.conns[0]["rx"] == sum(r["traffic"]["bytes_up"] for r in records)
    methods = [m for m, _, _ in h11_origin.conns[0]["requests"]]
    assert methods == ["GET", "GET", "HEAD", "GET", "POST", "POST", "GET", "GET", "GET"]
    # Parsed: the first (the handshake) and each head that differs from the one before
    # it (2nd, HEAD, 4th, 1st POST, 7th); the 3rd, the 2nd POST and the pipelined two
    # were their predecessor's bytes again.
    assert parsed == ["GET", "GET", "HEAD", "GET", "POST", "GET"]
    one_completed_each(engine)


def conn_stats(engine) -> dict[str, int]:
    return engine._core.bridge.conn.stats()


def test_c_forwards_plain_requests_and_python_takes_over_the_rest(make_engine, h11_origin):
    """GETs in C's subset are forwarded by the C connection loop itself (a STARTED /
    ROUTED / ENDED triple each, no hand-over); a chunked answer goes to Python mid-way
    (SW_DEFER_FORWARD) and a request with a body at its head; every request is still
    one flow with exact bytes, and the origin got exactly what the flows say."""
    engine = make_engine()
    before = conn_stats(engine)
    buf = bytearray()
    plain = get(h11_origin, "/len/700")
    exchanges = []
    with connect(engine) as sock:
        for request in (plain, plain, get(h11_origin, "/len/3", method="HEAD"), plain):
            sock.sendall(request)
            if b"HEAD " in request:
                while b"\r\n\r\n" not in buf:
                    buf += sock.recv(65536)
                end = buf.index(b"\r\n\r\n") + 4
                answer = bytes(buf[:end])
                del buf[:end]
            else:
                answer = read_response(sock, buf)
            exchanges.append((request, answer))
        # C counts a forwarded request ended once its loop has written the answer, which
        # the client can have read first: settled, the counts must be exact.
        after_plain = wait_until(
            lambda: (stats := conn_stats(engine))["ended"] - before["ended"] >= 4 and stats,
            what="C's four forwarded requests ended",
        )
        chunked = get(h11_origin, "/chunked/3000")  # C sends it up; Python takes the answer
        sock.sendall(chunked)
        exchanges.append((chunked, read_response(sock, buf)))
        posted = get(h11_origin, "/echo", "Content-Length: 2", method="POST") + b"hi"
        sock.sendall(posted)
        exchanges.append((posted, read_response(sock, buf)))
        last = get(h11_origin, "/len/1", "Connection: close")
        sock.sendall(last)
        exchanges.append((last, read_response(sock, buf)))
        assert_closed(sock)
    for _, answer in exchanges:
        assert answer.startswith(b"HTTP/1.1 200 ")
    assert exchanges[0][1].endswith(b"a" * 700) and b"connection" not in exchanges[0][1].lower()
    assert exchanges[4][1].count(b"b") >= 3000
    assert exchanges[5][1].endswith(f"2 {hashlib.sha256(b'hi').hexdigest()}".encode())
    # The first four were C's: started and ended there, nothing deferred.
    assert after_plain["started"] - before["started"] == 4
    assert after_plain["ended"] - before["ended"] == 4
    assert after_plain["deferred"] == before["deferred"]
    records = records_by_start(engine, len(exchanges))
    assert len({r["flow_id"] for r in records}) == len(exchanges)
    for record, (request, answer) in zip(records, exchanges, strict=True):
        t = record["traffic"]
        assert record["result"]["outcome"] == "direct_relayed", record
        # Forwarded, whether C or Python (or C, then Python) served it.
        assert record["inbound"] == {
            "tag": "http-in",
            "protocol": "http",
            "client_protocol": "http",
        }
        assert t["inbound_rx_bytes"] == len(request)
        assert t["bytes_down"] == t["inbound_tx_bytes"] == len(answer)
        assert t["outbound_tx_bytes"] == t["bytes_up"]
        assert record["target"]["host"] == "127.0.0.1"
        assert record["path"]["remote"] == {"host": "127.0.0.1", "port": h11_origin.port}
    # C's upstream connection served its requests and the chunked one; Python, taking
    # the connection over, kept that one for the POST and the last GET.
    assert sum(c["rx"] for c in h11_origin.conns) == sum(r["traffic"]["bytes_up"] for r in records)
    assert len(h11_origin.conns) == 1
    one_completed_each(engine)


def test_c_forwarded_request_whose_dial_fails_keeps_the_connection(make_engine, h11_origin):
    """A refused dial of a request C forwards: Python's answer (502, keep-alive for a
    client that keeps its connection), a failed flow, and the next request served."""
    engine = make_engine()
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    port = dead.getsockname()[1]
    dead.close()  # nothing listens there now
    buf = bytearray()
    with connect(engine) as sock:
        refused = f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n".encode()
        sock.sendall(refused)
        answer = read_response(sock, buf)
        sock.sendall(get(h11_origin, "/len/2"))
        assert read_response(sock, buf).endswith(b"aa")
    message = f"connect to 127.0.0.1:{port} failed: Connection refused\n".encode()
    assert answer == (
        b"HTTP/1.1 502 Bad Gateway\r\nConnection: keep-alive\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(message), message)
    )
    r1, r2 = records_by_start(engine, 2)
    assert r1["result"]["outcome"] == "failed"
    assert r1["result"]["failure"]["code"] == "connection_refused"
    assert r1["traffic"]["inbound_rx_bytes"] == len(refused)
    assert r1["traffic"]["inbound_tx_bytes"] == len(answer)
    assert r2["result"]["outcome"] == "direct_relayed"


def test_c_forwarded_request_to_a_quiet_or_long_answer(make_engine, h11_origin):
    """The upstream goes quiet (runtime.tcp_idle_timeout_seconds): the client gets
    Python's 502 and the close, the flow fails as _upstream_failed fails it; a long
    answer (past what C buffers) goes to Python with what C read, byte for byte."""
    engine = make_engine(base_config(runtime={"tcp_idle_timeout_seconds": 1}))
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    waiter = threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True)
    waiter.start()
    buf = bytearray()
    try:
        with connect(engine) as sock:
            long = get(h11_origin, "/len/40000")
            sock.sendall(long)
            long_answer = read_response(sock, buf)
        # A connection of its own: the first one is Python's since its long answer.
        with connect(engine) as sock:
            quiet = f"GET http://127.0.0.1:{silent.getsockname()[1]}/ HTTP/1.1\r\n\r\n".encode()
            sock.sendall(quiet)
            sock.settimeout(8)
            answer = read_response(sock, buf)
            assert_closed(sock)
    finally:
        silent.close()
        waiter.join(5)
        for conn in accepted:
            conn.close()
    assert long_answer.endswith(b"a" * 40000)
    body = b"upstream connection failed: timed out\n"
    assert answer == (
        b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s"
        % (len(body), body)
    )
    r1, r2 = records_by_start(engine, 2)
    assert r1["result"]["outcome"] == "direct_relayed"
    assert r1["traffic"]["bytes_down"] == len(long_answer)
    assert r1["traffic"]["inbound_rx_bytes"] == len(long)
    assert r2["result"]["outcome"] == "failed"
    assert r2["result"]["close_reason"] == "upstream_error"
    assert r2["result"]["failure"]["message"] == body.decode().strip()
    assert r2["traffic"]["inbound_tx_bytes"] == len(answer)
    assert r2["traffic"]["bytes_down"] == 0
    assert r2["traffic"]["bytes_up"] == r2["traffic"]["outbound_tx_bytes"] > 0


def test_flows_close_on_a_request_c_forwards(make_engine):
    """flows.close while C waits for a forwarded request's answer: the flow ends cancelled
    (manual), once, and the client connection closes; no second close finds it."""
    engine = make_engine()
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    waiter = threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True)
    waiter.start()
    try:
        with connect(engine) as sock:
            port = silent.getsockname()[1]
            request = f"GET http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n".encode()
            sock.sendall(request)
            flows = wait_until(
                lambda: [
                    f for f in engine.query("flows")["active_flows"] if f["state"] == "active"
                ],
                timeout=5,
                what="the forwarded request's flow, routed",
            )
            (flow,) = flows
            assert engine.execute("flows.close", {"flow_id": flow["flow_id"]}) == {
                "flow_id": flow["flow_id"],
                "closed": True,
            }
            assert_closed(sock)
    finally:
        silent.close()
        waiter.join(5)
        for conn in accepted:
            conn.close()
    (record,) = records_by_start(engine, 1)
    assert record["flow_id"] == flow["flow_id"]
    assert record["result"]["outcome"] == "cancelled"
    assert record["result"]["close_reason"] == "manual"
    assert record["traffic"]["inbound_rx_bytes"] == len(request)
    one_completed_each(engine)


def test_a_socks5_greeting_after_forwarded_requests_on_a_mixed_port_is_a_bad_head(
    make_engine, h11_origin
):
    """On a mixed inbound, a connection that carried HTTP requests (C forwarded them)
    stays HTTP: SOCKS5 bytes next are a malformed head (400 and the close), as on the
    Python path, not a new SOCKS5 handshake."""
    engine = make_engine()
    buf = bytearray()
    with connect(engine, "mixed-in") as sock:
        sock.sendall(get(h11_origin, "/len/3"))
        assert read_response(sock, buf).endswith(b"aaa")
        sock.sendall(b"\x05\x01\x00")
        answer = read_response(sock, buf)
        assert_closed(sock)
    assert answer.startswith(b"HTTP/1.1 400 ")
    (record,) = records_by_start(engine, 1)
    assert record["result"]["outcome"] == "direct_relayed"
