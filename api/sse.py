"""``GET /api/v1/events/stream``: Server-Sent Events with resume (docs/events.md).

A stream is a WSGI iterable the server drains on one of its worker threads:
- frames are ``id: <sequence>``, ``event: <type>``, ``data: <envelope JSON>``;
- with ``since`` / ``Last-Event-ID`` the ring's later events come first
  (catch-up), then the live phase, which starts with ``flow.snapshot`` when the
  filter includes flow types (its id is the watermark, so resuming from it
  continues exactly after the baseline);
- a comment line every ``keepalive_s`` (at most 15 s) keeps proxies from
  timing out an idle stream;
- at engine stop, ``engine.stopped`` is the last frame of every stream, whatever
  its ``types`` filter, and then the response ends;
- a slot of the concurrency limit is held from acceptance until the server
  calls ``close()``, which it does for every response, however it ended; the
  stream also notices a vanished client between frames (Waitress's
  ``client_disconnected`` hook) so the slot comes back promptly;
- a slow reader's backlog is bounded in bytes, whatever the ring's size: while
  the server holds more than ``SEND_AHEAD_BYTES`` unsent for the stream, its
  frames wait in the stream; past ``MAX_BACKLOG_BYTES`` waiting the stream
  drops them, stops its subscription and ends with an ``overflow`` comment after
  the last whole frame it sent, so the client reconnects with ``Last-Event-ID``
  and resumes from the ring (what an ``EventSource`` does by itself).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from spliceway.errors import invalid_argument
from spliceway.events.log import Envelope, EventLog, Subscription

KEEPALIVE_S = 10.0
#: How long a stream lets a burst gather after its first event before writing it.
#: Each stream thread then wakes (and takes the GIL from the data plane) at most
#: 1/LINGER_S times a second however fast events come, for at most this much
#: added latency.
LINGER_S = 0.005
_POLL_S = 0.25
_BATCH = 1024
#: Frames a stream keeps for a client that reads slower than events come, at most.
MAX_BACKLOG_BYTES = 4 * 1024 * 1024
#: Unsent output the server may hold for a stream before its frames wait in the
#: stream instead (below Waitress's high watermark, so a write never blocks on it).
SEND_AHEAD_BYTES = 512 * 1024
#: How often a stream whose client is behind checks whether it caught up.
_BEHIND_POLL_S = 0.05


def overflow_comment(backlog: int) -> bytes:
    """The comment that ends a stream whose client fell too far behind."""
    return (
        b": overflow: this client fell more than %d bytes behind; the stream ends here, "
        b"reconnect with Last-Event-ID to resume from the event ring\n\n" % backlog
    )


def parse_since(query: str | None, header: str | None) -> int | None:
    """The resume point from ``since`` or, failing that, ``Last-Event-ID``."""
    for raw, field in ((query, "since"), (header, "Last-Event-ID")):
        if raw is None or raw == "":
            continue
        value = raw.strip()
        if not (value.isascii() and value.isdigit()):
            raise invalid_argument(f"{field} must be a non-negative event sequence", field)
        return int(value)
    return None


class FrameCache:
    """Encoded frames shared by every stream, so N streams encode each event once."""

    def __init__(
        self, size: int = 8192, encode: Callable[[Envelope], bytes] = orjson.dumps
    ) -> None:
        self._size = size
        #: The envelope's JSON: the event log's own (``EventLog.encoded``), shared with
        #: every other consumer, in an engine's app.
        self._encode = encode
        self._frames: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def frames(self, envelopes: list[Envelope]) -> bytes:
        """The SSE frames of a batch, joined.

        Built under the lock: streams reading in step would otherwise each encode the
        same events (encoding holds the GIL anyway, so the lock costs no parallelism).
        """
        frames = self._frames
        with self._lock:
            out = []
            for envelope in envelopes:
                data = frames.get(envelope["event_id"])
                if data is None:
                    data = frames[envelope["event_id"]] = self._build(envelope)
                out.append(data)
            while len(frames) > self._size:
                frames.popitem(last=False)
        return b"".join(out)

    def frame(self, envelope: Envelope) -> bytes:
        """The SSE frame for one envelope."""
        return self.frames([envelope])

    def _build(self, envelope: Envelope) -> bytes:
        return b"".join(
            (
                b"id: %d\nevent: %s\ndata: "
                % (envelope["sequence"], envelope["event_type"].encode()),
                self._encode(envelope),
                b"\n\n",
            )
        )


class EventStream:
    """One SSE response body; iterate it to stream, ``close()`` to end it."""

    def __init__(
        self,
        subscription: Subscription,
        frames: FrameCache,
        release: Callable[[], None],
        disconnected: Callable[[], bool],
        keepalive_s: float = KEEPALIVE_S,
        preface: bytes = b"",
        unsent: Callable[[], int] | None = None,
        max_backlog: int = MAX_BACKLOG_BYTES,
    ) -> None:
        """``unsent()`` is the output the server holds unsent for this response (None:
        unknown, every frame is handed over at once and a slow reader blocks the
        stream's thread); past ``max_backlog`` bytes waiting, the stream ends."""
        self._sub = subscription
        self._unsent = unsent
        self._max_backlog = max_backlog
        #: Whether the stream ended because its client fell too far behind.
        self.overflowed = False
        self._frames = frames
        self._release: Callable[[], None] | None = release
        self._disconnected = disconnected
        self._keepalive_s = keepalive_s
        self._preface = preface
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[bytes]:
        # The first chunk makes the server send the headers now, not with the first event.
        yield b": connected\nretry: 1000\n\n" + self._preface
        last_write = time.monotonic()
        poll = min(_POLL_S, self._keepalive_s)
        #: Frames the client is not ready for yet (the server holds enough unsent).
        waiting: list[bytes] = []
        waiting_bytes = 0
        while True:
            batch = self._sub.get_many(
                timeout=min(poll, _BEHIND_POLL_S) if waiting else poll, limit=_BATCH
            )
            if batch:
                if len(batch) < _BATCH:
                    time.sleep(LINGER_S)
                    batch.extend(self._sub.get_many(timeout=0, limit=_BATCH - len(batch)))
                data = self._frames.frames(batch)
                waiting.append(data)
                waiting_bytes += len(data)
                if waiting_bytes > self._max_backlog:
                    # Dropped, not buffered: the ring has them for a resume.
                    self.overflowed = True
                    waiting.clear()
                    # The slot comes back now: a stalled client may take long to read
                    # the end (the server closes it after its send deadline).
                    self.close()
                    yield overflow_comment(self._max_backlog)
                    return
            if waiting:
                # Once the subscription has ended nothing more comes: the rest goes out
                # even to a slow client (the write then waits for it, as at shutdown).
                if not self._behind() or self._sub.ended:
                    yield b"".join(waiting)
                    waiting.clear()
                    waiting_bytes = 0
                    last_write = time.monotonic()
                elif self._disconnected():
                    return
                continue
            if self._sub.closed:
                if not self._sub.ended:
                    continue  # closed while this wait timed out: what is queued goes first
                final = self._sub.ended_by
                # engine.stopped ends every stream, filter or not, so a client can tell
                # a shutdown from a dropped connection.
                if final is not None and not self._sub.accepts(final["event_type"]):
                    yield self._frames.frame(final)
                return
            if self._disconnected():
                return
            if time.monotonic() - last_write >= self._keepalive_s:
                yield b": keep-alive\n\n"
                last_write = time.monotonic()

    def _behind(self) -> bool:
        """Whether the server already holds enough unsent output for this client."""
        return self._unsent is not None and self._unsent() > SEND_AHEAD_BYTES

    def close(self) -> None:
        """End the stream and give its slot back (called by the server, exactly once or more)."""
        self._sub.close()
        with self._lock:
            release, self._release = self._release, None
        if release is not None:
            release()


def open_stream(
    log: EventLog,
    types: list[str] | None,
    since: int | None,
    snapshot: Callable[[], list[dict[str, Any]]],
) -> tuple[Subscription, bytes]:
    """Subscribe with catch-up; returns the subscription and a preface comment (gap notice).

    A ``since`` beyond the ring's newest sequence cannot belong to this engine
    start (sequences restart at 1), so the whole ring is replayed instead.
    """
    preface = b""
    if since is not None:
        oldest, latest = log.snapshot_bounds()
        if since > latest:
            preface = b": since %d is ahead of this engine start; replaying the ring\n\n" % since
            since = 0
        elif since + 1 < oldest:
            preface = b": replay gap: events %d..%d were evicted from the ring\n\n" % (
                since + 1,
                oldest - 1,
            )
    # A stream further behind than twice the ring (room for a full catch-up) is
    # closed (``overflowed``) rather than buffered without bound; its client
    # resumes from the ring by Last-Event-ID.
    sub = log.subscribe(types, since=since, snapshot=snapshot, max_pending=2 * log.capacity)
    return sub, preface
