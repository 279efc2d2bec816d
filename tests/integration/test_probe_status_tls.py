"""``diagnostics.probe_outbound`` as mihomo's delay test: ``https://`` URLs (TLS with SNI
over the dialed connection, verified against the trust store), the answer's status
against ``expected_status``, ``timeout_ms``, and the result recorded as the target's
latest health.

The TLS origin's certificate is issued by a CA this test makes with ``cryptography``;
the engine trusts it through ``SSL_CERT_FILE`` (OpenSSL's default trust store reads it
at each probe), the way an operator trusts a private CA, with no parameter of ours.
"""

from __future__ import annotations

import datetime
import http.server
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from spliceway.errors import ApiError
from tests.conftest import base_config
from tests.helpers.servers import serving
from tests.helpers.upstreams import microsocks, ss_server

SS_METHOD = "aes-256-gcm"
SS_PASSWORD = "secret"


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def make_pki(tmp: Path, host: str = "localhost") -> tuple[Path, Path, Path]:
    """A CA and a leaf for the name ``host`` only: (ca.pem, leaf.pem, leaf.key)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("spliceway test CA"))
        .issuer_name(_name("spliceway test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name(host))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName(host)]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), False)
        .sign(ca_key, hashes.SHA256())
    )
    ca_pem, leaf_pem, key_pem = tmp / "ca.pem", tmp / "leaf.pem", tmp / "leaf.key"
    ca_pem.write_bytes(_pem(ca))
    leaf_pem.write_bytes(_pem(leaf))
    key_pem.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return ca_pem, leaf_pem, key_pem


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        server: StatusOrigin = self.server  # type: ignore[assignment]
        with server.lock:
            server.requests.append((self.path, self.headers.get("Host")))
        status = int(self.path.strip("/") or 204)
        self.send_response(status)
        self.send_header("Content-Length", "0")
        self.end_headers()


class StatusOrigin(http.server.ThreadingHTTPServer):
    """An origin answering ``HEAD /<status>`` with that status, over TLS when given a
    context; it records each request's path and Host, and the SNI of each handshake."""

    daemon_threads = True

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str | None]] = []
        #: The server name of each TLS handshake, verified or not.
        self.sni_seen: list[str | None] = []
        if context is not None:
            context.sni_callback = self._sni
            self.socket = context.wrap_socket(self.socket, server_side=True)

    def _sni(self, _sock: Any, name: str | None, _ctx: Any) -> None:
        with self.lock:
            self.sni_seen.append(name)

    @property
    def port(self) -> int:
        return int(self.server_address[1])


@pytest.fixture
def pki(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The test CA trusted through SSL_CERT_FILE; yields (leaf.pem, leaf.key)."""
    ca, leaf, key = make_pki(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    return leaf, key


@pytest.fixture
def tls_origin(pki: tuple[Path, Path]) -> Iterator[StatusOrigin]:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*pki)
    with serving(StatusOrigin(context)) as origin:
        yield origin


@pytest.fixture
def plain_origin() -> Iterator[StatusOrigin]:
    with serving(StatusOrigin()) as origin:
        yield origin


def probe(engine: Any, target: str = "direct", **params: Any) -> dict[str, Any]:
    result: dict[str, Any] = engine.execute(
        "diagnostics.probe_outbound", {"target_tag": target, **params}
    )
    return result


def test_https_probe_verifies_and_sends_sni(make_engine, tls_origin) -> None:
    engine = make_engine(base_config())
    # The certificate names localhost only: by its address the origin is refused.
    refused = probe(engine, url=f"https://127.0.0.1:{tls_origin.port}/204")
    assert (refused["reachable"], refused["latency_ms"], refused["status"]) == (False, None, None)
    assert refused["error"].startswith("TLS: ") and "CERTIFICATE_VERIFY_FAILED" in refused["error"]
    assert tls_origin.requests == []

    ok = probe(engine, url=f"https://localhost:{tls_origin.port}/204")
    assert ok["reachable"] is True, ok
    assert ok["status"] == 204 and ok["timed_out"] is False
    assert 0 < ok["latency_ms"] < 5000
    assert tls_origin.requests == [("/204", f"localhost:{tls_origin.port}")]
    # No SNI for an address (RFC 6066), the name for a name.
    assert tls_origin.sni_seen == [None, "localhost"]


def test_https_is_refused_without_the_ca(make_engine, tls_origin, monkeypatch) -> None:
    """Without SSL_CERT_FILE only the system's store is trusted: the test CA is not."""
    monkeypatch.delenv("SSL_CERT_FILE")
    engine = make_engine(base_config())
    refused = probe(engine, url=f"https://localhost:{tls_origin.port}/204")
    assert refused["reachable"] is False and "CERTIFICATE_VERIFY_FAILED" in refused["error"]
    assert tls_origin.requests == []


def test_expected_status_ranges(make_engine, plain_origin) -> None:
    engine = make_engine(base_config())
    base = f"http://127.0.0.1:{plain_origin.port}"
    cases = [
        ("/204", None, True),
        ("/204", "", True),
        ("/204", "*", True),
        ("/204", "204", True),
        ("/204", "200", False),
        ("/204", "200/204", True),
        ("/204", "200,204", True),
        ("/301", "200-299", False),
        ("/299", "200-299", True),
        ("/503", "200/204/401-429/501-503", True),
        ("/500", "200/204/401-429/501-503", False),
    ]
    for path, expected, passes in cases:
        params: dict[str, Any] = {"url": base + path}
        if expected is not None:
            params["expected_status"] = expected
        result = probe(engine, **params)
        assert result["status"] == int(path[1:]), (path, expected, result)
        assert result["reachable"] is passes, (path, expected, result)
        if passes:
            assert result["latency_ms"] > 0 and "error" not in result
        else:
            assert result["latency_ms"] is None
            assert result["error"] == f"status {path[1:]}, not an expected status"

    for bad in ("abc", "200-", "1-2-3", "300-200", "/".join(["200"] * 29)):
        with pytest.raises(ApiError) as info:
            probe(engine, url=base + "/204", expected_status=bad)
        assert (info.value.code, info.value.field_path) == (
            "invalid_argument",
            "params.expected_status",
        ), bad
    assert len(plain_origin.requests) == len(cases)  # refused params probe nothing


def test_timeout_ms_bounds_the_probe(make_engine) -> None:
    engine = make_engine(base_config())
    # A listener that accepts and never answers.
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        url = f"http://127.0.0.1:{silent.getsockname()[1]}/"
        result = probe(engine, url=url, timeout_ms=300)
        assert result["reachable"] is False and result["timed_out"] is True
        assert result["error"] == "no answer within 0.3 s"
        for bad in (0, 32768, "5000", True):
            with pytest.raises(ApiError) as info:
                probe(engine, url=url, timeout_ms=bad)
            assert info.value.field_path == "params.timeout_ms"
    finally:
        silent.close()


def test_https_through_socks5_and_shadowsocks(make_engine, tls_origin) -> None:
    url = f"https://localhost:{tls_origin.port}/204"
    with microsocks() as socks_port, ss_server(SS_METHOD, SS_PASSWORD) as ss_port:
        engine = make_engine(
            {
                **base_config(),
                "outbounds": [
                    *base_config().get("outbounds", []),
                    {"tag": "s5", "protocol": "socks5", "server": "127.0.0.1", "port": socks_port},
                    {
                        "tag": "ss",
                        "protocol": "shadowsocks",
                        "server": "127.0.0.1",
                        "port": ss_port,
                        "method": SS_METHOD,
                        "password": SS_PASSWORD,
                    },
                ],
            }
        )
        for tag in ("s5", "ss"):
            result = probe(engine, tag, url=url, expected_status="204")
            assert result["reachable"] is True, (tag, result)
            assert result["status"] == 204
    assert len(tls_origin.requests) == 2


def test_result_is_recorded_as_latest_health(make_engine, plain_origin) -> None:
    cfg = base_config()
    cfg["outbound_groups"] = [{"tag": "pick", "kind": "selector", "outbounds": ["direct"]}]
    engine = make_engine(cfg)
    before = engine.query("policy", {"policy_tag": "pick"})["member_health"]
    assert before[0]["healthy"] is None  # a selector's member nothing probed

    ok = probe(engine, url=f"http://127.0.0.1:{plain_origin.port}/204")
    (health,) = engine.query("policy", {"policy_tag": "pick"})["member_health"]
    assert health["healthy"] is True
    assert health["latency_ms"] == ok["latency_ms"]
    assert health["checked_by"] is None
    assert health["last_checked_unix_ms"] > 0

    failed = probe(engine, url=f"http://127.0.0.1:{plain_origin.port}/500", expected_status="204")
    (health,) = engine.query("policy", {"policy_tag": "pick"})["member_health"]
    assert (health["healthy"], health["latency_ms"]) == (False, None)
    assert health["last_error"] == failed["error"]
