"""Event sinks end to end: a real engine, real flows through its SOCKS inbound, a real
webhook receiver on loopback and a JSONL file, checked against the engine's event ring."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request

import pytest

from spliceway import ApiError, Engine
from tests.conftest import wait_until
from tests.helpers.program import SPLICEWAY
from tests.helpers.receiver import Receiver, Reply
from tests.helpers.servers import EchoServer
from tests.helpers.sinks import (
    DELIVERY_KEYS,
    EMITTED,
    RECOVERY_KEYS,
    SOURCE_ID,
    STATUS_KEYS,
    STORAGE_KEYS,
    assert_at_least_once,
    every_event_groups,
    expected_body,
    flows,
    jsonl,
    ring_events,
    sink_config,
    status_of,
    wait_completed,
    webhook,
)
from tests.helpers.socks import socks5_connect


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as answer:
        assert answer.status == 200
        doc = json.loads(answer.read())
    assert doc["ok"] is True, doc
    return doc["result"]


def test_every_event_type_is_delivered_once_as_the_ring_has_it(make_engine, origin, tmp_path):
    """All event types this build emits reach an unfiltered webhook exactly once, with the
    configured headers, JSON content type and source_id; the body is the ring's envelope
    byte for byte (source_id filled in); flow.snapshot never reaches a sink; filters hold."""
    with Receiver() as rx, Receiver() as picky_rx, EchoServer() as echo:
        cfg = sink_config(
            [
                webhook("hook", rx.url, headers={"Authorization": "Bearer x", "X-Extra": "1"}),
                webhook("picky", picky_rx.url, events=["flow.completed", "policy.selected"]),
                jsonl("audit", tmp_path / "audit.jsonl", events=["flow.completed"]),
            ],
            tmp_path / "outbox",
            runtime={"stats_interval_ms": 100},
        )
        cfg["outbound_groups"] = every_event_groups(origin)
        engine = make_engine(cfg)
        # A live subscriber with a flow.snapshot baseline: the snapshot must stay its own.
        with engine.subscribe(snapshot=True, timeout=0.1) as sub:
            flows(engine, origin, 2)
            engine.execute("policies.select", {"policy_tag": "pick", "target_tag": "block"})
            # A flow that moves bytes across a stats tick gets a flow.updated.
            with socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port) as s:
                s.sendall(b"ping")
                assert s.recv(4) == b"ping"

                def updated() -> bool:
                    ring = engine.query("events")["events"]
                    return any(e["event_type"] == "flow.updated" for e in ring)

                wait_until(updated, 10, "a flow.updated event")
            wait_until(
                lambda: (
                    {"policy.probe.completed", "stats.sampled"}
                    <= {e["event_type"] for e in engine.query("events")["events"]}
                ),
                10,
                "a probe round and a stats sample",
            )
            assert next(iter(sub))["event_type"] == "flow.snapshot"
        ring = engine.query("events")
        selected = ring_events(ring)
        rx.wait_for(len(selected))
        engine.stop()
        delivered = rx.bodies_by_event_id()
        # Every ring event (from before the stop) arrived, byte-identical to the ring.
        expected = {e["event_id"]: expected_body(e) for e in selected}
        assert_at_least_once(delivered, expected)
        # ... exactly once, and nothing else but the later stats samples and engine.stopped.
        assert all(len(bodies) == 1 for bodies in delivered.values()), "duplicates"
        envelopes = [json.loads(r.body) for r in rx.requests]
        types = {e["event_type"] for e in envelopes}
        assert types == EMITTED, types ^ EMITTED
        assert [e["event_type"] for e in envelopes].count("engine.stopped") == 1
        assert envelopes[-1]["event_type"] == "engine.stopped"
        sequences = [e["sequence"] for e in envelopes]
        assert sequences == sorted(sequences), "one sink delivers in order"
        assert sequences == list(range(1, len(sequences) + 1)), "no event skipped"
        assert {e["source_id"] for e in envelopes} == {SOURCE_ID}
        for request in rx.requests:
            assert request.method == "POST"
            assert request.path == "/hook"
            assert request.headers["content-type"] == "application/json"
            assert request.headers["authorization"] == "Bearer x"
            assert request.headers["x-extra"] == "1"
            assert int(request.headers["content-length"]) == len(request.body)

        # The filtered webhook: exactly its types, each once.
        picked = [json.loads(r.body) for r in picky_rx.requests]
        want = [e for e in envelopes if e["event_type"] in ("flow.completed", "policy.selected")]
        assert [e["event_id"] for e in picked] == [e["event_id"] for e in want]
        assert [r.body for r in picky_rx.requests] == [
            r.body for r, e in zip(rx.requests, envelopes, strict=True) if e in want
        ]
        # The JSONL sink: one envelope per line, only flow.completed, source_id null.
        lines = (tmp_path / "audit.jsonl").read_bytes().splitlines()
        completed = [e for e in envelopes if e["event_type"] == "flow.completed"]
        assert len(completed) == 3
        assert lines == [expected_body(e, None) for e in completed]


def test_sinks_resource_reports_exact_counts_after_n_flows(make_engine, origin, tmp_path):
    """GET /api/v1/sinks over HTTP after N flows: every field, pending 0, total_delivered
    equal to the selected events, cursor at the ring's latest sequence, no delivery block
    when idle, a clean recovery."""
    n = 4
    with Receiver() as rx:
        cfg = sink_config(
            [
                webhook("hook", rx.url),
                jsonl("audit", tmp_path / "audit.jsonl", events=["flow.completed"]),
            ],
            tmp_path / "outbox",
            control=True,
        )
        engine = make_engine(cfg)
        flows(engine, origin, n)
        ring = wait_completed(engine, n)
        events = ring_events(ring)
        assert len(events) == 1 + 3 * n  # engine.started; started, routed, completed per flow
        rx.wait_for(len(events))
        url = f"{engine.control_url}/api/v1/sinks"

        def idle() -> dict | None:
            doc = get_json(url)
            return doc if all(s["pending"] == 0 for s in doc["sinks"]) else None

        doc = wait_until(idle, 10, "both sinks idle")
        assert [s["name"] for s in doc["sinks"]] == ["hook", "audit"]
        for item, delivered in (
            (status_of(doc, "hook"), len(events)),
            (status_of(doc, "audit"), n),
        ):
            assert set(item) == STATUS_KEYS - {"delivery"}, set(item) ^ STATUS_KEYS
            assert item["pending"] == 0
            assert item["total_delivered"] == delivered
            assert item["total_failed"] == 0
            assert item["total_dead_lettered"] == item["total_discarded"] == 0
            assert item["dead_letters"] == item["replay_gaps"] == 0
            assert item["cursor_sequence"] == ring["latest_sequence"]
            assert item["last_success_at_unix_ms"] >= events[-1]["occurred_at_unix_ms"]
            assert item["last_failure_at_unix_ms"] is None
            assert item["last_error"] is None
            assert set(item["outbox_storage"]) == STORAGE_KEYS
            assert item["outbox_storage"]["write_blocked"] is False
            assert item["outbox_storage"]["reserve_bytes"] == 0
            assert set(item["outbox_recovery"]) == RECOVERY_KEYS
            assert item["outbox_recovery"]["state"] == "clean"
            assert item["outbox_recovery"]["recovered_records"] == 0
        assert status_of(doc, "hook")["type"] == "webhook"
        assert status_of(doc, "audit")["type"] == "jsonl"
        # The embedded query answers the same.
        assert engine.query("sinks")["sinks"][0]["total_delivered"] == len(events)
        assert len(rx.requests) == len(events)


def test_busy_sink_reports_its_delivery_stage(make_engine, tmp_path):
    """While an event is held by the receiver the item has a delivery block: in flight,
    durable_pending counting the disk backlog."""
    with Receiver() as rx:
        rx.default = Reply(hang=True)
        engine = make_engine(
            sink_config(
                [webhook("hook", rx.url)],
                tmp_path / "outbox",
                dispatcher={"request_timeout_ms": 60000},
            )
        )
        rx.wait_for(1)
        item = wait_until(
            lambda: (s := status_of(engine.query("sinks"), "hook")).get("delivery") and s,
            5,
            "a delivery block",
        )
        assert set(item["delivery"]) == DELIVERY_KEYS
        assert item["delivery"]["in_flight"] == 1
        assert item["delivery"]["durable_pending"] == item["pending"] == 1
        assert item["delivery"]["retry_pending"] == 0


def test_memory_outbox_delivers_and_reports_no_storage(make_engine, origin, tmp_path):
    """Without api.outbox_path events still reach the webhook (and the JSONL file); the
    items have no outbox_storage."""
    with Receiver() as rx:
        engine = make_engine(
            sink_config([webhook("hook", rx.url), jsonl("audit", tmp_path / "a.jsonl")])
        )
        flows(engine, origin, 2)
        events = ring_events(wait_completed(engine, 2))
        rx.wait_for(len(events))
        assert_at_least_once(
            rx.bodies_by_event_id(),
            {e["event_id"]: expected_body(e) for e in events},
        )
        assert len(rx.requests) == len(events)
        doc = wait_until(
            lambda: (
                (d := engine.query("sinks")) and all(s["pending"] == 0 for s in d["sinks"]) and d
            ),
            10,
            "idle sinks",
        )
        for item in doc["sinks"]:
            assert "outbox_storage" not in item
            assert item["total_delivered"] == len(events)
            assert item["outbox_recovery"]["state"] == "clean"
        lines = (tmp_path / "a.jsonl").read_bytes().splitlines()
        assert lines == [expected_body(e, None) for e in events]


def test_second_engine_on_the_same_outbox_is_refused_with_conflict(make_engine, origin, tmp_path):
    """The outbox is one engine's: a second one (embedded, or the program) fails to start
    with code conflict and leaves the first one delivering."""
    outbox = tmp_path / "outbox"
    with Receiver() as rx:
        first = make_engine(sink_config([webhook("hook", rx.url)], outbox))
        rx.wait_for(1)
        second = Engine(sink_config([webhook("hook", rx.url)], outbox))
        with pytest.raises(ApiError) as caught:
            second.start()
        assert caught.value.code == "conflict"
        assert caught.value.field_path == "api.outbox_path"
        assert not second.running
        # Nothing of the refused engine is left listening.
        with socket.socket() as probe:
            assert probe.connect_ex(first.listen_address("socks-in")) == 0

        config = tmp_path / "second.json"
        config.write_text(json.dumps(sink_config([webhook("hook", rx.url)], outbox)))
        result = subprocess.run(
            [*SPLICEWAY, "run", "-c", str(config)],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode == 2, result.stderr
        assert "conflict" in result.stderr and str(outbox) in result.stderr, result.stderr
        # The first engine still owns the outbox and delivers.
        flows(first, origin, 1)
        rx.wait_for(4)
        wait_until(
            lambda: status_of(first.query("sinks"), "hook")["total_delivered"] == 4,
            5,
            "the first engine's four deliveries counted",
        )
