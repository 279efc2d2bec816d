"""``GET /metrics`` on a real engine with real flows: every figure read back through
``prometheus_client``'s own parsers equals what the engine's other resources say, byte
counts exact; OpenMetrics on request; the API's authentication and permissions hold."""

from __future__ import annotations

import http.client
import os
import re
import socket
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import control_config
from tests.conftest import wait_until
from tests.helpers.receiver import Receiver
from tests.helpers.servers import EchoServer
from tests.helpers.socks import socks5_connect

ADMIN_ENV, ADMIN = "SW_TEST_METRICS_ADMIN", "admin-key-for-metrics"
READ_ENV, READER = "SW_TEST_METRICS_READ", "read-key-for-metrics"
CONTROL_ENV, CONTROLLER = "SW_TEST_METRICS_CONTROL", "control-key-no-read"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(base_url: str, *, accept: str | None = None, key: str | None = None):
    """One scrape: ``(status, content type, body text)``."""
    headers = {}
    if accept is not None:
        headers["Accept"] = accept
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", "/metrics", headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.getheader("Content-Type"), answer.read().decode()
    finally:
        conn.close()


def samples(text: str) -> Samples:
    """Every sample of a text-format scrape, by name and sorted labels."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, tuple(sorted(labels.items()))))


def echo_flow(engine: Any, port: int, size: int) -> None:
    """One flow that sends ``size`` bytes to the echo server and reads them back."""
    with socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", port) as s:
        s.sendall(b"x" * size)
        got = 0
        while got < size:
            chunk = s.recv(65536)
            assert chunk
            got += len(chunk)


@pytest.fixture
def metrics_engine(make_engine, origin):
    """An engine with a selector, a url_test group probing the local origin, a webhook
    sink and rules that send port 9 to block."""
    with Receiver() as rx:
        cfg = control_config()
        cfg["outbound_groups"] = [
            {"tag": "pick", "kind": "selector", "outbounds": ["direct", "block"]},
            {
                "tag": "auto",
                "kind": "url_test",
                "outbounds": ["direct", "block"],
                "url": f"http://127.0.0.1:{origin[1]}/generate_204",
            },
        ]
        cfg["rules"] = [{"port": 9, "outbound": "block"}]
        cfg["route"] = {"final": "pick"}
        cfg["api"]["event_sinks"] = [
            {"type": "webhook", "tag": "hook", "url": rx.url, "events": ["flow.completed"]}
        ]
        yield make_engine(cfg), rx


def test_scrape_matches_the_engine_exactly(metrics_engine):
    """Completed and open flows, bytes by outbound, outcomes, groups, sinks and the event
    ring, each equal to what the engine's own resources say."""
    engine, rx = metrics_engine
    base = engine.control_url
    with EchoServer() as echo:
        echo_flow(engine, echo.port, 1000)
        echo_flow(engine, echo.port, 2345)
        with pytest.raises(ConnectionError, match="socks reply 2"):
            echo_flow(engine, 9, 10)  # blocked by the rule: refused at the handshake
        wait_until(lambda: engine.query("stats")["completed_sessions"] == 3, 10, "3 completed")
        held = socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port)
        try:
            held.sendall(b"y" * 777)
            assert len(held.recv(777, socket.MSG_WAITALL)) == 777
            wait_until(lambda: engine.query("stats")["bytes_up"] == 1000 + 2345 + 777, 10, "live")
            rx.wait_for(3)
            wait_until(
                lambda: engine.query("sinks")["sinks"][0]["total_delivered"] == 3, 10, "acks"
            )
            before = engine.query("events")["events"]
            status, content_type, text = scrape(base)
            after = engine.query("events")["events"]
        finally:
            held.close()
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    found = samples(text)
    assert value(found, "spliceway_up") == 1
    assert value(found, "spliceway_flows_started_total") == 4
    assert (
        value(found, "spliceway_flows_completed_total", network="tcp", outcome="direct_relayed")
        == 2
    )
    assert value(found, "spliceway_flows_completed_total", network="tcp", outcome="blocked") == 1
    assert value(found, "spliceway_flows_active", inbound="socks-in", network="tcp") == 1
    # Completed and open flows alike, exact: C's counters for the open one.
    assert value(found, "spliceway_flow_bytes_total", outbound="direct", direction="up") == 4122
    assert value(found, "spliceway_flow_bytes_total", outbound="direct", direction="down") == 4122
    assert value(found, "spliceway_relay_active_flows") == 1
    assert value(found, "spliceway_relay_loops") >= 1
    # Groups: the selector's choice, the url_test members' health and latency.
    assert (
        value(found, "spliceway_policy_selected", policy="pick", kind="selector", member="direct")
        == 1
    )
    assert value(found, "spliceway_policy_member_healthy", policy="auto", member="direct") == 1
    assert value(found, "spliceway_policy_member_healthy", policy="auto", member="block") == 0
    latency = value(
        found, "spliceway_policy_member_latency_seconds", policy="auto", member="direct"
    )
    snapshot = engine.query("policy", {"policy_tag": "auto"})
    direct = next(m for m in snapshot["url_test_members"] if m["member_tag"] == "direct")
    assert latency == pytest.approx(direct["latency_ms"] / 1000)
    # The sink, as GET /api/v1/sinks has it.
    labels = {"sink": "hook", "type": "webhook"}
    assert value(found, "spliceway_sink_delivered_events_total", **labels) == 3
    assert value(found, "spliceway_sink_pending_events", **labels) == 0
    assert value(found, "spliceway_sink_failed_attempts_total", **labels) == 0
    assert value(found, "spliceway_sink_replay_gaps_total", **labels) == 0
    # The ring (which evicted nothing): per-type counts and fill between what
    # GET /api/v1/events had just before and just after the scrape.
    for event_type in {e["event_type"] for e in after}:
        emitted = value(found, "spliceway_events_emitted_total", type=event_type) or 0
        low = sum(e["event_type"] == event_type for e in before)
        assert low <= emitted <= sum(e["event_type"] == event_type for e in after)
    assert len(before) <= value(found, "spliceway_event_ring_events") <= len(after)
    assert value(found, "spliceway_event_ring_capacity") == 8192


def test_selection_and_sse_streams_move_the_gauges(metrics_engine):
    """A selection changes spliceway_policy_selected; an open SSE stream counts."""
    engine, _rx = metrics_engine
    base = engine.control_url
    engine.execute("policies.select", {"policy_tag": "pick", "target_tag": "block"})
    found = samples(scrape(base)[2])
    assert (
        value(found, "spliceway_policy_selected", policy="pick", kind="selector", member="block")
        == 1
    )
    assert (
        value(found, "spliceway_policy_selected", policy="pick", kind="selector", member="direct")
        is None
    )
    assert value(found, "spliceway_sse_streams_open") == 0
    with urllib.request.urlopen(f"{base}/api/v1/events/stream", timeout=10) as stream:
        assert stream.status == 200
        wait_until(
            lambda: value(samples(scrape(base)[2]), "spliceway_sse_streams_open") == 1,
            10,
            "the stream counted",
        )
    wait_until(
        lambda: value(samples(scrape(base)[2]), "spliceway_sse_streams_open") == 0,
        10,
        "the stream gone",
    )


def test_openmetrics_when_asked(metrics_engine):
    """Accept: application/openmetrics-text gets OpenMetrics, which its parser reads,
    ending in # EOF."""
    engine, _rx = metrics_engine
    status, content_type, text = scrape(
        engine.control_url, accept="application/openmetrics-text; version=1.0.0"
    )
    assert status == 200
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert text.endswith("# EOF\n")
    names = {family.name for family in openmetrics_families(text)}
    assert {"spliceway_flows_started", "spliceway_build", "spliceway_policy_selected"} <= names


def test_unknown_parameters_are_refused(metrics_engine):
    engine, _rx = metrics_engine
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{engine.control_url}/metrics?name[]=x", timeout=10)
    assert refused.value.code == 400
    assert b'"invalid_argument"' in refused.value.read()


def test_the_api_keys_and_permissions_apply(make_engine, monkeypatch):
    """With keys: no key is 401, a key without read is 403, read and admin keys scrape."""
    monkeypatch.setenv(ADMIN_ENV, ADMIN)
    monkeypatch.setenv(READ_ENV, READER)
    monkeypatch.setenv(CONTROL_ENV, CONTROLLER)
    cfg = control_config(
        api_key_env=ADMIN_ENV,
        keys=[
            {"name": "dash", "key_env": READ_ENV, "permissions": ["read"]},
            {"name": "ops", "key_env": CONTROL_ENV, "permissions": ["control"]},
        ],
    )
    base = make_engine(cfg).control_url
    status, _type, body = scrape(base)
    assert status == 401 and '"unauthenticated"' in body
    status, _type, body = scrape(base, key=CONTROLLER)
    assert status == 403 and '"permission_denied"' in body
    for key in (READER, ADMIN):
        status, _type, body = scrape(base, key=key)
        assert status == 200 and "spliceway_up 1.0" in body


def test_process_collector_and_flow_histograms_by_outbound(make_engine):
    """The process collector's figures are this process's; every completed flow with an
    outbound is in the duration and size histograms of its outbound, exactly once; a flow
    without one (blocked by a rule's action) makes no series with an empty outbound."""
    cfg = control_config()
    cfg["rules"] = [
        {"port": 9, "action": "block"},
        {"port": 10, "outbound": "block"},
        # Ranked before route.final: a flow to any other port waits for its first bytes
        # (the sniff) before its route is decided.
        {"domain_suffix": ["never.test"], "action": "block"},
    ]
    for inbound in cfg["inbounds"]:
        inbound["sniff_timeout_ms"] = 10000
    engine = make_engine(cfg)
    with EchoServer() as echo:
        echo_flow(engine, echo.port, 100)
        echo_flow(engine, echo.port, 3000)
        for port in (9, 10):
            with pytest.raises(ConnectionError, match="socks reply 2"):
                echo_flow(engine, port, 10)
        wait_until(lambda: engine.query("stats")["completed_sessions"] == 4, 10, "4 completed")
        # One more, open while scraped and not routed yet (silent, so sniffing): no
        # series for it either.
        pending = socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port)
        try:
            (opening,) = wait_until(
                lambda: engine.query("flows")["active_flows"], 10, "the sniffing flow"
            )
            assert opening["route"]["action"] == "pending"
            status, _, text = scrape(engine.control_url)
        finally:
            pending.close()
    assert status == 200
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for family in families.values():
        for s in family.samples:
            assert s.labels.get("outbound") != "", (family.name, s)
    found = samples(text)
    # The process collector: this very process (the engine runs in it).
    with open("/proc/self/statm") as statm:
        resident = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    rss = value(found, "process_resident_memory_bytes")
    assert rss is not None and 0.5 * resident < rss < 2 * resident
    open_fds = value(found, "process_open_fds")
    assert open_fds is not None and open_fds >= 3
    assert value(found, "process_cpu_seconds_total") > 0
    assert value(found, "process_max_fds") > 0
    # The histograms: two direct flows of 200 and 6000 bytes, one to the block outbound.
    assert families["spliceway_flow_size_bytes"].type == "histogram"
    assert families["spliceway_flow_duration_seconds"].type == "histogram"
    size = {
        s.labels["le"]: s.value
        for s in families["spliceway_flow_size_bytes"].samples
        if s.name.endswith("_bucket") and s.labels["outbound"] == "direct"
    }
    assert (size["0.0"], size["1024.0"], size["4096.0"], size["16384.0"], size["+Inf"]) == (
        0,
        1,
        1,
        2,
        2,
    )
    assert value(found, "spliceway_flow_size_bytes_sum", outbound="direct") == 6200
    assert value(found, "spliceway_flow_size_bytes_count", outbound="direct") == 2
    assert value(found, "spliceway_flow_size_bytes_count", outbound="block") == 1
    assert value(found, "spliceway_flow_size_bytes_bucket", outbound="block", le="0.0") == 1
    assert value(found, "spliceway_flow_duration_seconds_count", outbound="direct") == 2
    assert value(found, "spliceway_flow_duration_seconds_count", outbound="block") == 1
    assert value(found, "spliceway_flow_duration_seconds_bucket", outbound="direct", le="+Inf") == 2
    # The sniffing flow completed after the scrape, when the test closed it.
    events = engine.query("events", {"types": "flow.completed"})["events"]
    completed = [e["payload"]["record"] for e in events]
    durations = [
        r["timing"]["duration_ms"]
        for r in completed
        if r["state"] == "completed"
        and r["flow_id"] != opening["flow_id"]
        and (r["path"]["outbound"] or {}).get("tag") == "direct"
    ]
    assert len(durations) == 2
    assert value(found, "spliceway_flow_duration_seconds_sum", outbound="direct") == (
        pytest.approx(sum(durations) / 1000)
    )
    # Labelled by outbound only: the blocked-by-action flow is in no outbound's figures.
    assert {s.labels["outbound"] for s in families["spliceway_flow_bytes"].samples} == {
        "direct",
        "block",
    }



def test_every_metric_family_is_in_the_readme(metrics_engine):
    """A family the engine exports that the README does not name fails here, and so
    does a row of the README's metrics table naming a family the engine no longer has."""
    engine, _ = metrics_engine
    with EchoServer() as echo:
        echo_flow(engine, echo.port, 100)
    wait_until(
        lambda: "spliceway_flow_duration_seconds_count" in scrape(engine.control_url)[2],
        what="a completed flow in the histograms",
    )
    _, _, text = scrape(engine.control_url)
    exported = set()
    for family in text_string_to_metric_families(text):
        # The parser names a counter family without its samples' _total.
        name = family.name + ("_total" if family.type == "counter" else "")
        exported.add(name.removeprefix("spliceway_"))
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text("utf-8")
    named = set(re.findall(r"`([a-z_]+)`", readme))
    undocumented = {
        n
        for n in exported
        if n not in named
        and not (n.startswith("udp_upstream_") and "`udp_upstream_<counter>_total`" in readme)
    }
    assert undocumented == set()
    table = readme[readme.index("| `start_time_seconds`") :].split("\n\n", 1)[0]
    rows = [line.split("|")[1] for line in table.splitlines() if line.startswith("| `")]
    in_table = {n for row in rows for n in re.findall(r"`([a-z_]+)`", row)}
    assert in_table - exported == set()
