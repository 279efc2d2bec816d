"""The event log: a bounded ring of envelopes with sequences, and live subscriptions.

Contract (docs/events.md):
- ``sequence`` starts at 1 per engine start and grows by one per event entering
  the ring; ``event_id`` is ``<random epoch>-<sequence>``, unique across starts.
- Subscribers are attached under the log's lock, so a catch-up read from the
  ring followed by the live phase has neither gaps nor duplicates, and a
  ``flow.snapshot`` taken at attach time carries the exact watermark.
- ``flow.snapshot`` never enters the ring.
- Delivery to a subscriber never blocks the emitter: a subscriber that falls
  ``max_pending`` events behind is closed with ``overflowed`` set; it can resume
  from the ring by sequence.
- At engine stop every open subscription is closed with ``ended_by`` set to the
  ``engine.stopped`` envelope, so a stream transport can make it the last frame
  even when the subscriber's filter leaves that type out.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import orjson

from spliceway.errors import invalid_argument
from spliceway.events.catalogue import EVENT_CATALOGUE
from spliceway.shapes.event import SCHEMA_ID, Envelope

logger = logging.getLogger(__name__)

SNAPSHOT = "flow.snapshot"
FLOW_TYPES = frozenset(
    {"flow.started", "flow.routed", "flow.updated", "flow.completed", "flow.snapshot"}
)

__all__ = [
    "FLOW_TYPES",
    "SCHEMA_ID",
    "SNAPSHOT",
    "Envelope",
    "EventLog",
    "Subscription",
    "normalize_types",
    "now_ms",
    "parse_types",
    "wants_flow_snapshot",
]


def now_ms() -> int:
    """Wall-clock UNIX time in milliseconds."""
    return time.time_ns() // 1_000_000


def normalize_types(types: Iterable[str] | None) -> frozenset[str] | None:
    """Turn an allow-list into a set; ``None``, empty and ``['*']`` mean all events."""
    if types is None:
        return None
    wanted = frozenset(t for t in types if t)
    if not wanted or "*" in wanted:
        return None
    return wanted


def parse_types(raw: str | None) -> list[str] | None:
    """A ``types`` parameter (comma-separated) as an allow-list (None: every type); an
    unknown type is ``invalid_argument`` on ``types``. The SSE stream and the events
    query both read it."""
    if raw is None or not raw.strip():
        return None
    types = [t.strip() for t in raw.split(",") if t.strip()]
    for t in types:
        if t != "*" and t not in EVENT_CATALOGUE:
            raise invalid_argument(f"unknown event type {t!r}", "types")
    return types


def wants_flow_snapshot(types: frozenset[str] | None) -> bool:
    """Whether a live subscription with this filter starts with a flow.snapshot."""
    return types is None or bool(types & FLOW_TYPES)


class Subscription:
    """A live feed of envelopes from an ``EventLog``; iterate it or call ``get``.

    The queue is a C ``SimpleQueue``: offering an event costs the emitting
    thread (the data plane) one put, with no Python-level condition to notify.
    """

    def __init__(
        self,
        log: EventLog,
        types: frozenset[str] | None,
        max_pending: int,
        timeout: float | None = None,
    ) -> None:
        self._log = log
        self.types = types
        self._max_pending = max_pending
        # Ring JSON (bytes) from a catch-up is decoded by the reader, not under the lock.
        self._queue: queue.SimpleQueue[Envelope | bytes | None] = queue.SimpleQueue()
        self._timeout = timeout
        self._ended = False
        self._close_lock = threading.Lock()
        self.closed = False
        self.overflowed = False
        #: The ``engine.stopped`` envelope when the engine's stop closed this subscription.
        self.ended_by: Envelope | None = None

    @property
    def ended(self) -> bool:
        """Closed, and every event queued before the close has been read."""
        return self._ended

    def accepts(self, event_type: str) -> bool:
        """Whether this subscription's filter lets ``event_type`` through."""
        return self.types is None or event_type in self.types

    def _offer(self, envelope: Envelope) -> None:
        """Called by the log under its lock; never blocks."""
        if self.closed or not self.accepts(envelope["event_type"]):
            return
        if self._queue.qsize() >= self._max_pending:
            self.overflowed = True
            self._mark_closed()
            return
        self._queue.put(envelope)

    def _preload(self, envelopes: Iterable[Envelope | bytes]) -> None:
        """Queue catch-up events: envelopes, or ring JSON that :meth:`get` decodes (so the
        log's lock is not held while a whole ring is decoded)."""
        for envelope in envelopes:
            self._queue.put(envelope)

    def _mark_closed(self, ended_by: Envelope | None = None) -> None:
        with self._close_lock:
            if self.closed:
                return
            self.closed = True
            self.ended_by = ended_by
        # None marks the end: everything queued before it is still delivered.
        self._queue.put(None)

    def get(self, timeout: float | None = None) -> Envelope | None:
        """Next envelope, or ``None`` on timeout or once closed and drained."""
        if self._ended:
            return None
        try:
            if timeout is not None and timeout <= 0:
                item = self._queue.get_nowait()
            else:
                item = self._queue.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self._ended = True
            return None
        if isinstance(item, bytes):
            decoded: Envelope = orjson.loads(item)
            return decoded
        return item

    def get_many(self, timeout: float | None = None, limit: int = 1024) -> list[Envelope]:
        """Wait up to ``timeout`` for one envelope, then take every pending one (up to
        ``limit``); an empty list on timeout or once closed and drained."""
        first = self.get(timeout)
        if first is None:
            return []
        out = [first]
        take = self._queue.get_nowait
        try:
            while len(out) < limit:
                item = take()
                if item is None:
                    self._ended = True
                    break
                out.append(orjson.loads(item) if isinstance(item, bytes) else item)
        except queue.Empty:
            pass
        return out

    def close(self, ended_by: Envelope | None = None) -> None:
        """Detach from the log and wake any waiting reader; ``ended_by`` is the event that
        ended the feed (``engine.stopped``), recorded unless it was already closed."""
        self._log._detach(self)
        self._mark_closed(ended_by)

    def __iter__(self) -> Iterator[Envelope]:
        while True:
            envelope = self.get(self._timeout)
            if envelope is None:
                return
            yield envelope

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _dumps(envelope: Envelope) -> tuple[bytes, bool]:
    """An envelope's JSON, and whether its payload needed a fallback.  A value JSON has
    no type for (a bug in its producer) is written as its ``repr``; a payload that not
    even that can carry (a non-string key orjson cannot write, an integer past 64 bits,
    a cycle) is replaced by its ``repr``: the event is never lost, and the sequence it
    took is always in the ring."""
    try:
        return orjson.dumps(envelope), False
    except TypeError:
        pass
    try:
        return orjson.dumps(envelope, default=repr, option=orjson.OPT_NON_STR_KEYS), True
    except TypeError:
        stub = {**envelope, "payload": {"unencodable_payload": repr(envelope["payload"])}}
        return orjson.dumps(stub), True


class EventLog:
    """A thread-safe ring of events with monotonic sequences.

    The ring keeps each event as its JSON, rendered once by :meth:`emit` while the
    envelope is fresh in the emitting thread's cache: SSE streams and sink intake take
    those bytes as they are (:meth:`encoded`), and readers of the ring get envelopes
    decoded from them.  Keeping thousands of envelope trees instead made every
    eviction free a cold tree of some forty objects, the largest single cost of a
    flow on the dispatcher (a quarter of its time, measured with py-spy), and a
    reader encoding a cold envelope paid several times what emit pays.
    """

    def __init__(self, capacity: int = 8192) -> None:
        self.capacity = capacity
        self.epoch = secrets.token_hex(8)
        #: ``(sequence, event_type, JSON)`` per event, oldest first.
        self._ring: deque[tuple[int, str, bytes]] = deque(maxlen=capacity)
        self._seq = 0
        self._lock = threading.Lock()
        self._subs: list[Subscription] = []
        #: Events emitted per type since start: lets a filtered reader that fell behind
        #: the ring count exactly how many of *its* events it lost.
        self._type_counts: dict[str, int] = {}

    @property
    def latest_sequence(self) -> int:
        """Sequence of the newest event (0 before the first)."""
        return self._seq

    def type_counts(self) -> dict[str, int]:
        """Events emitted since start, by type (a copy)."""
        with self._lock:
            return dict(self._type_counts)

    def fill(self) -> int:
        """How many events the ring holds now."""
        return len(self._ring)

    def resize(self, capacity: int) -> None:
        """Keep at most ``capacity`` events from now on (a smaller ring evicts its oldest)."""
        with self._lock:
            self._ring = deque(self._ring, maxlen=capacity)
            self.capacity = capacity

    def emit(
        self,
        event_type: str,
        payload: dict[str, Any],
        *,
        principal_key: str | None = None,
        labels: dict[str, str] | None = None,
        occurred_at_unix_ms: int | None = None,
    ) -> Envelope:
        """Append one event to the ring and offer it to every subscriber."""
        occurred = occurred_at_unix_ms if occurred_at_unix_ms is not None else now_ms()
        with self._lock:
            self._seq += 1
            seq = self._seq
            envelope: Envelope = {
                "schema_id": SCHEMA_ID,
                "event_id": f"{self.epoch}-{seq}",
                "event_type": event_type,
                "occurred_at_unix_ms": occurred,
                "source_id": None,
                "sequence": seq,
                "principal_key": principal_key,
                "labels": labels if labels is not None else {},
                "payload": payload,
            }
            data, fallback = _dumps(envelope)
            # A copy: orjson's bytes keep its whole growth buffer (measured: a full ring
            # of flow events took 48 MB more RSS than exact-size copies, 9 KiB per flow
            # in run_peers' idle-flow test); the copy is one memcpy.
            self._ring.append((seq, event_type, bytes(memoryview(data))))
            self._type_counts[event_type] = self._type_counts.get(event_type, 0) + 1
            for sub in self._subs:
                sub._offer(envelope)
        if fallback:  # logged outside the lock: a handler may emit events itself
            logger.error("event %s has a value JSON cannot carry", event_type)
        return envelope

    def encoded(self, envelope: Envelope) -> bytes:
        """``envelope`` as JSON: the ring's own bytes while it holds the event (one
        rendering for every consumer), else rendered now."""
        seq = envelope["sequence"]
        with self._lock:
            ring = self._ring
            if ring:
                index = seq - ring[0][0]
                if 0 <= index < len(ring):
                    slot = ring[index]
                    # A flow.snapshot shares its sequence with a ring event.
                    if slot[0] == seq and slot[1] == envelope["event_type"]:
                        return slot[2]
        return _dumps(envelope)[0]

    def snapshot(
        self,
        since: int | None = None,
        types: Iterable[str] | None = None,
        limit: int | None = None,
    ) -> dict[str, Any]:
        """The ring as ``GET /api/v1/events`` returns it (docs/http-api.md): events after
        ``since`` of ``types`` (all when None), the oldest ``limit``.  Only those are
        decoded, outside the lock."""
        wanted = normalize_types(types)
        with self._lock:
            slots = list(self._ring)
            latest = self._seq
        oldest = slots[0][0] if slots else latest + 1
        chosen: list[bytes] = []
        for seq, kind, data in slots:
            if limit is not None and len(chosen) >= limit:
                break
            if (since is None or seq > since) and (wanted is None or kind in wanted):
                chosen.append(data)
        return {
            "events": [orjson.loads(data) for data in chosen],
            "oldest_sequence": oldest,
            "latest_sequence": latest,
            "capacity": self.capacity,
        }

    def latest_of_type(self, event_type: str, limit: int) -> list[Envelope]:
        """The newest ``limit`` ring events of ``event_type``, oldest first."""
        if limit <= 0:
            return []
        with self._lock:
            found = []
            for _seq, kind, data in reversed(self._ring):
                if kind == event_type:
                    found.append(data)
                    if len(found) >= limit:
                        break
        return [orjson.loads(data) for data in reversed(found)]

    def read_after_encoded(
        self, sequence: int, limit: int
    ) -> tuple[list[tuple[int, str, bytes]], int]:
        """Up to ``limit`` ring events after ``sequence``, oldest first, as ``(sequence,
        event_type, JSON)``, and the oldest sequence the ring still holds (a reader whose
        cursor is below it lost events).  Walks from the newest end, so a reader that
        keeps up pays only for what is new."""
        newer: list[tuple[int, str, bytes]] = []
        with self._lock:
            for slot in reversed(self._ring):
                if slot[0] <= sequence:
                    break
                newer.append(slot)
            oldest = self._ring[0][0] if self._ring else self._seq + 1
        newer.reverse()
        return newer[:limit], oldest

    def read_after(self, sequence: int, limit: int) -> tuple[list[Envelope], int]:
        """:meth:`read_after_encoded` with the events decoded into envelopes."""
        slots, oldest = self.read_after_encoded(sequence, limit)
        return [orjson.loads(data) for _, _, data in slots], oldest

    def count_before(self, sequence: int, types: frozenset[str] | None) -> int:
        """How many events with a sequence below ``sequence`` have one of ``types``
        (all events when ``None``), evicted ones included."""
        with self._lock:
            if types is None:
                return min(sequence - 1, self._seq)
            total = sum(self._type_counts.get(t, 0) for t in types)
            later = sum(1 for seq, kind, _ in self._ring if seq >= sequence and kind in types)
        return total - later

    def snapshot_bounds(self) -> tuple[int, int]:
        """``(oldest_sequence, latest_sequence)`` of the ring, without copying it."""
        with self._lock:
            latest = self._seq
            oldest = self._ring[0][0] if self._ring else latest + 1
        return oldest, latest

    def subscribe(
        self,
        types: Iterable[str] | None = None,
        *,
        since: int | None = None,
        snapshot: Callable[[], list[dict[str, Any]]] | None = None,
        max_pending: int = 65536,
        timeout: float | None = None,
    ) -> Subscription:
        """Attach a live subscription.

        With ``since``, ring events after that sequence come first (catch-up).
        With ``snapshot`` (a function returning the active flow records) and a
        filter that includes flow types, a ``flow.snapshot`` envelope whose
        ``sequence`` and ``watermark`` are the ring's latest sequence follows.
        """
        wanted = normalize_types(types)
        sub = Subscription(self, wanted, max_pending, timeout)
        with self._lock:
            preload: list[Envelope | bytes] = []
            if since is not None:
                preload.extend(
                    data
                    for seq, kind, data in self._ring
                    if seq > since and (wanted is None or kind in wanted)
                )
            if snapshot is not None and wants_flow_snapshot(wanted):
                preload.append(self._snapshot_envelope(snapshot()))
            sub._preload(preload)
            self._subs.append(sub)
        return sub

    def _snapshot_envelope(self, records: list[dict[str, Any]]) -> Envelope:
        seq = self._seq
        return {
            "schema_id": SCHEMA_ID,
            "event_id": f"{self.epoch}-{seq}-snapshot",
            "event_type": SNAPSHOT,
            "occurred_at_unix_ms": now_ms(),
            "source_id": None,
            "sequence": seq,
            "principal_key": None,
            "labels": {},
            "payload": {"watermark": seq, "records": records},
        }

    def _detach(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)

    def close_all(self, ended_by: Envelope | None = None) -> None:
        """Close every live subscription (engine stop, after ``ended_by``: engine.stopped)."""
        with self._lock:
            subs = list(self._subs)
        for sub in subs:
            sub.close(ended_by)
