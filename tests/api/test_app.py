"""The control app through Falcon's TestClient: envelope, shapes, errors, commands, permissions."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from typing import Any

import falcon.testing
import orjson
import pytest

from spliceway.api.auth import KeyTable
from spliceway.api.limits import Limits
from spliceway.errors import HTTP_STATUS
from tests.api.conftest import JSON_BODY, local_client
from tests.conftest import base_config, wait_until
from tests.helpers.socks import socks5_connect

API = "/api/v1"
ENVELOPE_KEYS = {"api_id", "id", "ok", "result"}
ERROR_ENVELOPE_KEYS = {"api_id", "id", "ok", "error"}


@pytest.fixture
def client(app_for: Callable[..., Any]) -> falcon.testing.TestClient:
    """A TestClient over a running engine, no key, relaxed limits."""
    return local_client(app_for())


def ok(result: falcon.testing.Result) -> dict[str, Any]:
    """The result of a successful envelope (asserting the envelope and CORS)."""
    assert result.status_code == 200, result.text
    assert result.headers["Access-Control-Allow-Origin"] == "*"
    body = result.json
    assert set(body) == ENVELOPE_KEYS
    assert body["api_id"] == "service.api.v1" and body["ok"] is True
    return body["result"]


def err(result: falcon.testing.Result, status: int, code: str) -> dict[str, Any]:
    """The error of a failed envelope (asserting status, code, envelope and CORS)."""
    assert result.status_code == status, result.text
    assert result.headers["Access-Control-Allow-Origin"] == "*"
    body = result.json
    assert set(body) == ERROR_ENVELOPE_KEYS
    assert body["api_id"] == "service.api.v1" and body["ok"] is False
    assert body["error"]["code"] == code
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return body["error"]


def command(
    client: falcon.testing.TestClient, body: Any, headers: dict[str, str] | None = None
) -> falcon.testing.Result:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return client.simulate_post(
        f"{API}/commands", body=raw, headers={**JSON_BODY, **(headers or {})}
    )


# -- queries -------------------------------------------------------------------------


def test_health(client: falcon.testing.TestClient) -> None:
    result = ok(client.simulate_get(f"{API}/health"))
    assert set(result) == {"engine_build_id", "started_at_unix_ms", "healthy"}
    assert result["healthy"] is True and result["started_at_unix_ms"] > 0


def test_capabilities(client: falcon.testing.TestClient) -> None:
    result = ok(client.simulate_get(f"{API}/capabilities"))
    assert result["api_id"] == "service.api.v1"
    assert result["schema_id"] == "service.event.v1"
    assert result["permissions"] == ["admin", "config", "control", "read"]
    assert {e["code"]: e["http_status"] for e in result["error_codes"]} == HTTP_STATUS
    for feature in ("query", "config_snapshot", "runtime_snapshot", "flow_snapshot"):
        assert feature in result["features"]
    assert "event_stream" in result["features"]
    names = {c["name"]: c for c in result["contracts"]}
    assert names["api"]["id"] == "service.api.v1" and names["event"]["id"] == "service.event.v1"
    protocols = {p["protocol"]: p for p in result["protocols"]}
    socks = protocols["socks5"]
    assert socks["compiled"] is True
    assert socks["inbound"]["tcp"] == {"supported": True, "level": "supported", "notes": []}
    # The UDP matrix, exactly: where UDP is relayed, and the transports that follow.
    udp = {
        name: (p["inbound"]["udp"]["supported"], p["outbound"]["udp"]["supported"])
        for name, p in protocols.items()
    }
    assert udp == {
        "socks5": (True, True),
        "http": (False, False),
        "mixed": (True, False),
        "direct": (False, True),
        "block": (False, True),
        "shadowsocks": (False, True),
        "tun": (True, False),
    }
    for name, (inbound, outbound) in udp.items():
        expected = ["tcp", "udp"] if inbound or outbound else ["tcp"]
        assert protocols[name]["transports"] == expected, name
    assert socks["mux"]["level"] == "not_applicable"
    assert protocols["shadowsocks"]["compiled"] is True
    assert protocols["shadowsocks"]["outbound"]["tcp"]["supported"] is True
    assert protocols["tun"]["compiled"] is True
    assert protocols["tun"]["inbound"]["tcp"]["supported"] is True
    for item in result["protocols"]:
        assert set(item) == {
            "protocol",
            "feature",
            "compiled",
            "status",
            "compatibility_baseline",
            "inbound",
            "outbound",
            "transports",
            "mux",
            "limitations",
        }
    methods = {c["method"]: c for c in result["commands"]}
    assert methods["flows.close"]["available"] is True
    assert methods["diagnostics.trace_route"]["available"] is True
    for method in ("policies.select", "policies.probe", "diagnostics.probe_outbound"):
        assert methods[method]["available"] is True
    assert methods["tun.start"]["available"] is True
    # Every command of the table is built.
    assert all(c["available"] for c in result["commands"]), result["commands"]
    for lim in result["global_limitations"]:
        assert set(lim) == {"code", "message"}


def test_config_reports_bound_ports(make_engine: Callable[..., Any]) -> None:
    from spliceway.api.app import create_app

    engine = make_engine(base_config())
    client = local_client(create_app(engine.control_plane, keys=KeyTable([])))
    result = ok(client.simulate_get(f"{API}/config"))
    assert result["mode"] == {"kind": "rule", "outbound": None}
    assert result["rule_count"] == 0
    ports = {item["tag"]: item["listen_port"] for item in result["listeners"]}
    assert ports == {tag: engine.listen_address(tag)[1] for tag in ports}
    assert all(p > 0 for p in ports.values())
    assert {o["tag"] for o in result["outbounds"]} == {"direct", "block"}
    assert result["outbound_groups"] == []


def test_fixed_shapes(client: falcon.testing.TestClient) -> None:
    assert ok(client.simulate_get(f"{API}/tun_status")) == {
        "running": False,
        "name": None,
        "addr": None,
        "tag": None,
    }
    assert ok(client.simulate_get(f"{API}/sinks")) == {"sinks": []}
    assert ok(client.simulate_get(f"{API}/policies")) == {"policies": []}
    err(client.simulate_get(f"{API}/policies/proxy"), 404, "not_found")
    stats = ok(client.simulate_get(f"{API}/stats"))
    assert set(stats) >= {"active_sessions", "total_started", "bytes_up", "udp_upstream"}
    assert len(stats["udp_upstream"]) == 11
    runtime = ok(client.simulate_get(f"{API}/runtime"))
    assert runtime["stats"].keys() == stats.keys()
    assert runtime["log_files"] == [] and runtime["log_level"] == "info"
    assert "config_path" not in runtime
    events = ok(client.simulate_get(f"{API}/events"))
    assert set(events) == {"events", "oldest_sequence", "latest_sequence", "capacity"}
    assert events["events"][0]["event_type"] == "engine.started"
    assert events["events"][0]["sequence"] == 1


@pytest.fixture
def two_flows(
    make_engine: Callable[..., Any], origin: tuple[str, int]
) -> Iterator[tuple[falcon.testing.TestClient, list[socket.socket]]]:
    """An engine with one open flow from a user and one anonymous one."""
    from spliceway.api.app import create_app

    cfg = base_config()
    cfg["inbounds"].append(
        {
            "tag": "auth-in",
            "protocol": "socks5",
            "listen": {"port": 0},
            "users": [{"username": "u", "password": "p", "principal_key": "alice"}],
        }
    )
    engine = make_engine(cfg)
    client = local_client(create_app(engine.control_plane, keys=KeyTable([])))
    socks = [
        socks5_connect(engine.listen_address("socks-in"), *origin),
        socks5_connect(engine.listen_address("auth-in"), *origin, auth=("u", "p")),
    ]
    wait_until(lambda: len(ok(client.simulate_get(f"{API}/flows"))["active_flows"]) == 2)
    try:
        yield client, socks
    finally:
        for s in socks:
            s.close()


def test_flows_filters_and_detail(
    two_flows: tuple[falcon.testing.TestClient, list[socket.socket]],
) -> None:
    client, _ = two_flows
    flows = ok(client.simulate_get(f"{API}/flows"))["active_flows"]
    assert {f["inbound"]["tag"] for f in flows} == {"socks-in", "auth-in"}
    assert all(f["state"] in ("opening", "active") for f in flows)
    only = ok(client.simulate_get(f"{API}/flows", params={"inbound_tag": "auth-in"}))
    assert [f["inbound"]["tag"] for f in only["active_flows"]] == ["auth-in"]
    alice = ok(client.simulate_get(f"{API}/flows", params={"principal_key": "alice"}))
    assert len(alice["active_flows"]) == 1
    none = ok(client.simulate_get(f"{API}/flows", params={"principal_key": "bob"}))
    assert none == {"active_flows": []}
    assert len(ok(client.simulate_get(f"{API}/flows", params={"limit": "1"}))["active_flows"]) == 1
    flow_id = flows[0]["flow_id"]
    detail = ok(client.simulate_get(f"{API}/flows/{flow_id}"))
    assert detail["flow_id"] == flow_id and "traffic" in detail
    err(client.simulate_get(f"{API}/flows/no-such-flow"), 404, "not_found")


@pytest.mark.parametrize("limit", ["0", "10001", "abc", "-1", "1.5"])
def test_flows_limit_out_of_range(client: falcon.testing.TestClient, limit: str) -> None:
    error = err(
        client.simulate_get(f"{API}/flows", params={"limit": limit}), 400, "invalid_argument"
    )
    assert error["field_path"] == "limit"


# -- routing errors and CORS -----------------------------------------------------------


def test_unknown_path_is_enveloped_404(client: falcon.testing.TestClient) -> None:
    err(client.simulate_get(f"{API}/nope"), 404, "not_found")
    err(client.simulate_get("/"), 404, "not_found")


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/health"), ("GET", "/commands"), ("DELETE", "/flows"), ("PUT", "/stats")],
)
def test_wrong_method_is_405_unsupported(
    client: falcon.testing.TestClient, method: str, path: str
) -> None:
    result = client.simulate_request(method, f"{API}{path}")
    err(result, 405, "unsupported")
    assert result.headers.get("Allow")


def test_preflight(client: falcon.testing.TestClient) -> None:
    # Keyless: only the API's own origin (http:// + its Host) gets a preflight answer.
    result = client.simulate_options(
        f"{API}/commands",
        headers={"Origin": "http://127.0.0.1", "Access-Control-Request-Method": "POST"},
    )
    assert ok(result) == {}
    assert "POST" in result.headers["Access-Control-Allow-Methods"]
    assert "X-Service-Api-Key" in result.headers["Access-Control-Allow-Headers"]
    assert "Content-Type" in result.headers["Access-Control-Allow-Headers"]


def test_preflight_from_another_origin_with_a_key_configured(
    scoped: falcon.testing.TestClient,
) -> None:
    result = scoped.simulate_options(
        f"{API}/commands",
        headers={"Origin": "http://dash.example", "Access-Control-Request-Method": "POST"},
    )
    assert ok(result) == {}
    assert "POST" in result.headers["Access-Control-Allow-Methods"]


# -- commands -------------------------------------------------------------------------


def test_command_echoes_id(client: falcon.testing.TestClient) -> None:
    for request_id in ("abc", 42, 4.5, None):
        body = {
            "id": request_id,
            "method": "diagnostics.trace_route",
            "params": {"target": "example.com", "port": 443},
        }
        result = command(client, body)
        assert result.json["id"] == request_id
        assert ok(result) == {
            "target": "example.com",
            "resolved_ip": None,
            "port": 443,
            "protocol": "tcp",
            "inbound_tag": None,
            "effective_mode": "rule",
            "route_action": {"route": "direct"},
            "matched_rule": None,
        }
    failed = command(client, {"id": "x1", "method": "flows.close", "params": {"flow_id": "nope"}})
    err(failed, 404, "not_found")
    assert failed.json["id"] == "x1"


@pytest.mark.parametrize(
    ("body", "field_path"),
    [
        (b"{not json", None),
        (b"[1, 2]", None),
        (b"", None),
        ({"params": {}}, "method"),
        ({"method": "no.such", "params": {}}, "method"),
        ({"method": 7, "params": {}}, "method"),
        ({"method": "mode.set"}, "params"),
        ({"method": "mode.set", "params": None}, "params"),
        ({"method": "mode.set", "params": [1]}, "params"),
        ({"method": "mode.set", "params": {"mode": "sideways"}}, "params.mode"),
        ({"method": "mode.set", "params": {"mode": "global"}}, "params.outbound"),
        ({"method": "mode.set", "params": {"mode": "global", "outbound": "zz"}}, "params.outbound"),
        ({"method": "mode.set", "params": {"mode": "rule", "extra": 1}}, "params.extra"),
        ({"method": "flows.close", "params": {}}, "params.flow_id"),
        (
            {"method": "mode.set", "params": {"mode": "direct", "outbound": "block"}},
            "params.outbound",
        ),
        (
            {"method": "diagnostics.trace_route", "params": {"target": "a", "port": True}},
            "params.port",
        ),
        (
            {"method": "diagnostics.trace_route", "params": {"target": "a", "port": "80"}},
            "params.port",
        ),
        ({"method": "flows.close", "params": {"flow_id": 12}}, "params.flow_id"),
        ({"id": True, "method": "flows.close", "params": {"flow_id": "x"}}, "id"),
        ({"id": {"a": 1}, "method": "flows.close", "params": {"flow_id": "x"}}, "id"),
        ({"method": "flows.close", "params": {"flow_id": "x"}, "paramz": {}}, "paramz"),
        (
            {"method": "diagnostics.trace_route", "params": {"target": "a", "port": 70000}},
            "params.port",
        ),
    ],
)
def test_command_bad_requests(
    client: falcon.testing.TestClient, body: Any, field_path: str | None
) -> None:
    error = err(command(client, body), 400, "invalid_argument")
    assert error.get("field_path") == field_path


def test_mode_set_then_trace_route(client: falcon.testing.TestClient) -> None:
    assert ok(
        command(client, {"method": "mode.set", "params": {"mode": "global", "outbound": "block"}})
    ) == {"accepted": True}
    trace = ok(
        command(
            client, {"method": "diagnostics.trace_route", "params": {"target": "a.b", "port": 80}}
        )
    )
    assert trace["effective_mode"] == "global" and trace["route_action"] == {"route": "block"}
    summary = ok(client.simulate_get(f"{API}/config"))
    assert summary["mode"] == {"kind": "global", "outbound": "block"}
    ok(command(client, {"method": "mode.set", "params": {"mode": "rule"}}))
    assert ok(client.simulate_get(f"{API}/config"))["mode"] == {"kind": "rule", "outbound": None}


def test_config_validate(client: falcon.testing.TestClient) -> None:
    assert ok(command(client, {"method": "config.validate", "params": {"config": {}}})) == {
        "valid": True
    }
    bad = {
        "inbounds": [{"tag": "x", "protocol": "socks5", "listen": {"port": 70000}}],
        "runtime": {"udp_upstream_idle_timeout_seconds": -1},
    }
    error = err(
        command(client, {"method": "config.validate", "params": {"config": bad}}),
        400,
        "invalid_argument",
    )
    assert error["cause"]
    paths = {d.get("field_path") for d in error["details"]}
    assert "inbounds[0].listen.port" in paths
    assert "runtime.udp_upstream_idle_timeout_seconds" in paths


def test_tun_commands_validate_before_touching_the_host(
    client: falcon.testing.TestClient,
) -> None:
    # Each is refused before any device, route or rule exists (the TUN itself is
    # tested in network namespaces: tests/integration/test_tun_engine.py).
    error = err(command(client, {"method": "tun.start", "params": {}}), 400, "invalid_argument")
    assert error["field_path"] == "params.addr"
    params = {"addr": "10.0.0.1", "tag": "socks-in"}  # the inbound's tag
    error = err(command(client, {"method": "tun.start", "params": params}), 400, "invalid_argument")
    assert error["field_path"] == "params.tag"
    params = {"addr": "10.0.0.1/24", "tag": "t", "mtu": 1000}  # IPv6 (dual_stack) needs 1280
    error = err(command(client, {"method": "tun.start", "params": params}), 400, "invalid_argument")
    assert error["field_path"] == "params.mtu"
    assert ok(command(client, {"method": "tun.stop", "params": {}})) == {"accepted": False}


def test_flows_close_over_http(
    two_flows: tuple[falcon.testing.TestClient, list[socket.socket]],
) -> None:
    client, socks = two_flows
    flow = ok(client.simulate_get(f"{API}/flows", params={"principal_key": "alice"}))[
        "active_flows"
    ][0]
    result = ok(command(client, {"method": "flows.close", "params": {"flow_id": flow["flow_id"]}}))
    assert result == {"flow_id": flow["flow_id"], "closed": True}
    socks[1].settimeout(5)
    assert socks[1].recv(1) == b""
    err(
        command(client, {"method": "flows.close", "params": {"flow_id": flow["flow_id"]}}),
        404,
        "not_found",
    )


# -- scoped keys ----------------------------------------------------------------------


@pytest.fixture
def scoped(app_for: Callable[..., Any]) -> falcon.testing.TestClient:
    keys = KeyTable(
        [
            ("admin", "admin-key", frozenset({"admin"})),
            ("dash", "read-key", frozenset({"read"})),
            ("ops", "control-key", frozenset({"read", "control"})),
            ("cfg", "config-key", frozenset({"config"})),
        ]
    )
    return local_client(app_for(keys=keys))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_scoped_keys(scoped: falcon.testing.TestClient) -> None:
    caps = ok(scoped.simulate_get(f"{API}/capabilities", headers=bearer("read-key")))
    assert caps["permissions"] == ["read"]
    caps = ok(
        scoped.simulate_get(f"{API}/capabilities", headers={"X-Service-Api-Key": "admin-key"})
    )
    assert caps["permissions"] == ["admin", "config", "control", "read"]
    mode = {"method": "mode.set", "params": {"mode": "direct"}}
    err(command(scoped, mode, bearer("read-key")), 403, "permission_denied")
    err(command(scoped, mode, bearer("control-key")), 403, "permission_denied")
    ok(command(scoped, mode, bearer("admin-key")))
    close = {"method": "flows.close", "params": {"flow_id": "nope"}}
    err(command(scoped, close, bearer("read-key")), 403, "permission_denied")
    err(command(scoped, close, bearer("control-key")), 404, "not_found")
    validate = {"method": "config.validate", "params": {"config": {}}}
    ok(command(scoped, validate, bearer("config-key")))
    err(command(scoped, validate, bearer("control-key")), 403, "permission_denied")
    # A key without read may not query.
    err(
        scoped.simulate_get(f"{API}/health", headers=bearer("config-key")), 403, "permission_denied"
    )


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "Basic YWRtaW4ta2V5"},
        {"Authorization": "Bearer "},
        {"Authorization": "admin-key"},
        {"X-Service-Api-Key": "admin-ke"},
        {"X-Service-Api-Key": "admin-key2"},
    ],
)
def test_unauthenticated(scoped: falcon.testing.TestClient, headers: dict[str, str]) -> None:
    result = scoped.simulate_get(f"{API}/health", headers=headers)
    err(result, 401, "unauthenticated")
    assert result.headers["WWW-Authenticate"].startswith("Bearer")


def test_rate_limits_in_process(app_for: Callable[..., Any]) -> None:
    client = local_client(app_for(limits=Limits(queries_per_second=3, commands_per_second=2)))
    statuses = [client.simulate_get(f"{API}/health").status_code for _ in range(6)]
    assert statuses[:3] == [200, 200, 200] and 429 in statuses[3:]
    result = client.simulate_get(f"{API}/health")
    error = err(result, 429, "rate_limited")
    assert "query" in error["message"]
    assert int(result.headers["Retry-After"]) >= 1
    body = {"method": "mode.set", "params": {"mode": "rule"}}
    statuses = [command(client, body).status_code for _ in range(4)]
    assert statuses[:2] == [200, 200] and 429 in statuses[2:]
