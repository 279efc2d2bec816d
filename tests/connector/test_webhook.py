"""WebhookClient against real loopback servers: the receiver helper and raw-socket peers."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from spliceway import __version__
from spliceway.connector.webhook import DeliveryError, Response, WebhookClient
from tests.helpers.receiver import Receiver, Reply


@pytest.fixture
def receiver():
    with Receiver() as r:
        yield r


@pytest.fixture
def client_for():
    clients = []

    def make(url, headers=None, timeout_ms=2000, **kwargs):
        client = WebhookClient(url, headers, timeout_ms, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def read_request(conn: socket.socket) -> bytes:
    """One whole request (head and Content-Length body) from ``conn``; b"" at EOF."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        chunk = conn.recv(65536)
        if not chunk:
            return b""
        body += chunk
    return head + b"\r\n\r\n" + body


class RawServer:
    """A loopback peer that runs ``handler(conn)`` for each connection, in a thread."""

    def __init__(self, handler):
        self.handler = handler
        self.connections = 0
        self.captured: list[bytes] = []
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}/hook"
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self):
        while not self.stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            self.connections += 1
            self._conns.append(conn)
            thread = threading.Thread(target=self._run, args=(conn,), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _run(self, conn):
        conn.settimeout(5)
        with contextlib.suppress(OSError):
            self.handler(self, conn)
        conn.close()

    def close(self):
        self.stop.set()
        self._acceptor.join()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in self._threads:
            thread.join()
        self._listener.close()


def post_in_thread(client: WebhookClient) -> tuple[threading.Thread, list[str]]:
    """Start ``client.post(b"{}")`` on a thread; the list collects its DeliveryError text."""
    errors: list[str] = []

    def post():
        try:
            client.post(b"{}")
        except DeliveryError as exc:
            errors.append(str(exc))

    thread = threading.Thread(target=post)
    thread.start()
    return thread, errors


@pytest.fixture
def raw_server():
    servers = []

    def make(handler):
        server = RawServer(handler)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


def serve_forever(answer: bytes, *, close_after=False):
    """A handler that answers every request with ``answer`` bytes."""

    def handler(server, conn):
        while request := read_request(conn):
            server.captured.append(request)
            conn.sendall(answer)
            if close_after:
                return

    return handler


def test_status_and_retry_after_pass_through(receiver, client_for):
    receiver.script(
        Reply(200),
        Reply(201),
        Reply(204),
        Reply(404),
        Reply(500),
        Reply(429, {"Retry-After": "7"}),
        Reply(503, {"retry-after": "Wed, 21 Oct 2099 07:28:00 GMT"}),
    )
    client = client_for(receiver.url)
    results = [client.post(b"{}") for _ in range(7)]
    assert results == [
        Response(200, None),
        Response(201, None),
        Response(204, None),
        Response(404, None),
        Response(500, None),
        Response(429, "7"),
        Response(503, "Wed, 21 Oct 2099 07:28:00 GMT"),
    ]


def test_receiver_gets_the_exact_body_and_headers(receiver, client_for):
    client = client_for(
        receiver.url + "?token=a%20b&x=1",
        {"Authorization": "Bearer s3cret", "X-Extra": "1", "Host": "evil", "content-length": "9"},
    )
    body = b'{"event_id":"e-1","data":"\xc3\xa9"}'
    assert client.post(body).status == 200
    (got,) = receiver.wait_for(1)
    assert (got.method, got.path, got.body) == ("POST", "/hook?token=a%20b&x=1", body)
    assert got.headers == {
        "host": f"127.0.0.1:{receiver.port}",
        "content-type": "application/json",
        "user-agent": f"spliceway/{__version__}",
        "authorization": "Bearer s3cret",
        "x-extra": "1",
        "content-length": str(len(body)),
    }


def test_request_bytes_on_the_wire(raw_server, client_for):
    server = raw_server(serve_forever(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"))
    client = client_for(server.url, {"content-type": "application/cloudevents+json"})
    client.post(b"[1]")
    port = server.url.split(":")[2].split("/")[0]
    assert server.captured == [
        b"POST /hook HTTP/1.1\r\n"
        b"Host: 127.0.0.1:" + port.encode() + b"\r\n"
        b"content-type: application/cloudevents+json\r\n"
        b"User-Agent: spliceway/" + __version__.encode() + b"\r\n"
        b"Content-Length: 3\r\n\r\n[1]"
    ]


def test_one_connection_carries_many_posts(receiver, client_for):
    client = client_for(receiver.url)
    for i in range(50):
        assert client.post(b'{"event_id":"%d"}' % i).status == 200
    assert receiver.connections == 1
    assert sorted(receiver.bodies_by_event_id(), key=int) == [str(i) for i in range(50)]


def test_server_closing_an_idle_connection_is_a_transparent_reconnect(raw_server, client_for):
    # No "Connection: close": the client only learns of the close when it reuses the socket.
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    server = raw_server(serve_forever(answer, close_after=True))
    client = client_for(server.url)
    for _ in range(5):
        assert client.post(b"{}").status == 200
    assert server.connections == 5
    assert len(server.captured) == 5


def test_stale_retry_happens_once_only(raw_server, client_for):
    def read_and_hang_up(server, conn):
        if server.connections == 1:
            read_request(conn)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
            read_request(conn)  # the client's second post on this connection
        else:
            read_request(conn)  # every later request: read, then close without an answer

    server = raw_server(read_and_hang_up)
    client = client_for(server.url)
    assert client.post(b"{}").status == 200
    with pytest.raises(DeliveryError, match="closed before a full response"):
        client.post(b"{}")
    assert server.connections == 2


def test_connection_close_from_the_server_is_honoured(receiver, client_for):
    receiver.default = Reply(200, {"Connection": "close"})
    client = client_for(receiver.url)
    for _ in range(3):
        assert client.post(b"{}").status == 200
    assert receiver.connections == 3


def test_chunked_response_then_keep_alive(raw_server, client_for):
    answer = (
        b"HTTP/1.1 202 Accepted\r\nTransfer-Encoding: chunked\r\nRetry-After: 1\r\n\r\n"
        b"5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    )
    server = raw_server(serve_forever(answer))
    client = client_for(server.url)
    assert client.post(b"{}") == Response(202, "1")
    assert client.post(b"{}") == Response(202, "1")
    assert server.connections == 1


def test_response_without_length_reads_to_close(raw_server, client_for):
    server = raw_server(serve_forever(b"HTTP/1.1 200 OK\r\n\r\nsome body", close_after=True))
    client = client_for(server.url)
    assert client.post(b"{}").status == 200
    assert client.post(b"{}").status == 200
    assert server.connections == 2


def test_interim_100_continue_is_skipped(raw_server, client_for):
    answer = b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"
    server = raw_server(serve_forever(answer))
    client = client_for(server.url)
    assert client.post(b"{}").status == 201
    assert client.post(b"{}").status == 201
    assert server.connections == 1


def test_huge_response_body_is_dropped_not_read(raw_server, client_for):
    size = 100 * 1024 * 1024
    sent = []

    def firehose(server, conn):
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        chunk = b"x" * 65536
        total = 0
        with contextlib.suppress(OSError):
            while total < size:
                total += conn.send(chunk)
        sent.append(total)

    server = raw_server(firehose)
    client = client_for(server.url)
    start = time.monotonic()
    assert client.post(b"{}").status == 200
    assert time.monotonic() - start < 1.0
    server.close()
    assert sent[0] < size  # the client hung up long before the body's end
    assert server.connections == 1


def test_redirect_is_a_status_not_followed(receiver, client_for):
    receiver.script(Reply(301, {"Location": "http://127.0.0.1:1/elsewhere"}))
    client = client_for(receiver.url)
    assert client.post(b"{}") == Response(301, None)
    assert len(receiver.requests) == 1


def test_silent_server_times_out_within_the_deadline(receiver, client_for):
    receiver.script(Reply(hang=True))
    client = client_for(receiver.url, timeout_ms=300)
    start = time.monotonic()
    with pytest.raises(DeliveryError, match=r"^timeout after 300 ms$"):
        client.post(b"{}")
    assert 0.29 <= time.monotonic() - start < 0.8


def test_headers_then_stall_times_out(raw_server, client_for):
    def stall(server, conn):
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab")
        server.stop.wait()

    server = raw_server(stall)
    client = client_for(server.url, timeout_ms=300)
    start = time.monotonic()
    with pytest.raises(DeliveryError, match="timeout after 300 ms"):
        client.post(b"{}")
    assert 0.29 <= time.monotonic() - start < 0.8


def test_reset_mid_response(receiver, client_for):
    receiver.script(Reply(reset=True))
    client = client_for(receiver.url)
    with pytest.raises(DeliveryError) as info:
        client.post(b"{}")
    assert str(info.value) in ("connection reset", "connection closed before a full response")
    assert client.post(b"{}").status == 200  # the next post gets a fresh connection


def test_close_before_the_full_body(raw_server, client_for):
    def truncate(server, conn):
        read_request(conn)
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab")

    client = client_for(raw_server(truncate).url)
    with pytest.raises(DeliveryError, match=r"^connection closed before a full response$"):
        client.post(b"{}")


def test_malformed_response(raw_server, client_for):
    client = client_for(raw_server(serve_forever(b"SMTP ready\r\n\r\n")).url)
    with pytest.raises(DeliveryError, match=r"^malformed response$"):
        client.post(b"{}")


def test_connection_refused(client_for):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = client_for(f"http://127.0.0.1:{port}/hook")
    with pytest.raises(DeliveryError, match=r"^connection refused$"):
        client.post(b"{}")


def test_abort_unblocks_a_hung_post_from_another_thread(receiver, client_for):
    receiver.script(Reply(hang=True))
    client = client_for(receiver.url, timeout_ms=10_000)
    thread, errors = post_in_thread(client)
    receiver.wait_for(1)
    aborted_at = time.monotonic()
    client.abort()
    thread.join(timeout=5)
    assert not thread.is_alive()
    assert errors == ["aborted"]
    assert time.monotonic() - aborted_at < 0.5
    with pytest.raises(DeliveryError, match=r"^aborted$"):
        client.post(b"{}")
    assert len(receiver.requests) == 1  # no retry on a fresh connection after abort


def test_tls_failure_is_a_delivery_error(raw_server, client_for):
    # A plain-HTTP peer behind an https:// URL answers the ClientHello with plaintext.
    def plaintext(server, conn):
        conn.recv(65536)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    server = raw_server(plaintext)
    client = client_for(server.url.replace("http://", "https://"))
    with pytest.raises(DeliveryError, match=r"^tls failure"):
        client.post(b"{}")


@pytest.mark.parametrize(
    ("url", "headers"),
    [
        ("ftp://127.0.0.1/x", None),
        ("http:///nohost", None),
        ("http://127.0.0.1/a b", None),
        ("http://127.0.0.1/", {"X-Bad": "a\r\nInjected: 1"}),
        ("http://127.0.0.1/", {"Bad Name": "1"}),
        ("http://127.0.0.1/", {"X": "\u2603"}),
    ],
)
def test_unusable_urls_and_headers_are_refused(url, headers):
    with pytest.raises(ValueError, match=r"\S"):
        WebhookClient(url, headers, 1000)


def test_url_credentials_become_basic_auth(receiver, client_for):
    client = client_for(receiver.url.replace("http://", "http://us%40er:p%3Ass@"))
    client.post(b"{}")
    # "us@er:p:ss" in base64
    assert receiver.wait_for(1)[0].headers["authorization"] == "Basic dXNAZXI6cDpzcw=="


def test_receiver_records_before_replying_and_runs_before_hooks(receiver, client_for):
    seen = []

    def before(request):
        seen.append((len(receiver.requests), request.body))

    receiver.script(Reply(202, before=before))
    client = client_for(receiver.url)
    assert client.post(b'{"event_id":"x"}').status == 202
    assert seen == [(1, b'{"event_id":"x"}')]
    assert receiver.bodies_by_event_id() == {"x": [b'{"event_id":"x"}']}


def test_receiver_serves_concurrent_connections(receiver):
    receiver.script(Reply(hang=True))
    hung = WebhookClient(receiver.url, None, 5000)
    thread, errors = post_in_thread(hung)
    receiver.wait_for(1)
    other = WebhookClient(receiver.url, None, 2000)
    assert other.post(b"{}").status == 200
    other.close()
    receiver.close()  # releases the hung request: the client sees EOF, not a 5 s timeout
    thread.join(timeout=2)
    assert not thread.is_alive()
    assert errors == ["connection closed before a full response"]
    hung.close()


def test_receiver_wait_for_reports_a_shortfall(receiver):
    with pytest.raises(AssertionError, match="got 0 of 1 requests"):
        receiver.wait_for(1, timeout=0.05)


def test_a_body_larger_than_the_socket_buffer_is_sent_whole(receiver, client_for):
    body = b'{"event_id":"big","pad":"' + b"x" * (8 * 1024 * 1024) + b'"}'
    client = client_for(receiver.url, timeout_ms=5000)
    assert client.post(body).status == 200
    assert client.post(b'{"event_id":"small"}').status == 200
    assert [r.body for r in receiver.wait_for(2)] == [body, b'{"event_id":"small"}']
    assert receiver.connections == 1


@pytest.fixture(scope="module")
def tls_pair():
    """A server context with a fresh self-signed cert for 127.0.0.1, and a client trusting it."""
    import datetime
    import ipaddress
    import ssl

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_pem = cert.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = f"{tmp}/cert.pem", f"{tmp}/key.pem"
        with open(cert_path, "wb") as f:
            f.write(cert_pem)
        with open(key_path, "wb") as f:
            f.write(key_pem)
        server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        server.load_cert_chain(cert_path, key_path)
    client = ssl.create_default_context(cadata=cert_pem.decode())
    return server, client


def tls_handler(server_ctx, inner):
    def handler(server, conn):
        with server_ctx.wrap_socket(conn, server_side=True) as tls:
            inner(server, tls)

    return handler


def test_https_keep_alive_with_a_trusted_cert(tls_pair, raw_server, client_for):
    server_ctx, client_ctx = tls_pair
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    server = raw_server(tls_handler(server_ctx, serve_forever(answer)))
    client = client_for(server.url.replace("http://", "https://"), ssl_context=client_ctx)
    assert [client.post(b'{"n":%d}' % i).status for i in range(3)] == [200, 200, 200]
    assert server.connections == 1
    assert server.captured[0].endswith(b'\r\n\r\n{"n":0}')


def test_https_with_an_untrusted_cert_is_a_tls_failure(tls_pair, raw_server, client_for):
    server_ctx, _ = tls_pair
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
    server = raw_server(tls_handler(server_ctx, serve_forever(answer)))
    client = client_for(server.url.replace("http://", "https://"))
    with pytest.raises(DeliveryError, match=r"^tls failure: .*certificate"):
        client.post(b"{}")


def test_https_timeout_and_abort(tls_pair, raw_server, client_for):
    server_ctx, client_ctx = tls_pair
    requests = []
    second_request = threading.Event()

    def silent(server, tls):
        requests.append(read_request(tls))
        if len(requests) == 2:
            second_request.set()
        server.stop.wait()

    server = raw_server(tls_handler(server_ctx, silent))
    url = server.url.replace("http://", "https://")
    quick = client_for(url, timeout_ms=300, ssl_context=client_ctx)
    start = time.monotonic()
    with pytest.raises(DeliveryError, match="timeout after 300 ms"):
        quick.post(b"{}")
    assert 0.29 <= time.monotonic() - start < 0.8

    slow = client_for(url, timeout_ms=10_000, ssl_context=client_ctx)
    thread, errors = post_in_thread(slow)
    assert second_request.wait(5)
    slow.abort()
    thread.join(timeout=2)
    assert not thread.is_alive()
    assert errors == ["aborted"]
