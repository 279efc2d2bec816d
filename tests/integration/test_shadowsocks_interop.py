"""The shadowsocks codec against Debian's ss-server (shadowsocks-libev), every AEAD method."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from spliceway.protocols.shadowsocks import (
    CIPHERS,
    Decryptor,
    Encryptor,
    master_key,
    target_header,
)
from tests.helpers.upstreams import ss_server


@pytest.fixture(params=sorted(CIPHERS))
def ss(request: pytest.FixtureRequest) -> Iterator[tuple[str, int]]:
    with ss_server(request.param) as port:
        yield request.param, port


def test_request_through_ss_server(ss: tuple[str, int], origin: tuple[str, int]) -> None:
    method, port = ss
    cipher = CIPHERS[method]
    key = master_key("secret", cipher.key_size)
    enc, dec = Encryptor(cipher, key), Decryptor(cipher, key)
    request = b"GET /bytes/100000 HTTP/1.1\r\nHost: o\r\nConnection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(enc.header + enc.seal(target_header(*origin) + request))
        plain = b""
        while chunk := sock.recv(65536):
            plain += dec.feed(chunk)
    head, _, body = plain.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert body == b"x" * 100000
