"""After a kill -9, every started flow is completed, once (issue 26 point 7).

A real ``spliceway run`` with a webhook sink to a real receiver and two JSONL sinks on
one outbox: flows are held open through the SOCKS5 inbound, the engine is killed with
SIGKILL, and the next start must emit exactly one ``flow.completed`` with outcome
``engine_crashed`` per flow each sink was told had started, with the newest record that
sink had (bytes, route), and nothing for a flow whose real completion it had already
taken (tests/connector/test_openflows.py shows a second start adds none). The leftover
temporary files of an apply killed mid-way go at the next start (and before the next
apply) unless their process is alive.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

from tests.api.test_openapi import validate_component
from tests.conftest import wait_until
from tests.events.test_catalogue import check_event
from tests.helpers.proc import command_request
from tests.helpers.receiver import Receiver, Reply
from tests.helpers.servers import EchoServer
from tests.helpers.sinks import EngineProcess, jsonl, sink_config, webhook
from tests.helpers.socks import recv_exact, socks5_connect

FLOW_EVENTS = ["flow.started", "flow.routed", "flow.updated", "flow.completed"]
CRASHED = "engine_crashed"


def _events(rx: Receiver) -> list[dict[str, Any]]:
    return [json.loads(r.body) for r in rx.requests]


def _of(events: list[dict[str, Any]], kind: str, flow_id: str) -> list[dict[str, Any]]:
    return [e for e in events if e["event_type"] == kind and e["payload"]["flow_id"] == flow_id]


def _crashed(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """flow id -> its engine_crashed completions (de-duplicated by event_id)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for e in events:
        if e["event_type"] == "flow.completed" and e["payload"]["outcome"] == CRASHED:
            out.setdefault(e["payload"]["flow_id"], {})[e["event_id"]] = e
    return {k: list(v.values()) for k, v in out.items()}


def _lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _open_flow(engine: EngineProcess, echo: EchoServer) -> socket.socket:
    return socks5_connect(("127.0.0.1", engine.socks_port), "127.0.0.1", echo.port)


def _dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    child = subprocess.Popen(["true"])
    child.wait(10)
    return child.pid


def _command(engine: EngineProcess, method: str, params: dict[str, Any]) -> dict[str, Any]:
    request = command_request(engine.base_url, method, params)
    with urllib.request.urlopen(request, timeout=20) as answer:
        return json.loads(answer.read())


def _idle(engine: EngineProcess) -> bool:
    """Every sink took the whole ring and delivered it."""
    latest = engine.get("events")["latest_sequence"]
    return all(
        s["cursor_sequence"] >= latest and s["pending"] == 0 for s in engine.get("sinks")["sinks"]
    )


def test_kill9_then_restart_completes_every_orphaned_flow_once(tmp_path):
    outbox = tmp_path / "outbox"
    started_file = tmp_path / "started.jsonl"  # flow.started + flow.completed
    done_file = tmp_path / "done.jsonl"  # flow.completed alone: never told a flow started
    tunnels: list[socket.socket] = []
    engines: list[EngineProcess] = []
    with Receiver() as rx, EchoServer() as echo:
        cfg = sink_config(
            [
                webhook("hook", rx.url, FLOW_EVENTS),
                jsonl("file", started_file, ["flow.started", "flow.completed"]),
                jsonl("done", done_file, ["flow.completed"]),
            ],
            outbox,
            control=True,
            runtime={"stats_interval_ms": 100},
        )
        try:
            engine = EngineProcess(cfg, tmp_path, "engine").wait_started()
            engines.append(engine)
            # busy: moves 4096 bytes each way, then idles (its last flow.updated has them);
            # idle: relayed, never a byte.
            busy, idle = _open_flow(engine, echo), _open_flow(engine, echo)
            tunnels += [busy, idle]
            busy.sendall(b"x" * 4096)
            assert recv_exact(busy, 4096) == b"x" * 4096
            flows = engine.get("flows")["active_flows"]
            assert len(flows) == 2
            ids = {f["source"]["port"]: f["flow_id"] for f in flows}
            busy_id, idle_id = ids[busy.getsockname()[1]], ids[idle.getsockname()[1]]

            def last_update() -> dict[str, Any] | None:
                ups = _of(_events(rx), "flow.updated", busy_id)
                if ups and ups[-1]["payload"]["record"]["traffic"]["bytes_down"] == 4096:
                    return ups[-1]
                return None

            update = wait_until(last_update, 10, "busy's flow.updated with every byte")
            wait_until(lambda: _of(_events(rx), "flow.routed", idle_id), 10, "idle's flow.routed")
            # done: completed before the kill, its flow.completed accepted by every sink but
            # not delivered to the receiver (503): redelivered, never completed a second time.
            rx.default = Reply(503)
            with _open_flow(engine, echo) as done:
                done.sendall(b"y")
                recv_exact(done, 1)
                port = done.getsockname()[1]
                (done_id,) = [
                    f["flow_id"]
                    for f in engine.get("flows")["active_flows"]
                    if f["source"]["port"] == port
                ]
            wait_until(
                lambda: _of(_lines(started_file), "flow.completed", done_id),
                10,
                "done's flow.completed in the JSONL file",
            )
            wait_until(lambda: _idle_but_hook(engine), 10, "done's completion in every outbox")
            assert engine.sink("hook")["pending"] > 0
            engine.kill()

            rx.default = Reply(200)
            engine = EngineProcess(cfg, tmp_path, "engine").wait_started()
            engines.append(engine)

            wait_until(lambda: len(_crashed(_events(rx))) >= 2, 10, "two crash completions")
            wait_until(lambda: _idle(engine), 10, "every sink idle after the restart")
            crashed = _crashed(_events(rx))
            assert sorted(crashed) == sorted([busy_id, idle_id])
            assert all(len(v) == 1 for v in crashed.values()), crashed
            # done: its real completion arrived (redelivered), no crash completion.
            real = _of(_events(rx), "flow.completed", done_id)
            assert {e["payload"]["outcome"] for e in real} == {"direct_relayed"}

            (busy_done,) = crashed[busy_id]
            (idle_done,) = crashed[idle_id]
            for event in (busy_done, idle_done):
                assert check_event(event) == []
                validate_component("EventEnvelope", event)
                record = event["payload"]["record"]
                assert record["state"] == "completed"
                assert record["result"] == {
                    "outcome": CRASHED,
                    "failure": {
                        "stage": "internal",
                        "code": CRASHED,
                        "message": record["result"]["failure"]["message"],
                    },
                }
                # Everything but what completing changes is the newest record the sink had.
                newest = (
                    update if event is busy_done else _of(_events(rx), "flow.routed", idle_id)[-1]
                )["payload"]["record"]
                for key in ("inbound", "source", "target", "route", "path", "traffic"):
                    assert record[key] == newest[key], key
                assert record["path"]["outbound"] == {"tag": "direct", "protocol": "direct"}
                timing = record["timing"]
                assert timing["duration_ms"] == timing["ended_at_unix_ms"] - (
                    timing["started_at_unix_ms"]
                )
                assert event["occurred_at_unix_ms"] == timing["ended_at_unix_ms"]
                assert event["source_id"] == "node-1"
            # The bytes last reported, one revision after the newest record the sink had.
            before = update["payload"]["record"]
            after = busy_done["payload"]["record"]
            assert after["traffic"] == before["traffic"]
            assert after["traffic"]["bytes_up"] == after["traffic"]["bytes_down"] == 4096
            assert after["revision"] == before["revision"] + 1
            assert after["timing"]["ended_at_unix_ms"] >= update["occurred_at_unix_ms"]
            assert busy_done["payload"]["traffic"]["bytes_down"] == 4096
            routed = _of(_events(rx), "flow.routed", idle_id)[-1]["payload"]["record"]
            assert idle_done["payload"]["record"]["traffic"] == routed["traffic"]
            assert idle_done["payload"]["record"]["revision"] == routed["revision"] + 1

            # The same completions in the ring, right after engine.started.
            ring = engine.get("events")["events"]
            kinds = [(e["event_type"], e["payload"].get("outcome")) for e in ring[:3]]
            assert kinds == [("engine.started", None)] + [("flow.completed", CRASHED)] * 2
            # The JSONL sink that saw the starts got the same two, byte for byte as the ring's;
            # the one of flow.completed alone got none.
            in_file = _crashed(_lines(started_file))
            assert sorted(in_file) == sorted([busy_id, idle_id])
            assert all(len(v) == 1 for v in in_file.values())
            assert in_file[busy_id][0]["event_id"] == busy_done["event_id"]
            assert _crashed(_lines(done_file)) == {}
            # New flows do not take a recovered id.
            with _open_flow(engine, echo) as fresh:
                fresh.sendall(b"z")
                recv_exact(fresh, 1)
                (fresh_id,) = {f["flow_id"] for f in engine.get("flows")["active_flows"]}
            assert fresh_id not in {busy_id, idle_id, done_id}
            assert fresh_id.split("-")[0] != busy_id.split("-")[0]
        finally:
            for tunnel in tunnels:
                with contextlib.suppress(OSError):
                    tunnel.close()
            for e in engines:
                e.close()


def _idle_but_hook(engine: EngineProcess) -> bool:
    """Every sink took the whole ring (the hook's receiver is failing: it stays pending)."""
    latest = engine.get("events")["latest_sequence"]
    return all(s["cursor_sequence"] >= latest for s in engine.get("sinks")["sinks"])


def test_leftover_staged_files_of_dead_processes_are_removed(tmp_path):
    """A kill -9 during config.apply leaves ``.<file>.<pid>.tmp`` (and ``.prev``) beside
    the configuration: the next start removes those of dead processes, and so does the
    next apply; one of a live process (another engine applying) is kept."""
    cfg = sink_config([], control=True)
    config = tmp_path / "engine.json"
    pid = _dead_pid()
    dead = [
        config.parent / f".{config.name}.{pid}.tmp",
        config.parent / f".{config.name}.prev.{pid}.tmp",
    ]
    live = config.parent / f".{config.name}.{os.getpid()}.tmp"
    other = config.parent / f".other.json.{pid}.tmp"  # another file's: not ours to touch
    for leftover in [*dead, live, other]:
        leftover.write_text("{}")
    engine = EngineProcess(cfg, tmp_path, "engine")
    try:
        engine.wait_started()
        assert [p.exists() for p in dead] == [False, False]
        assert live.exists() and other.exists()
        # And before an apply (with the apply lock held): one left since the start.
        dead[0].write_text("{}")
        answer = _command(engine, "config.apply", {"config": cfg})
        assert answer["ok"] is True, answer
        assert not dead[0].exists()
        assert live.exists() and other.exists()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == sorted(
            [live.name, other.name]
        )
    finally:
        engine.close()
