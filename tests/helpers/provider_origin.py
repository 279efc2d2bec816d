"""A subscription origin for the provider tests: a threaded HTTP/1.1 server on loopback whose
answer per path the test sets (and changes) while it runs.

Each path serves a queue of :class:`Answer`s: the first is served (and dropped, unless it
is the last, which stays) on every request, so a test scripts "good, then 500, then the
new body". Answers may be a body with headers, a status, a reset (RST, no answer), a
stall (headers sent, then nothing until the server closes), an oversized body streamed
without ``Content-Length``, or a redirect. With ``tls`` the server speaks HTTPS with a
certificate signed by a CA made for the test (:func:`make_ca`); the client side trusts it
through ``SSL_CERT_FILE``.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import ssl
import struct
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers.servers import LoopbackServer, read_head


@dataclass
class Answer:
    """One scripted answer."""

    body: bytes = b""
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    #: ``reset``: close with RST before answering; ``stall``: send the head, then nothing;
    #: ``stream``: send the body chunked (no Content-Length).
    mode: str = ""
    #: Answer only once this is set (a test holds a refresh mid-way).
    gate: threading.Event | None = None


class ProviderOrigin(LoopbackServer):
    """See the module docstring. ``requests`` counts requests per path; ``heads`` keeps
    every request head received."""

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        self._lock = threading.Lock()
        self._answers: dict[str, deque[Answer]] = {}
        self.requests: dict[str, int] = {}
        self.heads: list[bytes] = []
        self._context = context
        self._stalled: list[socket.socket] = []
        super().__init__()

    def url(self, path: str) -> str:
        scheme = "https" if self._context is not None else "http"
        return f"{scheme}://127.0.0.1:{self.port}{path}"

    def serve(self, path: str, *answers: Answer) -> None:
        """Replace the answers of ``path`` (the last one stays)."""
        with self._lock:
            self._answers[path] = deque(answers)

    def count(self, path: str) -> int:
        with self._lock:
            return self.requests.get(path, 0)

    def _next(self, path: str) -> Answer | None:
        with self._lock:
            self.requests[path] = self.requests.get(path, 0) + 1
            queue = self._answers.get(path)
            if not queue:
                return None
            return queue.popleft() if len(queue) > 1 else queue[0]

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        try:
            if self._context is not None:
                conn = self._context.wrap_socket(conn, server_side=True)
            head = read_head(conn)
            with self._lock:
                self.heads.append(head)
            path = head.split(b" ", 2)[1].decode().split("?")[0]
            answer = self._next(path)
            if answer is None:
                answer = Answer(b"not found", 404)
            self._send(conn, answer)
        except (OSError, IndexError, ValueError):
            pass  # not a request (a TLS client on the plain server, a closed socket)
        finally:
            if conn not in self._stalled:
                with contextlib.suppress(OSError):
                    conn.close()

    def _send(self, conn: socket.socket, answer: Answer) -> None:
        if answer.gate is not None:
            answer.gate.wait(30)
        if answer.mode == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            return
        lines = [f"HTTP/1.1 {answer.status} X"]
        headers = dict(answer.headers)
        if answer.mode == "stream":
            headers["Transfer-Encoding"] = "chunked"
        elif answer.mode != "stall":
            headers.setdefault("Content-Length", str(len(answer.body)))
        headers.setdefault("Connection", "close")
        lines += [f"{k}: {v}" for k, v in headers.items()]
        conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        if answer.mode == "stall":
            with self._lock:
                self._stalled.append(conn)
            return
        if answer.mode == "stream":
            step = 64 * 1024
            for i in range(0, len(answer.body), step):
                chunk = answer.body[i : i + step]
                conn.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            conn.sendall(b"0\r\n\r\n")
            return
        conn.sendall(answer.body)

    def close(self) -> None:
        super().close()
        with self._lock:
            stalled, self._stalled = self._stalled, []
        for conn in stalled:
            with contextlib.suppress(OSError):
                conn.close()


@contextlib.contextmanager
def provider_origin(context: ssl.SSLContext | None = None) -> Iterator[ProviderOrigin]:
    """A :class:`ProviderOrigin`, closed on exit."""
    origin = ProviderOrigin(context)
    try:
        yield origin
    finally:
        origin.close()


def make_ca(directory: Path) -> tuple[Path, ssl.SSLContext]:
    """A CA (its certificate written to ``directory/ca.pem``) and a server context whose
    certificate, for ``127.0.0.1``, it signed."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "spliceway test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(
            x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    ca_path = directory / "ca.pem"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    cert_path = directory / "server.pem"
    cert_path.write_bytes(
        cert.public_bytes(serialization.Encoding.PEM)
        + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert_path)
    return ca_path, context
