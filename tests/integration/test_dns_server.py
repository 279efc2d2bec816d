"""The engine's DNS server (runtime.dns.listen) and fake-ip answers, with real sockets on
loopback: ``dig`` (Debian dnsutils) against the engine, a zone served by the test DNS
server as the engine's upstream, flows through the engine's inbounds to fake addresses,
the fakeip commands, persistence across a restart, and a reload."""

from __future__ import annotations

import json
import shutil
import socket
import struct
import subprocess
from collections.abc import Iterator
from typing import Any

import dns.flags
import dns.message
import dns.rcode
import pytest

from spliceway import ApiError
from tests.conftest import base_config, wait_until
from tests.helpers.dnsserver import DnsServer, dns_server
from tests.helpers.flows import STATUS_ONLY, completed, curl, proxy_curl

pytestmark = pytest.mark.skipif(shutil.which("dig") is None, reason="dig (dnsutils) is missing")

ZONE = {
    "both.test": ["10.1.0.1", "fd00::1"],
    "v6only.test": ["fd00::2"],
    "nodata.test": [],
    "origin.test": ["127.0.0.1"],
    "blocked.test": ["127.0.0.1"],
}
LISTEN = {"address": "127.0.0.1", "port": 0}


@pytest.fixture
def zone() -> Iterator[DnsServer]:
    with dns_server(ZONE) as srv:
        yield srv


def dns_config(zone: DnsServer, answer: dict[str, Any] | None = None, **over: Any) -> dict:
    """A test engine whose resolver asks ``zone`` and whose DNS server listens on a free
    port; ``answer`` as ``runtime.dns.answer`` (real by default)."""
    dns_section: dict[str, Any] = {"servers": [zone.udp_url], "listen": LISTEN}
    if answer is not None:
        dns_section["answer"] = answer
    runtime = {"stats_interval_ms": 60_000, "dns": dns_section, **over.pop("runtime", {})}
    return base_config(runtime=runtime, **over)


def dig(engine: Any, name: str, qtype: str = "A", *extra: str) -> tuple[str, list[list[str]]]:
    """``dig`` against the engine's DNS server: (status, answer records as
    [name, ttl, class, type, data])."""
    host, port = engine.dns_address()
    out = subprocess.run(
        ["dig", f"@{host}", "-p", str(port), "+tries=1", "+time=5", name, qtype, *extra],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    ).stdout
    status = out.split("status: ", 1)[1].split(",", 1)[0]
    section = out.split(";; ANSWER SECTION:\n", 1)
    records = []
    if len(section) == 2:
        for line in section[1].split("\n\n", 1)[0].splitlines():
            records.append(line.split(None, 4))
    return status, records


def ask(engine: Any, wire: bytes, timeout: float = 2.0) -> bytes | None:
    """Send one raw datagram to the DNS server; its answer, or None when none comes."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.sendto(wire, engine.dns_address())
        try:
            return s.recv(65535)
        except TimeoutError:
            return None


def counters(engine: Any) -> dict[str, int]:
    return engine.query("runtime")["dns_server"]["counters"]


# -- real answers -------------------------------------------------------------------------


def test_real_answers_over_udp_and_tcp(make_engine, zone):
    engine = make_engine(dns_config(zone))
    status, records = dig(engine, "both.test")
    assert status == "NOERROR"
    assert [(r[0], r[3], r[4]) for r in records] == [("both.test.", "A", "10.1.0.1")]
    assert 0 < int(records[0][1]) <= 300
    assert dig(engine, "Both.Test", "AAAA")[1][0][3:] == ["AAAA", "fd00::1"]
    assert dig(engine, "both.test", "A", "+tcp")[1][0][4] == "10.1.0.1"
    assert dig(engine, "v6only.test", "A") == ("NOERROR", [])  # NODATA
    assert dig(engine, "nx.test")[0] == "NXDOMAIN"
    assert dig(engine, "nodata.test")[0] == "NOERROR"
    # Cached: the zone was asked once per name (A and AAAA together), whatever dig asked.
    assert zone.count("both.test") == 2
    c = counters(engine)
    assert c["tcp_queries"] == 1 and c["queries"] == 6 == c["answered"]
    assert c["nxdomain"] == 1 and c["noerror"] == 5
    assert engine.query("runtime")["dns_server"]["listen_port"] == engine.dns_address()[1]


def test_repeated_queries_come_from_the_wire_cache_with_the_clients_id_and_case(
    make_engine, zone, monkeypatch
):
    # Kept longer than the test can take, however slow the machine.
    monkeypatch.setattr("spliceway.dns.server.WIRE_CACHE_SECONDS", 600.0)
    engine = make_engine(dns_config(zone))
    query = dns.message.make_query("BoTh.tEsT.", "A")
    query.flags &= ~dns.flags.RD
    first = dns.message.from_wire(ask(engine, query.to_wire()))
    for qid in (1, 2, 65535):
        query.id = qid
        again = dns.message.from_wire(ask(engine, query.to_wire()))
        assert again.id == qid and again.rcode() == dns.rcode.NOERROR
        assert again.question[0].name.to_text() == "BoTh.tEsT."  # 0x20 case echoed
        assert again.answer == first.answer
        assert not again.flags & dns.flags.RD and again.flags & dns.flags.RA
    assert counters(engine)["cache_hits"] == 3


def test_servfail_when_no_server_answers(make_engine, zone):
    zone.fail = True
    engine = make_engine(dns_config(zone))
    assert dig(engine, "both.test")[0] == "SERVFAIL"


def test_other_types_are_forwarded_or_not_implemented(make_engine, zone):
    engine = make_engine(dns_config(zone))
    host, port = engine.dns_address()
    out = subprocess.run(
        ["dig", f"@{host}", "-p", str(port), "+tries=1", "both.test", "MX"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "status: NOERROR" in out and "SOA" in out  # the zone's negative answer, relayed
    assert ("both.test", "MX", "udp") in zone.queries
    assert counters(engine)["forwarded"] == 1
    assert dig(engine, "both.test", "ANY")[0] == "NOTIMP"
    system_only = make_engine(base_config(runtime={"dns": {"listen": LISTEN}}))
    assert dig(system_only, "both.test", "TXT")[0] == "NOTIMP"


# -- malformed input ------------------------------------------------------------------------


def test_malformed_queries_get_formerr_or_are_dropped_and_counted(make_engine, zone):
    engine = make_engine(dns_config(zone))
    # A readable query header, then garbage: FORMERR with the same id.
    reply = ask(engine, struct.pack(">HHHHHH", 0xBEEF, 0x0100, 1, 0, 0, 0) + b"\x07broken")
    assert reply is not None
    assert struct.unpack(">HH", reply[:4]) == (0xBEEF, 0x8181)  # QR RD RA, FORMERR
    # Two questions: FORMERR too (parsed, but not one question).
    two = dns.message.make_query("both.test", "A")
    two.question.append(two.question[0])
    assert dns.message.from_wire(ask(engine, two.to_wire())).rcode() == dns.rcode.FORMERR
    # Too short for a header, and a response sent as a query: no answer.
    assert ask(engine, b"\x12\x34\x01", timeout=0.3) is None
    response = dns.message.make_response(dns.message.make_query("both.test", "A"))
    assert ask(engine, response.to_wire(), timeout=0.3) is None
    # A garbage TCP message (length-prefixed) gets FORMERR too; the server is still fine.
    with socket.create_connection(engine.dns_address(), timeout=5) as s:
        body = struct.pack(">HHHHHH", 7, 0, 1, 0, 0, 0) + b"\xff\xff"
        s.sendall(struct.pack(">H", len(body)) + body)
        size = struct.unpack(">H", s.recv(2))[0]
        assert dns.message.from_wire(s.recv(size)).rcode() == dns.rcode.FORMERR
    assert dig(engine, "both.test")[0] == "NOERROR"
    c = counters(engine)
    assert c["formerr"] == 3 and c["dropped"] == 2


# -- fake-ip ----------------------------------------------------------------------------


def test_fake_ip_answers(make_engine, zone):
    engine = make_engine(dns_config(zone, {"type": "fake_ip"}))
    status, records = dig(engine, "some.example")
    assert status == "NOERROR"
    assert records == [["some.example.", "1", "IN", "A", "198.18.0.2"]]
    assert dig(engine, "other.example")[1][0][4] == "198.18.0.3"
    assert dig(engine, "SOME.example.", "A", "+tcp")[1][0][4] == "198.18.0.2"
    assert dig(engine, "some.example", "AAAA") == ("NOERROR", [])  # an IPv4 range
    assert dig(engine, "some.example", "HTTPS") == ("NOERROR", [])  # no address hints
    assert dig(engine, "localhost")[1][0][4] == "127.0.0.1"  # never faked
    ptr = dig(engine, "2.0.18.198.in-addr.arpa", "PTR")[1]
    assert ptr[0][3:] == ["PTR", "some.example."]
    assert zone.count() == 0  # fake answers ask no server
    # Two names allocated (more answers only if the 1 s wire cache expired meanwhile).
    assert counters(engine)["fake_ip_answers"] >= 2


def test_fake_ip_ipv6_range(make_engine, zone):
    engine = make_engine(dns_config(zone, {"type": "fake_ip", "fake_ip_range": "fc00::/64"}))
    assert dig(engine, "six.example", "AAAA")[1][0][3:] == ["AAAA", "fc00::2"]
    assert dig(engine, "six.example", "A") == ("NOERROR", [])


def test_fakeip_lookup_and_clear(make_engine, zone, tmp_path):
    path = tmp_path / "fakeip.json"
    answer = {"type": "fake_ip", "persist_path": str(path)}
    engine = make_engine(dns_config(zone, answer))
    ip = dig(engine, "a.example")[1][0][4]
    dig(engine, "b.example")
    dig(engine, "c.example")
    lookup = engine.execute
    assert lookup("diagnostics.fakeip_lookup", {"domain": "A.example."}) == {
        "enabled": True,
        "domain": "A.example.",
        "fake_ip": ip,
    }
    assert lookup("diagnostics.fakeip_lookup", {"ip": ip}) == {
        "enabled": True,
        "ip": ip,
        "domain": "a.example",
    }
    # Never allocates.
    assert lookup("diagnostics.fakeip_lookup", {"domain": "new.example"})["fake_ip"] is None
    assert lookup("diagnostics.fakeip_lookup", {"ip": "198.18.9.9"})["domain"] is None
    for params, field in (
        ({}, "params"),
        ({"domain": "a.example", "ip": ip}, "params.ip"),
        ({"ip": "not-an-ip"}, "params.ip"),
        ({"domain": ""}, "params.domain"),
    ):
        with pytest.raises(ApiError) as info:
            lookup("diagnostics.fakeip_lookup", params)
        assert (info.value.code, info.value.field_path) == ("invalid_argument", field)
    with pytest.raises(ApiError) as info:
        lookup("fakeip.clear", {"domain": "a.example", "ip": ip})
    assert info.value.code == "invalid_argument"
    assert lookup("fakeip.clear", {"domain": "a.example"}) == {"cleared": 1}
    assert lookup("fakeip.clear", {"domain": "a.example"}) == {"cleared": 0}
    # Persisted before the answer.
    entries = json.loads(path.read_text())["entries"]
    assert [e[0] for e in entries] == ["b.example", "c.example"]
    b_ip = lookup("diagnostics.fakeip_lookup", {"domain": "b.example"})["fake_ip"]
    assert lookup("fakeip.clear", {"ip": b_ip}) == {"cleared": 1}
    assert lookup("fakeip.clear", {}) == {"cleared": 1}
    assert json.loads(path.read_text())["entries"] == []
    # A name asked again after a clear gets a fresh answer (the wire cache was dropped).
    assert dig(engine, "c.example")[1][0][4] == "198.18.0.2"


def test_fakeip_commands_without_fake_ip(make_engine, zone):
    engine = make_engine(dns_config(zone))
    assert engine.execute("diagnostics.fakeip_lookup", {"ip": "198.18.0.2"}) == {
        "enabled": False,
        "ip": "198.18.0.2",
        "domain": None,
    }
    assert engine.execute("fakeip.clear", {}) == {"cleared": 0}


def test_restart_keeps_the_fake_ip_mapping(make_engine, zone, tmp_path):
    path = tmp_path / "state" / "fakeip.json"
    path.parent.mkdir()
    cfg = dns_config(zone, {"type": "fake_ip", "persist_path": str(path)})
    first = make_engine(cfg)
    ips = [dig(first, f"n{i}.example")[1][0][4] for i in range(3)]
    first.stop()
    second = make_engine(cfg)
    assert [dig(second, f"n{i}.example")[1][0][4] for i in range(3)] == ips
    assert second.execute("diagnostics.fakeip_lookup", {"ip": ips[1]})["domain"] == "n1.example"
    assert dig(second, "fresh.example")[1][0][4] == "198.18.0.5"


def test_damaged_fake_ip_file_is_reported_and_the_engine_runs(make_engine, zone, tmp_path):
    path = tmp_path / "fakeip.json"
    path.write_bytes(b"\x00garbage")
    engine = make_engine(dns_config(zone, {"type": "fake_ip", "persist_path": str(path)}))
    warnings = [
        e["payload"]
        for e in engine.query("events")["events"]
        if e["event_type"] == "engine.warning"
    ]
    assert [w["code"] for w in warnings] == ["fakeip_table_damaged"]
    assert (tmp_path / "fakeip.json.damaged").read_bytes() == b"\x00garbage"
    assert dig(engine, "a.example")[1][0][4] == "198.18.0.2"


# -- flows to fake addresses ----------------------------------------------------------------


def routed_config(zone: DnsServer, **over: Any) -> dict:
    """Fake-ip answers; blocked.test blocked by a domain rule; the rest of the fake range
    blocked by IP (a fake address that maps to nothing must not go anywhere)."""
    return dns_config(
        zone,
        {"type": "fake_ip"},
        rules=[
            {"domain": ["blocked.test"], "action": "block"},
            {"domain_suffix": ["origin.test"], "outbound": "direct"},
            {"ip_cidr": ["198.18.0.0/15"], "action": "block"},
        ],
        **over,
    )


@pytest.mark.parametrize("inbound", ["socks-in", "mixed-in"])
def test_socks5_flow_to_a_fake_ip_is_routed_by_its_domain(make_engine, zone, origin, inbound):
    engine = make_engine(routed_config(zone))
    conn = engine._core.bridge.conn
    deferred = conn.stats()["deferred"]
    ok_ip = dig(engine, "origin.test")[1][0][4]
    blocked_ip = dig(engine, "blocked.test")[1][0][4]
    proxy = "{}:{}".format(*engine.listen_address(inbound))
    ok = curl("--socks5", proxy, f"http://{ok_ip}:{origin[1]}/bytes/100", *STATUS_ONLY)
    assert ok.stdout == "200", ok.stderr
    refused = curl("--socks5", proxy, f"http://{blocked_ip}:{origin[1]}/", *STATUS_ONLY)
    assert refused.returncode != 0
    # Both went through C's handshake and were handed to Python to be mapped.
    assert conn.stats()["deferred"] - deferred == 2
    records = sorted(
        (e["payload"]["record"] for e in completed(engine, 2)),
        key=lambda r: r["target"]["host"],
    )
    blocked, relayed = records
    assert (blocked["target"]["host"], blocked["target"]["port"]) == ("blocked.test", origin[1])
    assert blocked["result"]["outcome"] == "blocked"
    assert blocked["route"]["matched_rule"]["index"] == 0
    assert (relayed["target"]["host"], relayed["target"]["port"]) == ("origin.test", origin[1])
    assert relayed["target"]["resolved_ip"] == "127.0.0.1"
    assert relayed["result"]["outcome"] == "direct_relayed"
    assert relayed["route"]["matched_rule"]["index"] == 1
    assert relayed["path"]["remote"]["host"] == "origin.test"


def test_trace_route_maps_a_fake_ip_to_its_domain(make_engine, zone):
    engine = make_engine(routed_config(zone))
    ip = dig(engine, "blocked.test")[1][0][4]
    traced = engine.execute("diagnostics.trace_route", {"target": ip, "port": 80})
    assert traced["target"] == ip
    assert traced["matched_rule"]["index"] == 0 and traced["route_action"] == {"block": True}
    other = engine.execute("diagnostics.trace_route", {"target": "198.18.3.3", "port": 80})
    assert other["matched_rule"]["index"] == 2  # unmapped: by address


def test_trace_route_reads_addresses_and_resolves_names_as_a_flow_does(make_engine, zone):
    """Every spelling of an address is that address, and a name meets an ip_cidr rule
    ranked before any match by its resolved address (routing.needs_address), as a flow's
    target does; the answer says which address the rules met."""
    rules = [
        {"domain": ["origin.test"], "outbound": "direct"},
        {"ip_cidr": ["127.0.0.0/8"], "action": "block"},
        {"ip_cidr": ["10.0.0.0/8"], "outbound": "direct"},
    ]
    engine = make_engine(dns_config(zone, rules=rules))

    def trace(target: str) -> dict:
        return engine.execute("diagnostics.trace_route", {"target": target, "port": 80})

    for spelling in ("0x7f.1", "2130706433", "127.0.0.1.", "0"):
        traced = trace(spelling)
        assert (traced["route_action"], traced["matched_rule"]["index"]) == ({"block": True}, 1)
        assert traced["resolved_ip"] is None and traced["target"] == spelling
    blocked = trace("blocked.test")  # resolves to 127.0.0.1
    assert (blocked["route_action"], blocked["resolved_ip"]) == ({"block": True}, "127.0.0.1")
    both = trace("both.test.")
    assert (both["route_action"], both["resolved_ip"]) == ({"route": "direct"}, "10.1.0.1")
    # Matched by name before any ip_cidr rule: not resolved.
    first = trace("origin.test")
    assert (first["matched_rule"]["index"], first["resolved_ip"]) == (0, None)
    # No address: the rules go on without one.
    nodata = trace("nodata.test")
    assert (nodata["matched_rule"], nodata["resolved_ip"]) == (None, None)


def test_http_proxy_flow_to_a_fake_ip_is_routed_by_its_domain(make_engine, zone, origin):
    engine = make_engine(routed_config(zone))
    ip = dig(engine, "origin.test")[1][0][4]
    result = proxy_curl(engine, f"http://{ip}:{origin[1]}/bytes/10", *STATUS_ONLY)
    assert result.stdout == "200", result.stderr
    record = completed(engine)[0]["payload"]["record"]
    assert record["target"]["host"] == "origin.test"


def test_a_cleared_fake_ip_is_routed_as_an_address(make_engine, zone, origin):
    engine = make_engine(routed_config(zone))
    ip = dig(engine, "origin.test")[1][0][4]
    assert engine.execute("fakeip.clear", {"ip": ip}) == {"cleared": 1}
    proxy = "{}:{}".format(*engine.listen_address("socks-in"))
    assert curl("--socks5", proxy, f"http://{ip}:{origin[1]}/").returncode != 0
    record = completed(engine)[0]["payload"]["record"]
    assert record["target"]["host"] == ip
    assert record["route"]["matched_rule"]["index"] == 2  # the ip_cidr rule


# -- reload ---------------------------------------------------------------------------------


def test_reload_moves_and_switches_the_dns_server(make_engine, zone):
    cfg = dns_config(zone)
    engine = make_engine(cfg)
    old = engine.dns_address()
    assert dig(engine, "both.test")[1][0][4] == "10.1.0.1"
    cfg["runtime"]["dns"]["answer"] = {"type": "fake_ip"}
    result = engine.execute("config.apply_runtime", {"config": cfg})
    assert "dns" in result["changed_components"]
    assert engine.dns_address() == old  # listen unchanged: the same server, fake answers now
    assert dig(engine, "both.test")[1][0][4] == "198.18.0.2"
    # A new port: a new server there; the old port is closed.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    cfg["runtime"]["dns"]["listen"] = {"address": "127.0.0.1", "port": free}
    engine.execute("config.apply_runtime", {"config": cfg})
    assert engine.dns_address() == ("127.0.0.1", free)
    assert dig(engine, "both.test")[1][0][4] == "198.18.0.2"  # the same pool
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(old)  # free again
    # listen null: no server.
    cfg["runtime"]["dns"]["listen"] = None
    engine.execute("config.apply_runtime", {"config": cfg})
    with pytest.raises(ApiError):
        engine.dns_address()
    assert "dns_server" not in engine.query("runtime")


def test_reload_to_a_taken_port_changes_nothing(make_engine, zone):
    cfg = dns_config(zone)
    engine = make_engine(cfg)
    before = engine.dns_address()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        cfg["runtime"]["dns"]["listen"] = {"address": "127.0.0.1", "port": taken.getsockname()[1]}
        cfg["runtime"]["dns"]["answer"] = {"type": "fake_ip"}
        with pytest.raises(ApiError) as info:
            engine.execute("config.apply_runtime", {"config": cfg})
    assert info.value.code == "internal"
    assert info.value.field_path == "config.runtime.dns.listen"
    assert engine.dns_address() == before
    assert dig(engine, "both.test")[1][0][4] == "10.1.0.1"  # still real answers


def test_start_fails_cleanly_when_the_dns_port_is_taken(zone):
    from spliceway import Engine

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as taken:
        taken.bind(("127.0.0.1", 0))
        cfg = dns_config(zone)
        cfg["runtime"]["dns"]["listen"] = {"address": "127.0.0.1", "port": taken.getsockname()[1]}
        engine = Engine(cfg)
        with pytest.raises(ApiError) as info:
            engine.start()
    assert info.value.code == "conflict"
    assert info.value.field_path == "runtime.dns.listen"


def test_stop_closes_the_server(make_engine, zone):
    engine = make_engine(dns_config(zone))
    address = engine.dns_address()
    engine.stop()
    wait_until(lambda: _free(address), 5, "the DNS port to be released")


def _free(address: tuple[str, int]) -> bool:
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        with socket.socket(socket.AF_INET, kind) as s:
            try:
                s.bind(address)
            except OSError:
                return False
    return True


def test_socks5_hostname_to_a_fake_ip_name_dials_its_real_address(make_engine, zone, origin):
    """curl --socks5-hostname gives the proxy the name itself: with fake-ip answers on,
    the flow is routed by that domain and dials the name's real address, never a fake
    one (the fake range is blocked by the last rule, so a fake dial would fail)."""
    engine = make_engine(routed_config(zone))
    dig(engine, "origin.test")  # the name has a fake address too, which must not be used
    proxy = "{}:{}".format(*engine.listen_address("socks-in"))
    ok = curl("--socks5-hostname", proxy, f"http://origin.test:{origin[1]}/bytes/100", *STATUS_ONLY)
    assert ok.stdout == "200", ok.stderr
    refused = curl("--socks5-hostname", proxy, f"http://blocked.test:{origin[1]}/", *STATUS_ONLY)
    assert refused.returncode != 0
    records = sorted(
        (e["payload"]["record"] for e in completed(engine, 2)),
        key=lambda r: r["target"]["host"],
    )
    blocked, relayed = records
    assert blocked["target"]["host"] == "blocked.test"
    assert blocked["result"]["outcome"] == "blocked"
    assert blocked["route"]["matched_rule"]["index"] == 0
    assert relayed["target"]["host"] == "origin.test"
    assert relayed["target"]["resolved_ip"] == "127.0.0.1"
    assert relayed["route"]["matched_rule"]["index"] == 1
    assert relayed["result"]["outcome"] == "direct_relayed"
    assert relayed["traffic"]["bytes_down"] > 100
