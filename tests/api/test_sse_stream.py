"""The SSE stream body against a real event log: how it ends when the engine stops."""

from __future__ import annotations

import orjson

from spliceway.api.sse import EventStream, FrameCache
from spliceway.events.log import EventLog


def frames(chunks: list[bytes]) -> list[dict]:
    out = []
    for chunk in chunks:
        for block in chunk.split(b"\n\n"):
            for line in block.split(b"\n"):
                if line.startswith(b"data: "):
                    out.append(orjson.loads(line[len(b"data: ") :]))
    return out


def stream_closed_during_an_idle_wait(types: list[str] | None) -> list[dict]:
    """A stream whose wait times out on an empty queue just as the engine emits its last
    events and closes every subscription: the check after the wait sees it closed."""
    log = EventLog()
    sub = log.subscribe(types)
    wait = sub.get_many
    calls = 0

    def get_many(timeout=None, limit=1024):
        nonlocal calls
        calls += 1
        got = wait(timeout=timeout, limit=limit)
        if calls == 1:
            assert got == []  # nothing happened yet: the wait timed out
            log.emit("flow.completed", {"flow_id": "f-1"})
            stopped = log.emit("engine.stopped", {"stopped_at_unix_ms": 1, "reason": "signal"})
            log.close_all(ended_by=stopped)
        return got

    sub.get_many = get_many  # type: ignore[method-assign]
    stream = EventStream(sub, FrameCache(), lambda: None, lambda: False, keepalive_s=0.05)
    return frames(list(stream))


def test_events_queued_when_the_engine_stops_are_still_sent() -> None:
    sent = stream_closed_during_an_idle_wait(None)
    assert [e["event_type"] for e in sent] == ["flow.completed", "engine.stopped"]


def test_a_filtered_stream_still_ends_with_engine_stopped() -> None:
    sent = stream_closed_during_an_idle_wait(["flow.completed"])
    assert [e["event_type"] for e in sent] == ["flow.completed", "engine.stopped"]
    assert sent[-1]["payload"]["reason"] == "signal"
