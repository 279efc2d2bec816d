"""How an engine ends: engine.stopped closes every event stream; SIGHUP reloads, not ends, it."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from tests.api.conftest import control_config
from tests.api.sse_client import Stream
from tests.conftest import wait_until
from tests.helpers.flows import curl
from tests.helpers.program import environ_without, running, wait_for_line, write_config


def drain(stream: Stream) -> list[dict[str, Any]]:
    """Every envelope the stream still sends, until the server ends it."""
    return [orjson.loads(event.data) for event in stream.events()]


def test_engine_stopped_is_the_last_frame_of_every_stream(
    make_engine: Callable[..., Any], origin: tuple[str, int]
) -> None:
    engine = make_engine(control_config())
    filters: list[dict[str, str] | None] = [
        None,
        {"types": "flow.completed"},
        {"types": "stats.sampled,flow.started"},
        {"types": "engine.stopped"},
    ]
    streams = [Stream(engine.control_url, params) for params in filters]
    try:
        host, port = engine.listen_address("socks-in")
        fetched = curl("--socks5-hostname", f"{host}:{port}", f"http://127.0.0.1:{origin[1]}/")
        assert fetched.returncode == 0, fetched.stderr
        engine.stop(reason="signal")
        received = [drain(stream) for stream in streams]
    finally:
        for stream in streams:
            stream.close()
    for params, envelopes in zip(filters, received, strict=True):
        types = [e["event_type"] for e in envelopes]
        assert types, params
        assert types[-1] == "engine.stopped", (params, types)
        assert types.count("engine.stopped") == 1, (params, types)
        assert envelopes[-1]["payload"]["reason"] == "signal"
    unfiltered = [e["event_type"] for e in received[0]]
    assert "flow.completed" in unfiltered
    # A filtered stream gets its types (and the flow.snapshot baseline they imply),
    # then the one final frame.
    assert received[1][0]["event_type"] == "flow.snapshot"
    assert {e["event_type"] for e in received[1][1:-1]} == {"flow.completed"}
    assert [e["event_type"] for e in received[1]].count("flow.completed") == 1
    # Its sequence is the real one, so the frame is the same event every stream saw.
    assert len({stream_events[-1]["event_id"] for stream_events in received}) == 1


def test_sighup_reloads_the_file_and_sigterm_still_stops_cleanly(tmp_path, origin) -> None:
    doc = control_config()
    config = write_config(tmp_path, doc)
    with running(config, environ_without("SPLICEWAY_API_KEY")) as proc:
        socks = wait_for_line(proc, r"inbound socks-in \(socks5\) listening on (\S+)").group(1)
        base = wait_for_line(proc, r"control API listening on (http://\S+)/api/v1/").group(1)
        with Stream(base, {"types": "config.changed,engine.stopped"}) as stream:
            # The file now blocks the origin's address: after SIGHUP, new flows obey it.
            block = {"ip_cidr": ["127.0.0.1/32"], "port": [str(origin[1])], "action": "block"}
            doc["rules"] = [block]
            Path(config).write_text(json.dumps(doc))
            proc.send_signal(signal.SIGHUP)
            event, changed = stream.next_envelope()
            assert event.event == "config.changed"
            assert changed["payload"]["trigger"] == "sighup"
            assert changed["payload"]["persistence"] == "source_file"
            assert changed["payload"]["changed_components"] == ["routing"]
            wait_for_line(proc, r"INFO spliceway: reloaded \S+ \(changed: routing\)")
            refused = curl("--socks5-hostname", socks, f"http://127.0.0.1:{origin[1]}/")
            assert refused.returncode == 97, refused.stderr  # the SOCKS5 request was refused
            proc.send_signal(signal.SIGTERM)
            rest = drain(stream)
            assert [e["event_type"] for e in rest] == ["engine.stopped"]
            assert rest[0]["payload"]["reason"] == "signal"
        assert proc.wait(20) == 0


def test_every_engine_thread_leaves_the_control_signals_to_the_main_thread(tmp_path):
    """SIGINT/SIGTERM/SIGHUP are blocked in every thread and taken by sigwait() in the
    main one: a process-directed signal can then never land on a worker thread, where
    it would not wake a main thread blocked on a lock (the engine hung until SIGKILL)."""
    config = write_config(tmp_path, control_config())
    with running(config, environ_without("SPLICEWAY_API_KEY")) as proc:
        wait_for_line(proc, r"control API listening on")
        wanted = (
            (1 << (signal.SIGHUP - 1)) | (1 << (signal.SIGINT - 1)) | (1 << (signal.SIGTERM - 1))
        )
        # The main thread is the one waiting for them (sigwait unblocks what it waits for
        # while it sleeps, so its own mask reads 0 then).
        wait_until(
            lambda: "sigtimedwait" in Path(f"/proc/{proc.pid}/wchan").read_text(),
            what="the main thread in sigwait()",
        )
        tasks = [t for t in os.listdir(f"/proc/{proc.pid}/task") if t != str(proc.pid)]
        assert len(tasks) > 5  # dispatcher, relay loops, Waitress workers, actors...
        for tid in tasks:
            with open(f"/proc/{proc.pid}/task/{tid}/status") as status:
                blocked = next(line for line in status if line.startswith("SigBlk:"))
            assert int(blocked.split()[1], 16) & wanted == wanted, (tid, blocked)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0


def test_commands_on_a_connection_open_while_the_engine_stops_are_conflicts(make_engine):
    """The control API outlives the core's stop (its streams must still get
    engine.stopped), so a keep-alive connection opened before can still send commands:
    each is 409 conflict, never a 500 from a dead actor or a closed event loop."""
    import http.client

    engine = make_engine(control_config())
    host, port = engine.control_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/api/v1/health")
    assert conn.getresponse().read()
    engine.core.stop()  # the core alone: the control server is still up
    try:
        for method, params in [
            ("mode.set", {"mode": "direct"}),
            ("diagnostics.probe_target", {"target_tag": "direct"}),
            ("diagnostics.probe_outbound", {"target_tag": "direct"}),
            ("flows.close", {"flow_id": "gone"}),
        ]:
            body = json.dumps({"method": method, "params": params})
            conn.request("POST", "/api/v1/commands", body, {"Content-Type": "application/json"})
            answer = conn.getresponse()
            envelope = json.loads(answer.read())
            assert (answer.status, envelope["error"]["code"]) == (409, "conflict"), envelope
    finally:
        conn.close()
