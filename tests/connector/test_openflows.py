"""Open-flow tracking of a sink's outbox (connector/openflows.py) and the crash completion
built from it (records.crashed_completion), against real files and real envelopes."""

from __future__ import annotations

import os
from pathlib import Path

import orjson

from spliceway.config import parse_config
from spliceway.connector import openflows
from spliceway.connector.intake import with_source
from spliceway.connector.openflows import OpenFlows, flow_event_of
from spliceway.connector.outbox import DiskOutbox, OutboxStore
from spliceway.connector.service import Connector
from spliceway.events.log import EventLog
from spliceway.flows import records
from tests.connector.test_outbox import fill_disk
from tests.events.test_catalogue import check_event
from tests.helpers.flows import flow_state
from tests.helpers.sinks import jsonl, sink_config

LOG = EventLog(1000)


def _state(flow_id: str) -> records.FlowState:
    state = flow_state(
        flow_id=flow_id,
        inbound_tag="socks-in",
        inbound_protocol="socks5",
        source_port=40000,
        state="opening",
        target_host="example.test",
        last_activity_at_unix_ms=1_000,
    )
    state.revision = 1
    return state


def _lifecycle(kind: str, state: records.FlowState, at: int) -> bytes:
    record = state.render()
    env = LOG.emit(
        kind, records.lifecycle_payload(state, record), labels={"team": "a"}, occurred_at_unix_ms=at
    )
    return LOG.encoded(env)


def _updated(state: records.FlowState, at: int) -> bytes:
    env = LOG.emit("flow.updated", records.updated_payload(state, state.render()))
    data = orjson.loads(LOG.encoded(env))
    data["occurred_at_unix_ms"] = at
    return orjson.dumps(data)


def _routed(state: records.FlowState) -> None:
    state.revision += 1
    state.state = "active"
    state.route_action = "route"
    state.route_target = "direct"
    state.outbound_tag, state.outbound_protocol = "direct", "direct"
    state.remote_host, state.remote_port = "example.test", 443


def _completed(flow_id: str) -> bytes:
    state = _state(flow_id)
    state.revision, state.state, state.outcome = 2, "completed", records.CANCELLED
    state.ended_at_unix_ms = 2_000
    return _lifecycle("flow.completed", state, 2_000)


def _other() -> bytes:
    return LOG.encoded(LOG.emit("engine.started", {"build_id": "x", "started_at_unix_ms": 1}))


def test_flow_event_of_reads_envelopes_without_decoding_and_any_shape_by_decoding():
    started = _lifecycle("flow.started", _state("ab-0-1"), 1_000)
    assert flow_event_of(started) == ("flow.started", "ab-0-1")
    assert flow_event_of(with_source(started, "node-1")) == ("flow.started", "ab-0-1")
    assert flow_event_of(_completed("ab-0-2")) == ("flow.completed", "ab-0-2")
    assert flow_event_of(_other()) is None
    # Another key order (not what the engine writes): decoded in full.
    doc = orjson.loads(started)
    assert flow_event_of(orjson.dumps({"payload": doc["payload"], **doc})) == (
        "flow.started",
        "ab-0-1",
    )
    assert flow_event_of(b"not json") is None


def test_open_flows_keep_the_newest_lifecycle_and_update_bodies():
    flows = OpenFlows()
    a, b = _state("f-a"), _state("f-b")
    flows.note(1, _lifecycle("flow.started", a, 1_000))
    flows.note(2, _lifecycle("flow.started", b, 1_000))
    _routed(a)
    routed = _lifecycle("flow.routed", a, 1_100)
    flows.note(3, routed)
    up1, up2 = _updated(a, 1_200), _updated(a, 1_300)
    flows.note(4, up1)
    flows.note(5, up2)
    flows.note(6, _other())
    flows.note(7, _completed("f-b"))
    assert sorted(flows.flows) == ["f-a"]
    assert flows.bodies("f-a") == [routed, up2]
    assert flows.bytes == len(routed) + len(up2)
    assert flows.through_id == 7
    again = OpenFlows.decode(flows.encode())
    assert again.flows == flows.flows and again.through_id == 7 and again.bytes == flows.bytes


def _outbox(path: Path, **kw: object) -> DiskOutbox:
    return DiskOutbox(str(path), segment_bytes=4096, track_flows=True, **kw)  # type: ignore[arg-type]


def _deliver_all(box: DiskOutbox) -> None:
    while items := box.take(1000):
        for item in items:
            box.ack(item.record_id)
    box.flush_acks()


def test_a_started_flow_in_a_deleted_segment_is_still_an_orphan_after_a_crash(tmp_path):
    box = _outbox(tmp_path)
    box.append([_lifecycle("flow.started", _state("old"), 1_000)])
    box.commit()
    # Enough other events, delivered and acknowledged, that old's segment is deleted.
    for _ in range(40):
        box.append([_other()] * 10)
        box.commit()
        _deliver_all(box)
    segments = sorted(n for n in os.listdir(tmp_path) if n.startswith("seg-"))
    assert segments[0] != "seg-00000000000000000001.log"  # the first one is gone
    assert (tmp_path / openflows.FILE_NAME).exists()
    box.append([_lifecycle("flow.started", _state("new"), 1_000), _completed("done")])
    box.commit()
    # A crash: nothing closed, nothing flushed.
    again = _outbox(tmp_path)
    assert sorted(again.orphans) == ["new", "old"]
    assert again.recovery.state == "clean"
    # Its completion committed, the flow is closed for good; a second crash finds only new.
    again.append([_completed("old")])
    again.commit()
    assert sorted(_outbox(tmp_path).orphans) == ["new"]


def test_a_checkpoint_is_not_written_for_more_than_it_frees(tmp_path):
    box = _outbox(tmp_path)
    # Open flows only: the acknowledged segments hold less than the flows' bodies (the
    # active segment is never deleted), so deleting them would cost more than it frees.
    for i in range(12):
        box.append([_lifecycle("flow.started", _state(f"f{i}"), 1_000)])
        box.commit()
    before = sorted(n for n in os.listdir(tmp_path) if n.startswith("seg-"))
    assert len(before) >= 3
    _deliver_all(box)
    assert box.flows is not None and len(box.flows.flows) == 12
    assert not (tmp_path / openflows.FILE_NAME).exists()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("seg-")) == before
    assert len(_outbox(tmp_path).orphans) == 12


def test_an_uncommitted_append_opens_no_flow_and_rollback_forgets_it(tmp_path):
    box = _outbox(tmp_path)
    box.append([_lifecycle("flow.started", _state("x"), 1_000)])
    box._rollback()
    assert box.flows is not None and box.flows.flows == {}
    box.append([_lifecycle("flow.started", _state("y"), 1_000)])
    box.commit()
    assert sorted(box.flows.flows) == ["y"]


def test_a_sink_not_selecting_completions_tracks_nothing_and_drops_its_checkpoint(tmp_path):
    box = _outbox(tmp_path)
    box.append([_lifecycle("flow.started", _state("x"), 1_000)])
    box.commit()
    openflows.write_checkpoint(str(tmp_path), box.flows)  # type: ignore[arg-type]
    plain = DiskOutbox(str(tmp_path), segment_bytes=4096)
    assert plain.flows is None and plain.orphans == {}
    assert not (tmp_path / openflows.FILE_NAME).exists()


def test_a_damaged_checkpoint_is_ignored_and_reported_never_raised(tmp_path):
    box = _outbox(tmp_path)
    box.append([_lifecycle("flow.started", _state("x"), 1_000)])
    box.commit()
    path = tmp_path / openflows.FILE_NAME
    openflows.write_checkpoint(str(tmp_path), box.flows)  # type: ignore[arg-type]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))
    again = _outbox(tmp_path)
    assert again.recovery.state == "repaired"
    assert any("open-flows checkpoint" in e for e in again.recovery.errors)
    # Its flows are those of the records still on disk above its id (none here: the
    # checkpoint is ignored, so every record on disk counts).
    assert sorted(again.orphans) == ["x"]


def test_crash_completion_is_a_catalogue_conforming_completed_event():
    state = _state("f-a")
    state.auth_scheme, state.principal_key = "username", "alice"
    started = orjson.loads(_lifecycle("flow.started", state, 1_000))
    _routed(state)
    routed = orjson.loads(_lifecycle("flow.routed", state, 1_100))
    state.traffic.bytes_up, state.traffic.bytes_down = 10, 20
    state.revision += 1
    state.sampled_at_unix_ms = 1_500
    state.last_activity_at_unix_ms = 1_400
    updated = orjson.loads(_updated(state, 1_600))
    done = records.crashed_completion([started, routed, updated])
    assert done.occurred_at_unix_ms == 1_600
    assert done.labels == {"team": "a"}
    env = LOG.emit(
        "flow.completed",
        done.payload,
        principal_key=done.principal_key,
        labels=done.labels,
        occurred_at_unix_ms=done.occurred_at_unix_ms,
    )
    assert check_event(env) == []
    payload = env["payload"]
    record = payload["record"]
    assert payload["outcome"] == record["result"]["outcome"] == records.ENGINE_CRASHED
    assert record["result"]["failure"]["code"] == "engine_crashed"
    assert record["revision"] == updated["payload"]["record"]["revision"] + 1
    assert record["traffic"] == updated["payload"]["record"]["traffic"]
    assert record["route"] == routed["payload"]["record"]["route"]
    assert record["timing"] == {
        "started_at_unix_ms": 1_000,
        "last_activity_at_unix_ms": 1_400,
        "ended_at_unix_ms": 1_600,
        "duration_ms": 600,
    }
    assert payload["auth"]["scheme"] == "username"
    assert payload["auth"]["principal_key"] == "alice"
    assert payload["traffic"]["bytes_down"] == 20


def test_each_sink_gets_the_crash_completions_of_the_flows_its_own_outbox_shows_open(tmp_path):
    """Sink a had taken flow x's real flow.completed before the kill, sink b had not (the
    intake feeds sinks one after the other): at the next start a gets nothing for x and b
    gets a's real completion, the same event (same event_id, its own source_id), not a
    crash completion; both get y's crash completion, the one event of the ring; a second
    start adds none."""
    outbox = tmp_path / "outbox"
    files = {tag: tmp_path / f"{tag}.jsonl" for tag in ("a", "b")}
    cfg = sink_config(
        [jsonl(tag, path, ["flow.started", "flow.completed"]) for tag, path in files.items()],
        outbox,
    )
    store = OutboxStore(str(outbox))
    x, y = _state("dead-0-1"), _state("dead-0-2")
    started = [_lifecycle("flow.started", x, 1_000), _lifecycle("flow.started", y, 1_000)]
    real = with_source(_completed("dead-0-1"), "node-a")
    for tag, bodies in (("a", [*started, real]), ("b", started)):
        box = store.open_sink(tag, track_flows=True)
        box.append(bodies)
        box.commit()
        box.close()
    store.close()

    def run() -> list[dict[str, object]]:
        log = EventLog(16)
        connector = Connector(parse_config(cfg).api, log)
        connector.start()
        try:
            assert connector.orphan_flow_ids() <= {"dead-0-1", "dead-0-2"}
            log.emit("engine.started", {"build_id": "t", "started_at_unix_ms": 1})
            connector.complete_orphans()
            return [orjson.loads(e) for _, _, e in log.read_after_encoded(0, 100)[0]]
        finally:
            connector.stop()

    ring = run()
    assert [(e["event_type"], e["payload"].get("flow_id")) for e in ring] == [
        ("engine.started", None),
        ("flow.completed", "dead-0-2"),
    ]

    def completions(tag: str) -> list[tuple[str, str, object]]:
        lines = [orjson.loads(line) for line in files[tag].read_text().splitlines()]
        return [
            (e["payload"]["flow_id"], e["payload"]["outcome"], e["event_id"])
            for e in lines
            if e["event_type"] == "flow.completed"
        ]

    crash_id = ring[1]["event_id"]
    real_id = orjson.loads(real)["event_id"]
    expected = {
        "a": [("dead-0-1", "cancelled", real_id), ("dead-0-2", "engine_crashed", crash_id)],
        "b": [("dead-0-1", "cancelled", real_id), ("dead-0-2", "engine_crashed", crash_id)],
    }
    assert {tag: sorted(completions(tag)) for tag in files} == expected
    resent = [orjson.loads(line) for line in files["b"].read_text().splitlines()]
    assert [e["source_id"] for e in resent if e["event_id"] == real_id] == [None]
    # Committed to each sink's outbox: closed there for good.
    again = run()
    assert [e["event_type"] for e in again] == ["engine.started"]
    assert {tag: sorted(completions(tag)) for tag in files} == expected


def test_more_crash_completions_than_the_ring_holds_reach_every_sink(tmp_path):
    """30 orphans, a ring of 8: they go out two at a time, each pair taken by every sink
    before the next, so the ring evicts none before its sinks took it."""
    outbox = tmp_path / "outbox"
    files = {tag: tmp_path / f"{tag}.jsonl" for tag in ("a", "b")}
    cfg = sink_config([jsonl(tag, path) for tag, path in files.items()], outbox)
    store = OutboxStore(str(outbox))
    for tag in files:
        box = store.open_sink(tag, track_flows=True)
        box.append([_lifecycle("flow.started", _state(f"dead-0-{i}"), 1_000) for i in range(30)])
        box.commit()
        box.close()
    store.close()
    log = EventLog(8)
    connector = Connector(parse_config(cfg).api, log)
    connector.start()
    try:
        log.emit("engine.started", {"build_id": "t", "started_at_unix_ms": 1})
        assert connector.complete_orphans() == 30
    finally:
        connector.stop()
    for tag, path in files.items():
        lines = [orjson.loads(line) for line in path.read_text().splitlines()]
        done = [e["payload"]["flow_id"] for e in lines if e["event_type"] == "flow.completed"]
        assert sorted(done) == sorted(f"dead-0-{i}" for i in range(30)), tag


def test_on_a_full_disk_acknowledged_segments_go_without_a_checkpoint(tmpfs):
    """Space comes first: when the checkpoint cannot be written for want of space, the old
    one is removed and the segments are deleted anyway. Recovery then sees only the records
    left: a flow started in a deleted segment is missed, a completed one never shows open."""
    mnt = tmpfs("64k")
    d = mnt / "sink"
    box = _outbox(d)
    box.append([_lifecycle("flow.started", _state("gone"), 1_000)])
    box.commit()
    for _ in range(3):
        box.append([_other()] * 10)
        box.commit()
    _deliver_all(box)  # the first checkpoint fits
    assert (d / openflows.FILE_NAME).exists()
    box.append([_lifecycle("flow.started", _state("x"), 1_000), _completed("x")])
    box.commit()
    for _ in range(3):
        box.append([_other()] * 10)
        box.commit()
    filler = fill_disk(str(mnt))
    try:
        before = sorted(n for n in os.listdir(d) if n.startswith("seg-"))
        _deliver_all(box)
        after = sorted(n for n in os.listdir(d) if n.startswith("seg-"))
        assert len(after) < len(before)
        assert not (d / openflows.FILE_NAME).exists()
        assert not (d / (openflows.FILE_NAME + ".tmp")).exists()
        assert sorted(_outbox(d).orphans) == []
    finally:
        os.unlink(filler)


def test_a_flow_whose_kept_events_are_unreadable_is_logged_and_forgotten(tmp_path, caplog):
    outbox = tmp_path / "outbox"
    cfg = sink_config([jsonl("a", tmp_path / "a.jsonl")], outbox)
    store = OutboxStore(str(outbox))
    box = store.open_sink("a", track_flows=True)
    good = _lifecycle("flow.started", _state("dead-0-1"), 1_000)
    # A flow event without its record (not what this engine writes): it cannot be completed.
    bad = orjson.loads(_lifecycle("flow.started", _state("dead-0-2"), 1_000))
    del bad["payload"]["record"]
    box.append([good, orjson.dumps(bad)])
    box.commit()
    box.close()
    store.close()
    for expected in (1, 0):
        connector = Connector(parse_config(cfg).api, EventLog(16))
        connector.start()
        try:
            orphans = {"dead-0-1", "dead-0-2"} if expected else set()
            assert connector.orphan_flow_ids() == orphans
            assert connector.complete_orphans() == expected
            box = connector.slots[0].outbox
            assert isinstance(box, DiskOutbox) and box.flows is not None
        finally:
            connector.stop()
        # The next checkpoint (as before deleting segments) leaves the unreadable one out.
        openflows.write_checkpoint(box.directory, box.flows)
    assert "cannot complete flow dead-0-2" in caplog.text
