"""Micro benchmarks of the pure per-flow Python work (parsers, sniffing, routing, flow log).

    python -m pytest benchmarks/test_micro.py --benchmark-only

Not part of the default ``python -m pytest`` run (pyproject's testpaths is
``tests``).  Each case asserts its result once, so a broken parser cannot look fast.
These are the pieces every connection pays for in the engine's dispatcher thread;
the end-to-end cost per connection is in ``run_e2e.py`` (proxy CPU us/conn).
"""

from __future__ import annotations

import logging
import struct

import pytest

from spliceway.config import Rule
from spliceway.flows import log as flowlog
from spliceway.flows import records
from spliceway.flows.records import FlowState
from spliceway.protocols import http, sniff, socks5
from spliceway.routing.rules import FlowFacts, compile_rules, decide
from tests.helpers.flows import flow_state

pytest.importorskip("pytest_benchmark")

GREETING = bytes([5, 1, 0])
REQ_IPV4 = bytes([5, 1, 0, 1, 127, 0, 0, 1]) + struct.pack("!H", 8080)
REQ_DOMAIN = bytes([5, 1, 0, 3, len(b"www.example.com")]) + b"www.example.com" + b"\x01\xbb"
REQ_IPV6 = bytes([5, 1, 0, 4]) + bytes(15) + b"\x01" + b"\x01\xbb"
HTTP_GET = (
    b"GET / HTTP/1.1\r\nHost: www.example.com\r\nUser-Agent: bench/1.0\r\n"
    b"Accept: */*\r\nConnection: keep-alive\r\n\r\n"
)
HTTP_CONNECT = (
    b"CONNECT www.example.com:443 HTTP/1.1\r\nHost: www.example.com:443\r\n"
    b"User-Agent: bench/1.0\r\nProxy-Connection: keep-alive\r\n\r\n"
)


def _client_hello(server_name: str) -> bytes:
    """A minimal TLS 1.2-style ClientHello record carrying an SNI extension."""
    name = server_name.encode()
    sni_list = b"\x00" + struct.pack("!H", len(name)) + name
    extensions = (
        struct.pack("!HH", 0, len(sni_list) + 2) + struct.pack("!H", len(sni_list)) + sni_list
    )
    body = (
        b"\x03\x03"
        + bytes(32)  # random
        + b"\x00"  # session id
        + struct.pack("!H", 2)
        + b"\x13\x01"  # one cipher suite
        + b"\x01\x00"  # compression: null
        + struct.pack("!H", len(extensions))
        + extensions
    )
    handshake = b"\x01" + struct.pack("!I", len(body))[1:] + body
    return b"\x16\x03\x01" + struct.pack("!H", len(handshake)) + handshake


CLIENT_HELLO = _client_hello("www.example.com")


# --------------------------------------------------------------------------- SOCKS5


def test_socks5_parse_greeting(benchmark):
    result = benchmark(socks5.parse_greeting, GREETING)
    assert result is not socks5.NEED_MORE


@pytest.mark.parametrize(
    ("buf", "host"),
    [(REQ_IPV4, "127.0.0.1"), (REQ_DOMAIN, "www.example.com"), (REQ_IPV6, "::1")],
    ids=["ipv4", "domain", "ipv6"],
)
def test_socks5_parse_request(benchmark, buf, host):
    result = benchmark(socks5.parse_request, buf)
    assert result.host == host


def test_socks5_reply(benchmark):
    out = benchmark(socks5.reply, socks5.REP_SUCCEEDED, "127.0.0.1", 40000)
    assert out[:2] == b"\x05\x00"


# --------------------------------------------------------------------------- HTTP and sniffing


def test_http_parse_connect_head(benchmark):
    result = benchmark(http.parse_request_head, HTTP_CONNECT)
    assert result is not http.NEED_MORE


def test_sniff_http_host(benchmark):
    found = benchmark(sniff.sniff, HTTP_GET)
    assert found.host == "www.example.com"


def test_sniff_tls_sni(benchmark):
    found = benchmark(sniff.sniff, CLIENT_HELLO)
    assert found.host == "www.example.com"


def test_sniff_opaque_bytes(benchmark):
    """What the sniffer does with a first packet that is neither TLS nor HTTP."""
    benchmark(sniff.sniff, b"\x00\x01binary-protocol-hello" * 4)


# --------------------------------------------------------------------------- routing


def _rules(n: int) -> list[Rule]:
    rules = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            cond = {"domain_suffix": [f"s{i}.example", f"t{i}.example"]}
        elif kind == 1:
            cond = {"domain_keyword": [f"kw{i}"]}
        elif kind == 2:
            cond = {"ip_cidr": [f"10.{i % 256}.0.0/16"]}
        else:
            cond = {"domain": [f"exact{i}.example.org"]}
        rules.append(Rule.model_validate({**cond, "outbound": f"out{i % 3}"}))
    return rules


FACTS_DOMAIN = FlowFacts(network="tcp", host="www.example.com", port=443, source_ip="127.0.0.1")
FACTS_IP = FlowFacts(network="tcp", host="127.0.0.1", port=8080, source_ip="127.0.0.1")


def test_route_no_rules(benchmark):
    ruleset = compile_rules([])
    d = benchmark(decide, ruleset, "rule", None, "direct", FACTS_IP)
    assert d.target == "direct"


@pytest.mark.parametrize("n", [10, 100])
@pytest.mark.parametrize("facts", [FACTS_DOMAIN, FACTS_IP], ids=["domain", "ip"])
def test_route_rules_final(benchmark, n, facts):
    """Worst case: every rule is tried and none matches (the flow goes to final)."""
    ruleset = compile_rules(_rules(n))
    d = benchmark(decide, ruleset, "rule", None, "direct", facts)
    assert d.target == "direct" and d.matched_rule is None


def _completed_flow(outcome: str) -> FlowState:
    state = flow_state(
        flow_id="3f2a9c1e-0-17",
        source_port=53422,
        outbound_tag="hop-a",
        ended_at_unix_ms=1_012,
        outcome=outcome,
    )
    if outcome == records.FAILED:
        state.close_reason = records.UPSTREAM_ERROR
        state.failure = records.Failure("connect", "connection_refused", "connection refused")
    return state


def test_flow_log_of_a_relayed_flow_at_info(benchmark):
    """What every relayed flow pays at the default level: its line is skipped."""
    logging.getLogger("spliceway.flow").setLevel(logging.INFO)
    state = _completed_flow(records.DIRECT_RELAYED)
    assert flowlog.level_for(state) == logging.DEBUG
    benchmark(flowlog.log_completed, state)


def test_flow_log_line_of_a_failed_flow(benchmark):
    """Formatting one line (a failed flow at info, every flow at debug)."""
    state = _completed_flow(records.FAILED)
    line = benchmark(flowlog.line, state)
    assert line.endswith('code=connection_refused error="connection refused"')
