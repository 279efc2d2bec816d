"""The event ring: sequences, ids, catch-up, snapshots and subscriber bounds."""

from __future__ import annotations

import threading

import orjson

from spliceway.events.log import EventLog, normalize_types


def test_sequences_start_at_one_and_ids_carry_the_epoch():
    log = EventLog(capacity=4)
    first = log.emit("engine.started", {"x": 1})
    second = log.emit("stats.sampled", {})
    assert (first["sequence"], second["sequence"]) == (1, 2)
    assert first["event_id"] == f"{log.epoch}-1"
    assert first["schema_id"] == "service.event.v1"
    assert first["source_id"] is None
    assert first["labels"] == {}
    assert EventLog().epoch != log.epoch


def test_ring_keeps_the_newest_capacity_events():
    log = EventLog(capacity=3)
    for i in range(5):
        log.emit("stats.sampled", {"i": i})
    snap = log.snapshot()
    assert [e["sequence"] for e in snap["events"]] == [3, 4, 5]
    assert (snap["oldest_sequence"], snap["latest_sequence"], snap["capacity"]) == (3, 5, 3)


def test_subscribe_since_replays_then_goes_live_without_gaps_or_duplicates():
    log = EventLog()
    for _ in range(5):
        log.emit("flow.started", {})
    sub = log.subscribe(since=2, timeout=1)
    log.emit("flow.completed", {})
    got = [e["sequence"] for e in sub if e["sequence"] <= 6 or sub.close()]
    assert got[:4] == [3, 4, 5, 6]


def test_snapshot_follows_catch_up_with_the_latest_sequence_as_watermark():
    log = EventLog()
    log.emit("flow.started", {})
    log.emit("stats.sampled", {})
    sub = log.subscribe(["flow.started"], since=0, snapshot=lambda: [{"flow_id": "a"}])
    first, snapshot = sub.get(1), sub.get(1)
    assert first["sequence"] == 1
    assert snapshot["event_type"] == "flow.snapshot"
    assert snapshot["sequence"] == snapshot["payload"]["watermark"] == 2
    assert snapshot["payload"]["records"] == [{"flow_id": "a"}]
    assert all(e["event_type"] != "flow.snapshot" for e in log.snapshot()["events"])


def test_no_snapshot_when_the_filter_has_no_flow_types():
    log = EventLog()
    sub = log.subscribe(["stats.sampled"], snapshot=list)
    assert sub.get(0.05) is None


def test_filter_normalisation():
    assert normalize_types(None) is None
    assert normalize_types([]) is None
    assert normalize_types(["*"]) is None
    assert normalize_types(["a", "b"]) == {"a", "b"}


def test_slow_subscriber_is_closed_not_blocking_the_emitter():
    log = EventLog()
    sub = log.subscribe(max_pending=3)
    for _ in range(10):
        log.emit("stats.sampled", {})
    assert sub.overflowed
    assert [sub.get(0) for _ in range(4)][-1] is None


def test_concurrent_emitters_get_unique_contiguous_sequences():
    log = EventLog(capacity=10_000)
    barrier = threading.Barrier(4)

    def emit_many():
        barrier.wait()
        for _ in range(1000):
            log.emit("stats.sampled", {})

    threads = [threading.Thread(target=emit_many) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [e["sequence"] for e in log.snapshot()["events"]] == list(range(1, 4001))


def test_an_event_is_rendered_once_for_every_consumer():
    from spliceway.api.sse import FrameCache

    log = EventLog(capacity=4)
    envelope = log.emit("engine.started", {"build_id": "b", "started_at_unix_ms": 1})
    first = log.encoded(envelope)
    assert first == orjson.dumps(envelope)
    assert log.encoded(envelope) is first  # the same bytes object: rendered once
    frame = FrameCache(encode=log.encoded).frame(envelope)
    assert frame == b"id: 1\nevent: engine.started\ndata: " + first + b"\n\n"
    # Bounded like the ring: the oldest renderings go.
    for i in range(5):
        log.encoded(log.emit("engine.started", {"build_id": str(i), "started_at_unix_ms": i}))
    assert log.encoded(envelope) is not first and log.encoded(envelope) == first


def test_ring_readers_get_equal_copies_of_what_was_emitted():
    log = EventLog(capacity=8)
    emitted = [log.emit("flow.started", {"flow_id": f"f{i}", "n": [i, None]}) for i in range(3)]
    assert log.snapshot()["events"] == emitted
    events, oldest = log.read_after(1, 10)
    assert (events, oldest) == (emitted[1:], 1)
    slots, _ = log.read_after_encoded(1, 10)
    assert [(seq, kind) for seq, kind, _ in slots] == [(2, "flow.started"), (3, "flow.started")]
    assert [data for _, _, data in slots] == [log.encoded(e) for e in emitted[1:]]
    with log.subscribe(since=0) as sub:
        assert [sub.get(0) for _ in range(3)] == emitted
    # A copy: changing what a reader got changes nothing in the ring.
    log.snapshot()["events"][0]["payload"]["n"].append(7)
    assert log.snapshot()["events"][0] == emitted[0]


def test_a_snapshot_envelope_is_never_given_the_ring_event_of_its_sequence():
    log = EventLog(capacity=8)
    event = log.emit("flow.started", {"flow_id": "f1"})
    with log.subscribe(snapshot=lambda: [{"flow_id": "f1"}]) as sub:
        snap = sub.get(0)
    assert snap["event_type"] == "flow.snapshot" and snap["sequence"] == event["sequence"]
    assert orjson.loads(log.encoded(snap)) == snap
    assert log.encoded(event) == orjson.dumps(event)


def test_latest_of_type_is_the_newest_n_oldest_first():
    log = EventLog(capacity=16)
    for i in range(6):
        log.emit("flow.completed" if i % 2 else "flow.started", {"i": i})
    assert [e["payload"]["i"] for e in log.latest_of_type("flow.completed", 2)] == [3, 5]
    assert log.latest_of_type("engine.stopped", 2) == []


def test_a_payload_json_cannot_carry_is_kept_with_its_repr_not_lost(caplog):
    log = EventLog(capacity=4)
    log.emit("stats.sampled", {"odd": {1, 2}, 3: "x"})
    (event,) = log.snapshot()["events"]
    assert event["payload"] == {"odd": repr({1, 2}), "3": "x"}
    assert "stats.sampled has a value JSON cannot carry" in caplog.text


def test_encoded_finds_each_event_after_the_ring_wrapped():
    log = EventLog(capacity=4)
    emitted = [log.emit("flow.updated", {"i": i}) for i in range(10)]
    for envelope in emitted[6:]:
        assert orjson.loads(log.encoded(envelope)) == envelope
    assert orjson.loads(log.encoded(emitted[2])) == emitted[2]  # evicted: rendered anew


def test_an_event_not_even_repr_can_carry_keeps_its_sequence_in_the_ring():
    log = EventLog(capacity=8)
    first = log.emit("flow.updated", {"i": 1})
    odd = log.emit("flow.updated", {(1, 2): "tuple key"})  # no JSON for a tuple key
    last = log.emit("flow.updated", {"i": 3})
    events = log.snapshot()["events"]
    assert [e["sequence"] for e in events] == [1, 2, 3]
    assert events[1]["payload"] == {"unencodable_payload": repr({(1, 2): "tuple key"})}
    assert orjson.loads(log.encoded(last)) == last and orjson.loads(log.encoded(first)) == first
    assert orjson.loads(log.encoded(odd))["sequence"] == 2


def test_snapshot_filters_before_it_decodes():
    log = EventLog(capacity=16)
    for i in range(6):
        log.emit("flow.completed" if i % 2 else "flow.started", {"i": i})
    snap = log.snapshot(since=2, types=["flow.completed"], limit=1)
    assert [e["sequence"] for e in snap["events"]] == [4]
    assert (snap["oldest_sequence"], snap["latest_sequence"]) == (1, 6)
    assert log.latest_of_type("flow.completed", 0) == []
