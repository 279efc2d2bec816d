"""The flow hook's client (spliceway.flows.hook) against real hook servers on real Unix
sockets: verdicts, pipelining, timeouts, outages and their warnings, reconnects,
malformed answers, a hook that stops reading, closing; plus parse_answer and
HookSettings on their own, and contrib/flow_hook_example.py as a subprocess."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from spliceway.actors.dispatcher import Dispatcher
from spliceway.flows.hook import (
    ALLOW,
    BACKPRESSURE,
    BAD_ANSWER,
    CLOSED,
    DENY,
    DISCONNECTED,
    MAX_ANSWER_LINE,
    TIMEOUT,
    UNENCODABLE,
    UNREACHABLE,
    BadAnswer,
    FlowHookClient,
    HookSettings,
    Verdict,
    parse_answer,
)
from spliceway.flows.records import FlowState
from tests.conftest import fd_count, wait_until

EXAMPLE = Path(__file__).resolve().parents[2] / "contrib" / "flow_hook_example.py"


def flow(host: str = "example.com", *, tag: str = "socks-in", pad: int = 0) -> dict[str, Any]:
    """A FlowRecord in state opening, as the engine renders it."""
    record = FlowState(
        flow_id="f-1",
        inbound_tag=tag,
        inbound_protocol="socks5",
        source_ip="127.0.0.1",
        source_port=40000,
        started_at_unix_ms=1_700_000_000_000,
        mode="rule",
        target_host=host,
        target_port=443,
    ).render()
    if pad:
        record["pad"] = "x" * pad
    return record


# -- a hook server ---------------------------------------------------------------------

#: What the hook answers to each of the ``rev-`` requests.
REVERSED: dict[str, dict[str, Any]] = {
    "rev-1": {"verdict": "allow", "labels": {"n": "1"}},
    "rev-2": {"verdict": "deny"},
    "rev-3": {"verdict": "allow", "principal_key": "p3"},
}


class Hook:
    """A hook process stand-in: an asyncio Unix server on a thread of its own.

    It answers by the flow's target host: ``deny.example`` deny, ``who.example`` allow
    with a principal and labels, ``slow.example`` allow after 0.3 s, ``silent.example``
    never, ``die.example`` kills the whole hook (every connection, the listener),
    ``garbage.example`` a line that is not JSON, ``bad.example`` a malformed answer with
    the right id, ``long.example`` a 2 MiB line and then the real answer, ``rev-N``
    nothing until three ``rev-`` requests are in, then all three in reverse order;
    anything else allow. ``reads=False``: answers the first request, then reads no more.
    ``close_at_once``: accepts and closes at once.
    """

    def __init__(self, path: Path, *, reads: bool = True, close_at_once: bool = False) -> None:
        self.path = str(path)
        self.reads = reads
        self.close_at_once = close_at_once
        self.requests: list[dict[str, Any]] = []
        self.connections = 0
        self._held: list[dict[str, Any]] = []
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.AbstractServer | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="test-hook")
        self._thread.start()

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(5)

    def start(self) -> Hook:
        """Listen at the path (again, after ``kill``)."""

        async def listen() -> None:
            self._server = await asyncio.start_unix_server(
                self._serve, path=self.path, limit=8 << 20
            )

        self._call(listen())
        return self

    def kill(self) -> None:
        """Die as a crashed hook does: connections reset, socket file gone."""
        self._call(self._kill())

    def stop(self) -> None:
        """Kill, then end the thread."""
        self.kill()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    async def _kill(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        if self.close_at_once:
            writer.transport.abort()
        try:
            while line := await reader.readline():
                request = json.loads(line)
                self.requests.append(request)
                self._answer(request, writer)
                if not self.reads:
                    # Nothing more is read: the client's requests pile up in the kernel,
                    # then in its transport.
                    writer.transport.pause_reading()
        except ConnectionError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()

    def _answer(self, request: dict[str, Any], writer: asyncio.StreamWriter) -> None:
        request_id = request["id"]
        record = request["flow"]
        host = record["target"]["host"]

        def send(answer: dict[str, Any]) -> None:
            if not writer.transport.is_closing():
                writer.write(json.dumps({"id": request_id, **answer}).encode() + b"\n")

        if host == "deny.example":
            send({"verdict": "deny"})
        elif host == "who.example":
            tag = record["inbound"]["tag"]
            send({"verdict": "allow", "principal_key": "alice", "labels": {"inbound": tag}})
        elif host == "slow.example":
            self._loop.call_later(0.3, send, {"verdict": "allow"})
        elif host == "silent.example":
            pass
        elif host == "die.example":
            self._loop.create_task(self._kill())
        elif host == "garbage.example":
            writer.write(b"this is not json\n")
        elif host == "bad.example":
            send({"verdict": "maybe"})
        elif host == "long.example":
            writer.write(b"[" + b"0," * (1 << 20) + b"0]\n")
            send({"verdict": "allow"})
        elif host.startswith("rev-"):
            self._held.append(request)
            if len(self._held) == 3:
                for held in reversed(self._held):
                    name = held["flow"]["target"]["host"]
                    writer.write(json.dumps({"id": held["id"], **REVERSED[name]}).encode())
                    writer.write(b"\n")
                self._held.clear()
        else:
            send({"verdict": "allow"})


@pytest.fixture
def hook_path(sock_path: Path) -> Iterator[Path]:
    sock_path.parent.mkdir(mode=0o700, exist_ok=True)
    path = sock_path.parent / "hook.sock"
    yield path
    path.unlink(missing_ok=True)  # before sock_path removes the directory


@pytest.fixture
def make_hook(hook_path: Path) -> Iterator[Any]:
    hooks: list[Hook] = []

    def make(**kwargs: Any) -> Hook:
        hook = Hook(hook_path, **kwargs).start()
        hooks.append(hook)
        return hook

    yield make
    for hook in hooks:
        hook.stop()


# -- a client on a real dispatcher -------------------------------------------------------


class Client:
    """A FlowHookClient on a dispatcher's loop, driven from the test thread."""

    def __init__(self, dispatcher: Dispatcher, path: Path, timeout_ms: int, **kwargs: Any):
        self.loop = dispatcher.loop
        self.warnings: list[str] = []
        self.client = FlowHookClient(
            HookSettings(str(path), timeout_ms=timeout_ms),
            self.loop,
            self.warnings.append,
            **kwargs,
        )

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 10) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def ask(self, host: str = "example.com", **kwargs: Any) -> Verdict:
        return self.run(self.client.ask(flow(host, **kwargs)))

    def ask_all(self, records: list[dict[str, Any]]) -> list[Verdict]:
        async def ask_all() -> list[Verdict]:
            return await asyncio.gather(*(self.client.ask(record) for record in records))

        return self.run(ask_all())

    def counters(self) -> dict[str, int]:
        return self.run(self._counters())

    async def _counters(self) -> dict[str, int]:
        return self.client.counters()


@pytest.fixture
def dispatcher() -> Iterator[Dispatcher]:
    d = Dispatcher("test-flowhook")
    d.start()
    yield d
    d.stop()


@pytest.fixture
def make_client(dispatcher: Dispatcher, hook_path: Path) -> Iterator[Any]:
    clients: list[Client] = []

    def make(timeout_ms: int = 2000, **kwargs: Any) -> Client:
        client = Client(dispatcher, hook_path, timeout_ms, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.client.close()


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    start = time.monotonic()
    result = fn(*args)
    return result, time.monotonic() - start


# -- verdicts ----------------------------------------------------------------------------


def test_allow_deny_principal_and_labels(make_hook, make_client):
    hook = make_hook()
    c = make_client()
    assert hook.connections == 0  # lazy: no connection before the first ask
    assert c.ask() == ALLOW
    assert c.ask("deny.example") == DENY
    assert c.ask("who.example", tag="http-in") == Verdict(
        allow=True, principal_key="alice", labels={"inbound": "http-in"}
    )
    # One line per request: the id and the record as given.
    assert hook.requests[0] == {"id": 1, "flow": flow()}
    assert [r["id"] for r in hook.requests] == [1, 2, 3]
    assert hook.connections == 1
    assert c.warnings == []
    assert c.counters() == {
        "asked": 3,
        "allowed": 2,
        "denied": 1,
        "failed_open": 0,
        "late_answers": 0,
        "bad_answers": 0,
    }


def test_pipelined_asks_are_answered_out_of_order_by_id(make_hook, make_client):
    hook = make_hook()
    c = make_client()
    # The hook answers only once all three are in, so they were outstanding together.
    verdicts = c.ask_all([flow("rev-1"), flow("rev-2"), flow("rev-3")])
    assert verdicts == [
        Verdict(allow=True, labels={"n": "1"}),
        DENY,
        Verdict(allow=True, principal_key="p3"),
    ]
    assert hook.connections == 1


# -- timeouts and outages ----------------------------------------------------------------


def test_a_late_answer_fails_open_and_warns_once_per_outage(make_hook, make_client, hook_path):
    make_hook()
    c = make_client(timeout_ms=100)
    verdict, took = timed(c.ask, "slow.example")
    assert verdict.failed_open and verdict.allow and verdict.reason == TIMEOUT
    assert 0.09 <= took < 0.3
    assert len(c.warnings) == 1
    assert str(hook_path) in c.warnings[0] and "within 100 ms" in c.warnings[0]
    # Still the same outage: no second warning.
    assert c.ask("slow.example").reason == TIMEOUT
    assert len(c.warnings) == 1
    # The answers come after all; they are dropped and counted.
    wait_until(lambda: c.counters()["late_answers"] == 2, 3, "late answers counted")
    # A good answer ends the outage; the next failure is a new one.
    assert c.ask() == ALLOW
    assert c.ask("slow.example").reason == TIMEOUT
    assert len(c.warnings) == 2
    counters = c.counters()
    assert counters["failed_open"] == 3 and counters["allowed"] == 1


@pytest.mark.parametrize("kind", ["no file", "nobody listening"])
def test_nothing_at_the_path_fails_open_at_once(make_client, hook_path, kind):
    if kind == "nobody listening":
        # A socket file left by a dead hook: connect is refused.
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(hook_path))
        stale.close()
    c = make_client(timeout_ms=2000)
    start = time.monotonic()
    verdicts = [c.ask() for _ in range(5)]
    assert time.monotonic() - start < 1.0  # nobody waited timeout_ms
    assert all(v.allow and v.failed_open and v.reason == UNREACHABLE for v in verdicts)
    assert len(c.warnings) == 1 and "unreachable" in c.warnings[0]
    assert c.counters()["failed_open"] == 5


def test_hook_dying_mid_flight_then_coming_back(make_hook, make_client):
    hook = make_hook()
    c = make_client(timeout_ms=3000)
    assert c.ask() == ALLOW
    # Two requests outstanding when a third kills the hook: all fail open at once.
    verdicts, took = timed(
        c.ask_all, [flow("silent.example"), flow("silent.example"), flow("die.example")]
    )
    assert took < 1.0
    assert all(v.failed_open and v.allow and v.reason == DISCONNECTED for v in verdicts)
    assert len(c.warnings) == 1
    # While it is gone: fail open, no new warning.
    assert c.ask().reason in (UNREACHABLE, DISCONNECTED)
    assert c.ask().reason == UNREACHABLE
    assert len(c.warnings) == 1
    # It restarts at the same path: after the backoff the client is back.
    hook.start()
    wait_until(lambda: not c.ask().failed_open, 5, "verdicts after the hook restarted")
    assert c.ask("deny.example") == DENY
    assert hook.connections == 2
    assert len(c.warnings) == 1
    # A second outage: a second warning.
    assert c.ask("die.example").reason == DISCONNECTED
    assert len(c.warnings) == 2


def test_reconnects_back_off(make_hook, make_client):
    # A hook that accepts and hangs up at once, answering nothing: each attempt waits
    # longer (50, 100, 200, 400 ms...), so a second of asks every 10 ms makes only a
    # few connections.
    hook = make_hook(close_at_once=True)
    c = make_client(timeout_ms=2000, backoff_initial_s=0.05, backoff_max_s=0.4)
    deadline = time.monotonic() + 1.0
    asks = 0
    while time.monotonic() < deadline:
        assert c.ask().failed_open
        asks += 1
        time.sleep(0.01)
    assert asks > 40
    assert 3 <= hook.connections <= 8
    assert len(c.warnings) == 1


# -- bad answers -------------------------------------------------------------------------


def test_a_garbage_line_spares_the_connection_and_good_answers(make_hook, make_client):
    hook = make_hook()
    c = make_client(timeout_ms=300)
    # Not JSON: no id to recover, so its request waits out its timeout; the other
    # request on the same connection gets its answer.
    garbage, good = c.ask_all([flow("garbage.example"), flow()])
    assert garbage.failed_open and garbage.reason == TIMEOUT
    assert good == ALLOW
    assert len(c.warnings) == 1
    # A malformed answer with a readable id fails its request at once.
    verdict, took = timed(c.ask, "bad.example")
    assert verdict.failed_open and verdict.reason == BAD_ANSWER
    assert took < 0.25
    assert len(c.warnings) == 1  # the outage goes on: no good answer since
    assert c.ask() == ALLOW
    assert c.ask("bad.example").reason == BAD_ANSWER
    assert len(c.warnings) == 2
    assert hook.connections == 1
    assert c.counters()["bad_answers"] == 3


def test_an_over_long_line_is_skipped(make_hook, make_client):
    hook = make_hook()
    c = make_client(timeout_ms=2000)
    # 2 MiB of valid JSON with no answer in it, then the real answer.
    assert c.ask("long.example") == ALLOW
    assert c.ask("deny.example") == DENY
    assert c.counters()["bad_answers"] == 1
    assert hook.connections == 1
    assert c.warnings == []


def test_a_hook_that_stops_reading_costs_bounded_memory(make_hook, make_client):
    make_hook(reads=False)
    limit = 64 << 10
    c = make_client(timeout_ms=300, max_write_buffer=limit)
    # Connected first, so that the burst goes to the transport, not the connect backlog.
    assert c.ask() == ALLOW
    # 300 requests of 16 KiB: 4.8 MB, far beyond the kernel's buffer and the limit.
    verdicts, took = timed(c.ask_all, [flow(pad=16 << 10) for _ in range(300)])
    assert all(v.allow and v.failed_open for v in verdicts)
    reasons = {v.reason for v in verdicts}
    assert reasons <= {BACKPRESSURE, TIMEOUT} and BACKPRESSURE in reasons
    assert took < 2.0
    held = c.run(_write_buffer(c.client))
    assert 0 < held <= limit
    assert len(c.warnings) == 1 and "not reading" in c.warnings[0]


async def _write_buffer(client: FlowHookClient) -> int:
    assert client._transport is not None
    return client._transport.get_write_buffer_size()


def test_an_unencodable_record_fails_open_without_a_warning(make_hook, make_client):
    make_hook()
    c = make_client()
    record = flow()
    record["odd"] = {1, 2}  # a set: not JSON
    assert c.run(c.client.ask(record)).reason == UNENCODABLE
    assert c.warnings == []
    assert c.ask() == ALLOW


# -- cancelling and closing ----------------------------------------------------------------


def test_a_cancelled_ask_withdraws_its_request(make_hook, make_client):
    hook = make_hook()
    c = make_client(timeout_ms=2000)

    async def ask_and_cancel() -> None:
        task = asyncio.ensure_future(c.client.ask(flow("slow.example")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert c.client._waiters == {}

    c.run(ask_and_cancel())
    wait_until(lambda: c.counters()["late_answers"] == 1, 3, "the answer counted late")
    assert c.counters()["failed_open"] == 0
    assert c.ask() == ALLOW
    assert len(hook.requests) == 2


def test_close_from_another_thread_fails_open_outstanding_asks(make_hook, make_client):
    hook = make_hook()
    before = fd_count()
    c = make_client(timeout_ms=5000)
    outstanding = asyncio.run_coroutine_threadsafe(c.client.ask(flow("silent.example")), c.loop)
    wait_until(lambda: hook.requests, 3, "the request reached the hook")
    assert fd_count() == before + 2  # both ends live in this process
    _, took = timed(c.client.close)
    assert took < 1.0
    assert outstanding.result(1).reason == CLOSED
    assert c.ask().reason == CLOSED
    assert c.warnings == []  # closing is no outage
    c.client.close()  # twice is fine
    wait_until(lambda: fd_count() == before, 3, "both ends of the connection closed")


def test_aclose(make_hook, make_client):
    make_hook()
    c = make_client()
    assert c.ask() == ALLOW
    c.run(c.client.aclose())
    assert not c.client.connected
    assert c.ask().reason == CLOSED


def test_close_after_the_loop_is_gone(make_hook, hook_path):
    make_hook()
    loop = asyncio.new_event_loop()
    client = FlowHookClient(HookSettings(str(hook_path)), loop, lambda message: None)
    assert loop.run_until_complete(client.ask(flow())) == ALLOW
    loop.close()
    client.close()  # no loop to run on: closes the socket itself, raises nothing
    assert client._sock is None


# -- the example hook ---------------------------------------------------------------------


def test_the_example_hook(make_client, hook_path):
    process = subprocess.Popen(
        [sys.executable, str(EXAMPLE), str(hook_path), "--deny-suffix", ".blocked.example"],
        stderr=subprocess.PIPE,
    )
    try:
        wait_until(hook_path.exists, 5, "the example hook listening")
        c = make_client(timeout_ms=2000)
        verdicts = c.ask_all(
            [
                flow("www.example.com", tag="mixed-in"),
                flow("ads.blocked.example"),
                flow("blocked.example"),
                flow("notblocked.example"),
            ]
        )
        assert verdicts == [
            Verdict(allow=True, labels={"inbound": "mixed-in"}),
            DENY,
            DENY,
            Verdict(allow=True, labels={"inbound": "socks-in"}),
        ]
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=5)
    assert process.returncode == 0, err
    assert not hook_path.exists()  # it removes its socket


# -- settings ---------------------------------------------------------------------------------


def test_settings_defaults_and_selection():
    settings = HookSettings("/run/hook.sock")
    assert (settings.timeout_ms, settings.networks, settings.inbound_tags) == (
        200,
        ("tcp", "udp"),
        None,
    )
    assert settings.selects("tcp", "any") and settings.selects("udp", "other")
    some = HookSettings("/h", networks=["udp"], inbound_tags=["b", "a", "b"])  # type: ignore[arg-type]
    assert some.networks == ("udp",) and some.inbound_tags == ("a", "b")
    assert some.selects("udp", "a")
    assert not some.selects("tcp", "a")
    assert not some.selects("udp", "c")
    # Equal when they select the same flows, whatever the order given.
    assert HookSettings("/h", networks=("udp", "tcp")) == HookSettings("/h")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"path": ""}, "path"),
        ({"path": "/" + "x" * 200}, "path"),
        ({"timeout_ms": 0}, "timeout_ms"),
        ({"timeout_ms": True}, "timeout_ms"),
        ({"timeout_ms": 1.5}, "timeout_ms"),
        ({"networks": ()}, "networks"),
        ({"networks": "tcp"}, "networks"),
        ({"networks": ("tcp", "sctp")}, "networks"),
        ({"inbound_tags": []}, "inbound_tags"),
        ({"inbound_tags": ["", "a"]}, "inbound_tags"),
    ],
)
def test_settings_refuse_bad_values(kwargs, field):
    kwargs = {"path": "/run/hook.sock", **kwargs}
    with pytest.raises(ValueError, match=field):
        HookSettings(**kwargs)


# -- parse_answer ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (b'{"id": 1, "verdict": "allow"}', (1, ALLOW)),
        (b'{"id": 2, "verdict": "deny"}\n', (2, DENY)),
        (
            b'{"id": 3, "verdict": "allow", "principal_key": "k", "labels": {"a": "", "b": "c"}}',
            (3, Verdict(allow=True, principal_key="k", labels={"a": "", "b": "c"})),
        ),
        # With a deny, principal and labels are checked but not carried.
        (b'{"id": 4, "verdict": "deny", "principal_key": "k", "labels": {"a": "b"}}', (4, DENY)),
        # null counts as absent; unknown members are ignored.
        (b'{"id": 5, "verdict": "allow", "principal_key": null, "labels": null}', (5, ALLOW)),
        (b'{"id": 6, "verdict": "allow", "labels": {}, "future": [1]}', (6, ALLOW)),
        (b'{"id": -7, "verdict": "allow"}\r\n', (-7, ALLOW)),
    ],
)
def test_parse_answer_valid(line, expected):
    assert parse_answer(line) == expected


@pytest.mark.parametrize(
    ("line", "request_id"),
    [
        (b"", None),
        (b"not json", None),
        (b'[1, "allow"]', None),
        (b'"allow"', None),
        (b'{"verdict": "allow"}', None),
        (b'{"id": "1", "verdict": "allow"}', None),
        (b'{"id": 1.0, "verdict": "allow"}', None),
        (b'{"id": true, "verdict": "allow"}', None),
        (b'{"id": 1}', 1),
        (b'{"id": 1, "verdict": "Allow"}', 1),
        (b'{"id": 1, "verdict": true}', 1),
        (b'{"id": 1, "verdict": "allow", "principal_key": ""}', 1),
        (b'{"id": 1, "verdict": "allow", "principal_key": 7}', 1),
        (b'{"id": 1, "verdict": "allow", "labels": []}', 1),
        (b'{"id": 1, "verdict": "allow", "labels": {"a": 1}}', 1),
        (b'{"id": 1, "verdict": "allow", "labels": {"a": null}}', 1),
        (b'{"id": 1, "verdict": "allow", "labels": {"": "x"}}', 1),
        (b'{"id": 1, "verdict": "deny", "labels": {"a": {"b": "c"}}}', 1),
    ],
)
def test_parse_answer_invalid(line, request_id):
    with pytest.raises(BadAnswer) as info:
        parse_answer(line)
    assert isinstance(info.value, ValueError)
    assert info.value.request_id == request_id


def test_parse_answer_refuses_over_long_lines():
    padding = b" " * MAX_ANSWER_LINE
    with pytest.raises(BadAnswer, match="over"):
        parse_answer(b'{"id": 1, "verdict": "allow"}' + padding)


_names = st.text(min_size=1, max_size=8)


@given(
    request_id=st.integers(min_value=-(2**63), max_value=2**63 - 1),
    allow=st.booleans(),
    principal=st.none() | _names,
    labels=st.none() | st.dictionaries(_names, st.text(max_size=8), max_size=4),
)
def test_parse_answer_reads_what_a_hook_writes(request_id, allow, principal, labels):
    answer: dict[str, Any] = {"id": request_id, "verdict": "allow" if allow else "deny"}
    if principal is not None:
        answer["principal_key"] = principal
    if labels is not None:
        answer["labels"] = labels
    got_id, verdict = parse_answer(orjson.dumps(answer))
    assert got_id == request_id and verdict.allow is allow and not verdict.failed_open
    if allow:
        assert verdict.principal_key == principal
        assert verdict.labels == (labels or None)
    else:
        assert verdict == DENY


@given(st.binary(max_size=200))
def test_parse_answer_raises_only_bad_answer(line):
    with contextlib.suppress(BadAnswer):
        request_id, verdict = parse_answer(line)
        assert type(request_id) is int and isinstance(verdict, Verdict)
