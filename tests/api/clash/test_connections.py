"""Flows as mihomo's connections: the rule mapping, TrackerInfo, the snapshot's encoding
and its cost, and ``GET``/``DELETE /connections`` against a real engine."""

from __future__ import annotations

import base64
import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import orjson
import pytest

from spliceway.api.clash.connections import SnapshotBuilder, tracker_info
from spliceway.api.clash.mapping import rule_type_and_payload
from spliceway.config import Rule
from spliceway.routing.rules import compile_rules
from tests.api.clash.conftest import ClashEngine, call
from tests.conftest import wait_until
from tests.helpers.flows import flow_state
from tests.helpers.servers import EchoServer, LoopbackServer, read_head
from tests.helpers.socks import recv_exact, socks5_connect

#: mihomo 1.19's TrackerInfo and Metadata keys, in its order (its binary's
#: ``GET /connections``, read for this file).
TRACKER_KEYS = [
    "id",
    "metadata",
    "upload",
    "download",
    "start",
    "chains",
    "providerChains",
    "rule",
    "rulePayload",
]
METADATA_KEYS = [
    "network",
    "type",
    "sourceIP",
    "destinationIP",
    "sourceGeoIP",
    "destinationGeoIP",
    "sourceIPASN",
    "destinationIPASN",
    "sourcePort",
    "destinationPort",
    "inboundIP",
    "inboundPort",
    "inboundName",
    "inboundUser",
    "rematchName",
    "host",
    "dnsMode",
    "uid",
    "process",
    "processPath",
    "specialProxy",
    "specialRules",
    "remoteDestination",
    "dscp",
    "sniffHost",
]
LISTENERS = {"mixed-in": ("127.0.0.1", 7000)}


def condition_of(**rule: Any) -> str:
    """The ``matched_rule.condition`` text the engine writes for ``rule``."""
    compiled = compile_rules([Rule(outbound="direct", **rule)])
    matched = compiled.rules[0].decision.matched_rule
    assert matched is not None
    return matched.condition


# -- rule_type_and_payload -----------------------------------------------------------


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ({"domain": ["a.example"]}, ("Domain", "a.example")),
        ({"domain_suffix": ["example.com"]}, ("DomainSuffix", "example.com")),
        ({"domain_keyword": ["goog"]}, ("DomainKeyword", "goog")),
        ({"domain_regex": [r"^ads?\."]}, ("DomainRegex", r"^ads?\.")),
        ({"ip_cidr": ["10.0.0.0/8"]}, ("IPCIDR", "10.0.0.0/8")),
        ({"source_ip_cidr": ["192.168.1.0/24"]}, ("SrcIPCIDR", "192.168.1.0/24")),
        ({"port": ["443"]}, ("DstPort", "443")),
        ({"port": ["80", "443", "8000-8100"]}, ("DstPort", "80/443/8000-8100")),
        ({"source_port": ["5000-6000"]}, ("SrcPort", "5000-6000")),
        ({"network": "udp"}, ("Network", "udp")),
        ({"inbound_tag": ["mixed-in", "socks-in"]}, ("InName", "mixed-in/socks-in")),
        ({"principal_key": ["alice"]}, ("InUser", "alice")),
        ({"process_name": ["curl"]}, ("ProcessName", "curl")),
        (
            {"domain_suffix": ["a.example", "b.example"]},
            ("OR", "((DomainSuffix,a.example) || (DomainSuffix,b.example))"),
        ),
        (
            {"domain_suffix": ["example.test"], "port": ["443"], "network": "tcp"},
            ("AND", "((DomainSuffix,example.test) && (DstPort,443) && (Network,tcp))"),
        ),
        (
            {"domain": ["a.test", "b.test"], "port": ["80", "443"]},
            ("AND", "((OR,((Domain,a.test) || (Domain,b.test))) && (DstPort,80/443))"),
        ),
        # A regex list is one alternation (the same matches), and commas or bars inside
        # a regex are not condition or item separators.
        ({"domain_regex": ["^a{1,3}$", "b|c"]}, ("DomainRegex", "^a{1,3}$|b|c")),
        (
            {"domain_regex": ["^x{1,2}"], "port": ["443"]},
            ("AND", "((DomainRegex,^x{1,2}) && (DstPort,443))"),
        ),
    ],
)
def test_rule_type_and_payload_of_the_engines_condition_text(
    rule: dict[str, Any], expected: tuple[str, str]
) -> None:
    assert rule_type_and_payload(condition_of(**rule)) == expected


def test_no_condition_is_mihomos_final_match_rule() -> None:
    assert rule_type_and_payload("") == ("Match", "")


def test_conditions_spliceway_may_grow_keep_mihomos_names() -> None:
    assert rule_type_and_payload("geoip=cn") == ("GeoIP", "cn")
    assert rule_type_and_payload("geosite=google") == ("GeoSite", "google")
    assert rule_type_and_payload("rule_set=ads,network=tcp") == (
        "AND",
        "((RuleSet,ads) && (Network,tcp))",
    )
    assert rule_type_and_payload("some_new_key=x") == ("SomeNewKey", "x")


def test_text_that_is_not_key_value_is_shown_as_it_is() -> None:
    assert rule_type_and_payload("garbage") == ("Unknown", "garbage")


# -- tracker_info --------------------------------------------------------------------


def proxied_record(**fields: Any) -> dict[str, Any]:
    """An active rule-mode flow through Proxy -> auto -> s5, as FlowState renders it."""
    base: dict[str, Any] = {
        "state": "active",
        "route_action": "route",
        "route_target": "Proxy",
        "selection_chain": ["Proxy", "auto", "s5"],
        "outbound_tag": "s5",
        "outbound_protocol": "socks5",
        "remote_host": "127.0.0.1",
        "remote_port": 1080,
        "matched_rule": {"index": 0, "condition": "domain_suffix=example.com"},
    }
    return dict(flow_state(**(base | fields)).render())


def test_tracker_info_has_mihomos_keys_in_its_order_with_its_types() -> None:
    info = tracker_info(proxied_record(), LISTENERS)
    assert list(info) == TRACKER_KEYS
    assert list(info["metadata"]) == METADATA_KEYS
    meta = info["metadata"]
    # mihomo writes ports as strings ("for compatibility").
    assert (meta["sourcePort"], meta["destinationPort"], meta["inboundPort"]) == (
        "50000",
        "443",
        "7000",
    )
    assert meta["sourceGeoIP"] is None and meta["destinationGeoIP"] is None
    assert (meta["uid"], meta["dscp"]) == (0, 0)
    assert info["id"] == "ab12-7"
    assert info["start"] == "1970-01-01T00:00:01.000Z"


def test_chains_are_leaf_first_and_the_rule_is_mihomos() -> None:
    info = tracker_info(proxied_record(), LISTENERS)
    assert info["chains"] == ["s5", "auto", "Proxy"]
    assert info["providerChains"] == ["", "", ""]
    assert (info["rule"], info["rulePayload"]) == ("DomainSuffix", "example.com")
    meta = info["metadata"]
    assert meta["host"] == "example.com" and meta["destinationIP"] == ""
    assert meta["remoteDestination"] == "127.0.0.1"  # the proxy the engine dialled
    # A record without inbound.client_protocol (an older version's) keeps the inbound's.
    assert (meta["type"], meta["inboundName"], meta["inboundIP"]) == (
        "Mixed",
        "mixed-in",
        "127.0.0.1",
    )
    assert (meta["dnsMode"], meta["inboundUser"]) == ("normal", "")


@pytest.mark.parametrize(
    ("spoken", "mihomo"),
    [("socks5", "Socks5"), ("http", "HTTP"), ("http_connect", "HTTPS"), ("tun", "Tun")],
)
def test_the_type_is_what_the_client_spoke_in_mihomos_words(spoken: str, mihomo: str) -> None:
    # mihomo's http listener: HTTPS for a CONNECT tunnel, HTTP for a request it forwards.
    meta = tracker_info(proxied_record(client_protocol=spoken), LISTENERS)["metadata"]
    assert meta["type"] == mihomo


def test_a_fake_ip_target_is_its_name_in_dns_mode_fake_ip_and_the_principal_is_the_user() -> None:
    meta = tracker_info(proxied_record(fake_ip="198.18.0.7", principal_key="alice"), LISTENERS)[
        "metadata"
    ]
    # As mihomo: the name the fake address stood for, no destination address of its own.
    assert (meta["host"], meta["destinationIP"], meta["dnsMode"]) == (
        "example.com",
        "",
        "fake-ip",
    )
    assert meta["inboundUser"] == "alice"


def test_the_final_route_is_match_and_modes_global_and_direct_have_no_rule() -> None:
    final = tracker_info(proxied_record(matched_rule=None), LISTENERS)
    assert (final["rule"], final["rulePayload"]) == ("Match", "")
    direct = tracker_info(
        proxied_record(
            mode="direct",
            matched_rule=None,
            route_target="direct",
            selection_chain=["direct"],
            outbound_tag="direct",
            outbound_protocol="direct",
            resolved_ip="93.184.216.34",
        ),
        LISTENERS,
    )
    assert (direct["rule"], direct["rulePayload"], direct["chains"]) == ("", "", ["direct"])
    assert direct["metadata"]["destinationIP"] == "93.184.216.34"
    assert direct["metadata"]["remoteDestination"] == "93.184.216.34"
    # mihomo dials mode global's flows through its GLOBAL selector: the outermost link.
    global_ = tracker_info(proxied_record(mode="global", matched_rule=None), LISTENERS)
    assert global_["chains"] == ["s5", "auto", "Proxy", "GLOBAL"]
    assert (global_["rule"], global_["rulePayload"]) == ("", "")


def test_an_address_target_has_no_host_and_sniffing_and_process_show() -> None:
    info = tracker_info(
        proxied_record(
            target_host="2001:db8::1",
            sniffed_host="www.example.org",
            process_id=42,
            process_name="curl",
            process_path="/usr/bin/curl",
            inbound_tag="socks-in",
            inbound_protocol="socks5",
        ),
        LISTENERS,
    )
    meta = info["metadata"]
    assert (meta["host"], meta["destinationIP"], meta["sniffHost"]) == (
        "",
        "2001:db8::1",
        "www.example.org",
    )
    assert (meta["process"], meta["processPath"]) == ("curl", "/usr/bin/curl")
    # An inbound the listener map does not know (it stopped): no address to show.
    assert (meta["type"], meta["inboundIP"], meta["inboundPort"]) == ("Socks5", "", "")


# -- the snapshot's encoding -------------------------------------------------------------


def records(count: int, **fields: Any) -> list[dict[str, Any]]:
    """``count`` distinct active flows."""
    out = []
    for i in range(count):
        record = proxied_record(flow_id=f"f-{i}", target_host=f"h{i}.example.com", **fields)
        out.append(record)
    return out


def test_snapshot_lists_active_flows_and_null_when_there_are_none() -> None:
    builder = SnapshotBuilder(None)  # type: ignore[arg-type]
    empty = json.loads(builder.encode([], LISTENERS, (5, 7), 123))
    assert empty == {"downloadTotal": 7, "uploadTotal": 5, "connections": None, "memory": 123}
    opening = proxied_record(state="opening", flow_id="o")
    data = builder.encode([*records(2), opening], LISTENERS, (5, 7), 123)
    assert data.endswith(b"\n")
    snap = json.loads(data)
    assert list(snap) == ["downloadTotal", "uploadTotal", "connections", "memory"]
    assert [c["id"] for c in snap["connections"]] == ["f-0", "f-1"]
    assert snap["connections"][0] == tracker_info(records(1)[0], LISTENERS)


def test_an_unchanged_record_reuses_its_bytes_and_a_sample_only_its_text() -> None:
    builder = SnapshotBuilder(None)  # type: ignore[arg-type]
    first = records(1)
    builder.encode(first, LISTENERS, (0, 0), 0)
    encoded = builder._cache["f-0"]
    builder.encode(first, LISTENERS, (0, 0), 0)
    assert builder._cache["f-0"] is encoded  # the same record object: nothing redone
    sampled = proxied_record(flow_id="f-0", target_host="h0.example.com", revision=9)
    sampled["traffic"] = dict(sampled["traffic"], bytes_up=1234, bytes_down=56789)
    snap = json.loads(builder.encode([sampled], LISTENERS, (0, 0), 0))
    again = builder._cache["f-0"]
    assert again.head is encoded.head and again.tail is encoded.tail
    assert (snap["connections"][0]["upload"], snap["connections"][0]["download"]) == (
        1234,
        56789,
    )
    assert snap["connections"][0] == tracker_info(sampled, LISTENERS)
    # A re-routed flow (another chain) is mapped again.
    rerouted = proxied_record(
        flow_id="f-0", target_host="h0.example.com", selection_chain=["Proxy", "s5"]
    )
    snap = json.loads(builder.encode([rerouted], LISTENERS, (0, 0), 0))
    assert snap["connections"][0]["chains"] == ["s5", "Proxy"]


def test_ten_thousand_flows_cost(capsys: pytest.CaptureFixture[str]) -> None:
    """The GIL-holding part of a tick with 10,000 open flows: the first build maps every
    flow; then an idle tick reuses every flow's bytes, and a tick in which every flow's
    counters moved reuses the text around new numbers. Budgets are loose (a loaded CI
    machine); the numbers go to the output for the record."""
    builder = SnapshotBuilder(None)  # type: ignore[arg-type]
    flows = records(10_000)
    moved = []
    for record in flows:
        again = dict(record)
        again["target"] = dict(record["target"])
        again["route"] = dict(record["route"])
        again["path"] = dict(record["path"])
        again["traffic"] = dict(record["traffic"], bytes_up=10, bytes_down=20)
        moved.append(again)
    timings: dict[str, float] = {}
    for name, batch in (("first", flows), ("idle", flows), ("moved", moved)):
        started = time.perf_counter()
        data = builder.encode(batch, LISTENERS, (0, 0), 0)
        timings[name] = time.perf_counter() - started
    snap = orjson.loads(data)
    assert len(snap["connections"]) == 10_000
    assert snap["connections"][-1]["download"] == 20
    with capsys.disabled():
        print(
            "\n10,000 flows: "
            + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in timings.items())
            + f", {len(data) / 1e6:.1f} MB per snapshot"
        )
    assert timings["first"] < 5.0
    assert timings["idle"] < 0.5
    assert timings["moved"] < 2.0


# -- against a real engine -----------------------------------------------------------


@pytest.fixture
def routed(make_clash: Callable[..., ClashEngine], echo: EchoServer) -> ClashEngine:
    """The shared engine plus a rule sending ``localhost:<echo>`` to ``Proxy``."""

    def prepare(cfg: dict[str, Any]) -> None:
        cfg["rules"].insert(
            0, {"domain_suffix": ["localhost"], "port": [str(echo.port)], "outbound": "Proxy"}
        )

    return make_clash(prepare)


def open_flow(clash: ClashEngine, echo: EchoServer, payload: bytes = b"ping") -> socket.socket:
    """A SOCKS5 tunnel through the mixed inbound to the echo server, ``payload`` echoed."""
    sock = socks5_connect(clash.engine.listen_address("mixed-in"), "localhost", echo.port)
    sock.sendall(payload)
    assert recv_exact(sock, len(payload)) == payload
    return sock


def active_ids(clash: ClashEngine) -> set[str]:
    return {r["flow_id"] for r in clash.engine.query("flows")["active_flows"]}


def completed_reasons(clash: ClashEngine) -> dict[str, str | None]:
    """flow_id -> close reason of every flow.completed in the event ring."""
    events = clash.engine.query("events", {"types": "flow.completed"})["events"]
    return {
        e["payload"]["flow_id"]: e["payload"]["record"]["result"].get("close_reason")
        for e in events
    }


def test_an_unchanged_flow_table_reuses_the_encoded_connections_whole() -> None:
    builder = SnapshotBuilder(None)  # type: ignore[arg-type]
    table = records(3)
    first = builder.encode(list(table), LISTENERS, (1, 2), 3)
    connections = builder._connections
    # The same record objects (a new list, as flow_records returns): only the header moves.
    again = builder.encode(list(table), LISTENERS, (10, 20), 30)
    assert builder._connections is connections
    assert json.loads(again) == dict(json.loads(first), uploadTotal=10, downloadTotal=20, memory=30)
    # One flow gone: the list is encoded again, without it.
    fewer = json.loads(builder.encode(table[1:], LISTENERS, (10, 20), 30))
    assert [c["id"] for c in fewer["connections"]] == ["f-1", "f-2"]
    assert builder._connections is not connections


def test_live_totals_are_what_live_traffic_sums_to(routed: ClashEngine, echo: EchoServer) -> None:
    core = routed.engine._core
    with open_flow(routed, echo, b"y" * 3000):
        # C's counters of the echo's last write can trail the client's read by a moment.
        live = wait_until(
            lambda: (t := core.live_traffic()) and len(t) == 1 and t[0][1:] == (3000, 3000) and t,
            what="the relay's counters at 3000 bytes each way",
        )
        up, down = core.live_totals()
        assert (up, down) == (sum(e[1] for e in live), sum(e[2] for e in live))
        stats = routed.engine.query("stats")
        counters = core.counters
        assert stats["bytes_up"] == counters.completed_bytes_up + 3000
        assert stats["bytes_down"] == counters.completed_bytes_down + 3000


def test_get_connections_is_one_snapshot_of_the_live_flows(
    routed: ClashEngine, echo: EchoServer
) -> None:
    with open_flow(routed, echo, b"x" * 1000) as sock:
        (flow_id,) = active_ids(routed)

        def snapshot_counts() -> Any:
            status, snap = call(routed.url + "/connections")
            assert status == 200
            conns = snap["connections"] or []
            ok = conns and (conns[0]["upload"], conns[0]["download"]) == (1000, 1000)
            return snap if ok else None

        snap = wait_until(snapshot_counts, what="1000 bytes each way in the snapshot")
        # Read after the snapshot: the record's route revision may publish after the
        # first bytes moved.
        record = routed.engine.query("flow", {"flow_id": flow_id})
        assert list(snap) == ["downloadTotal", "uploadTotal", "connections", "memory"]
        (conn,) = snap["connections"]
        assert conn["id"] == flow_id
        assert conn["chains"] == list(reversed(record["route"]["selection_chain"]))
        assert conn["chains"][-1] == "Proxy" and conn["chains"][0] in ("s5", "direct")
        assert (conn["rule"], conn["rulePayload"]) == (
            "AND",
            f"((DomainSuffix,localhost) && (DstPort,{echo.port}))",
        )
        meta = conn["metadata"]
        assert (meta["host"], meta["destinationPort"], meta["inboundName"]) == (
            "localhost",
            str(echo.port),
            "mixed-in",
        )
        mixed = routed.engine.listen_address("mixed-in")
        assert (meta["inboundIP"], meta["inboundPort"]) == (mixed[0], str(mixed[1]))
        assert (meta["sourceIP"], meta["sourcePort"]) == (
            "127.0.0.1",
            str(sock.getsockname()[1]),
        )
        assert snap["uploadTotal"] >= 1000 and snap["downloadTotal"] >= 1000
        assert snap["memory"] > 0


def test_delete_one_connection_closes_that_flow_through_flows_close(
    routed: ClashEngine, echo: EchoServer
) -> None:
    with open_flow(routed, echo) as first, open_flow(routed, echo) as second:
        ids = active_ids(routed)
        victim = routed.engine.query("flows")["active_flows"][0]["flow_id"]
        status, body = call(routed.url + f"/connections/{victim}", "DELETE")
        assert (status, body) == (204, None)
        wait_until(lambda: victim in completed_reasons(routed), what="the flow completes")
        assert completed_reasons(routed)[victim] == "manual"
        assert active_ids(routed) == ids - {victim}
        # Its client sees the tunnel end; the other flow still echoes.
        ended = {first, second}
        for sock in ended:
            sock.settimeout(5)
        survivors = []
        for sock in ended:
            sock.sendall(b"?")
            try:
                got = sock.recv(1)
            except (ConnectionResetError, TimeoutError):
                got = b""
            survivors.append(got == b"?")
        assert sorted(survivors) == [False, True]


def test_delete_an_unknown_connection_is_204_as_mihomo(clash: ClashEngine) -> None:
    assert call(clash.url + "/connections/no-such-flow", "DELETE") == (204, None)


def test_delete_all_connections_closes_every_flow(routed: ClashEngine, echo: EchoServer) -> None:
    with open_flow(routed, echo), open_flow(routed, echo), open_flow(routed, echo):
        ids = active_ids(routed)
        assert len(ids) == 3
        assert call(routed.url + "/connections", "DELETE") == (204, None)
        wait_until(lambda: ids <= set(completed_reasons(routed)), what="every flow completes")
        assert {completed_reasons(routed)[i] for i in ids} == {"manual"}
        assert active_ids(routed) == set()
        status, snap = call(routed.url + "/connections")
        assert (status, snap["connections"]) == (200, None)


# -- what the client spoke, fake-ip and the principal, on real flows ---------------------


class HoldingOrigin(LoopbackServer):
    """An HTTP origin that reads each request head and answers only when told: a
    forwarded request stays an active flow until :meth:`answer`."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.conns: list[socket.socket] = []
        self.lock = threading.Lock()
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._read_head, args=(conn,), daemon=True).start()

    def _read_head(self, conn: socket.socket) -> None:
        head = b""
        with contextlib.suppress(OSError):
            head = read_head(conn)
        with self.lock:
            self.heads.append(head)
            self.conns.append(conn)

    def answer(self) -> None:
        """Answer every request received (``ok``, then close)."""
        with self.lock:
            for conn in self.conns:
                with contextlib.suppress(OSError):
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                conn.close()
            self.conns.clear()


def http_connect(
    proxy: tuple[str, int], host: str, port: int, auth: tuple[str, str] | None = None
) -> socket.socket:
    """An HTTP ``CONNECT`` tunnel through ``proxy``, its ``200`` read."""
    sock = socket.create_connection(proxy, timeout=10)
    lines = [f"CONNECT {host}:{port} HTTP/1.1", f"Host: {host}:{port}"]
    if auth is not None:
        token = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
        lines.append(f"Proxy-Authorization: Basic {token}")
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        data = sock.recv(1)
        assert data, f"the proxy closed after {head!r}"
        head += data
    assert head.startswith(b"HTTP/1.1 200 "), head
    return sock


def echoes(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(payload)
    assert recv_exact(sock, len(payload)) == payload


def connections_by_port(clash: ClashEngine, count: int) -> dict[int, dict[str, Any]]:
    """The snapshot's connections by client port, once it lists ``count`` of them."""

    def listed() -> list[dict[str, Any]] | None:
        status, snap = call(clash.url + "/connections")
        assert status == 200
        conns = snap["connections"] or []
        return conns if len(conns) == count else None

    conns = wait_until(listed, what=f"{count} connections listed")
    return {int(c["metadata"]["sourcePort"]): c for c in conns}


def records_by_port(clash: ClashEngine) -> dict[int, dict[str, Any]]:
    """The active flows' records (``GET /api/v1/flows``) by client port."""
    return {r["source"]["port"]: r for r in clash.engine.query("flows")["active_flows"]}


def test_one_mixed_inbound_shows_socks5_http_and_https_as_its_clients_spoke(
    routed: ClashEngine, echo: EchoServer
) -> None:
    mixed = routed.engine.listen_address("mixed-in")
    with (
        HoldingOrigin() as origin,
        open_flow(routed, echo) as socks,
        http_connect(mixed, "localhost", echo.port) as tunnel,
        socket.create_connection(mixed, timeout=10) as plain,
    ):
        echoes(tunnel, b"through CONNECT")
        # A plain request to a port no rule names goes direct, forwarded (by C's loop):
        # its flow is active until the origin answers.
        target = f"127.0.0.1:{origin.port}"
        plain.sendall(f"GET http://{target}/held HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        wait_until(lambda: origin.heads, what="the origin has the request")
        conns = connections_by_port(routed, 3)
        ports = {
            "socks": socks.getsockname()[1],
            "tunnel": tunnel.getsockname()[1],
            "plain": plain.getsockname()[1],
        }
        types = {name: conns[port]["metadata"]["type"] for name, port in ports.items()}
        assert types == {"socks": "Socks5", "tunnel": "HTTPS", "plain": "HTTP"}
        assert {c["metadata"]["inboundName"] for c in conns.values()} == {"mixed-in"}
        assert conns[ports["plain"]]["metadata"]["host"] == ""
        assert conns[ports["plain"]]["metadata"]["destinationIP"] == "127.0.0.1"
        # The records say it first, as every transport sees them.
        records = records_by_port(routed)
        spoken = {name: records[port]["inbound"] for name, port in ports.items()}
        assert spoken == {
            "socks": {"tag": "mixed-in", "protocol": "mixed", "client_protocol": "socks5"},
            "tunnel": {"tag": "mixed-in", "protocol": "mixed", "client_protocol": "http_connect"},
            "plain": {"tag": "mixed-in", "protocol": "mixed", "client_protocol": "http"},
        }
        for record in records.values():
            assert "fake_ip" not in record["target"] and "principal_key" not in record
            assert conns[record["source"]["port"]]["metadata"]["dnsMode"] == "normal"
        origin.answer()
        answer = b""
        while not answer.endswith(b"ok"):
            data = plain.recv(4096)
            assert data, answer
            answer += data
        assert answer.startswith(b"HTTP/1.1 200 OK\r\n")


def test_a_flow_to_a_fake_ip_address_shows_its_name_and_dns_mode_fake_ip(
    routed: ClashEngine, echo: EchoServer
) -> None:
    # The address the engine's DNS would answer for the name (runtime.dns fake_ip).
    fake = routed.engine.core.dns.pool.lookup("localhost")
    mixed = routed.engine.listen_address("mixed-in")
    with socks5_connect(mixed, fake, echo.port) as sock:
        echoes(sock, b"by its fake address")
        (conn,) = connections_by_port(routed, 1).values()
        meta = conn["metadata"]
        assert (meta["host"], meta["dnsMode"], meta["destinationPort"]) == (
            "localhost",
            "fake-ip",
            str(echo.port),
        )
        # Routed by its name, as mihomo's fake-ip does: the localhost rule matched.
        assert (conn["rule"], conn["rulePayload"]) == (
            "AND",
            f"((DomainSuffix,localhost) && (DstPort,{echo.port}))",
        )
        (record,) = routed.engine.query("flows")["active_flows"]
        assert record["target"]["host"] == "localhost"
        assert record["target"]["fake_ip"] == fake
        assert record["target"]["port"] == echo.port


def test_an_authenticated_flow_shows_its_principal_as_the_inbound_user(
    make_clash: Callable[..., ClashEngine], echo: EchoServer
) -> None:
    users = [{"username": "alice", "password": "s3cret", "principal_key": "p-alice"}]

    def prepare(cfg: dict[str, Any]) -> None:
        cfg["inbounds"][2]["users"] = users

    clash = make_clash(prepare)
    mixed = clash.engine.listen_address("mixed-in")
    auth = ("alice", "s3cret")
    with (
        socks5_connect(mixed, "127.0.0.1", echo.port, auth=auth) as socks,
        http_connect(mixed, "127.0.0.1", echo.port, auth=auth) as tunnel,
    ):
        echoes(socks, b"as alice")
        echoes(tunnel, b"as alice again")
        conns = connections_by_port(clash, 2)
        meta = {port: c["metadata"] for port, c in conns.items()}
        by_client = {
            "socks": meta[socks.getsockname()[1]],
            "tunnel": meta[tunnel.getsockname()[1]],
        }
        assert {k: (m["type"], m["inboundUser"]) for k, m in by_client.items()} == {
            "socks": ("Socks5", "p-alice"),
            "tunnel": ("HTTPS", "p-alice"),
        }
        records = records_by_port(clash)
        assert {r["principal_key"] for r in records.values()} == {"p-alice"}
