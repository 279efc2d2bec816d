"""The local IPC control socket, driven by a raw Unix-socket client (docs/ipc.md)."""

from __future__ import annotations

import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from spliceway.api import ipc

from spliceway import Engine
from spliceway.errors import ApiError
from tests.conftest import base_config, wait_until
from tests.unit.test_event_catalogue import check_event


def _config(path: Path) -> dict[str, Any]:
    return base_config(
        api={"control": {"enabled": False}, "ipc": {"enabled": True, "path": str(path)}}
    )


@pytest.fixture
def engine(sock_path: Path) -> Iterator[Engine]:
    eng = Engine(_config(sock_path)).start()
    try:
        yield eng
    finally:
        eng.stop()


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
        server = eng._ipc
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
    c.close()


def test_a_second_engine_on_a_live_socket_is_refused_and_a_stale_one_is_replaced(engine, sock_path):
    with pytest.raises(ApiError) as refused:
        Engine(_config(sock_path)).start()
    assert refused.value.code == "conflict" and "in use" in refused.value.message
    first = Client(sock_path)  # the first engine still serves
    first.send(b'{"id": 1, "health": {}}\n')
    assert first.line()["ok"] is True
    first.close()
    engine.stop()
    # A socket file nobody listens on (an engine that was killed): taken over.
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(sock_path))
    stale.close()
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
    wait_until(lambda: eng._ipc is not None and eng._ipc.active == 1, what="connected")
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
    ipc.prepare_path(str(shared / "control.sock"), private_dir=False)  # a chosen path: allowed
