"""The connector's intake: moves events from the event log into each sink's outbox.

Each sink has a cursor into the event log (a sequence). Every few milliseconds
the intake reads the events after each cursor, keeps those the sink's filter
wants, stamps the sink's ``source_id`` into the envelope, and appends the
bodies to the sink's outbox, then commits (fsync). Only after the commit does
the cursor move, so an event is either durable for the sink or still in the
event log. When the disk gate refuses the write (``write_blocked``) or a write
fails, the cursor stays and the events wait in the log; if the log evicts them
first, each one lost is a replay gap, counted and never reset.

The intake is a plain thread rather than an actor because its whole job is a
timed loop over shared, append-only state; it never blocks on a receiver, so a
hung webhook cannot delay anyone's group commit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import orjson

from spliceway.connector import segments
from spliceway.connector.diskgate import DiskGate, Storage
from spliceway.connector.outbox import MemoryOutbox, Outbox
from spliceway.events.log import SNAPSHOT, EventLog, normalize_types

logger = logging.getLogger(__name__)

#: Commit cadence: far inside the 100 ms group-commit bound even with a slow fsync.
INTERVAL_S = 0.01
_BATCH = 4096
_ERROR_BACKOFF_S = (0.1, 1.0)


@dataclass(slots=True)
class Feed:
    """The intake's state for one sink. Written by the intake thread only."""

    tag: str
    types: frozenset[str] | None
    source_id: str | None
    outbox: Outbox
    #: Called after a commit made new events available (wakes the sink).
    notify: Callable[[], None] = lambda: None
    cursor: int = 0
    #: Events this sink's filter selects with a sequence up to ``cursor``.
    selected: int = 0
    replay_gaps: int = 0
    write_blocked: bool = False
    last_write_error: str | None = None
    retry_at: float = 0.0
    #: Sequences of events this sink must not take although its filter selects them: the
    #: crash completions of flows its outbox did not show open (Connector.complete_orphans).
    skip: set[int] = field(default_factory=set)
    _error_delay: float = field(default=_ERROR_BACKOFF_S[0])

    @classmethod
    def for_sink(
        cls, tag: str, events: tuple[str, ...], source_id: str | None, outbox: Outbox
    ) -> Feed:
        """A feed for a sink registration's filter and source id."""
        return cls(tag, normalize_types(events), source_id, outbox)


def with_source(data: bytes, source_id: str | None) -> bytes:
    """An envelope's JSON with its ``source_id`` set to ``source_id`` (None: the
    engine's own null, as for a sink that stamps none)."""
    return orjson.dumps({**orjson.loads(data), "source_id": source_id})


_SCHEMA_KEY = b'{"schema_id":"'
_EVENT_ID_KEY = b',"event_id":"'


def event_id_of(body: bytes) -> str:
    """The ``event_id`` of an envelope's JSON, as the outbox holds it.

    The engine writes ``schema_id`` first and ``event_id`` right after it, so that
    prefix is read without decoding the event; any other shape is decoded in full.
    """
    if body.startswith(_SCHEMA_KEY):
        after_schema = body.find(b'"', len(_SCHEMA_KEY)) + 1
        if after_schema and body.startswith(_EVENT_ID_KEY, after_schema):
            start = after_schema + len(_EVENT_ID_KEY)
            end = body.find(b'"', start)
            if end > start and body.find(b"\\", start, end) < 0:
                return body[start:end].decode("ascii", "replace")
    try:
        value = orjson.loads(body).get("event_id")
    except (orjson.JSONDecodeError, AttributeError):
        return "?"
    return value if isinstance(value, str) else "?"


class Intake:
    """The thread that feeds every sink's outbox from the event log."""

    def __init__(self, log: EventLog, feeds: list[Feed], gate: DiskGate | None) -> None:
        self.log = log
        self.feeds = feeds
        self.gate = gate
        self.storage: Storage | None = None
        #: Held for a round over the feeds; a reload takes it to add or remove one.
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread."""
        self._thread = threading.Thread(target=self._run, name="spliceway-intake", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread, then take in what the log still holds (engine.stopped too)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.pump()

    def _run(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            try:
                self.pump()
            except Exception:  # a bug here must not end durable intake for good
                logger.exception("connector intake failed; retrying")

    def pump(self) -> None:
        """One round over every feed (on the intake thread, or after it stopped)."""
        now = time.monotonic()
        with self.lock:
            for feed in self.feeds:
                if feed.retry_at <= now:
                    self._feed(feed)

    def take_in(self, feed: Feed) -> None:
        """Take in what the log holds for ``feed`` now (call with ``lock`` held), so a
        sink being removed has every event emitted before in its outbox."""
        self._feed(feed)

    def read_storage(self) -> Storage | None:
        """Free space of the outbox filesystem now (None without an outbox)."""
        if self.gate is None:
            return None
        try:
            self.storage = self.gate.read()
        except OSError as ex:
            logger.warning("cannot read free space of %s: %s", self.gate.path, ex)
        return self.storage

    def _feed(self, feed: Feed) -> None:
        events, oldest = self.log.read_after_encoded(feed.cursor, _BATCH)
        if oldest > feed.cursor + 1:
            # The log evicted events this sink never took: those its filter selects can
            # never be delivered.
            before = self.log.count_before(oldest, feed.types)
            feed.replay_gaps += before - feed.selected
            feed.selected = before
            feed.cursor = oldest - 1
        if not events:
            return
        skip = feed.skip
        if skip:
            skip.difference_update([s for s in skip if s <= feed.cursor])
        # The ring's own JSON of each event, unless this sink stamps its source_id.
        batch = [
            (seq, data if feed.source_id is None else with_source(data, feed.source_id))
            for seq, kind, data in events
            if kind != SNAPSHOT
            and (feed.types is None or kind in feed.types)
            and (not skip or seq not in skip)
        ]
        last = events[-1][0]
        if not batch:
            feed.cursor = last
            return
        fits = self._room(feed, batch)
        feed.write_blocked = fits < len(batch)
        if fits == 0:
            return
        if fits < len(batch):
            last = batch[fits][0] - 1
            batch = batch[:fits]
        try:
            feed.outbox.append([body for _, body in batch])
            feed.outbox.commit()
        except OSError as ex:
            # Fail closed: nothing of this batch counts as written; try again later.
            feed.last_write_error = f"outbox write failed: {ex.strerror or ex}"
            feed.write_blocked = True
            feed.retry_at = time.monotonic() + feed._error_delay
            feed._error_delay = min(feed._error_delay * 2, _ERROR_BACKOFF_S[1])
            logger.warning("sink %s: %s", feed.tag, feed.last_write_error)
            return
        feed.last_write_error = None
        feed._error_delay = _ERROR_BACKOFF_S[0]
        feed.cursor = last
        feed.selected += len(batch)
        feed.notify()

    def _room(self, feed: Feed, batch: list[tuple[int, bytes]]) -> int:
        """How many of ``batch`` the gate lets this sink write now."""
        if isinstance(feed.outbox, MemoryOutbox):
            return min(len(batch), feed.outbox.room())
        storage = self.read_storage()
        if storage is None:
            return len(batch)
        room = storage.available_bytes - storage.reserve_bytes
        used = 0
        for n, (_, body) in enumerate(batch):
            used += len(body) + segments.HEADER_SIZE
            if used > room:
                return n
        return len(batch)
