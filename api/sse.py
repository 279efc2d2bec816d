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
  ``client_disconnected`` hook) so the slot comes back promptly.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import orjson

from spliceway.errors import invalid_argument
from spliceway.events import Envelope, EventLog, Subscription

KEEPALIVE_S = 10.0
#: How long a stream lets a burst gather after its first event before writing it.
#: Each stream thread then wakes (and takes the GIL from the data plane) at most
#: 1/LINGER_S times a second however fast events come, for at most this much
#: added latency.
LINGER_S = 0.005
_POLL_S = 0.25
_BATCH = 1024


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
    ) -> None:
        self._sub = subscription
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
        while True:
            batch = self._sub.get_many(timeout=poll, limit=_BATCH)
            if batch:
                if len(batch) < _BATCH:
                    time.sleep(LINGER_S)
                    batch.extend(self._sub.get_many(timeout=0, limit=_BATCH - len(batch)))
                yield self._frames.frames(batch)
                last_write = time.monotonic()
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
