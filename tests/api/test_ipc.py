"""The local IPC control socket, driven by a raw Unix-socket client (docs/ipc.md)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
import stat
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway import Engine
from spliceway.api import ipc
from spliceway.errors import ApiError
from tests.conftest import base_config, wait_until
from tests.events.test_catalogue import check_event
from tests.helpers.upstreams import refused_port


def _config(path: Path) -> dict[str, Any]:
    return base_config(
        api={"control": {"enabled": False}, "ipc": {"enabled": True, "path": str(path)}}
    )


@pytest.fixture
def engine(sock_path: Path) -> Iterator[Engine]:
    with Engine(_config(sock_path)) as eng:
        yield eng


class Client:
    """A raw IPC client: write bytes, read one JSON line at a time."""

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(str(path))
        self.file = self.sock.makefile("rb")

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def line(self) -> dict[str, Any]:
        raw = self.file.readline()
        assert raw.endswith(b"\n"), raw
        return json.loads(raw)

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def test_socket_is_private_and_answers_pipelined_queries_and_commands_in_order(engine, sock_path):
    assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(sock_path.parent).st_mode) == 0o700
    c = Client(sock_path)
    c.send(
        b'{"id": 1, "health": {}}\n'
        b'{"id": "two", "flows": {"limit": 5}}\n'
        b'{"id": 3, "command": {"method": "mode.set", "params": {"mode": "direct"}}}\n'
        b'{"id": 4, "runtime": {}}\n'
    )
    replies = [c.line() for _ in range(4)]
    assert [r["id"] for r in replies] == [1, "two", 3, 4]
    assert all(r["ok"] and r["api_id"] == "service.api.v1" for r in replies)
    assert [list(r["result"]) for r in replies] == [["health"], ["flows"], ["command"], ["runtime"]]
    assert replies[0]["result"]["health"]["healthy"] is True
    assert replies[2]["result"]["command"] == {"accepted": True}
    c.close()


def test_bad_frames_get_invalid_argument_and_the_connection_stays_usable(engine, sock_path):
    c = Client(sock_path)
    c.send(b"not json\n[1, 2]\n")
    for _ in range(2):
        reply = c.line()
        assert (reply["ok"], reply["id"], reply["error"]["code"]) == (
            False,
            None,
            "invalid_argument",
        )
    c.send(b'{"id": 7, "no_such_query": {}}\n{"id": 8, "health": {}, "stats": {}}\n')
    assert c.line()["error"]["code"] == "invalid_argument"
    assert c.line()["error"]["code"] == "invalid_argument"  # two requests in one frame
    c.send(b'{"id": 9, "command": {"method": "no.such", "params": {}}}\n')
    assert c.line()["error"]["code"] == "invalid_argument"
    # A frame over 16 MiB: refused once, the rest of it skipped, the next frame answered.
    c.send(
        b'{"id": 10, "health": {"pad": "' + b"x" * (17 << 20) + b'"}}\n{"id": 11, "health": {}}\n'
    )
    big = c.line()
    assert (big["ok"], big["error"]["code"]) == (False, "invalid_argument")
    assert str(ipc.MAX_FRAME) in big["error"]["message"]
    after = c.line()
    assert (after["id"], after["ok"]) == (11, True)
    c.close()


def _frame_of(size: int, request_id: int) -> bytes:
    """A health query padded with an unknown parameter to exactly ``size`` bytes."""
    head, tail = b'{"id": %d, "health": {"pad": "' % request_id, b'"}}'
    return head + b"x" * (size - len(head) - len(tail)) + tail


def _unread(sock: socket.socket) -> int:
    """Bytes this Unix socket sent that the peer has not read yet (SIOCOUTQ)."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4), "little")


@pytest.mark.parametrize(
    ("size", "about_size"), [(ipc.MAX_FRAME, False), (ipc.MAX_FRAME + 1, True)]
)
def test_the_frame_limit_is_exact_whatever_the_reads(engine, sock_path, size, about_size):
    """All but the frame's last bytes are read first, so its end and newline come in one
    read on top of a buffer still under the limit: a frame of MAX_FRAME bytes is answered
    (here: the unknown parameter), one byte more is refused for its size."""
    c = Client(sock_path)
    frame = _frame_of(size, 1)
    c.send(frame[:-100])
    wait_until(lambda: _unread(c.sock) == 0, what="the engine read the frame's start")
    c.send(frame[-100:] + b'\n{"id": 2, "health": {}}\n')
    reply = c.line()
    assert (reply["ok"], reply["error"]["code"]) == (False, "invalid_argument")
    if about_size:
        assert reply["id"] is None
        assert f"frame larger than {ipc.MAX_FRAME} bytes" in reply["error"]["message"]
    else:
        assert reply["id"] == 1
        assert "unknown parameter 'pad'" in reply["error"]["message"]
    after = c.line()  # the connection stays usable
    assert (after["id"], after["ok"]) == (2, True)
    c.close()


def test_subscribe_acks_then_snapshot_then_live_events_without_history(engine, sock_path):
    engine.execute("mode.set", {"mode": "direct"})  # history a subscriber must not get
    c = Client(sock_path)
    c.send(b'{"id": 5, "type": "subscribe", "events": ["flow.started", "ipc.connected"]}\n')
    ack = c.line()
    assert ack["id"] == 5 and ack["result"] == {
        "subscribed": {"events": ["flow.started", "ipc.connected"]}
    }
    snapshot = c.line()
    assert snapshot["event_type"] == "flow.snapshot"
    assert snapshot["payload"]["records"] == []
    other = Client(sock_path)  # an event the subscription selects
    event = c.line()
    assert event["event_type"] == "ipc.connected" and event["payload"]["active"] == 2
    assert check_event(event) == []
    c.send(b'{"id": 6, "type": "subscribe", "events": []}\n')
    assert c.line()["error"]["code"] == "conflict"
    other_client = Client(sock_path)
    other_client.send(b'{"id": 7, "type": "subscribe", "events": ["no.such"]}\n')
    refused = other_client.line()["error"]
    assert (refused["code"], refused["field_path"]) == ("invalid_argument", "events")
    other_client.close()
    other.close()
    c.close()


def test_connect_and_disconnect_events_match_the_catalogue(engine, sock_path):
    c = Client(sock_path)
    c.send(b'{"id": 1, "health": {}}\n')
    c.line()
    c.close()

    def ipc_events() -> list[dict[str, Any]]:
        events = engine.query("events", {"types": "ipc.connected,ipc.disconnected"})["events"]
        return events if len(events) == 2 else []

    connected, disconnected = wait_until(ipc_events, what="ipc.connected and ipc.disconnected")
    assert connected["payload"]["active"] == 1 and disconnected["payload"]["active"] == 0
    assert "error" not in disconnected["payload"]
    assert check_event(connected) == [] and check_event(disconnected) == []


def test_a_client_that_stops_reading_is_dropped_and_never_blocks_the_engine(sock_path):
    eng = Engine(_config(sock_path))
    eng.start()
    try:
        # Small bounds, so a few thousand events overflow them.
        server = eng._transports.ipc
        assert server is not None
        server._max_pending, server._out_queue = 64, 4
        c = Client(sock_path)
        c.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        c.send(b'{"id": 1, "type": "subscribe"}\n')
        assert "subscribed" in c.line()["result"]  # then it reads nothing more
        for _ in range(3000):  # each emit returns at once though nobody reads
            eng.core.log.emit("engine.warning", {"code": "test", "message": "x" * 2000})

        def dropped() -> list[dict[str, Any]]:
            return eng.query("events", {"types": "ipc.disconnected"})["events"]

        (gone,) = wait_until(dropped, what="the slow client dropped")
        assert "fell more than 64 events behind" in gone["payload"]["error"]
        assert eng.query("health")["healthy"] is True
        c.close()
    finally:
        eng.stop()


def test_stop_ends_subscriptions_with_engine_stopped_and_removes_the_socket(sock_path):
    eng = Engine(_config(sock_path)).start()
    c = Client(sock_path)
    c.send(b'{"id": 1, "type": "subscribe", "events": ["ipc.connected"]}\n')
    assert "subscribed" in c.line()["result"]
    eng.stop()
    last = c.line()
    assert last["event_type"] == "engine.stopped"
    assert c.file.readline() == b""  # then the engine closed the connection
    assert not sock_path.exists()
    assert os.listdir(sock_path.parent) == []  # the lock file went with it
    c.close()


def test_a_second_engine_on_a_live_socket_is_refused_and_a_stale_one_is_replaced(engine, sock_path):
    with pytest.raises(ApiError) as refused:
        Engine(_config(sock_path)).start()
    assert refused.value.code == "conflict" and "in use" in refused.value.message
    assert f"pid {os.getpid()} holds {sock_path}.lock" in refused.value.message
    first = Client(sock_path)  # the first engine still serves
    first.send(b'{"id": 1, "health": {}}\n')
    assert first.line()["ok"] is True
    first.close()
    engine.stop()
    # A socket file nobody listens on and its lock file, unlocked (an engine that was
    # killed): taken over.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()
    Path(f"{sock_path}.lock").write_text("12345\n")
    second = Engine(_config(sock_path)).start()
    try:
        c = Client(sock_path)
        c.send(b'{"id": 1, "health": {}}\n')
        assert c.line()["ok"] is True
        c.close()
    finally:
        second.stop()


def test_capabilities_list_the_ipc_adapter_and_contract(engine, sock_path):
    c = Client(sock_path)
    c.send(b'{"id": 1, "capabilities": {}}\n')
    caps = c.line()["result"]["capabilities"]
    assert {"kind": "ipc", "enabled": True} in caps["adapters"]
    assert "ipc" in caps["features"]
    assert any(x["name"] == "ipc" for x in caps["contracts"])
    assert all(x["code"] != "ipc_not_built" for x in caps["global_limitations"])
    c.close()


def test_stop_cuts_off_a_client_that_neither_reads_nor_closes(sock_path):
    eng = Engine(_config(sock_path)).start()
    c = Client(sock_path)
    c.send(b'{"id": 1, "runtime": {}}\n' * 3000)  # replies pile up unread
    wait_until(
        lambda: eng._transports.ipc is not None and eng._transports.ipc.active == 1,
        what="connected",
    )
    started = time.monotonic()
    eng.stop()
    assert time.monotonic() - started < 8.0
    assert not sock_path.exists()
    c.close()


def test_a_default_directory_another_user_could_have_made_is_refused(tmp_path):
    shared = tmp_path / "spliceway-x"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    with pytest.raises(ApiError) as refused:
        ipc.prepare_path(str(shared / "control.sock"), private_dir=True)
    assert refused.value.code == "conflict" and "0700" in refused.value.message
    link = tmp_path / "link"
    link.symlink_to(shared)
    with pytest.raises(ApiError):
        ipc.prepare_path(str(link / "control.sock"), private_dir=True)
    # A chosen path: allowed.
    ipc.prepare_path(str(shared / "control.sock"), private_dir=False).release()


def _race(plane: Any, path: str) -> tuple[list[ipc.IpcServer], list[ApiError]]:
    """Two IpcServers started at the same moment on ``path``: those made, those refused."""
    barrier = threading.Barrier(2)
    won: list[ipc.IpcServer] = []
    lost: list[ApiError] = []

    def start() -> None:
        barrier.wait()
        try:
            won.append(ipc.IpcServer(plane, path))
        except ApiError as ex:
            lost.append(ex)

    threads = [threading.Thread(target=start) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return won, lost


def test_two_servers_starting_at_once_on_one_path_one_wins_the_other_conflicts(engine, sock_path):
    """Rounds of two IpcServers racing for one path that holds a stale socket (both
    would see it refuse, remove it and bind: without the lock, a second removal takes the
    first one's fresh socket and both win)."""
    path = str(sock_path.parent / "race.sock")
    deadline = time.monotonic() + 3.0
    rounds = 0
    while rounds < 200 and time.monotonic() < deadline:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(path)
        stale.close()
        won, lost = _race(engine.control_plane, path)
        try:
            assert (len(won), len(lost)) == (1, 1), (rounds, lost)
            assert lost[0].code == "conflict" and path in lost[0].message
            # The winner's socket is the one at the path.
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            probe.connect(path)
            probe.close()
        finally:
            for server in won:
                server.stop()
        # Stopped, the winner left nothing behind (socket and lock file removed).
        assert [n for n in os.listdir(sock_path.parent) if n.startswith("race")] == []
        rounds += 1
    assert rounds >= 20


def _read_until_closed(c: Client) -> list[dict[str, Any]]:
    lines = []
    while raw := c.file.readline():
        lines.append(json.loads(raw))
    return lines


def _leave_on_stopped(c: Client) -> None:
    with contextlib.suppress(OSError, ValueError):
        while raw := c.file.readline():
            if json.loads(raw)["event_type"] == "engine.stopped":
                break
    c.close()


def _churn(path: Path, stop: threading.Event) -> None:
    while not stop.is_set():
        try:
            c = Client(path)
        except OSError:
            return  # the engine stopped listening
        with contextlib.suppress(OSError):
            c.send(b'{"id": 1, "health": {}}\n')
            c.file.readline()
        c.close()


def test_no_ipc_event_follows_engine_stopped_while_clients_come_and_go(sock_path):
    """Clients that leave the moment they see engine.stopped, and others that connect and
    leave all along: a subscriber's last event is engine.stopped, every round. (A sink
    that cannot deliver keeps the stop busy after engine.stopped, where a late
    ipc.disconnected would land.)"""
    cfg = _config(sock_path)
    cfg["api"]["event_sinks"] = [
        {"type": "webhook", "tag": "nowhere", "url": f"http://127.0.0.1:{refused_port()}/"}
    ]
    for _ in range(3):
        eng = Engine(cfg).start()
        watcher = Client(sock_path)
        # engine.stopped in the filter: it comes in emit order, not as the stream's end.
        watcher.send(
            b'{"id": 1, "type": "subscribe", "events": '
            b'["ipc.connected", "ipc.disconnected", "engine.stopped"]}\n'
        )
        assert "subscribed" in watcher.line()["result"]
        leavers = []
        for _ in range(6):
            leaver = Client(sock_path)
            leaver.send(b'{"id": 1, "type": "subscribe", "events": ["engine.stopped"]}\n')
            assert "subscribed" in leaver.line()["result"]
            leavers.append(leaver)
        stop = threading.Event()
        threads = [threading.Thread(target=_leave_on_stopped, args=(c,)) for c in leavers]
        threads += [threading.Thread(target=_churn, args=(sock_path, stop)) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            eng.stop()
        finally:
            stop.set()
            for t in threads:
                t.join(10)
        events = [e["event_type"] for e in _read_until_closed(watcher)]
        watcher.close()
        assert events[-1] == "engine.stopped", events[-5:]
        assert events.count("engine.stopped") == 1


def test_logs_query_reads_the_engines_log_ring(engine, sock_path):
    """``logs`` is offered on IPC as on HTTP: records, filters, a bad level refused."""
    logging.getLogger("spliceway.test_ipc").warning("ipc logs marker")
    c = Client(sock_path)
    c.send(
        b'{"id": 1, "logs": {"level": "warn", "limit": 1000}}\n{"id": 2, "logs": {"level": 3}}\n'
    )
    good, bad = c.line(), c.line()
    c.close()
    assert good["ok"], good
    records = good["result"]["logs"]["records"]
    assert any(r["message"] == "ipc logs marker" for r in records)
    assert (bad["ok"], bad["error"]["code"], bad["error"]["field_path"]) == (
        False,
        "invalid_argument",
        "level",
    )
