"""``/connections``, ``/traffic``, ``/memory`` and ``/logs`` as WebSocket streams and as
chunked HTTP lines, against a real engine with real flows and real clients: what they
send, bad parameters, slow readers, closed clients and the engine stopping."""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from spliceway.api.clash.streams import SEND_TIMEOUT_S, find_hub
from tests.api.clash.conftest import ClashEngine, call
from tests.api.clash.test_connections import active_ids, open_flow, routed
from tests.conftest import spliceway_logs_at, wait_until
from tests.helpers.servers import EchoServer, LoopbackServer, read_head

__all__ = ["routed"]  # a fixture shared with test_connections


def ws(clash: ClashEngine, path: str) -> ClientConnection:
    """A WebSocket client of ``path`` on the Clash listener (no proxy from the env)."""
    return connect(clash.url.replace("http://", "ws://") + path, proxy=None, open_timeout=10)


def frames_until(
    conn: ClientConnection, predicate: Callable[[Any], Any], timeout: float = 10.0
) -> tuple[Any, list[Any]]:
    """Read JSON frames until one satisfies ``predicate``; that frame and all read."""
    deadline = time.monotonic() + timeout
    seen: list[Any] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise AssertionError(f"no matching frame within {timeout} s; got {seen[-3:]}")
        frame = json.loads(conn.recv(timeout=remaining))
        seen.append(frame)
        if predicate(frame):
            return frame, seen


def hub_counts(clash: ClashEngine) -> dict[str, int]:
    hub = find_hub(int(clash.url.rsplit(":", 1)[1]))
    assert hub is not None
    return hub.counts()


IDLE = {"subscribers": 0, "topics": 0, "tasks": 0}


# -- /connections --------------------------------------------------------------------


def test_connections_stream_sees_a_flow_appear_grow_and_vanish(
    routed: ClashEngine, echo: EchoServer
) -> None:
    with ws(routed, "/connections?interval=200") as conn:
        first = json.loads(conn.recv(timeout=5))
        assert first["connections"] is None
        sock = open_flow(routed, echo, b"a" * 1000)
        (flow_id,) = active_ids(routed)

        def has(up: int, down: int) -> Callable[[Any], bool]:
            def check(frame: Any) -> bool:
                mine = [c for c in frame["connections"] or [] if c["id"] == flow_id]
                return bool(mine) and (mine[0]["upload"], mine[0]["download"]) == (up, down)

            return check

        frame, _ = frames_until(conn, has(1000, 1000))
        record = routed.engine.query("flow", {"flow_id": flow_id})
        (found,) = frame["connections"]
        assert found["chains"] == list(reversed(record["route"]["selection_chain"]))
        assert found["chains"][-1] == "Proxy"
        assert found["rule"] == "AND"
        assert found["rulePayload"] == f"((DomainSuffix,localhost) && (DstPort,{echo.port}))"
        sock.sendall(b"b" * 2345)
        got = b""
        while len(got) < 2345:
            got += sock.recv(65536)
        frames_until(conn, has(3345, 3345))
        sock.close()
        frame, _ = frames_until(
            conn, lambda f: all(c["id"] != flow_id for c in f["connections"] or [])
        )
        assert frame["connections"] is None


def test_connections_stream_sends_a_snapshot_at_once_then_every_interval(
    clash: ClashEngine,
) -> None:
    started = time.monotonic()
    with ws(clash, "/connections?interval=60000") as slow_interval:
        json.loads(slow_interval.recv(timeout=5))
        assert time.monotonic() - started < 5
        with pytest.raises(TimeoutError):
            slow_interval.recv(timeout=0.5)
    # Out-of-range intervals are clamped (Clash controller clients ask for 1 ms).
    with ws(clash, "/connections?interval=1") as fast:
        json.loads(fast.recv(timeout=5))
        began = time.monotonic()
        for _ in range(5):
            json.loads(fast.recv(timeout=5))
        assert time.monotonic() - began >= 0.4  # five ticks of at least 100 ms


@pytest.mark.parametrize(
    "path",
    [
        "/connections?interval=abc",
        "/connections?interval=1.5",
        "/logs?level=bogus",
        "/logs?level=INFO",
    ],
)
def test_bad_parameters_are_400_before_the_upgrade(clash: ClashEngine, path: str) -> None:
    with pytest.raises(InvalidStatus) as info:
        ws(clash, path)
    response = info.value.response
    assert response.status_code == 400
    body = json.loads(bytes(response.body))
    assert list(body) == ["message"] and body["message"]
    assert hub_counts(clash) == IDLE


def test_bad_level_of_a_chunked_log_stream_is_400(clash: ClashEngine) -> None:
    status, body = call(clash.url + "/logs?level=verbose")
    assert status == 400
    assert "level" in body["message"]


# -- /traffic and /memory ------------------------------------------------------------


def test_traffic_totals_grow_by_the_exact_bytes_moved(
    routed: ClashEngine, echo: EchoServer
) -> None:
    with ws(routed, "/traffic") as conn:
        first = json.loads(conn.recv(timeout=5))
        assert list(first) == ["up", "down", "upTotal", "downTotal"]
        up0, down0 = first["upTotal"], first["downTotal"]
        with open_flow(routed, echo, b"t" * 7000):
            _, seen = frames_until(
                conn,
                lambda f: (f["upTotal"], f["downTotal"]) == (up0 + 7000, down0 + 7000),
            )
        assert all(isinstance(f[k], int) for f in seen for k in f)
        # The per-second rates add up to what moved (each tick: bytes since the last).
        assert 0 < sum(f["up"] for f in seen) <= 7000 * 1.2


def sample_feeds(clash: ClashEngine) -> int:
    """The engine log's subscriptions that follow ``stats.sampled`` alone (the hub's)."""
    subs = clash.engine._core.log._subs
    return sum(1 for sub in subs if sub.types == frozenset({"stats.sampled"}))


def test_traffic_reads_the_engines_samples_and_lets_go_of_them(clash: ClashEngine) -> None:
    hub = find_hub(int(clash.url.rsplit(":", 1)[1]))
    assert hub is not None
    with ws(clash, "/traffic") as conn:
        frames = [json.loads(conn.recv(timeout=5)) for _ in range(3)]
        assert sample_feeds(clash) == 1
        sample = hub.builder.sample()
        assert sample is not None
        # The totals are a stats.sampled event's, exactly.
        events = clash.engine.query("events", {"types": "stats.sampled"})["events"]
        sampled = {
            (e["occurred_at_unix_ms"], e["payload"]["bytes_up"], e["payload"]["bytes_down"])
            for e in events
        }
        assert sample in sampled
        assert all(list(f) == ["up", "down", "upTotal", "downTotal"] for f in frames)
    wait_until(lambda: hub_counts(clash) == IDLE, 5, "the stream is gone")
    wait_until(lambda: sample_feeds(clash) == 0, 5, "the samples' feed is closed")


def test_websockets_are_not_compressed(clash: ClashEngine) -> None:
    # The client offers permessage-deflate (websockets does by default); mihomo declines
    # it, and so does this listener (a 10,000-flow frame is megabytes to compress).
    with ws(clash, "/memory") as conn:
        assert conn.response is not None
        assert "Sec-WebSocket-Extensions" not in conn.response.headers
        assert json.loads(conn.recv(timeout=5)) == {"inuse": 0, "oslimit": 0}


def test_memory_starts_at_zero_then_reports_rss(clash: ClashEngine) -> None:
    with ws(clash, "/memory") as conn:
        assert json.loads(conn.recv(timeout=5)) == {"inuse": 0, "oslimit": 0}
        second = json.loads(conn.recv(timeout=5))
        assert second["inuse"] > 1 << 20 and second["oslimit"] == 0


def test_chunked_http_variants_are_newline_delimited_json(clash: ClashEngine) -> None:
    for path, first_keys in (
        ("/memory", ["inuse", "oslimit"]),
        ("/traffic", ["up", "down", "upTotal", "downTotal"]),
    ):
        with urllib.request.urlopen(clash.url + path, timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"] == "application/json"
            assert resp.headers["Transfer-Encoding"] == "chunked"
            lines = [resp.readline(), resp.readline()]
        for line in lines:
            assert line.endswith(b"\n")
            assert list(json.loads(line)) == first_keys
    # HEAD gets the stream's headers, not a stream that never ends.
    assert call(clash.url + "/traffic", "HEAD") == (200, None)
    # A plain GET of /connections is one snapshot, as mihomo's.
    status, snap = call(clash.url + "/connections?interval=100")
    assert status == 200 and list(snap) == [
        "downloadTotal",
        "uploadTotal",
        "connections",
        "memory",
    ]
    wait_until(lambda: hub_counts(clash) == IDLE, 5, "the chunked streams are gone")


# -- /logs -----------------------------------------------------------------------------


class ProbeTarget(LoopbackServer):
    """What ``auto`` probes: 204 while ``healthy``, else the connection is closed."""

    def __init__(self) -> None:
        self.healthy = True
        super().__init__()

    def handle(self, conn: socket.socket) -> None:
        threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(5)
            if b"\r\n\r\n" not in read_head(conn):
                return
            if self.healthy:
                conn.sendall(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")


@pytest.fixture
def probed(make_clash: Callable[..., ClashEngine]) -> Iterator[tuple[ClashEngine, ProbeTarget]]:
    """The shared engine with ``auto`` probing a target the test makes fail and recover:
    the engine logs a warning when no member is healthy, an info line when one is again."""
    with ProbeTarget() as target, spliceway_logs_at(logging.INFO):

        def prepare(cfg: dict[str, Any]) -> None:
            cfg["outbound_groups"][1]["url"] = f"http://127.0.0.1:{target.port}/generate_204"

        clash = make_clash(prepare)
        yield clash, target


def probe_round(clash: ClashEngine) -> None:
    """One probe round of ``auto``, to its end."""
    since = clash.engine.query("events", {"limit": 1})["latest_sequence"]
    # A round already running (the start's first, on a loaded machine) refuses a second:
    # ask again until this one is ours.
    wait_until(
        lambda: clash.engine.execute("policies.probe", {"policy_tag": "auto"})["probe_triggered"],
        15,
        "a probe round of auto to start",
    )

    def done() -> bool:
        events = clash.engine.query("events", {"types": "policy.probe.completed", "since": since})[
            "events"
        ]
        # trigger manual: the start's own round (trigger startup) may end after `since`.
        return any(
            e["payload"].get("policy_tag") == "auto" and e["payload"].get("trigger") == "manual"
            for e in events
        )

    wait_until(done, 15, "auto's probe round")


def test_logs_honour_the_level_and_the_format(
    probed: tuple[ClashEngine, ProbeTarget],
) -> None:
    clash, target = probed
    with (
        ws(clash, "/logs?level=warning") as warnings,
        ws(clash, "/logs?level=info&format=structured") as infos,
        ws(clash, "/logs?level=silent") as silent,
        urllib.request.urlopen(clash.url + "/logs?level=warn", timeout=15) as chunked,
    ):
        target.healthy = False
        probe_round(clash)
        warned, seen = frames_until(
            warnings, lambda f: "has no healthy member" in f["payload"], timeout=15
        )
        assert warned["type"] == "warning"
        assert {f["type"] for f in seen} <= {"warning", "error"}
        structured, _ = frames_until(
            infos, lambda f: "has no healthy member" in f["message"], timeout=15
        )
        assert list(structured) == ["time", "level", "message", "fields"]
        assert structured["level"] == "warn" and structured["fields"] == []
        assert len(structured["time"]) == 8 and structured["time"].count(":") == 2
        line = json.loads(chunked.readline())
        assert line == {"type": "warning", "payload": warned["payload"]}

        target.healthy = True
        probe_round(clash)
        recovered, _ = frames_until(
            infos, lambda f: "has a healthy member again" in f["message"], timeout=15
        )
        assert recovered["level"] == "info"
        # The info line went out in the same tick: the warning stream has nothing more.
        with pytest.raises(TimeoutError):
            warnings.recv(timeout=1.0)
        with pytest.raises(TimeoutError):
            silent.recv(timeout=0.1)


# -- slow readers, closed clients, the engine stopping -------------------------------


def raw_websocket(clash: ClashEngine, path: str, rcvbuf: int = 4096) -> socket.socket:
    """A WebSocket upgrade done by hand on a socket with a small receive buffer, whose
    frames the test never reads (a dashboard tab that hangs)."""
    host, port = clash.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect((host, int(port)))
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
        f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
        "Sec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def test_a_reader_that_never_reads_is_dropped_and_others_keep_their_pace(
    routed: ClashEngine, echo: EchoServer
) -> None:
    # Frames of ~75 kB ten times a second fill the stuck socket's buffers in seconds.
    flows = [open_flow(routed, echo) for _ in range(100)]
    try:
        wait_until(lambda: len(active_ids(routed)) == 100, what="100 open flows")
        arrivals: list[float] = []
        stop = threading.Event()

        def read_on_time(conn: ClientConnection) -> None:
            with contextlib.suppress(ConnectionClosed, TimeoutError):
                while not stop.is_set():
                    conn.recv(timeout=5)
                    arrivals.append(time.monotonic())

        with ws(routed, "/connections?interval=100") as fast:
            reader = threading.Thread(target=read_on_time, args=(fast,), daemon=True)
            reader.start()
            stuck = raw_websocket(routed, "/connections?interval=100")
            try:
                wait_until(lambda: hub_counts(routed)["subscribers"] == 2, 5, "both subscribed")
                began = time.monotonic()
                wait_until(
                    lambda: hub_counts(routed)["subscribers"] == 1,
                    30 + SEND_TIMEOUT_S,
                    "the reader that never reads is dropped",
                )
                dropped_after = time.monotonic() - began
                # The server closed it: reading now drains what was queued, then EOF.
                stuck.settimeout(10)
                while stuck.recv(1 << 20):
                    pass
            finally:
                stuck.close()
            later = len(arrivals)
            wait_until(lambda: len(arrivals) >= later + 5, 5, "frames go on")
            stop.set()
            reader.join(10)
        window = [t for t in arrivals if t >= began]
        gaps = [b - a for a, b in itertools.pairwise(window)]
        print(f"\ndropped after {dropped_after:.1f} s; max gap {max(gaps):.2f} s")
        # Interval 100 ms: the fast reader never waited on the stuck one.
        assert max(gaps) < 1.0
        # The reader's close reaches the server a moment after the client's.
        wait_until(lambda: hub_counts(routed)["subscribers"] == 0, 5, "every subscriber gone")
    finally:
        for sock in flows:
            sock.close()


def test_closed_clients_leave_nothing_behind(clash: ClashEngine) -> None:
    paths = ["/connections?interval=100", "/traffic", "/memory", "/logs?level=debug"]
    with contextlib.ExitStack() as stack:
        for path in paths:
            stack.enter_context(ws(clash, path))
        for path in paths[1:]:
            stack.enter_context(urllib.request.urlopen(clash.url + path, timeout=10))
        wait_until(lambda: hub_counts(clash)["subscribers"] == 7, 5, "seven streams open")
        assert hub_counts(clash) == {"subscribers": 7, "topics": 4, "tasks": 5}
    wait_until(lambda: hub_counts(clash) == IDLE, 2, "every stream cleaned up")


def test_streams_end_when_the_engine_stops(
    clash: ClashEngine, caplog: pytest.LogCaptureFixture
) -> None:
    stack = contextlib.ExitStack()
    conn = stack.enter_context(ws(clash, "/traffic"))
    chunked = stack.enter_context(urllib.request.urlopen(clash.url + "/memory", timeout=10))
    assert json.loads(chunked.readline()) == {"inuse": 0, "oslimit": 0}
    wait_until(lambda: hub_counts(clash)["subscribers"] == 2, 5, "both open")
    caplog.set_level(logging.INFO, logger="uvicorn.error")
    started = time.monotonic()
    clash.engine.stop()
    took = time.monotonic() - started
    closed: ConnectionClosed | None = None
    try:
        while True:
            conn.recv(timeout=5)
    except ConnectionClosed as ex:
        closed = ex
    assert closed is not None and closed.rcvd is not None
    assert closed.rcvd.code in (1001, 1012)
    rest = chunked.read()  # the chunked answer ended (its last chunk, then EOF)
    assert all(json.loads(line) for line in rest.splitlines())
    stack.close()
    # Within uvicorn's graceful window: nothing had to be cancelled.
    assert not [r for r in caplog.records if "graceful shutdown exceeded" in r.getMessage()]
    assert took < 10
    with contextlib.suppress(urllib.error.URLError, ConnectionError):
        call(clash.url + "/traffic", timeout=2)
