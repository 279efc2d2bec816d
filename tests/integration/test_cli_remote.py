"""The CLI's remote subcommands against a running engine, over its IPC socket."""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway import Engine
from tests.conftest import base_config, wait_until
from tests.helpers.program import SPLICEWAY, events_over_ipc
from tests.helpers.servers import EchoServer
from tests.helpers.socks import socks5_connect


def _config(path: Path) -> dict[str, Any]:
    return base_config(
        outbound_groups=[{"tag": "proxy", "kind": "selector", "outbounds": ["direct", "block"]}],
        api={"control": {"enabled": False}, "ipc": {"enabled": True, "path": str(path)}},
    )


@pytest.fixture
def engine(sock_path: Path) -> Iterator[Engine]:
    with Engine(_config(sock_path)) as eng:
        yield eng


def cli(path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    argv = [*SPLICEWAY, *(["--ipc", str(path)] if path else []), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env, check=False)


def test_status_prints_a_table_and_json(engine, sock_path):
    table = cli(sock_path, "status")
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["FIELD", "VALUE"]
    assert any(line.split() == ["healthy", "True"] for line in lines)
    as_json = cli(sock_path, "status", "--json")
    assert as_json.returncode == 0
    doc = json.loads(as_json.stdout)
    assert doc["health"]["healthy"] is True and "total_started" in doc["stats"]


def test_flows_lists_an_open_flow(engine, sock_path):
    with EchoServer() as echo:
        sock = socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port)
        try:
            sock.sendall(b"ping")
            assert sock.recv(4) == b"ping"
            doc = json.loads(cli(sock_path, "flows", "--json").stdout)
            (flow,) = doc["active_flows"]
            assert flow["target"]["port"] == echo.port
            table = cli(sock_path, "flows").stdout.splitlines()
            assert table[0].split() == [
                "FLOW",
                "INBOUND",
                "TARGET",
                "OUTBOUND",
                "STATE",
                "UP",
                "DOWN",
            ]
            row = table[1].split()
            assert row[0] == flow["flow_id"] and row[2] == f"127.0.0.1:{echo.port}"
            assert row[3:5] == ["direct", "active"]
        finally:
            sock.close()


def test_policies_select_and_mode_change_the_engine(engine, sock_path):
    table = cli(sock_path, "policies").stdout.splitlines()
    assert table[0].split()[:3] == ["POLICY", "KIND", "SELECTED"]
    assert table[1].split()[:3] == ["proxy", "selector", "direct"]
    done = cli(sock_path, "select", "proxy", "block")
    assert done.returncode == 0, done.stderr
    assert engine.query("policy", {"policy_tag": "proxy"})["selected"] == "block"
    assert cli(sock_path, "mode", "global", "proxy", "--json").returncode == 0
    assert engine.query("config")["mode"] == {"kind": "global", "outbound": "proxy"}
    wrong = cli(sock_path, "select", "proxy", "nowhere")
    assert wrong.returncode == 1
    assert wrong.stderr.startswith("spliceway: invalid_argument: ")


def test_json_of_policies_select_and_mode_is_the_result_over_spliceway_ipc(engine, sock_path):
    """``--json`` prints the command's result itself; the socket comes from
    ``$SPLICEWAY_IPC`` (no ``--ipc``)."""
    env = {**os.environ, "SPLICEWAY_IPC": str(sock_path)}
    selected = cli(None, "select", "proxy", "block", "--json", env=env)
    assert selected.returncode == 0, selected.stderr
    assert json.loads(selected.stdout) == {"policy_tag": "proxy", "selected": "block"}
    policies = json.loads(cli(None, "policies", "--json", env=env).stdout)
    (proxy,) = [p for p in policies["policies"] if p["tag"] == "proxy"]
    assert (proxy["kind"], proxy["selected"], proxy["outbounds"]) == (
        "selector",
        "block",
        ["direct", "block"],
    )
    mode = cli(None, "mode", "direct", "--json", env=env)
    assert json.loads(mode.stdout) == {"accepted": True}
    assert engine.query("config")["mode"]["kind"] == "direct"
    # --ipc wins over the variable.
    elsewhere = cli(sock_path.parent / "none.sock", "status", env=env)
    assert elsewhere.returncode == 1 and "none.sock" in elsewhere.stderr


def test_events_prints_one_envelope_per_line_until_the_engine_stops(sock_path):
    eng = Engine(_config(sock_path)).start()
    proc = events_over_ipc(sock_path)
    try:
        # Subscribed once the engine holds its subscription: then select.
        wait_until(lambda: any(c._sub for c in list(eng._transports.ipc._conns)), what="subscribed")
        eng.execute("policies.select", {"policy_tag": "proxy", "target_tag": "block"})
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        assert ready, "no event line within 20 s"
        event = json.loads(proc.stdout.readline())
        assert event["event_type"] == "policy.selected"
    finally:
        eng.stop()
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["event_type"] == "engine.stopped"


def test_without_an_engine_the_cli_says_so_and_exits_1(sock_path):
    result = cli(sock_path, "status")
    assert result.returncode == 1
    assert result.stderr.startswith("spliceway: not_found: no engine is listening on ")


def test_reload_applies_a_file_and_reports_every_problem(sock_path: Path, tmp_path: Path) -> None:
    source = tmp_path / "running.json"
    source.write_text(json.dumps(_config(sock_path)))
    with Engine.from_file(source) as engine:
        new = _config(sock_path)
        new["inbounds"].append({"tag": "extra", "protocol": "socks5", "listen": {"port": 0}})
        given = tmp_path / "new.json"
        given.write_text(json.dumps(new))
        table = cli(sock_path, "reload", str(given))
        assert table.returncode == 0, table.stderr
        rows = dict(line.split(None, 1) for line in table.stdout.splitlines()[1:])
        assert rows["applied"] == "True" and rows["reconciled"] == "True"
        assert rows["persistence"] == "source_file"
        assert rows["changed_components"] == "proxy_listeners"
        assert engine.listen_address("extra")[1] > 0
        # The engine saved the document to its own file, as given.
        assert json.loads(source.read_text()) == new
        as_json = cli(sock_path, "reload", "--json", str(given))
        assert json.loads(as_json.stdout)["changed_components"] == []

        new["rules"] = [{"domain": ["a.test"], "outbound": "nowhere"}, {"port": ["x"]}]
        given.write_text(json.dumps(new))
        bad = cli(sock_path, "reload", str(given))
        assert bad.returncode == 1
        lines = bad.stderr.splitlines()
        assert lines[0].startswith("spliceway: invalid_argument: configuration is invalid")
        assert any(line.startswith("spliceway: rules[0].outbound: ") for line in lines[1:])
        assert len(lines) >= 3
        assert "rules" not in json.loads(source.read_text())  # untouched
        missing = cli(sock_path, "reload", str(tmp_path / "nope.json"))
        assert missing.returncode == 1
        assert "cannot read" in missing.stderr


class FakeEngine:
    """A Unix socket server that answers each IPC request line with ``reply`` (None:
    closes the connection instead), one connection after another."""

    def __init__(self, path: Path, reply: bytes | None) -> None:
        self.reply = reply
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            with conn:
                conn.makefile("rb").readline()
                if self.reply is not None:
                    conn.sendall(self.reply)

    def close(self) -> None:
        self.server.shutdown(socket.SHUT_RDWR)
        self.server.close()
        self.thread.join(10)


@pytest.mark.parametrize(
    ("reply", "message", "commands"),
    [
        (b"<html>not json</html>\n", "the reply is not JSON", ("status", "events")),
        (b'{"id": 1, "ok": true, "result": {"a": 1}', "the reply was cut off", ("flows",)),
        (b'["an", "array"]\n', "the reply is not a JSON object", ("policies",)),
        (None, "the engine closed the IPC connection", ("status", "events")),
    ],
)
def test_a_broken_reply_is_an_error_line_not_a_traceback(sock_path, reply, message, commands):
    sock_path.parent.mkdir(mode=0o700, exist_ok=True)
    fake = FakeEngine(sock_path, reply)
    try:
        for command in commands:
            done = cli(sock_path, command)
            assert done.returncode == 1, done.stderr
            assert done.stderr.startswith("spliceway: internal: "), done.stderr
            assert message in done.stderr and "Traceback" not in done.stderr
    finally:
        fake.close()


def test_no_reply_in_time_is_an_api_error(sock_path):
    from spliceway.cli.ipc_client import IpcClient
    from spliceway.errors import ApiError

    sock_path.parent.mkdir(mode=0o700, exist_ok=True)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind(str(sock_path))
    silent.listen()  # accepts (the backlog) and never answers
    try:
        with IpcClient(str(sock_path), timeout=0.2) as client, pytest.raises(ApiError) as failed:
            client.query("health")
        assert failed.value.code == "internal"
        assert "no reply in time" in failed.value.message
    finally:
        silent.close()
