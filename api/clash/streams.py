"""``/traffic``, ``/memory``, ``/logs`` and ``/connections``: WebSocket or chunked HTTP.

Each stream is answered as mihomo's: a WebSocket upgrade gets one JSON text frame per
tick; a plain ``GET`` of ``/traffic``, ``/memory`` or ``/logs`` gets the same JSON
objects as newline-delimited chunks (Yacd's fallback). ``GET /connections`` without an
upgrade is one snapshot (:mod:`.connections`), as in mihomo.

One :class:`StreamHub` per listener owns the work. Subscribers of the same stream (and,
for ``/connections``, the same interval) share a :class:`Topic`: one task that builds
each tick's frame once, encodes it once and offers the same bytes to every subscriber's
bounded queue. The building runs in a worker thread (queries and the mapping of up to
thousands of records), never on the event loop. A subscriber whose queue is full, or
whose frame is not written within :data:`SEND_TIMEOUT_S`, is dropped (its socket is
closed); offering never waits, so a reader that does not read delays no one else and
never the engine. A topic's task ends with its last subscriber; the hub's watcher ends
every stream within :data:`WATCH_S` of the engine stopping, well inside uvicorn's
graceful-shutdown window.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.types import Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect

from spliceway.api.clash.connections import SnapshotBuilder, connection_routes, rss_bytes
from spliceway.api.clash.context import ClashContext
from spliceway.api.clash.guard import error_response

__all__ = [
    "INTERVAL_DEFAULT_MS",
    "INTERVAL_MAX_MS",
    "INTERVAL_MIN_MS",
    "LOG_LEVELS",
    "StreamHub",
    "find_hub",
    "stream_routes",
]

logger = logging.getLogger(__name__)

#: ``/connections``'s ``interval`` (ms): the default, and the range a given value is
#: clamped to (Clash controller clients ask for ``interval=1``; mihomo itself takes any
#: integer and panics on 0).
INTERVAL_DEFAULT_MS = 1000
INTERVAL_MIN_MS = 100
INTERVAL_MAX_MS = 60_000
#: ``/traffic`` and ``/memory`` tick once a second, as mihomo's.
TICK_S = 1.0
#: How old the totals of a ``/connections`` tick may be.
TOTALS_MAX_AGE_S = 1.0
#: How often the engine's log ring is read for ``/logs``.
LOG_POLL_S = 0.2
#: How often the hub checks that the engine still runs (while any stream is open).
WATCH_S = 0.2
#: Frames a subscriber may lag behind before it is dropped.
QUEUE_FRAMES = 8
#: A frame not written within this is a reader that does not read: it is dropped.
SEND_TIMEOUT_S = 5.0
#: The closing handshake (or the end of a chunked answer) is given this long.
CLOSE_TIMEOUT_S = 1.0

#: ``/logs``'s ``level`` -> the lowest Python logging level sent (None: ``silent``,
#: nothing). mihomo accepts debug, info, warning, error and silent; sing-box also
#: trace, warn, fatal and panic; dashboards send either, and one that gets a 400
#: reconnects for ever, so all are accepted.
LOG_LEVELS: dict[str, int | None] = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "fatal": logging.ERROR,
    "panic": logging.ERROR,
    "silent": None,
}
#: The log ring's level names -> (Python level, mihomo's ``type``, structured ``level``).
_RING_LEVELS: dict[str, tuple[int, str, str]] = {
    "debug": (logging.DEBUG, "debug", "debug"),
    "info": (logging.INFO, "info", "info"),
    "warn": (logging.WARNING, "warning", "warn"),
    "error": (logging.ERROR, "error", "error"),
}

#: Every hub of this process (one per Clash listener), for :func:`find_hub`.
_HUBS: weakref.WeakSet[StreamHub] = weakref.WeakSet()


class Frame:
    """One JSON object as sent: ``data`` (with mihomo's trailing newline) for chunked
    HTTP, :attr:`text` (the same characters) for a WebSocket text frame, decoded on
    first use and then shared (a snapshot of 10,000 flows is megabytes)."""

    __slots__ = ("_text", "data")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self._text: str | None = None

    @property
    def text(self) -> str:
        """``data`` as text (JSON is UTF-8)."""
        if self._text is None:
            self._text = self.data.decode()
        return self._text

    @classmethod
    def json(cls, obj: Any) -> Frame:
        """The frame of ``obj``, encoded once."""
        return cls(orjson.dumps(obj, option=orjson.OPT_APPEND_NEWLINE))


@dataclass(frozen=True, slots=True)
class LogLine:
    """One record of the log ring, encoded both ways once for every subscriber."""

    level: int
    plain: Frame
    structured: Frame


def _log_line(record: dict[str, Any]) -> LogLine:
    level, kind, short = _RING_LEVELS.get(record["level"], _RING_LEVELS["info"])
    message = record["message"]
    clock = time.strftime("%H:%M:%S", time.localtime(record["time_unix_ms"] / 1000))
    return LogLine(
        level,
        Frame.json({"type": kind, "payload": message}),
        Frame.json({"time": clock, "level": short, "message": message, "fields": []}),
    )


Select = Callable[[Any], "Frame | None"]


def _as_frame(item: Any) -> Frame | None:
    return item if isinstance(item, Frame) else None


class Subscriber:
    """One open stream: a bounded queue of frames and the reason it ended, if it did."""

    def __init__(self, topic: Topic, select: Select) -> None:
        self.topic = topic
        self.select = select
        self.queue: asyncio.Queue[Frame] = asyncio.Queue(QUEUE_FRAMES)
        self.ended = asyncio.Event()
        #: ``slow`` (dropped), ``stopping`` (the engine stops) or None while it runs.
        self.reason: str | None = None

    def offer(self, frame: Frame) -> None:
        """Queue ``frame`` without waiting; a full queue drops this subscriber."""
        if self.ended.is_set():
            return
        try:
            self.queue.put_nowait(frame)
        except asyncio.QueueFull:
            self.end("slow")

    def take(self, items: list[Any]) -> None:
        """Offer the frames this subscriber selects from ``items``."""
        for item in items:
            frame = self.select(item)
            if frame is not None:
                self.offer(frame)

    async def ready(self) -> None:
        """Wait until the topic has its starting point, so nothing logged after the
        client is told the stream is open is missed."""
        await self.topic.primed.wait()

    def end(self, reason: str) -> None:
        """End the stream (the endpoint closes its socket)."""
        if not self.ended.is_set():
            self.reason = reason
            self.ended.set()


class Producer(abc.ABC):
    """What a topic sends: :meth:`prime` once before its first subscriber is told the
    stream is open, :meth:`produce` at each tick (both may block the calling thread's
    event loop for no longer than an await: blocking work goes to a worker thread)."""

    async def prime(self) -> None:  # noqa: B027 - optional hook, most streams need none
        """Read the starting point (a baseline), if the stream needs one."""

    @abc.abstractmethod
    async def produce(self) -> list[Any]:
        """This tick's items (frames, or log lines each subscriber selects from)."""


class ConnectionsProducer(Producer):
    """mihomo's connections snapshot, from the hub's one :class:`SnapshotBuilder`."""

    def __init__(self, builder: SnapshotBuilder, interval_s: float) -> None:
        self._builder = builder
        # Two intervals ticking within this of each other share one build.
        self._max_age = min(0.05, interval_s / 2)

    async def produce(self) -> list[Any]:
        """One snapshot (its totals read at most once a second: ``/traffic`` reads them
        too, and each reading walks every open flow's counters)."""
        data = await run_in_threadpool(self._builder.build, self._max_age, TOTALS_MAX_AGE_S)
        return [Frame(data)]


class TrafficProducer(Producer):
    """``{"up", "down", "upTotal", "downTotal"}``: the engine's lifetime totals (payload
    bytes of every flow) and bytes per second since the last tick's totals.

    The totals are the engine's newest ``stats.sampled`` when it is fresh (its sampler
    reads every open flow's counters anyway; reading them again here would hold the GIL
    for tens of milliseconds at 10,000 flows), the rates measured between the samples'
    own times; a tick with no new sample repeats the last rate (mihomo's ``/traffic``
    reports its last measured second too). Without a fresh sample the totals are read
    now and measured against the last tick's."""

    def __init__(self, builder: SnapshotBuilder) -> None:
        self._builder = builder
        #: ``(time, upTotal, downTotal, sampled)`` of the last tick: ``time`` is the
        #: sample's (ms) when ``sampled``, else ``time.monotonic()``.
        self._last: tuple[float, int, int, bool] | None = None
        self._rate = (0, 0)

    async def prime(self) -> None:
        """The totals the first tick's rates are measured from."""
        up, down = await run_in_threadpool(self._builder.totals)
        self._last = (time.monotonic(), up, down, False)

    async def produce(self) -> list[Any]:
        """One sample."""
        sampled = await run_in_threadpool(self._builder.sample)
        last = self._last
        if sampled is not None:
            at_ms, up, down = sampled
            now, elapsed = float(at_ms), None
            if last is not None and last[3]:
                elapsed = (at_ms - last[0]) / 1000 if at_ms > last[0] else 0.0
            is_sample = True
        else:
            up, down = await run_in_threadpool(self._builder.totals)
            now = time.monotonic()
            elapsed = now - last[0] if last is not None and not last[3] else None
            is_sample = False
        if last is not None and elapsed != 0.0:
            # A first tick of a kind (sampled after measured, or the reverse) has no
            # interval of its own: a second's worth.
            span = max(elapsed if elapsed is not None else 1.0, 1e-3)
            self._rate = (round((up - last[1]) / span), round((down - last[2]) / span))
        self._last = (now, up, down, is_sample)
        return [
            Frame.json(
                {"up": self._rate[0], "down": self._rate[1], "upTotal": up, "downTotal": down}
            )
        ]


class MemoryProducer(Producer):
    """``{"inuse": RSS bytes, "oslimit": 0}`` (each subscriber's first frame is mihomo's
    ``inuse: 0``, queued when it subscribes)."""

    async def produce(self) -> list[Any]:
        """One sample."""
        return [Frame.json({"inuse": rss_bytes(), "oslimit": 0})]


class LogsProducer(Producer):
    """The log ring's new records since the last read (the ``logs`` query), each as a
    :class:`LogLine`; a stream starts at the newest record when it opens, as mihomo's
    sends only what is logged after."""

    def __init__(self, hub: StreamHub) -> None:
        self._plane = hub.ctx.plane
        self._since = 0

    async def prime(self) -> None:
        """Start after the newest record in the ring."""
        snap = await run_in_threadpool(self._plane.run_query, "logs", {"limit": 1})
        self._since = int(snap["latest_sequence"])

    async def produce(self) -> list[Any]:
        """The lines logged since the last tick."""
        snap = await run_in_threadpool(self._plane.run_query, "logs", {"since": self._since})
        records = snap["records"]
        if not records:
            # A ring that was emptied (another engine's start) restarts the count.
            self._since = min(self._since, int(snap["latest_sequence"]))
            return []
        self._since = int(records[-1]["sequence"])
        return [_log_line(r) for r in records]


class Topic:
    """One stream's ticking task and its subscribers."""

    def __init__(self, spec: StreamSpec, producer: Producer) -> None:
        self.spec = spec
        self.key = spec.key
        self.producer = producer
        self.subscribers: set[Subscriber] = set()
        self.latest: list[Any] = []
        self.task: asyncio.Task[None] | None = None
        self.primed = asyncio.Event()

    def start(self) -> None:
        """Start ticking (on the running loop)."""
        self.task = asyncio.get_running_loop().create_task(
            self._run(), name=f"clash-stream-{'-'.join(map(str, self.key))}"
        )

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            await self.producer.prime()
        except Exception:
            logger.exception("the Clash API's %s stream could not start", self.key[0])
        finally:
            self.primed.set()
        next_at = loop.time() + self.spec.first_tick_s
        while True:
            delay = next_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                items = await self.producer.produce()
            except Exception:
                logger.exception("the Clash API's %s stream failed a tick", self.key[0])
                items = []
            if items:
                self.latest = items
                self.deliver(items)
            next_at += self.spec.interval_s
            if next_at < loop.time():
                # A tick took longer than the interval: the next one waits a whole
                # interval rather than running back to back.
                next_at = loop.time() + self.spec.interval_s

    def deliver(self, items: list[Any]) -> None:
        """Offer this tick's items to every subscriber (never waits)."""
        for sub in list(self.subscribers):
            sub.take(items)


@dataclass(frozen=True, slots=True)
class StreamSpec:
    """What one request subscribes to."""

    key: tuple[Any, ...]
    interval_s: float
    make: Callable[[StreamHub], Producer]
    select: Select = _as_frame
    first: Frame | None = None
    first_tick_s: float = 0.0
    #: A new subscriber gets the last tick's frames at once (``/connections``).
    replay: bool = False


class StreamHub:
    """The streams of one Clash listener (created with its app)."""

    def __init__(self, ctx: ClashContext) -> None:
        self.ctx = ctx
        self.builder = SnapshotBuilder(ctx.plane)
        self._topics: dict[tuple[Any, ...], Topic] = {}
        self._watcher: asyncio.Task[None] | None = None
        _HUBS.add(self)

    @property
    def stopped(self) -> bool:
        """The engine is not running: no stream may open."""
        return not self.ctx.plane.running

    def counts(self) -> dict[str, int]:
        """Open subscribers, live topics and running tasks (the tests' leak check)."""
        tasks = [t.task for t in self._topics.values() if t.task is not None]
        if self._watcher is not None:
            tasks.append(self._watcher)
        return {
            "subscribers": sum(len(t.subscribers) for t in self._topics.values()),
            "topics": len(self._topics),
            "tasks": sum(1 for t in tasks if not t.done()),
        }

    def subscribe(self, spec: StreamSpec) -> Subscriber:
        """Join ``spec``'s topic, starting it if needed (await :meth:`Subscriber.ready`
        before telling the client the stream is open; :meth:`unsubscribe` in any case)."""
        topic = self._topics.get(spec.key)
        if topic is None:
            topic = Topic(spec, spec.make(self))
            self._topics[spec.key] = topic
            topic.start()
        sub = Subscriber(topic, spec.select)
        if spec.first is not None:
            sub.offer(spec.first)
        if spec.replay:
            sub.take(topic.latest)
        topic.subscribers.add(sub)
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(
                self._watch(), name="clash-stream-watch"
            )
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        """Leave; the topic's task ends with its last subscriber, the watcher with the
        hub's."""
        topic = sub.topic
        topic.subscribers.discard(sub)
        if not topic.subscribers and self._topics.get(topic.key) is topic:
            del self._topics[topic.key]
            if topic.task is not None:
                topic.task.cancel()
        if not self._topics:
            if self._watcher is not None:
                self._watcher.cancel()
                self._watcher = None
            # Off the loop: a build in a worker thread may hold the builder's lock.
            asyncio.get_running_loop().run_in_executor(None, self.builder.release)

    def end_all(self, reason: str) -> None:
        """End every open stream."""
        for topic in list(self._topics.values()):
            for sub in list(topic.subscribers):
                sub.end(reason)

    async def _watch(self) -> None:
        while self._topics:
            if self.stopped:
                self.end_all("stopping")
            await asyncio.sleep(WATCH_S)


def find_hub(port: int) -> StreamHub | None:
    """The hub of the Clash listener bound to ``port`` in this process, if any."""
    for hub in list(_HUBS):
        listen = hub.ctx.listen
        if listen is not None and listen[1] == port:
            return hub
    return None


# -- the requests' parameters ------------------------------------------------------


class BadRequest(Exception):
    """A parameter mihomo answers with 400 ``{"message"}``."""


def connections_spec(query: dict[str, str]) -> StreamSpec:
    """``/connections?interval=<ms>``: a snapshot at once, then every interval."""
    raw = query.get("interval", "")
    interval_ms = INTERVAL_DEFAULT_MS
    if raw:
        try:
            interval_ms = int(raw)
        except ValueError:
            raise BadRequest(f"interval must be an integer (milliseconds), not {raw!r}") from None
    interval_ms = min(max(interval_ms, INTERVAL_MIN_MS), INTERVAL_MAX_MS)
    interval_s = interval_ms / 1000
    return StreamSpec(
        ("connections", interval_ms),
        interval_s,
        lambda hub: ConnectionsProducer(hub.builder, interval_s),
        replay=True,
    )


def traffic_spec(query: dict[str, str]) -> StreamSpec:
    """``/traffic``: a sample every second."""
    return StreamSpec(
        ("traffic",), TICK_S, lambda hub: TrafficProducer(hub.builder), first_tick_s=TICK_S
    )


_MEMORY_ZERO = Frame.json({"inuse": 0, "oslimit": 0})


def memory_spec(query: dict[str, str]) -> StreamSpec:
    """``/memory``: ``inuse: 0`` at once, then RSS every second."""
    return StreamSpec(
        ("memory",),
        TICK_S,
        lambda hub: MemoryProducer(),
        first=_MEMORY_ZERO,
        first_tick_s=TICK_S,
    )


def logs_spec(query: dict[str, str]) -> StreamSpec:
    """``/logs?level=&format=``: the records at or above ``level`` (default ``info``),
    mihomo's ``{type, payload}`` or, with ``format=structured``, ``{time, level,
    message, fields}``."""
    level_name = query.get("level") or "info"
    if level_name not in LOG_LEVELS:
        raise BadRequest(f"level must be one of {', '.join(LOG_LEVELS)}, not {level_name!r}")
    floor = LOG_LEVELS[level_name]
    structured = query.get("format") == "structured"

    def select(item: Any) -> Frame | None:
        if floor is None or not isinstance(item, LogLine) or item.level < floor:
            return None
        return item.structured if structured else item.plain

    return StreamSpec(("logs",), LOG_POLL_S, LogsProducer, select=select)


Parse = Callable[[dict[str, str]], StreamSpec]


_STOPPING = "the engine is not running"


def _spec_or_refusal(
    hub: StreamHub, parse: Parse, query: Mapping[str, str]
) -> StreamSpec | Response:
    """What the request subscribes to, or the answer refusing it: 400 for a wrong
    parameter, 503 when the engine is not running."""
    try:
        spec = parse(dict(query))
    except BadRequest as ex:
        return error_response(400, str(ex))
    if hub.stopped:
        return error_response(503, _STOPPING)
    return spec


# -- serving -----------------------------------------------------------------------


async def _until_disconnect(receive: Callable[[], Awaitable[Any]], kind: str) -> None:
    while True:
        message = await receive()
        if message["type"] == kind:
            return


async def _first_done(*tasks: asyncio.Future[Any]) -> set[asyncio.Future[Any]]:
    """Wait until one of ``tasks`` finishes; the others are cancelled and awaited."""
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done


async def _pump(
    sub: Subscriber,
    send: Send,
    message_of: Callable[[Frame], Message],
    gone: tuple[type[BaseException], ...],
) -> None:
    """Send ``sub``'s frames until the connection is ``gone`` or one is not written
    within :data:`SEND_TIMEOUT_S` (the subscriber is then ended as slow)."""
    while True:
        frame = await sub.queue.get()
        try:
            await asyncio.wait_for(send(message_of(frame)), SEND_TIMEOUT_S)
        except TimeoutError:
            sub.end("slow")
            return
        except gone:
            return


async def _stream(
    sub: Subscriber, receive: Receive, disconnect: str, pump: Awaitable[None]
) -> bool:
    """Run ``pump`` until it, the client or the subscriber ends; True when the client
    went away (or uvicorn shut the connection down)."""
    receiver = asyncio.ensure_future(_until_disconnect(receive, disconnect))
    done = await _first_done(
        receiver, asyncio.ensure_future(pump), asyncio.ensure_future(sub.ended.wait())
    )
    return receiver in done


def _ws_text(frame: Frame) -> Message:
    return {"type": "websocket.send", "text": frame.text}


def _http_chunk(frame: Frame) -> Message:
    return {"type": "http.response.body", "body": frame.data, "more_body": True}


async def serve_websocket(websocket: WebSocket, hub: StreamHub, parse: Parse) -> None:
    """One WebSocket stream: refused with 400 before the upgrade when a parameter is
    wrong, then frames until the client, the hub or a slow read ends it."""
    spec = _spec_or_refusal(hub, parse, websocket.query_params)
    if isinstance(spec, Response):
        await _deny(websocket, spec)
        return
    sub = hub.subscribe(spec)
    try:
        await sub.ready()
        await websocket.accept()
        pump = _pump(sub, websocket.send, _ws_text, (OSError, WebSocketDisconnect, RuntimeError))
        if await _stream(sub, websocket.receive, "websocket.disconnect", pump):
            return
        code = 1001 if sub.reason == "stopping" else 1008
        with contextlib.suppress(Exception):
            await asyncio.wait_for(websocket.close(code), CLOSE_TIMEOUT_S)
    except (OSError, WebSocketDisconnect):
        return
    finally:
        hub.unsubscribe(sub)


async def _deny(websocket: WebSocket, response: Response) -> None:
    try:
        await websocket.send_denial_response(response)
    except RuntimeError:
        # A server without the denial extension: the handshake is refused (403).
        await websocket.close(1008)


def _ndjson_start() -> dict[str, Any]:
    # A new header list each time: middleware (CORS) may add to it in place.
    return {
        "type": "http.response.start",
        "status": 200,
        "headers": [(b"content-type", b"application/json")],
    }


class LineStream:
    """A stream as chunked newline-delimited JSON (``GET`` without an upgrade)."""

    def __init__(self, hub: StreamHub, parse: Parse) -> None:
        self.hub = hub
        self.parse = parse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Serve one request."""
        spec = _spec_or_refusal(self.hub, self.parse, Request(scope).query_params)
        if isinstance(spec, Response):
            await spec(scope, receive, send)
            return
        if scope["method"] == "HEAD":
            # The headers of the stream, without a stream that would never end.
            await send(_ndjson_start())
            await send({"type": "http.response.body", "body": b""})
            return
        sub = self.hub.subscribe(spec)
        try:
            await sub.ready()
            await send(_ndjson_start())
            if await _stream(
                sub, receive, "http.disconnect", _pump(sub, send, _http_chunk, (OSError,))
            ):
                return
            # The last chunk; a reader that stopped reading will not take it either,
            # and then uvicorn closes the connection when this returns.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(
                    send({"type": "http.response.body", "body": b"", "more_body": False}),
                    CLOSE_TIMEOUT_S,
                )
        except OSError:
            return
        finally:
            self.hub.unsubscribe(sub)


def stream_routes(ctx: ClashContext) -> list[BaseRoute]:
    """The streaming routes of the Clash API, and ``GET``/``DELETE /connections``."""
    hub = StreamHub(ctx)

    def websocket_route(path: str, parse: Parse) -> WebSocketRoute:
        async def endpoint(websocket: WebSocket) -> None:
            await serve_websocket(websocket, hub, parse)

        return WebSocketRoute(path, endpoint)

    routes: list[BaseRoute] = [
        websocket_route("/connections", connections_spec),
        *connection_routes(ctx, hub.builder),
    ]
    for path, parse in (
        ("/traffic", traffic_spec),
        ("/memory", memory_spec),
        ("/logs", logs_spec),
    ):
        routes.append(websocket_route(path, parse))
        routes.append(Route(path, LineStream(hub, parse), methods=["GET"]))
    return routes
