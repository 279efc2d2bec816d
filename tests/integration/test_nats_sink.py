"""The NATS JetStream sink against a real ``nats-server -js``: every event type is stored
once with ``Nats-Msg-Id`` = its event_id and the ring's bytes; a server stopped and
restarted mid-stream, an engine killed with SIGKILL, and an outbox delivered twice all
leave the stream holding every event exactly once; a missing stream and bad credentials
are clear errors that lose nothing."""

from __future__ import annotations

import json
import random
import shutil
import threading
import time
from functools import partial

import pytest

from spliceway import ApiError, Engine
from tests.conftest import wait_until
from tests.helpers.nats import NatsServer, Stored, add_stream, needs_nats_server, stream_messages
from tests.helpers.servers import EchoServer
from tests.helpers.sinks import (
    EMITTED,
    SOURCE_ID,
    EngineProcess,
    every_event_groups,
    expected_body,
    flows,
    ring_events,
    sink_config,
    status_of,
)
from tests.helpers.socks import socks5_connect

pytestmark = needs_nats_server

SUBJECT = "spliceway.events"
STREAM = "SPLICEWAY"


def nats_sink(server: NatsServer, tag: str = "fleet", **extra: object) -> dict:
    """A nats registration publishing to SUBJECT on ``server``."""
    return {
        "type": "nats",
        "tag": tag,
        "servers": [server.url],
        "subject": SUBJECT,
        "source_id": SOURCE_ID,
        **extra,
    }


def assert_exactly_once(stored: list[Stored], expected: dict[str, bytes]) -> None:
    """The stream holds each expected event once, as its expected bytes, keyed by its
    Nats-Msg-Id, and nothing twice."""
    ids = [m.msg_id for m in stored]
    duplicated = {i for i in ids if ids.count(i) > 1}
    assert not duplicated, f"stored more than once: {sorted(duplicated)[:10]}"
    by_id = {m.msg_id: m.data for m in stored}
    missing = sorted(set(expected) - set(by_id))
    assert not missing, f"{len(missing)} of {len(expected)} events not stored: {missing[:10]}"
    for event_id, body in expected.items():
        assert by_id[event_id] == body, f"{event_id}: {by_id[event_id][:200]!r}"
        assert json.loads(body)["event_id"] == event_id


@pytest.fixture
def server(tmp_path):
    with NatsServer(tmp_path / "nats") as srv:
        add_stream(srv.url, STREAM, [SUBJECT])
        yield srv


def test_every_event_type_is_stored_once_with_its_id(make_engine, origin, server, tmp_path):
    """Each event type the build emits is published once, in order, with Nats-Msg-Id =
    event_id and the ring's envelope (source_id filled in) as the message."""
    with EchoServer() as echo:
        cfg = sink_config(
            [nats_sink(server)], tmp_path / "outbox", runtime={"stats_interval_ms": 100}
        )
        cfg["outbound_groups"] = every_event_groups(origin)
        engine = make_engine(cfg)
        flows(engine, origin, 2)
        engine.execute("policies.select", {"policy_tag": "pick", "target_tag": "block"})
        with socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port) as s:
            s.sendall(b"ping")
            assert s.recv(4) == b"ping"
            wait_until(
                lambda: (
                    EMITTED - {"engine.stopped"}
                    <= {e["event_type"] for e in engine.query("events")["events"]}
                ),
                10,
                "every event type but engine.stopped",
            )
        ring = engine.query("events")
        engine.stop()
    stored = stream_messages(server.url, STREAM)
    expected = {e["event_id"]: expected_body(e) for e in ring_events(ring)}
    assert_exactly_once(stored, expected)
    envelopes = [json.loads(m.data) for m in stored]
    assert {e["event_type"] for e in envelopes} == EMITTED
    assert envelopes[-1]["event_type"] == "engine.stopped"
    sequences = [e["sequence"] for e in envelopes]
    assert sequences == list(range(1, len(sequences) + 1)), "in order, none skipped"


def test_server_stopped_and_restarted_mid_stream(make_engine, origin, server, tmp_path):
    """Events made while the server is down wait in the outbox (pending, last_error set);
    once it is back they are stored, each once, after those stored before."""
    cfg = sink_config(
        [nats_sink(server, events=["flow.completed"])],
        tmp_path / "outbox",
        dispatcher={"request_timeout_ms": 1000, "backoff_max_ms": 200},
    )
    engine = make_engine(cfg)
    flows(engine, origin, 3)
    wait_until(lambda: len(stream_messages(server.url, STREAM)) == 3, 10, "3 stored")
    server.stop()
    flows(engine, origin, 4)
    down = wait_until(
        lambda: (
            (s := status_of(engine.query("sinks"), "fleet"))["last_error"]
            and s["pending"] == 4
            and s
        ),
        10,
        "the 4 events pending after a delivery failure while the server is down",
    )
    assert "connect" in down["last_error"], down["last_error"]
    server.start()
    wait_until(
        lambda: status_of(engine.query("sinks"), "fleet")["pending"] == 0, 20, "backlog delivered"
    )
    flows(engine, origin, 2)
    ring = wait_until(
        lambda: (
            (r := engine.query("events"))
            and sum(e["event_type"] == "flow.completed" for e in r["events"]) == 9
            and r
        ),
        10,
        "9 flows completed",
    )
    expected = {e["event_id"]: expected_body(e) for e in ring_events(ring, ["flow.completed"])}
    wait_until(lambda: len(stream_messages(server.url, STREAM)) >= 9, 10, "9 stored")
    item = status_of(engine.query("sinks"), "fleet")
    assert item["last_error"] is None and item["total_failed"] >= 1
    assert_exactly_once(stream_messages(server.url, STREAM), expected)


def test_sigkill_and_restart_store_every_event_once(tmp_path, origin, server):
    """An engine publishing under load is killed with SIGKILL at a random moment, twice;
    a third run delivers what the outbox still owes. Events a dead run had published but
    not yet durably acknowledged are published again, and JetStream's duplicate window
    keeps one copy: the stream holds every accepted event exactly once."""
    seed = random.randrange(1 << 32)
    rng = random.Random(seed)
    outbox = tmp_path / "outbox"
    cfg = sink_config([nats_sink(server)], outbox, control=True)
    accepted: dict[str, bytes] = {}
    for run in range(2):
        engine = EngineProcess(cfg, tmp_path, f"run{run}")
        stop = threading.Event()
        traffic = threading.Thread(
            target=_traffic, args=(engine, origin, stop), name="traffic", daemon=True
        )
        try:
            engine.wait_started()
            traffic.start()
            time.sleep(rng.uniform(0.2, 0.8))  # the kill's random moment, not a wait
            ring = engine.get("events")
            engine.kill()
            accepted.update({e["event_id"]: expected_body(e) for e in ring_events(ring)})
        finally:
            stop.set()
            traffic.join(20)
            engine.close()
    final = EngineProcess(cfg, tmp_path, "final")
    try:
        final.wait_started()
        wait_until(lambda: final.sink("fleet")["pending"] == 0, 20, f"backlog (seed {seed})")
        ring = final.get("events")
        assert final.stop() == 0
    finally:
        final.close()
    accepted.update({e["event_id"]: expected_body(e) for e in ring_events(ring)})
    stored = stream_messages(server.url, STREAM)
    assert_exactly_once([m for m in stored if m.msg_id in accepted], accepted)
    ids = [m.msg_id for m in stored]
    assert len(ids) == len(set(ids)), f"a duplicate stored (seed {seed})"


def _traffic(engine: EngineProcess, origin: tuple[str, int], stop: threading.Event) -> None:
    """Flows through the engine until ``stop`` or 10 s, tolerating its death."""
    deadline = time.monotonic() + 10
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            with socks5_connect(("127.0.0.1", engine.socks_port), *origin) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                while s.recv(65536):
                    pass
        except OSError:
            return


def test_an_outbox_delivered_twice_is_stored_once(tmp_path, origin, server):
    """The same outbox (a copy taken before delivery) delivered by two runs: the second
    run's every publish is answered as a duplicate, and the stream keeps one copy each."""
    outbox = tmp_path / "outbox"
    server.stop()
    cfg = sink_config(
        [nats_sink(server, events=["flow.completed"])],
        outbox,
        control=True,
        dispatcher={"request_timeout_ms": 500, "backoff_max_ms": 100},
    )
    first = EngineProcess(cfg, tmp_path, "offline")
    try:
        first.wait_started()
        for _ in range(5):
            with socks5_connect(("127.0.0.1", first.socks_port), *origin) as s:
                s.sendall(b"GET / HTTP/1.0\r\n\r\n")
                while s.recv(65536):
                    pass
        wait_until(lambda: first.sink("fleet")["pending"] == 5, 10, "5 events owed")
        ring = first.get("events")
        assert first.stop() == 0
    finally:
        first.close()
    copy = tmp_path / "outbox-copy"
    shutil.copytree(outbox, copy)
    server.start()
    expected = {e["event_id"]: expected_body(e) for e in ring_events(ring, ["flow.completed"])}
    for run, directory in (("deliver", outbox), ("again", copy)):
        engine = EngineProcess(
            {**cfg, "api": {**cfg["api"], "outbox_path": str(directory)}}, tmp_path, run
        )
        try:
            engine.wait_started()
            item = wait_until(
                lambda e=engine: (s := e.sink("fleet"))["pending"] == 0 and s, 20, run
            )
            assert item["total_delivered"] == 5
            assert engine.stop() == 0
        finally:
            engine.close()
        assert_exactly_once(stream_messages(server.url, STREAM), expected)
    assert len(stream_messages(server.url, STREAM)) == 5


def test_a_missing_stream_is_a_clear_error_and_loses_nothing(make_engine, origin, tmp_path):
    """With no stream capturing the subject, every attempt fails with last_error naming
    the subject and the events stay pending; once the stream exists they are stored."""
    with NatsServer(tmp_path / "nats") as server:
        cfg = sink_config(
            [nats_sink(server, events=["flow.completed"])],
            tmp_path / "outbox",
            dispatcher={"backoff_max_ms": 100},
        )
        engine = make_engine(cfg)
        flows(engine, origin, 2)
        item = wait_until(
            lambda: (
                (s := status_of(engine.query("sinks"), "fleet"))["last_error"]
                and s["pending"] == 2
                and s
            ),
            10,
            "both events failing for the missing stream",
        )
        assert f"no JetStream stream captures subject '{SUBJECT}'" in item["last_error"]
        assert item["total_delivered"] == 0
        add_stream(server.url, STREAM, [SUBJECT])
        wait_until(
            lambda: status_of(engine.query("sinks"), "fleet")["pending"] == 0, 10, "delivered"
        )
        ring = engine.query("events")
        expected = {e["event_id"]: expected_body(e) for e in ring_events(ring, ["flow.completed"])}
        assert_exactly_once(stream_messages(server.url, STREAM), expected)
        assert status_of(engine.query("sinks"), "fleet")["last_error"] is None


def test_credentials_from_the_environment(make_engine, origin, tmp_path, monkeypatch):
    """A server with a user and password: the right credentials_env value delivers, a
    wrong one is an authorization error in last_error, an unset one a start error."""
    with NatsServer(tmp_path / "nats", user="engine", password="s3cret") as server:
        add_stream(server.url, STREAM, [SUBJECT], user="engine", password="s3cret")
        sink = nats_sink(server, events=["flow.completed"], credentials_env="SW_TEST_NATS")
        cfg = sink_config([sink], dispatcher={"backoff_max_ms": 100})
        monkeypatch.delenv("SW_TEST_NATS", raising=False)
        with pytest.raises(ApiError) as unset:
            Engine(cfg).start()
        assert unset.value.field_path == "api.event_sinks[0].credentials_env"
        assert "SW_TEST_NATS" in unset.value.message

        monkeypatch.setenv("SW_TEST_NATS", "engine:wrong")
        engine = make_engine(cfg)
        flows(engine, origin, 1)
        item = wait_until(
            lambda: (s := status_of(engine.query("sinks"), "fleet"))["last_error"] and s,
            10,
            "an authorization failure",
        )
        assert "authorization" in item["last_error"].lower(), item["last_error"]
        engine.stop()

        monkeypatch.setenv("SW_TEST_NATS", "engine:s3cret")
        engine = make_engine(cfg)
        flows(engine, origin, 1)
        wait_until(
            partial(lambda e: status_of(e.query("sinks"), "fleet")["total_delivered"] == 1, engine),
            10,
            "delivered with the right credentials",
        )
        stored = stream_messages(server.url, STREAM, user="engine", password="s3cret")
        assert len(stored) == 1
