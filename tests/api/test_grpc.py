"""The gRPC control API (docs/grpc.md), driven by grpcio's own client and the checked-in
stubs, against real engines on loopback."""

from __future__ import annotations

import json
import logging
import random
import socket
import textwrap
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from spliceway import Engine
from spliceway.api import grpc_service
from spliceway.api.grpc_gen import control_pb2, control_pb2_grpc
from spliceway.api.grpc_service import struct_to_dict
from spliceway.errors import HTTP_STATUS, ApiError
from tests.conftest import base_config, wait_until
from tests.events.test_catalogue import check_event
from tests.helpers.program import python_json
from tests.helpers.servers import EchoServer
from tests.helpers.socks import socks5_connect

ADMIN_ENV, READ_ENV = "SPLICEWAY_TEST_GRPC_ADMIN", "SPLICEWAY_TEST_GRPC_READ"
ADMIN, READER = "grpc-admin-key", "grpc-read-key"


def grpc_config(**overrides: Any) -> dict[str, Any]:
    """Control API (admin key and a read-only scoped key) and gRPC on free ports, a
    selector policy to select through."""
    cfg = base_config(
        outbound_groups=[{"tag": "proxy", "kind": "selector", "outbounds": ["direct", "block"]}],
        **overrides,
    )
    cfg["api"]["control"] = {
        "enabled": True,
        "listen": {"address": "127.0.0.1", "port": 0},
        "api_key_env": ADMIN_ENV,
        "keys": [{"name": "dash", "key_env": READ_ENV, "permissions": ["read"]}],
    }
    cfg["api"]["grpc"] = {"enabled": True}
    return cfg


@pytest.fixture(autouse=True)
def _keys(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_ENV, ADMIN)
    monkeypatch.setenv(READ_ENV, READER)


def auth(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


ADMIN_MD = auth(ADMIN)


class Client:
    """A channel to an engine's gRPC API and the Control stub on it."""

    def __init__(self, engine: Engine) -> None:
        assert engine._transports.grpc is not None
        self.channel = grpc.insecure_channel(engine._transports.grpc.target)
        self.stub = control_pb2_grpc.ControlStub(self.channel)

    def query(self, name: str, params: dict[str, Any] | None = None, key: str = ADMIN) -> Any:
        request = control_pb2.QueryRequest(id=f"q-{name}", name=name, params=params or {})
        return self.stub.Query(request, metadata=auth(key), timeout=10)

    def execute(self, method: str, params: dict[str, Any] | None, key: str = ADMIN) -> Any:
        request = control_pb2.CommandRequest(id="c-1", method=method, params=params)
        return self.stub.Execute(request, metadata=auth(key), timeout=10)

    def subscribe(self, events: list[str], key: str = ADMIN, **fields: Any) -> Any:
        request = control_pb2.SubscribeRequest(events=events, **fields)
        return self.stub.Subscribe(request, metadata=auth(key), timeout=30)

    def close(self) -> None:
        self.channel.close()


@pytest.fixture
def engine(make_engine: Callable[..., Any]) -> Engine:
    return make_engine(grpc_config())


@pytest.fixture
def client(engine: Engine) -> Iterator[Client]:
    c = Client(engine)
    yield c
    c.close()


def refusal(call: Callable[[], Any]) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """The status, details and trailing metadata of a call that must fail."""
    with pytest.raises(grpc.RpcError) as failed:
        call()
    error: Any = failed.value
    return error.code(), error.details(), dict(error.trailing_metadata() or ())


def envelope_of(event: control_pb2.Event) -> dict[str, Any]:
    """An Event as the JSON envelope SSE and IPC carry."""
    return {
        "schema_id": event.schema_id,
        "event_id": event.event_id,
        "event_type": event.event_type,
        "occurred_at_unix_ms": event.occurred_at_unix_ms,
        "source_id": event.source_id if event.HasField("source_id") else None,
        "sequence": event.sequence,
        "principal_key": event.principal_key if event.HasField("principal_key") else None,
        "labels": dict(event.labels),
        "payload": struct_to_dict(event.payload),
    }


# -- queries and commands --------------------------------------------------------------


def test_queries_answer_the_http_apis_results_in_the_envelope(engine, client):
    assert engine._transports.grpc.address[1] != 0
    health = client.query("health")
    assert (health.api_id, health.id, health.ok) == ("service.api.v1", "q-health", True)
    assert not health.HasField("error")
    assert struct_to_dict(health.result) == engine.query("health")
    # An integral Struct number is an int to the query table (strict: 5.0 is no limit).
    flows = client.query("flows", {"limit": 5})
    assert flows.ok and struct_to_dict(flows.result) == {"active_flows": []}
    policy = struct_to_dict(client.query("policy", {"policy_tag": "proxy"}).result)
    assert policy["tag"] == "proxy" and policy["selected"] == "direct"
    missing = client.query("policy", {"policy_tag": "nope"})
    assert (missing.ok, missing.error.code) == (False, "not_found")
    assert not missing.HasField("result")
    unknown = client.query("no_such_query")
    assert (unknown.error.code, unknown.error.field_path) == ("invalid_argument", "name")
    undeclared = client.query("stats", {"pad": 1})
    assert (undeclared.error.code, undeclared.error.field_path) == ("invalid_argument", "pad")


def test_execute_runs_the_command_table_with_http_semantics(engine, client):
    selected = client.execute("policies.select", {"policy_tag": "proxy", "target_tag": "block"})
    assert (selected.ok, selected.id) == (True, "c-1")
    assert struct_to_dict(selected.result) == {"policy_tag": "proxy", "selected": "block"}
    assert engine.query("policy", {"policy_tag": "proxy"})["selected"] == "block"
    trace = client.execute("diagnostics.trace_route", {"target": "127.0.0.1", "port": 443})
    assert trace.ok and struct_to_dict(trace.result)["port"] == 443
    # Errors of the request itself: an envelope with ok false, and status OK.
    bad = client.execute("policies.select", {"policy_tag": "proxy", "target_tag": "nope"})
    assert (bad.ok, bad.error.code) == (False, "invalid_argument")
    assert client.execute("flows.close", {"flow_id": "nope"}).error.code == "not_found"
    unknown = client.execute("no.such", {})
    assert (unknown.error.code, unknown.error.field_path) == ("invalid_argument", "method")
    unset = client.execute("tun.stop", None)  # params left unset, as null over HTTP
    assert (unset.error.code, unset.error.field_path) == ("invalid_argument", "params")
    validation = client.execute("config.validate", {"config": {"inbounds": "x"}})
    assert validation.error.code == "invalid_argument" and validation.error.details
    assert all(d.message for d in validation.error.details)


def test_keys_and_permissions_are_the_http_apis(engine, client):
    request = control_pb2.QueryRequest(name="health")
    for metadata in ((), auth("wrong-key"), (("authorization", "Basic x"),)):
        code, details, trailing = refusal(lambda m=metadata: client.stub.Query(request, metadata=m))
        assert code == grpc.StatusCode.UNAUTHENTICATED, details
        assert trailing["spliceway-error-code"] == "unauthenticated"
    # The other header the HTTP API takes works too.
    other = client.stub.Query(request, metadata=(("x-service-api-key", READER),))
    assert other.ok
    # The read-only scoped key: queries yes, a control command no.
    caps = struct_to_dict(client.query("capabilities", key=READER).result)
    assert caps["permissions"] == ["read"]
    select = {"policy_tag": "proxy", "target_tag": "block"}
    code, details, trailing = refusal(lambda: client.execute("policies.select", select, READER))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "control" in details
    assert trailing["spliceway-error-code"] == "permission_denied"
    assert engine.query("policy", {"policy_tag": "proxy"})["selected"] == "direct"
    code, _, _ = refusal(lambda: next(iter(client.subscribe([], key="wrong-key"))))
    assert code == grpc.StatusCode.UNAUTHENTICATED


def test_execute_and_subscribe_without_a_key_are_unauthenticated(engine, client):
    select = control_pb2.CommandRequest(
        method="policies.select", params={"policy_tag": "proxy", "target_tag": "block"}
    )
    code, _, trailing = refusal(lambda: client.stub.Execute(select, timeout=10))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert trailing["spliceway-error-code"] == "unauthenticated"
    assert engine.query("policy", {"policy_tag": "proxy"})["selected"] == "direct"
    stream = client.stub.Subscribe(control_pb2.SubscribeRequest(events=[]), timeout=10)
    code, _, trailing = refusal(lambda: next(iter(stream)))
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert trailing["spliceway-error-code"] == "unauthenticated"


def test_an_engine_without_a_key_takes_calls_without_one(make_engine):
    cfg = grpc_config()
    cfg["api"]["control"]["api_key_env"] = None
    del cfg["api"]["control"]["keys"]
    engine = make_engine(cfg)
    client = Client(engine)
    try:
        select = control_pb2.CommandRequest(
            method="policies.select", params={"policy_tag": "proxy", "target_tag": "block"}
        )
        done = client.stub.Execute(select, timeout=10)
        assert done.ok and struct_to_dict(done.result)["selected"] == "block"
        stream = client.stub.Subscribe(
            control_pb2.SubscribeRequest(events=["flow.started"]), timeout=10
        )
        assert next(iter(stream)).event_type == "flow.snapshot"
        stream.cancel()
        caps = client.stub.Query(control_pb2.QueryRequest(name="capabilities"), timeout=10)
        assert sorted(struct_to_dict(caps.result)["permissions"]) == [
            "admin",
            "config",
            "control",
            "read",
        ]
    finally:
        client.close()


def test_config_apply_over_execute_persists_and_refuses_an_api_control_change(tmp_path):
    doc = grpc_config()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with Engine.from_file(path) as engine:
        client = Client(engine)
        try:
            doc["inbounds"].append({"tag": "extra", "protocol": "socks5", "listen": {"port": 0}})
            applied = client.execute("config.apply", {"config": doc})
            assert applied.ok, applied.error
            result = struct_to_dict(applied.result)
            assert (result["applied"], result["reconciled"]) == (True, True)
            assert result["persistence"] == "source_file"
            assert "proxy_listeners" in result["application_components"]
            assert result["changed_components"] == ["proxy_listeners"]
            assert json.loads(path.read_text()) == doc
            before = path.read_bytes()
            moved = json.loads(before)
            moved["api"]["control"]["listen"]["port"] = 1
            refused = client.execute("config.apply", {"config": moved})
            assert (refused.ok, refused.error.code) == (False, "conflict")
            assert refused.error.field_path == "config.api.control"
            assert path.read_bytes() == before
        finally:
            client.close()


def test_every_error_code_has_a_grpc_status():
    assert set(grpc_service.STATUS_FOR_CODE) == set(HTTP_STATUS)
    assert set(HTTP_STATUS) >= grpc_service.REFUSALS


def test_command_rate_limit_is_a_resource_exhausted_status_with_retry_after(client):
    for _ in range(10):  # the burst: 10 commands per second per engine
        assert client.execute("flows.close", {"flow_id": "nope"}).error.code == "not_found"
    code, _, trailing = refusal(lambda: client.execute("flows.close", {"flow_id": "nope"}))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailing["spliceway-error-code"] == "rate_limited"
    assert int(trailing["retry-after"]) >= 1


def test_capabilities_list_the_grpc_feature_contract_and_adapter(make_engine, engine, client):
    caps = struct_to_dict(client.query("capabilities").result)
    assert "grpc" in caps["features"] and "grpc-api" in caps["build_features"]
    contracts = {c["name"]: c for c in caps["contracts"]}
    assert contracts["grpc"]["id"] == "spliceway.grpc.v1"
    assert {"kind": "grpc", "enabled": True} in caps["adapters"]
    assert all(x["code"] != "grpc_not_built" for x in caps["global_limitations"])
    # Built but not enabled: the feature is listed, the adapter is off.
    caps = make_engine(base_config()).query("capabilities")
    assert "grpc" in caps["features"] and {"kind": "grpc", "enabled": False} in caps["adapters"]


def test_reflection_lists_and_describes_the_service(client):
    stub = reflection_pb2_grpc.ServerReflectionStub(client.channel)
    asks = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="spliceway.v1.Control"),
    ]
    listed, described = list(stub.ServerReflectionInfo(iter(asks), timeout=10))
    names = {s.name for s in listed.list_services_response.service}
    assert {"spliceway.v1.Control", "grpc.reflection.v1alpha.ServerReflection"} <= names
    files = described.file_descriptor_response.file_descriptor_proto
    proto = descriptor_pb2.FileDescriptorProto.FromString(files[0])
    assert proto.name == "spliceway/v1/control.proto"
    (service,) = proto.service
    assert [m.name for m in service.method] == ["Execute", "Query", "Subscribe"]


# -- Subscribe -------------------------------------------------------------------------


def test_subscribe_snapshot_then_live_events_then_engine_stopped(make_engine):
    engine = make_engine(grpc_config())
    client = Client(engine)
    try:
        types = ["flow.started", "flow.completed", "policy.selected"]
        call = client.subscribe(types)
        assert dict(call.initial_metadata())["spliceway-subscribed"] == ",".join(sorted(types))
        events = iter(call)
        snapshot = envelope_of(next(events))
        assert snapshot["event_type"] == "flow.snapshot" and snapshot["payload"]["records"] == []
        assert check_event(snapshot) == []
        with EchoServer() as echo:  # a real flow through the SOCKS inbound
            sock = socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port)
            sock.sendall(b"ping")
            assert sock.recv(4) == b"ping"
            sock.close()
            started, completed = envelope_of(next(events)), envelope_of(next(events))
        assert (started["event_type"], completed["event_type"]) == (
            "flow.started",
            "flow.completed",
        )
        record = completed["payload"]["record"]
        assert record["target"]["port"] == echo.port and record["traffic"]["bytes_up"] == 4
        assert check_event(started) == [] and check_event(completed) == []
        client.execute("policies.select", {"policy_tag": "proxy", "target_tag": "block"})
        selected = envelope_of(next(events))
        assert selected["event_type"] == "policy.selected" and check_event(selected) == []
        engine.stop()
        # engine.stopped ends the stream whatever its filter, then the call ends OK.
        rest = [e.event_type for e in events]
        assert rest == ["engine.stopped"]
        assert call.code() == grpc.StatusCode.OK
    finally:
        client.close()


def test_subscribe_resumes_from_the_ring_with_since(engine, client):
    engine.execute("mode.set", {"mode": "direct"})
    latest = engine.query("events", {"types": "config.changed"})["latest_sequence"]
    client.execute("policies.select", {"policy_tag": "proxy", "target_tag": "block"})
    call = client.subscribe(["policy.selected"], since=latest)
    event = next(iter(call))
    assert event.event_type == "policy.selected" and event.sequence == latest + 1
    call.cancel()
    bad = client.subscribe(["no.such"])
    code, details, trailing = refusal(lambda: next(iter(bad)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "no.such" in details
    assert trailing["spliceway-error-code"] == "invalid_argument"


def test_streams_share_the_engines_slots_and_a_cancel_gives_the_slot_back(engine, client):
    slots = engine._transports.grpc._service._state.sse_slots
    calls = [client.subscribe(["policy.selected"]) for _ in range(slots.capacity)]
    for call in calls:
        call.initial_metadata()  # each subscribed
    assert slots.used == slots.capacity
    code, details, trailing = refusal(lambda: next(iter(client.subscribe([]))))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "SSE and gRPC" in details
    assert trailing["spliceway-error-code"] == "rate_limited"
    for call in calls:
        call.cancel()
    wait_until(lambda: slots.used == 0, what="every cancelled stream's slot back")
    assert not engine._transports.grpc._service._streams


def test_a_subscriber_that_does_not_read_never_blocks_the_engine(make_engine):
    # A small ring: a stream may fall 2 * 64 events behind before it is ended.
    engine = make_engine(grpc_config(runtime={"event_ring_capacity": 64}))
    client = Client(engine)
    try:
        call = client.subscribe(["engine.warning"])
        call.initial_metadata()
        started = time.monotonic()
        for _ in range(3000):  # nobody reads: each emit still returns at once
            engine.core.log.emit("engine.warning", {"code": "test", "message": "x" * 4000})
        assert time.monotonic() - started < 5.0
        assert engine.query("health")["healthy"] is True
        received: list[Any] = []
        code, details, _ = refusal(lambda: received.extend(call))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "since" in details and len(received) < 3000
        slots = engine._transports.grpc._service._state.sse_slots
        wait_until(lambda: slots.used == 0, what="the overflowed stream's slot back")
    finally:
        client.close()


# -- configuration and build -----------------------------------------------------------


def test_grpc_without_the_control_api_is_a_start_error():
    cfg = grpc_config()
    cfg["api"]["control"]["enabled"] = False
    with pytest.raises(ApiError) as refused:
        Engine(cfg).start()
    error = refused.value
    assert (error.code, error.field_path) == ("invalid_argument", "api.grpc.enabled")


def _hold_next_port(other: grpc.Server) -> int:
    """A free control port P whose P + 1 ``other`` now listens on. Both lie below the
    kernel's ephemeral range, so the engine's own port-0 binds cannot take P meanwhile."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for control_port in random.sample(range(low - 4000, low - 2), 50):
        try:
            probe = socket.create_server(("127.0.0.1", control_port))
        except OSError:
            continue
        probe.close()
        try:
            if other.add_insecure_port(f"127.0.0.1:{control_port + 1}") == control_port + 1:
                return control_port
        except RuntimeError:  # taken
            continue
    raise AssertionError("no free port pair")


def test_a_taken_grpc_port_is_a_conflict_and_nothing_stays_listening():
    # The holder is a grpc server with grpc's default SO_REUSEPORT: ours must not share it.
    other = grpc.server(ThreadPoolExecutor(max_workers=1))
    control_port = _hold_next_port(other)
    other.start()
    try:
        cfg = grpc_config()
        cfg["api"]["control"]["listen"]["port"] = control_port
        with pytest.raises(ApiError) as refused:
            Engine(cfg).start()
        assert refused.value.code == "conflict"
        assert str(control_port + 1) in refused.value.message
        socket.create_server(("127.0.0.1", control_port)).close()  # the HTTP API let go
    finally:
        other.stop(None).wait(5)


def test_grpc_enabled_without_the_extra_is_feature_disabled():
    # A child where grpc cannot be imported, as when the extra is not installed.
    script = textwrap.dedent(
        """
        import json, os, sys
        sys.modules["grpc"] = None
        from spliceway import Engine, ApiError
        from tests.conftest import base_config
        os.environ["K"] = "k"
        cfg = base_config()
        cfg["api"]["control"] = {"enabled": True, "listen": {"port": 0}, "api_key_env": "K"}
        cfg["api"]["grpc"] = {"enabled": True}
        try:
            Engine(cfg).start()
            refused = None
        except ApiError as ex:
            refused = [ex.code, ex.field_path, ex.message]
        cfg["api"]["grpc"] = {"enabled": False}
        with Engine(cfg) as engine:
            caps = engine.query("capabilities")
        print(json.dumps({"refused": refused, "caps": caps}))
        """
    )
    result = python_json(script)
    code, field, message = result["refused"]
    assert (code, field) == ("feature_disabled", "api.grpc.enabled")
    assert "spliceway[grpc]" in message
    caps = result["caps"]
    assert "grpc" not in caps["features"] and "grpc-api" not in caps["build_features"]
    assert {"kind": "grpc", "enabled": False} in caps["adapters"]
    assert any(x["code"] == "grpc_not_built" for x in caps["global_limitations"])
    assert all(c["name"] != "grpc" for c in caps["contracts"])


def test_checked_in_stubs_match_the_proto(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    from spliceway.api.grpc_gen.__main__ import protoc_args

    out = tmp_path / "control.desc"
    assert protoc.main(protoc_args(f"--descriptor_set_out={out}")) == 0
    (fresh,) = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file
    # The Python stubs embed the descriptor without the derived json_name of each field.
    messages = list(fresh.message_type)
    while messages:
        message = messages.pop()
        messages.extend(message.nested_type)
        for field in message.field:
            field.ClearField("json_name")
    checked_in = descriptor_pb2.FileDescriptorProto.FromString(control_pb2.DESCRIPTOR.serialized_pb)
    assert fresh == checked_in, "stale stubs: run python -m spliceway.api.grpc_gen"


def test_stop_cuts_off_a_subscriber_that_neither_reads_nor_cancels(make_engine):
    engine = make_engine(grpc_config())
    client = Client(engine)
    try:
        call = client.subscribe(["engine.warning"])
        call.initial_metadata()
        # More than HTTP/2 flow control lets through unread: the stream's sender blocks.
        for _ in range(2000):
            engine.core.log.emit("engine.warning", {"code": "test", "message": "x" * 8000})
        started = time.monotonic()
        engine.stop()
        assert time.monotonic() - started < 8.0
        # Cut off after stop's grace: cancelled, or the connection closed under it.
        code, _, _ = refusal(lambda: list(call))
        assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    finally:
        client.close()


def test_logs_query_reads_the_engines_log_ring(engine, client):
    """``logs`` is offered on gRPC as on HTTP: records, filters, a bad level refused."""
    logging.getLogger("spliceway.test_grpc").warning("grpc logs marker")
    reply = client.query("logs", {"level": "warn"}, key=READER)
    assert reply.ok, reply.error
    result = struct_to_dict(reply.result)
    assert any(r["message"] == "grpc logs marker" for r in result["records"])
    assert result == engine.query("logs", {"level": "warn"})
    bad = client.query("logs", {"level": "loud"})
    assert (bad.ok, bad.error.code, bad.error.field_path) == (False, "invalid_argument", "level")
