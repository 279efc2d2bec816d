"""SSE on a real Waitress server, read with sseclient-py (docs/events.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest

from spliceway.api.app import create_app
from spliceway.api.auth import KeyTable
from spliceway.api.server import ControlServer
from tests.api.conftest import RELAXED
from tests.api.sse_client import Stream
from tests.conftest import base_config, wait_until
from tests.helpers.socks import recv_all, socks5_connect

LIFECYCLE = ("flow.started", "flow.routed", "flow.completed")
TYPES = {"types": ",".join(LIFECYCLE)}


def run_flow(engine: Any, origin: tuple[str, int]) -> None:
    """One complete request through the socks5 inbound (three lifecycle events)."""
    with socks5_connect(engine.listen_address("socks-in"), *origin) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: o\r\nConnection: close\r\n\r\n")
        recv_all(sock)


def ring(engine: Any, after: int, types: tuple[str, ...] = LIFECYCLE) -> list[dict[str, Any]]:
    """The ring's envelopes after sequence ``after`` of the given types."""
    events = engine.query("events")["events"]
    return [e for e in events if e["sequence"] > after and e["event_type"] in types]


def completed_count(engine: Any) -> int:
    return sum(1 for e in engine.query("events")["events"] if e["event_type"] == "flow.completed")


def test_live_phase_starts_with_snapshot_then_frames(
    engine: Any, base_url: str, origin: tuple[str, int]
) -> None:
    with Stream(base_url, TYPES) as stream:
        assert stream.status == 200
        assert stream.response.getheader("Content-Type").startswith("text/event-stream")
        assert stream.response.getheader("Access-Control-Allow-Origin") == "*"
        event, snap = stream.next_envelope()
        assert event.event == "flow.snapshot" and snap["event_type"] == "flow.snapshot"
        latest = engine.query("events")["latest_sequence"]
        assert int(event.id) == snap["sequence"] == snap["payload"]["watermark"] <= latest
        assert snap["payload"]["records"] == []
        run_flow(engine, origin)
        got = [stream.next_envelope() for _ in range(3)]
        assert [e.event for e, _ in got] == list(LIFECYCLE)
        for event, envelope in got:
            assert int(event.id) == envelope["sequence"]
            assert envelope["event_type"] == event.event
            assert envelope["schema_id"] == "service.event.v1"
        assert [env for _, env in got] == ring(engine, snap["sequence"])


def test_frames_arrive_while_the_flow_is_still_open(
    engine: Any, base_url: str, origin: tuple[str, int]
) -> None:
    """Nothing waits for more output: each frame reaches the client on its own."""
    held = socks5_connect(engine.listen_address("socks-in"), *origin)
    try:
        wait_until(lambda: engine.query("flows")["active_flows"])
        with Stream(base_url, TYPES) as stream:
            _, snap = stream.next_envelope()
            assert [r["flow_id"] for r in snap["payload"]["records"]] == [
                f["flow_id"] for f in engine.query("flows")["active_flows"]
            ]
            second = socks5_connect(engine.listen_address("socks-in"), *origin)
            try:
                started = time.monotonic()
                first, _ = stream.next_envelope()
                routed, env = stream.next_envelope()
                assert (first.event, routed.event) == ("flow.started", "flow.routed")
                assert env["payload"]["record"]["state"] == "active"
                # The flow is still open, so only a flushed frame can have got here.
                assert time.monotonic() - started < 5
            finally:
                second.close()
    finally:
        held.close()


def test_type_filter_without_flow_types_has_no_snapshot(engine: Any, base_url: str) -> None:
    with Stream(base_url, {"types": "stats.sampled"}) as stream:
        for _ in range(2):
            event, envelope = stream.next_envelope()
            assert event.event == "stats.sampled" == envelope["event_type"]
            assert "active_sessions" in envelope["payload"]


def test_resume_with_last_event_id_gets_exactly_the_missed_events(
    engine: Any, base_url: str, origin: tuple[str, int]
) -> None:
    with Stream(base_url, TYPES) as stream:
        stream.next_envelope()  # snapshot
        for _ in range(2):
            run_flow(engine, origin)
        seen = [stream.next_envelope() for _ in range(6)]
    last_id = int(seen[-1][0].id)
    before = completed_count(engine)
    for _ in range(3):
        run_flow(engine, origin)
    wait_until(lambda: completed_count(engine) == before + 3)
    missed = ring(engine, last_id)
    assert len(missed) == 9
    with Stream(base_url, TYPES, headers={"Last-Event-ID": str(last_id)}) as stream:
        got = [stream.next_envelope() for _ in range(9)]
        assert [env for _, env in got] == missed
        assert [int(e.id) for e, _ in got] == [m["sequence"] for m in missed]
        event, snap = stream.next_envelope()
        assert event.event == "flow.snapshot"
        assert snap["payload"]["watermark"] >= missed[-1]["sequence"]
        run_flow(engine, origin)
        live = [stream.next_envelope()[1] for _ in range(3)]
        assert [e["event_type"] for e in live] == list(LIFECYCLE)
        assert live[0]["sequence"] > snap["payload"]["watermark"]


def test_since_parameter_and_a_since_from_another_engine_start(
    engine: Any, base_url: str, origin: tuple[str, int]
) -> None:
    run_flow(engine, origin)
    wait_until(lambda: completed_count(engine) == 1)
    with Stream(base_url, {**TYPES, "since": "0"}) as stream:
        got = [stream.next_envelope()[1] for _ in range(3)]
        assert got == ring(engine, 0)
        assert stream.next_envelope()[1]["event_type"] == "flow.snapshot"
    # A sequence ahead of this start's ring cannot be ours: the whole ring is replayed.
    with Stream(base_url, TYPES, headers={"Last-Event-ID": "999999"}) as stream:
        got = [stream.next_envelope()[1] for _ in range(3)]
        assert got == ring(engine, 0)


@pytest.mark.parametrize(
    ("params", "headers", "field"),
    [
        ({"since": "abc"}, {}, "since"),
        ({"since": "-3"}, {}, "since"),
        ({}, {"Last-Event-ID": "x-1"}, "Last-Event-ID"),
        ({"types": "flow.started,no.such"}, {}, "types"),
    ],
)
def test_bad_stream_parameters(
    base_url: str, params: dict[str, str], headers: dict[str, str], field: str
) -> None:
    with Stream(base_url, params, headers) as stream:
        assert stream.status == 400
        body = stream.error_body()
        assert body["error"]["code"] == "invalid_argument"
        assert body["error"]["field_path"] == field


def test_sixth_stream_is_refused_and_a_dropped_client_frees_its_slot(
    engine: Any, base_url: str
) -> None:
    streams = [Stream(base_url, TYPES) for _ in range(5)]
    try:
        for s in streams:
            assert s.status == 200
            s.next_envelope()
        with Stream(base_url, TYPES) as sixth:
            assert sixth.status == 429
            assert int(sixth.response.getheader("Retry-After")) >= 1
            assert sixth.error_body()["error"]["code"] == "rate_limited"
        streams.pop().abort()

        def admitted() -> bool:
            probe = Stream(base_url, TYPES)
            if probe.status == 200:
                streams.append(probe)
                return True
            probe.close()
            return False

        # The slot comes back within the stream's disconnect poll, not at the next keep-alive.
        started = time.monotonic()
        wait_until(admitted, timeout=5, interval=0.05)
        assert time.monotonic() - started < 3
    finally:
        for s in streams:
            s.close()


def test_keepalive_comments_on_an_idle_stream(make_engine: Callable[..., Any]) -> None:
    engine = make_engine(base_config(runtime={"stats_interval_ms": 60000}))
    app = create_app(engine.control_plane, keys=KeyTable([]), limits=RELAXED, keepalive_s=0.2)
    server = ControlServer(app, "127.0.0.1", 0)
    server.start()
    try:
        with Stream(server.base_url, {"types": "engine.warning"}) as stream:
            seen = b""
            deadline = time.monotonic() + 5
            while seen.count(b": keep-alive\n\n") < 2 and time.monotonic() < deadline:
                seen += stream.response.read1(4096)
            assert seen.startswith(b": connected\n")
            assert seen.count(b": keep-alive\n\n") >= 2
    finally:
        server.stop()


def test_engine_stop_ends_open_streams(make_engine: Callable[..., Any]) -> None:
    from tests.api.conftest import control_config

    engine = make_engine(control_config())
    stream = Stream(engine.control_url, TYPES)
    stream.next_envelope()
    engine.stop()
    try:
        # Draining ends at EOF (possibly after engine.stopped-era frames), within the timeout.
        for _ in stream.events():
            pass
    except (TimeoutError, ConnectionError):
        pytest.fail("stream did not end cleanly when the engine stopped")
    finally:
        stream.close()
