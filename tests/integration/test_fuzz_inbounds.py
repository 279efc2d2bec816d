"""Arbitrary client bytes against live inbounds: an error reply or a close, never a crash."""

from __future__ import annotations

import logging
import socket

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import base_config, wait_until
from tests.helpers.flows import socks_curl

# Whatever a fuzzed request asks for, nothing is dialled: every route ends in block.
FUZZ_CONFIG = base_config(route={"final": "block"})

client_bytes = st.one_of(
    st.binary(max_size=400),
    st.binary(max_size=300).map(lambda b: b"\x05" + b),
    st.binary(max_size=300).map(lambda b: b"\x05\x01\x00\x05" + b),
    st.binary(max_size=300).map(lambda b: b"CONNECT " + b),
    st.binary(max_size=300).map(lambda b: b"GET http://" + b),
)


def exchange(address, data: bytes) -> bytes:
    with socket.create_connection(address, timeout=5) as sock:
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            return b""
        received = b""
        try:
            while chunk := sock.recv(4096):
                received += chunk
        except ConnectionResetError:
            pass
        return received


def test_fuzzed_handshakes_never_crash_an_actor(make_engine, origin, caplog):
    engine = make_engine(FUZZ_CONFIG)
    addresses = [engine.listen_address(t) for t in ("socks-in", "http-in", "mixed-in")]
    caplog.set_level(logging.ERROR)

    @settings(
        max_examples=120,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(data=client_bytes, which=st.integers(0, 2))
    def one(data, which):
        reply = exchange(addresses[which], data)
        if which == 1 and reply:
            assert reply.startswith(b"HTTP/1.1 "), reply[:40]
        if which == 0 and reply:
            assert reply[:1] in (b"\x05", b"\x01"), reply[:40]

    one()
    wait_until(lambda: engine.query("stats")["active_sessions"] == 0)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
    # Still serving, with the same rules.
    engine.execute("mode.set", {"mode": "direct"})
    result = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/", inbound="mixed-in")
    assert result.stdout == "hello from origin\n"
