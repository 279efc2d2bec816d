"""The OpenAPI document: valid OpenAPI 3.1, served as built, and true of real responses.

Every response here comes from a real engine over real HTTP (``urllib``), after
real SOCKS5/HTTP traffic, and is validated against the document's schema for
its path, method and status (jsonschema Draft 2020-12, ``#/components`` refs
resolved through a ``referencing`` registry holding the whole document). A
status the document does not list for the operation is a failure too.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import openapi_spec_validator
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from spliceway.api.openapi import command_component, openapi_document
from spliceway.config import EVENT_TYPES
from spliceway.control.commands import COMMANDS
from tests.api.conftest import control_config, local_client
from tests.conftest import base_config, wait_until
from tests.helpers.dnsserver import dns_server
from tests.helpers.socks import recv_all, socks5_connect
from tests.helpers.upstreams import refused_port

DOC = openapi_document()
_URI = "urn:spliceway:control-api:openapi"
_REGISTRY: Registry = Registry().with_resource(
    _URI, Resource.from_contents(DOC, default_specification=DRAFT202012)
)
JSON = "application/json"
SSE = "text/event-stream"
V1 = "/api/v1"

#: Params each command accepts (valid per its pydantic model), for the 200 / 501 round.
VALID_PARAMS: dict[str, dict[str, Any]] = {
    "flows.close": {"flow_id": "<open flow>"},
    "mode.set": {"mode": "direct"},
    "config.validate": {"config": base_config()},
    "diagnostics.trace_route": {"target": "x.blocked.test", "port": 443},
    "policies.select": {"policy_tag": "proxy", "target_tag": "direct"},
    "policies.probe": {"policy_tag": "auto"},
    "policies.unfix": {"policy_tag": "auto"},
    "config.apply": {"config": base_config()},
    "config.apply_runtime": {"config": base_config()},
    "tun.start": {"addr": "198.18.0.1", "tag": "tun-in"},
    "tun.stop": {},
    "diagnostics.probe_target": {"target_tag": "direct"},
    "diagnostics.probe_outbound": {"target_tag": "direct"},
    "diagnostics.dns_lookup": {"hostname": "www.example.test"},
    "diagnostics.dns_query": {"name": "www.example.test", "type": "A"},
    "diagnostics.dns_cache": {},
    "dns.cache_flush": {},
    "providers.update": {},
    "log.set_level": {"level": "info"},
    "diagnostics.fakeip_lookup": {"domain": "example.com"},
    "fakeip.clear": {},
}

#: Commands whose 200 changes what the rest of the test sees; they get their own cases.
_STATEFUL = {"flows.close", "mode.set", "tun.start", "config.apply", "config.apply_runtime"}


# ---------------------------------------------------------------------------
# The validator
# ---------------------------------------------------------------------------


class UndocumentedResponse(AssertionError):
    """A status or content type the document does not list for the operation."""


def _pointer(parts: list[str]) -> str:
    return "/".join(p.replace("~", "~0").replace("/", "~1") for p in parts)


def _validator_at(parts: list[str]) -> jsonschema.protocols.Validator:
    schema = {"$ref": f"{_URI}#/{_pointer(parts)}"}
    return jsonschema.Draft202012Validator(schema, registry=_REGISTRY)


def response_spec(method: str, path_template: str, status: int) -> tuple[dict[str, Any], list[str]]:
    """The response object the document lists for this operation and status, and its location."""
    method = method.lower()
    operation = DOC["paths"].get(path_template, {}).get(method)
    if operation is None:
        raise UndocumentedResponse(f"no operation {method.upper()} {path_template}")
    responses = operation["responses"]
    if str(status) not in responses:
        raise UndocumentedResponse(
            f"{method.upper()} {path_template} does not document status {status} "
            f"(it documents {sorted(responses)})"
        )
    response = responses[str(status)]
    parts = ["paths", path_template, method, "responses", str(status)]
    if "$ref" in response:
        name = response["$ref"].rsplit("/", 1)[1]
        response = DOC["components"]["responses"][name]
        parts = ["components", "responses", name]
    return response, parts


def validate_response(
    method: str,
    path_template: str,
    status: int,
    body: Any,
    *,
    content_type: str = JSON,
    headers: dict[str, str] | None = None,
) -> None:
    """Check one response against the document; raises on any mismatch.

    ``UndocumentedResponse`` when the status or content type is not listed,
    ``jsonschema.ValidationError`` when the body does not match, and
    ``AssertionError`` when a required documented header is missing or wrong.
    """
    response, parts = response_spec(method, path_template, status)
    media = content_type.split(";", 1)[0].strip()
    if media not in response.get("content", {}):
        raise UndocumentedResponse(
            f"{method.upper()} {path_template} {status}: content type {media!r} is not documented"
        )
    _validator_at([*parts, "content", media, "schema"]).validate(body)
    if headers is None:
        return
    lowered = {k.lower(): v for k, v in headers.items()}
    for name, header in response.get("headers", {}).items():
        if "$ref" in header:
            header = DOC["components"]["headers"][header["$ref"].rsplit("/", 1)[1]]
        value = lowered.get(name.lower())
        if value is None:
            assert not header.get("required"), f"{status}: required header {name} is missing"
            continue
        schema = header["schema"]
        instance: Any = int(value) if schema.get("type") == "integer" else value
        jsonschema.Draft202012Validator(schema).validate(instance)


def validate_component(name: str, instance: Any) -> None:
    """Check ``instance`` against ``components.schemas.<name>``."""
    _validator_at(["components", "schemas", name]).validate(instance)


# ---------------------------------------------------------------------------
# A small HTTP client that validates everything it receives
# ---------------------------------------------------------------------------

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass
class Reply:
    """One HTTP response."""

    status: int
    headers: dict[str, str]
    raw: bytes

    @property
    def json(self) -> Any:
        """The body parsed as JSON (a text body, such as a metrics scrape, as text)."""
        if not self.headers.get("Content-Type", JSON).startswith(JSON):
            return self.raw.decode()
        return json.loads(self.raw)


@dataclass
class Api:
    """Calls the control API and validates every response against the document."""

    base_url: str
    headers: dict[str, str] = field(default_factory=dict)
    seen: set[tuple[str, str, int]] = field(default_factory=set)

    def send(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
    ) -> Reply:
        """One request, no validation."""
        all_headers = {**self.headers, **(headers or {})}
        if body is not None:
            all_headers.setdefault("Content-Type", JSON)
        req = urllib.request.Request(
            self.base_url + path, data=body, method=method, headers=all_headers
        )
        try:
            with _OPENER.open(req, timeout=15) as resp:
                return Reply(resp.status, dict(resp.headers), resp.read())
        except urllib.error.HTTPError as ex:
            with ex:
                return Reply(ex.code, dict(ex.headers), ex.read())

    def check(
        self,
        method: str,
        template: str,
        status: int,
        *,
        path: str | None = None,
        body: Any = None,
        raw_body: bytes | None = None,
        headers: dict[str, str] | None = None,
        retry_rate_limited: bool = True,
        documented_as: str | None = None,
    ) -> Any:
        """Send, validate against ``template``'s operation, expect ``status``; the parsed body.

        A 429 (the spec's 10 commands/s) is validated too, then retried after
        its Retry-After unless ``retry_rate_limited`` is false. A method the path
        does not answer (405) is validated as the path's ``documented_as`` operation.
        """
        data = raw_body
        if body is not None:
            data = json.dumps(body).encode()
        for _ in range(20):
            reply = self.send(method, path or template, data, headers)
            parsed = reply.json
            validate_response(
                documented_as or method,
                template,
                reply.status,
                parsed,
                content_type=reply.headers.get("Content-Type", ""),
                headers=reply.headers,
            )
            self.seen.add((method.upper(), template, reply.status))
            if reply.status == 429 and retry_rate_limited and status != 429:
                time.sleep(int(reply.headers["Retry-After"]))
                continue
            assert reply.status == status, (
                f"{method} {path or template} -> {reply.status}, expected {status}: {parsed}"
            )
            return parsed
        raise AssertionError(f"{method} {path or template} stayed rate limited")

    def get(self, template: str, path: str | None = None) -> Any:
        """GET a query resource, expect 200, return its result."""
        return self.check("GET", template, 200, path=path)["result"]

    def command(self, method: str, params: Any, status: int = 200, **extra: Any) -> Any:
        """POST one command, expect ``status``; the whole envelope."""
        return self.check(
            "POST", f"{V1}/commands", status, body={"method": method, "params": params, **extra}
        )


# ---------------------------------------------------------------------------
# Real traffic
# ---------------------------------------------------------------------------


def _socks_get(proxy: tuple[str, int], host: str, port: int, path: str = "/bytes/2000") -> bytes:
    with socks5_connect(proxy, host, port) as sock:
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        return recv_all(sock)


def _socks_attempt(proxy: tuple[str, int], host: str, port: int) -> None:
    """A flow that fails or is blocked: refused at once, or (after sniffing) closed."""
    try:
        sock = socks5_connect(proxy, host, port)
    except ConnectionError:
        return
    with sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        with contextlib.suppress(OSError):
            recv_all(sock)


def _http_proxy_get(proxy: tuple[str, int], origin: tuple[str, int]) -> bytes:
    host = f"{origin[0]}:{origin[1]}"
    with socket.create_connection(proxy, timeout=10) as sock:
        sock.sendall(
            f"GET http://{host}/host HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
        )
        return recv_all(sock)


#: The zone of the local DNS server the engines resolve through (no real DNS in tests).
ZONE = {"www.example.test": ["192.0.2.10", "2001:db8::10"]}


@pytest.fixture
def dns_url() -> Iterator[str]:
    """``udp://127.0.0.1:<port>`` of a local authoritative server for ``ZONE``."""
    with dns_server(ZONE) as server:
        yield server.udp_url


def _engine_config(dns_url: str, origin: tuple[str, int], outbox: str) -> dict[str, Any]:
    """Control API on a free port (no key, spec limits), rules so routes can match, local DNS,
    one group of each kind (probing the origin), and two sinks: a webhook nobody answers
    (its events stay pending in the outbox) and a JSONL file."""
    cfg = control_config()
    cfg["api"]["event_sinks"] = [
        {"type": "webhook", "tag": "down", "url": f"http://127.0.0.1:{refused_port()}/hook"},
        {"type": "jsonl", "tag": "file", "path": f"{outbox}/events.jsonl"},
    ]
    cfg["api"]["outbox_path"] = f"{outbox}/outbox"
    cfg["api"]["outbox_min_free_bytes"] = 0
    cfg["api"]["outbox_min_free_percent"] = 0
    cfg["runtime"]["dns"] = {"servers": [dns_url]}
    cfg["runtime"]["latency_test_url"] = f"http://{origin[0]}:{origin[1]}/generate_204"
    cfg["outbounds"].append(
        {"tag": "dead-hop", "protocol": "socks5", "server": "127.0.0.1", "port": refused_port()}
    )
    cfg["outbound_groups"] = [
        {"tag": "proxy", "kind": "selector", "outbounds": ["auto", "direct"]},
        {"tag": "auto", "kind": "url_test", "outbounds": ["direct", "dead-hop"]},
        {"tag": "fb", "kind": "fallback", "outbounds": ["dead-hop", "direct"]},
        {"tag": "lb", "kind": "load_balance", "outbounds": ["direct", "dead-hop"]},
        {"tag": "chain", "kind": "relay", "outbounds": ["dead-hop"]},
    ]
    cfg["rules"] = [
        {"domain_suffix": ["blocked.test"], "action": "block"},
        {"ip_cidr": ["127.0.0.0/8"], "outbound": "direct"},
    ]
    return cfg


@dataclass
class Traffic:
    """The engine after real traffic: one flow still open, others completed."""

    engine: Any
    api: Api
    open_flow_id: str
    open_socket: socket.socket


@pytest.fixture
def traffic(make_engine, origin, dns_url, tmp_path) -> Iterator[Traffic]:
    """Completed flows (relayed via socks5 and http, failed, blocked) and one open flow."""
    engine = make_engine(_engine_config(dns_url, origin, str(tmp_path)))
    api = Api(engine.control_url)
    socks = engine.listen_address("socks-in")
    assert b"x" * 2000 in _socks_get(socks, *origin)
    assert origin[0].encode() in _http_proxy_get(engine.listen_address("http-in"), origin)
    _socks_attempt(socks, "127.0.0.1", refused_port())  # refused: a failed flow
    _socks_attempt(socks, "x.blocked.test", 80)  # a blocked flow
    sock = socks5_connect(socks, *origin)
    try:
        # Keep-alive request: the origin answers and keeps the connection (and the flow) open.
        sock.sendall(f"GET /bytes/5000 HTTP/1.1\r\nHost: {origin[0]}\r\n\r\n".encode())
        received = b""
        while b"x" * 5000 not in received:
            received += sock.recv(65536)

        source_port = sock.getsockname()[1]

        def open_flow() -> str | None:
            # Earlier flows may still be finishing: find this socket's flow by its port.
            flows = api.get(f"{V1}/flows")["active_flows"]
            mine = [
                f for f in flows if f["state"] == "active" and f["source"]["port"] == source_port
            ]
            return mine[0]["flow_id"] if mine else None

        flow_id = wait_until(open_flow)

        def completed_count() -> bool:
            events = api.get(f"{V1}/events")["events"]
            return sum(e["event_type"] == "flow.completed" for e in events) >= 4

        wait_until(completed_count)
        yield Traffic(engine, api, flow_id, sock)
    finally:
        sock.close()


def _sse_frames(reply: Any, until: str, limit: int = 500) -> list[dict[str, str]]:
    """Read SSE frames from an open response until one of event type ``until``."""
    frames: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for _ in range(limit * 8):
        line = reply.readline().decode().rstrip("\n")
        if line == "":
            if current:
                frames.append(current)
                if current.get("event") == until:
                    return frames
            current = {}
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(": ")
        current[key] = value
    raise AssertionError(f"no {until} frame in {len(frames)} frames")


@contextlib.contextmanager
def _stream(base_url: str, query: str = "") -> Iterator[Any]:
    req = urllib.request.Request(f"{base_url}{V1}/events/stream{query}")
    with _OPENER.open(req, timeout=15) as resp:
        yield resp


# ---------------------------------------------------------------------------
# The document itself
# ---------------------------------------------------------------------------


def test_document_is_valid_openapi_3_1() -> None:
    openapi_spec_validator.validate(DOC)
    assert DOC["openapi"] == "3.1.0"
    schemes = DOC["components"]["securitySchemes"]
    assert schemes["bearer"] == {**schemes["bearer"], "type": "http", "scheme": "bearer"}
    assert (schemes["apiKey"]["in"], schemes["apiKey"]["name"]) == ("header", "X-Service-Api-Key")
    assert DOC["security"] == [{}, {"bearer": []}, {"apiKey": []}]


def test_document_covers_every_route_and_command() -> None:
    queries = [
        "health",
        "capabilities",
        "config",
        "runtime",
        "stats",
        "flows",
        "flows/{flow_id}",
        "policies",
        "policies/{policy_tag}",
        "providers",
        "sinks",
        "tun_status",
        "events",
        "events/stream",
        "logs",
        "openapi.json",
    ]
    assert set(DOC["paths"]) == {f"{V1}/{q}" for q in queries} | {f"{V1}/commands", "/metrics"}
    for q in queries:
        assert "get" in DOC["paths"][f"{V1}/{q}"]
    assert "post" in DOC["paths"][f"{V1}/commands"]
    schemas = DOC["components"]["schemas"]
    assert schemas["CommandMethod"]["enum"] == list(COMMANDS)
    variants = DOC["components"]["schemas"]["CommandRequest"]["discriminator"]["mapping"]
    assert set(variants) == set(COMMANDS)
    for method, command in COMMANDS.items():
        variant = schemas[variants[method].rsplit("/", 1)[1]]
        assert variant["properties"]["method"]["const"] == method
        assert variant["properties"]["params"] == {
            "$ref": f"#/components/schemas/{command.params.__name__}"
        }
        result = schemas[command_component(method, "Result")]
        assert "Result shape not documented" not in result.get("description", ""), method
    limit = next(
        p for p in DOC["paths"][f"{V1}/flows"]["get"]["parameters"] if p["name"] == "limit"
    )
    assert limit["schema"] == {"type": "integer", "minimum": 1, "maximum": 10000, "default": 100}
    assert set(schemas["EventType"]["enum"]) == EVENT_TYPES
    assert set(DOC["paths"][f"{V1}/commands"]["post"]["responses"]) >= {
        "200", "400", "401", "403", "404", "405", "429", "500", "501"
    }  # fmt: skip
    assert set(DOC["paths"][f"{V1}/events/stream"]["get"]["responses"]["200"]["content"]) == {SSE}


def test_served_document_is_openapi_document(base_url) -> None:
    reply = Api(base_url).send("GET", f"{V1}/openapi.json")
    assert reply.status == 200
    assert reply.headers["Content-Type"].startswith(JSON)
    assert reply.json == json.loads(json.dumps(DOC))
    validate_response("GET", f"{V1}/openapi.json", 200, reply.json, headers=reply.headers)


# ---------------------------------------------------------------------------
# The validator can fail
# ---------------------------------------------------------------------------

_HEALTH = {"engine_build_id": "b", "started_at_unix_ms": 1, "healthy": True}


def _ok(result: Any) -> dict[str, Any]:
    return {"api_id": "service.api.v1", "id": None, "ok": True, "result": result}


def _err(code: str, **extra: Any) -> dict[str, Any]:
    error = {"code": code, "message": "m", **extra}
    return {"api_id": "service.api.v1", "id": None, "ok": False, "error": error}


@pytest.mark.parametrize(
    ("method", "template", "status", "body"),
    [
        pytest.param("GET", "/health", 200, _ok({**_HEALTH, "healthy": None}), id="null-healthy"),
        pytest.param(
            "GET",
            "/health",
            200,
            _ok({k: v for k, v in _HEALTH.items() if k != "healthy"}),
            id="health-missing-healthy",
        ),
        pytest.param("GET", "/health", 200, _ok({**_HEALTH, "x": 1}), id="health-extra-field"),
        pytest.param("GET", "/health", 200, {**_ok(_HEALTH), "api_id": "v2"}, id="wrong-api-id"),
        pytest.param("GET", "/health", 200, {**_ok(_HEALTH), "ok": False}, id="ok-false"),
        pytest.param("GET", "/health", 200, _err("internal"), id="error-as-success"),
        pytest.param("GET", "/flows/{flow_id}", 404, _err("invalid_argument"), id="404-code"),
        pytest.param("POST", "/commands", 501, _err("not_found"), id="501-code"),
        pytest.param("POST", "/commands", 400, _err("invalid_argument", hint=1), id="error-extra"),
        pytest.param("GET", "/stats", 200, _ok({"active_sessions": 0}), id="stats-incomplete"),
        pytest.param(
            "GET", "/tun_status", 200, _ok({"running": False, "name": "tun0"}), id="tun-mixed"
        ),
        pytest.param(
            "POST",
            "/commands",
            200,
            _ok({"flow_id": "f", "closed": True, "extra": 1}),
            id="command-result-extra",
        ),
    ],
)
def test_validator_rejects_wrong_bodies(method, template, status, body) -> None:
    with pytest.raises(jsonschema.ValidationError):
        validate_response(method, V1 + template, status, body)


def test_validator_rejects_wrong_flow_records(traffic) -> None:
    record = traffic.api.get(f"{V1}/flows/{{flow_id}}", f"{V1}/flows/{traffic.open_flow_id}")
    validate_component("FlowRecord", record)
    with pytest.raises(jsonschema.ValidationError):
        validate_component("FlowRecord", {**record, "state": "completed"})  # no result
    with pytest.raises(jsonschema.ValidationError):
        validate_component("FlowRecord", {**record, "result": {"outcome": "direct_relayed"}})
    with pytest.raises(jsonschema.ValidationError):
        validate_component("FlowRecord", {**record, "traffic": {**record["traffic"], "x": 1}})


def test_validator_rejects_undocumented_statuses_and_types() -> None:
    with pytest.raises(UndocumentedResponse):
        validate_response("GET", f"{V1}/health", 404, _err("not_found"))
    with pytest.raises(UndocumentedResponse):
        validate_response("GET", f"{V1}/health", 501, _err("unsupported"))
    with pytest.raises(UndocumentedResponse):
        validate_response("GET", f"{V1}/health", 200, _ok(_HEALTH), content_type="text/plain")
    with pytest.raises(AssertionError, match="Retry-After"):
        validate_response(
            "GET",
            f"{V1}/health",
            429,
            _err("rate_limited"),
            headers={"Access-Control-Allow-Origin": "*"},
        )


# ---------------------------------------------------------------------------
# Real responses
# ---------------------------------------------------------------------------


def test_queries_conform_after_real_traffic(traffic) -> None:
    api = traffic.api
    for name in (
        "health",
        "capabilities",
        "config",
        "policies",
        "providers",
        "sinks",
        "tun_status",
    ):
        api.get(f"{V1}/{name}")
    sinks = {s["name"]: s for s in api.get(f"{V1}/sinks")["sinks"]}
    assert sinks["down"]["pending"] > 0 and "delivery" in sinks["down"]
    assert sinks["down"]["outbox_storage"]["write_blocked"] is False
    assert api.get(f"{V1}/config")["listeners"][0]["listen_port"] > 0

    flows = api.get(f"{V1}/flows")["active_flows"]
    assert traffic.open_flow_id in [f["flow_id"] for f in flows]
    assert api.get(f"{V1}/flows", f"{V1}/flows?limit=1&inbound_tag=socks-in")["active_flows"]
    assert api.get(f"{V1}/flows", f"{V1}/flows?principal_key=nobody")["active_flows"] == []
    assert api.get(f"{V1}/flows", f"{V1}/flows?inbound_tag=http-in")["active_flows"] == []
    record = api.get(f"{V1}/flows/{{flow_id}}", f"{V1}/flows/{traffic.open_flow_id}")
    assert record["state"] == "active" and record["route"]["matched_rule"] is not None

    runtime = api.get(f"{V1}/runtime")
    assert traffic.open_flow_id in [f["flow_id"] for f in runtime["active_sessions"]]
    outcomes = {f["result"]["outcome"] for f in runtime["recent_completed_sessions"]}
    assert {"direct_relayed", "failed", "blocked"} <= outcomes
    failed = [f for f in runtime["recent_completed_sessions"] if "failure" in f["result"]]
    assert failed and failed[0]["result"]["failure"]["remote"]
    stats = api.get(f"{V1}/stats")
    assert stats["total_started"] >= 5 and stats["bytes_down"] > 0

    ring = api.get(f"{V1}/events")
    types = {e["event_type"] for e in ring["events"]}
    assert {"engine.started", "flow.started", "flow.routed", "flow.completed"} <= types

    api.check("GET", f"{V1}/flows", 400, path=f"{V1}/flows?limit=0")
    api.check("GET", f"{V1}/flows", 400, path=f"{V1}/flows?limit=10001")
    api.check("GET", f"{V1}/flows", 400, path=f"{V1}/flows?limit=ten")
    api.check("GET", f"{V1}/flows/{{flow_id}}", 404, path=f"{V1}/flows/no-such-flow")
    policies = {p["tag"]: p for p in api.get(f"{V1}/policies")["policies"]}
    assert set(policies) == {"proxy", "auto", "fb", "lb"}  # a relay is no policy
    for tag in policies:
        api.get(f"{V1}/policies/{{policy_tag}}", f"{V1}/policies/{tag}")
    groups = {g["tag"]: g for g in api.get(f"{V1}/config")["outbound_groups"]}
    assert groups["chain"]["effective_chains"] == [["dead-hop"]]
    api.check("GET", f"{V1}/policies/{{policy_tag}}", 404, path=f"{V1}/policies/chain")
    api.check("GET", f"{V1}/policies/{{policy_tag}}", 404, path=f"{V1}/policies/nope")
    logs = api.get(f"{V1}/logs")
    assert logs["capacity"] > 0
    api.get(f"{V1}/logs", f"{V1}/logs?since=0&limit=5&level=warn")
    api.check("GET", f"{V1}/logs", 400, path=f"{V1}/logs?level=loud")
    api.check("GET", f"{V1}/openapi.json", 200)
    api.check("GET", "/metrics", 200)
    api.check("GET", "/metrics", 200, headers={"Accept": "application/openmetrics-text"})
    api.check("GET", "/metrics", 400, path="/metrics?name[]=x")
    answered = {template for method, template, status in api.seen if status == 200}
    queries = {p for p, item in DOC["paths"].items() if "get" in item}
    # The stream has a test of its own.
    assert queries - answered == {f"{V1}/events/stream"}


def test_event_stream_frames_conform(traffic) -> None:
    api = traffic.api
    with _stream(api.base_url, "?since=0") as resp:
        assert resp.status == 200
        validate_response(
            "GET", f"{V1}/events/stream", 200, "", content_type=resp.headers["Content-Type"]
        )
        frames = _sse_frames(resp, "flow.snapshot")
    frames = [f for f in frames if "data" in f]
    envelopes = [json.loads(f["data"]) for f in frames]
    for frame, envelope in zip(frames, envelopes, strict=True):
        validate_component("EventEnvelope", envelope)
        assert frame["event"] == envelope["event_type"]
        assert int(frame["id"]) == envelope["sequence"]
    snapshot = envelopes[-1]["payload"]
    assert traffic.open_flow_id in [r["flow_id"] for r in snapshot["records"]]
    assert "flow.completed" in {e["event_type"] for e in envelopes}

    with _stream(api.base_url, "?types=flow.completed,engine.started&since=0") as resp:
        frames = _sse_frames(resp, "flow.snapshot")
    events = {f["event"] for f in frames if "event" in f}
    assert events == {"engine.started", "flow.completed", "flow.snapshot"}

    stream = f"{V1}/events/stream"
    api.check("GET", stream, 400, path=f"{stream}?since=-1")
    api.check("GET", stream, 400, path=f"{stream}?types=flow.bogus")
    api.check("GET", stream, 400, headers={"Last-Event-ID": "abc"})


def test_commands_conform(traffic) -> None:
    api = traffic.api
    caps = api.get(f"{V1}/capabilities")
    available = {c["method"]: c["available"] for c in caps["commands"]}
    assert set(available) == set(COMMANDS)

    # Every command with valid params: its result schema when built, 501 when not.
    for method, params in VALID_PARAMS.items():
        if method in _STATEFUL and available[method]:
            continue
        status = 200 if available[method] else 501
        envelope = api.command(method, params, status)
        if status == 200:
            validate_component(command_component(method, "Result"), envelope["result"])
        else:
            assert envelope["error"]["code"] == "unsupported"
    assert set(VALID_PARAMS) == set(COMMANDS)

    # flows.close on the open flow, then again (gone).
    flow = traffic.open_flow_id
    closed = api.command("flows.close", {"flow_id": flow})["result"]
    assert closed == {"flow_id": flow, "closed": True}
    validate_component("FlowsCloseResult", closed)
    assert api.command("flows.close", {"flow_id": flow}, 404)["error"]["code"] == "not_found"

    # mode.set round trip and its argument errors.
    api.command("mode.set", {"mode": "global", "outbound": "direct"})
    assert api.get(f"{V1}/config")["mode"] == {"kind": "global", "outbound": "direct"}
    api.command("mode.set", {"mode": "rule"})
    for bad in ({"mode": "bogus"}, {"mode": "global"}, {"mode": "global", "outbound": "nope"}):
        assert api.command("mode.set", bad, 400)["error"]["code"] == "invalid_argument"

    # trace_route: a blocking rule, a routed match, no match; and bad params.
    blocked = api.command("diagnostics.trace_route", {"target": "a.blocked.test", "port": 80})
    assert blocked["result"]["route_action"] == {"block": True}
    routed = api.command(
        "diagnostics.trace_route",
        {"target": "127.0.0.1", "port": 80, "protocol": "udp", "inbound_tag": "socks-in"},
    )["result"]
    assert routed["route_action"] == {"route": "direct"} and routed["matched_rule"]["index"] == 1
    final = api.command("diagnostics.trace_route", {"target": "example.org", "port": 1})
    assert final["result"]["matched_rule"] is None
    for bad in ({"target": "", "port": 1}, {"target": "x", "port": 70000}, {"target": "x"}):
        error = api.command("diagnostics.trace_route", bad, 400)["error"]
        assert error["field_path"].startswith("params.")

    # The resolver diagnostics, when built: a hit, a miss, the cache both ways.
    if available["diagnostics.dns_lookup"]:
        hit = api.command("diagnostics.dns_lookup", {"hostname": "www.example.test"})["result"]
        assert sorted(hit["resolved_addresses"]) == sorted(ZONE["www.example.test"])
        miss = api.command("diagnostics.dns_lookup", {"hostname": "nx.example.test"})["result"]
        assert miss["count"] == 0 and "error" in miss
    if available["diagnostics.dns_cache"]:
        entry = api.command("diagnostics.dns_cache", {"domain": "www.example.test"})["result"]
        validate_component("DiagnosticsDnsCacheResult", entry)
        listing = api.command("diagnostics.dns_cache", {"limit": 1})["result"]
        assert "entries" in listing

    # config.validate: valid, and a problem with details.
    assert api.command("config.validate", {"config": base_config()})["result"] == {"valid": True}
    invalid = api.command("config.validate", {"config": {"inbounds": 5}}, 400)["error"]
    assert invalid["details"]

    # The TUN commands, as far as they go without touching this namespace's network.
    assert api.command("tun.start", {"tag": "t"}, 400)["error"]["field_path"] == "params.addr"
    assert api.command("tun.stop", {"x": 1}, 400)["error"]["code"] == "invalid_argument"
    assert api.command("tun.stop", {})["result"] == {"accepted": False}

    # Envelope-level errors, and the id echoed on success and on error.
    commands = f"{V1}/commands"
    for raw in (b"not json", b"[1, 2]", b'{"method": "tun.stop"}', b'{"method": 1, "params": {}}'):
        api.check("POST", commands, 400, raw_body=raw)
    api.check("POST", commands, 400, body={"method": "nope", "params": {}})
    api.check("POST", commands, 400, body={"method": "tun.stop", "params": [], "id": 1})
    assert api.check("POST", commands, 400, body={"id": True, "method": "tun.stop", "params": {}})
    extra = api.check("POST", commands, 400, body={"id": "x", "method": "m", "params": {}, "z": 1})
    assert (extra["id"], extra["error"]["field_path"]) == ("x", "z")
    echoed = api.command("config.validate", {"config": {}}, id="req-7")
    assert echoed["id"] == "req-7"
    assert api.command("mode.set", {"mode": "x"}, 400, id=7.5)["id"] == 7.5
    seen = {status for method, template, status in api.seen if template == commands}
    assert {200, 400, 404} <= seen


def test_method_not_allowed_preflight_and_unknown_path_conform(base_url) -> None:
    api = Api(base_url)
    assert api.check("POST", f"{V1}/health", 405, raw_body=b"{}", documented_as="GET")
    assert api.check("DELETE", f"{V1}/flows/{{flow_id}}", 405, path=f"{V1}/flows/f1",
                     documented_as="GET")  # fmt: skip
    assert api.check("GET", f"{V1}/commands", 405, documented_as="POST")
    for template, item in DOC["paths"].items():
        if "options" in item:
            path = template.replace("{flow_id}", "f1").replace("{policy_tag}", "p1")
            assert api.check("OPTIONS", template, 200, path=path)["result"] == {}
    reply = api.send("GET", f"{V1}/no-such-endpoint")
    assert reply.status == 404
    validate_component("NotFoundEnvelope", reply.json)


def test_stream_concurrency_limit_conforms(base_url) -> None:
    api = Api(base_url)
    with contextlib.ExitStack() as stack:
        for _ in range(5):
            resp = stack.enter_context(_stream(base_url))
            assert resp.readline().startswith(b": connected")
        api.check("GET", f"{V1}/events/stream", 429, retry_rate_limited=False)


def test_rate_limited_commands_conform(base_url) -> None:
    api = Api(base_url)
    statuses: list[int] = []
    lock = threading.Lock()

    def burst() -> None:
        reply = api.send(
            "POST", f"{V1}/commands", json.dumps({"method": "tun.stop", "params": {}}).encode()
        )
        validate_response("POST", f"{V1}/commands", reply.status, reply.json, headers=reply.headers)
        with lock:
            statuses.append(reply.status)

    threads = [threading.Thread(target=burst) for _ in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert 429 in statuses and set(statuses) <= {429, 200}


def test_auth_errors_conform(make_engine, monkeypatch) -> None:
    monkeypatch.setenv("SPLICEWAY_TEST_ADMIN_KEY", "admin-secret")
    monkeypatch.setenv("SPLICEWAY_TEST_READ_KEY", "read-secret")
    monkeypatch.setenv("SPLICEWAY_TEST_CONTROL_KEY", "control-secret")
    engine = make_engine(
        control_config(
            api_key_env="SPLICEWAY_TEST_ADMIN_KEY",
            keys=[
                {"name": "reader", "key_env": "SPLICEWAY_TEST_READ_KEY", "permissions": ["read"]},
                {
                    "name": "operator",
                    "key_env": "SPLICEWAY_TEST_CONTROL_KEY",
                    "permissions": ["control"],
                },
            ],
        )
    )
    anonymous = Api(engine.control_url)
    for template in (f"{V1}/health", f"{V1}/flows", f"{V1}/openapi.json"):
        assert anonymous.check("GET", template, 401)["error"]["code"] == "unauthenticated"
    anonymous.check("POST", f"{V1}/commands", 401, body={"method": "tun.stop", "params": {}})
    wrong = Api(engine.control_url, {"Authorization": "Bearer wrong"})
    wrong.check("GET", f"{V1}/stats", 401)

    reader = Api(engine.control_url, {"X-Service-Api-Key": "read-secret"})
    assert reader.get(f"{V1}/capabilities")["permissions"] == ["read"]
    denied = reader.command("mode.set", {"mode": "direct"}, 403)
    assert denied["error"]["code"] == "permission_denied"

    operator = Api(engine.control_url, {"Authorization": "Bearer control-secret"})
    operator.check("GET", f"{V1}/health", 403)
    operator.command("flows.close", {"flow_id": "gone"}, 404)

    admin = Api(engine.control_url, {"Authorization": "Bearer admin-secret"})
    assert admin.get(f"{V1}/capabilities")["permissions"] == sorted(
        ["read", "control", "config", "admin"]
    )
    # Preflights need no key.
    anonymous.check("OPTIONS", f"{V1}/commands", 200)


# ---------------------------------------------------------------------------
# Known API bugs (see the report): non-ASCII digits crash the integer parsers
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("template", "path", "headers"),
    [
        pytest.param(f"{V1}/flows", f"{V1}/flows?limit=%C2%B2", None, id="flows-limit"),
        pytest.param(
            f"{V1}/flows", f"{V1}/flows?limit=%EF%BC%91%EF%BC%90", None, id="flows-fullwidth"
        ),
        pytest.param(
            f"{V1}/events/stream", f"{V1}/events/stream?since=%C2%B2", None, id="stream-since"
        ),
        pytest.param(
            f"{V1}/events/stream",
            f"{V1}/events/stream",
            {"Last-Event-ID": "\u00b2"},
            id="stream-last-event-id",
        ),
    ],
)
def test_non_ascii_digits_are_invalid_argument(base_url, template, path, headers) -> None:
    Api(base_url).check("GET", template, 400, path=path, headers=headers)


def test_app_serves_the_same_document_without_a_listener(app_for) -> None:
    client = local_client(app_for())
    result = client.simulate_get(f"{V1}/openapi.json")
    assert result.status_code == 200
    assert result.json == json.loads(json.dumps(DOC))


@pytest.mark.parametrize(
    ("params", "valid"),
    [
        ({"domain": "a.example"}, True),
        ({"ip": "198.18.0.1"}, True),
        ({"domain": None, "ip": "198.18.0.1"}, True),
        ({}, False),
        ({"domain": None, "ip": None}, False),
        ({"domain": "a.example", "ip": "198.18.0.1"}, False),
        ({"domain": ""}, False),
    ],
)
def test_fakeip_lookup_params_document_the_handlers_rule(engine, params, valid) -> None:
    """The document and the handler agree on ``diagnostics.fakeip_lookup``'s params: what
    the schema accepts is answered, what it rejects is ``invalid_argument`` (schemathesis
    found ``{}`` valid by the document and answered 400)."""
    from spliceway.control import commands
    from spliceway.errors import ApiError

    if valid:
        validate_component("FakeIpLookupParams", params)
        result = commands.execute(engine.core, "diagnostics.fakeip_lookup", params, {"admin"})
        assert result["enabled"] is False
    else:
        with pytest.raises(jsonschema.ValidationError):
            validate_component("FakeIpLookupParams", params)
        with pytest.raises(ApiError) as info:
            commands.execute(engine.core, "diagnostics.fakeip_lookup", params, {"admin"})
        assert info.value.code == "invalid_argument"


def test_an_oversized_command_body_is_a_documented_413(base_url) -> None:
    """A declared body over 16 MiB is refused before it is read, as the document says."""
    host, port = base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            f"POST {V1}/commands HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {16 * 1024 * 1024 + 1}\r\n\r\n"
            .encode()
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    assert lines[0].startswith("HTTP/1.1 413 ")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    assert headers["Connection"].lower() == "close"
    validate_response("POST", f"{V1}/commands", 413, json.loads(body), headers=headers)
