"""The HTTP control API: a Falcon WSGI app over the engine (interface.md 2.1, 4, 5, 7, 8).

``create_app(engine)`` builds it; ``api.server`` serves it on Waitress. Every
response carries the envelope ``{api_id, id, ok, result | error}`` and
``Access-Control-Allow-Origin: *`` (the SSE stream and the OpenAPI document
are bodies of their own formats). One gate authenticates, authorises and
rate-limits every request before routing; one error handler turns every
failure, Falcon's own routing errors included, into the envelope and the
status of ``spliceway.errors``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import falcon
import orjson
from spliceway.api.auth import KeyTable, Principal
from spliceway.api.limits import Limits, RateLimited, Slots, TokenBucket
from spliceway.api.openapi import openapi_document
from spliceway.api.sse import (
    KEEPALIVE_S,
    EventStream,
    FrameCache,
    open_stream,
    parse_since,
    parse_types,
)

from spliceway import commands, queries
from spliceway.capabilities import API_ID, capabilities
from spliceway.errors import ApiError, code_for_http_status, invalid_argument

if TYPE_CHECKING:
    from spliceway.engine import Engine
    from spliceway.engine_core import EngineCore

logger = logging.getLogger(__name__)

PREFIX = "/api/v1"
COMMANDS_PATH = f"{PREFIX}/commands"
MAX_BODY_BYTES = 16 * 1024 * 1024
_ALLOW_HEADERS = "Authorization, X-Service-Api-Key, Content-Type, Last-Event-ID"
_COMMAND_KEYS = frozenset({"id", "method", "params"})


def envelope_ok(result: Any, request_id: Any = None) -> bytes:
    """A success envelope (interface.md 2.1)."""
    return orjson.dumps({"api_id": API_ID, "id": request_id, "ok": True, "result": result})


def envelope_error(error: ApiError, request_id: Any = None) -> bytes:
    """An error envelope (interface.md 2.1)."""
    return orjson.dumps({"api_id": API_ID, "id": request_id, "ok": False, "error": error.to_dict()})


@dataclass
class ControlState:
    """What every request of one app shares."""

    core: EngineCore
    keys: KeyTable
    limits: Limits
    keepalive_s: float
    query_bucket: TokenBucket = field(init=False)
    command_bucket: TokenBucket = field(init=False)
    sse_slots: Slots = field(init=False)
    frames: FrameCache = field(default_factory=FrameCache)
    streams: set[EventStream] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.query_bucket = TokenBucket(self.limits.queries_per_second)
        self.command_bucket = TokenBucket(self.limits.commands_per_second)
        self.sse_slots = Slots(self.limits.sse_streams)

    def close_streams(self) -> None:
        """End every open SSE stream (server shutdown)."""
        with self.lock:
            streams = list(self.streams)
        for stream in streams:
            stream.close()


def _send(resp: falcon.Response, body: bytes, status: int = 200) -> None:
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    resp.data = body


def _principal(req: falcon.Request) -> Principal:
    principal: Principal = req.context.principal
    return principal


class _Gate:
    """Middleware: CORS, preflight, authentication, read permission, rate limits."""

    def __init__(self, state: ControlState) -> None:
        self._state = state

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.request_id = None
        if req.method == "OPTIONS":
            resp.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            resp.set_header("Access-Control-Allow-Headers", _ALLOW_HEADERS)
            resp.set_header("Access-Control-Max-Age", "600")
            _send(resp, envelope_ok({}))
            resp.complete = True
            return
        state = self._state
        principal = state.keys.authenticate(
            req.get_header("Authorization"), req.get_header("X-Service-Api-Key")
        )
        req.context.principal = principal
        is_command = req.path == COMMANDS_PATH and req.method == "POST"
        if not is_command and not principal.grants("read"):
            raise ApiError("permission_denied", "this endpoint needs the read permission")
        bucket = state.command_bucket if is_command else state.query_bucket
        wait = bucket.take()
        if wait:
            kind = "command" if is_command else "query"
            raise RateLimited(f"{kind} rate limit exceeded", wait)

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: object, ok: bool
    ) -> None:
        # Falcon runs this for every response, errors and preflights included.
        resp.set_header("Access-Control-Allow-Origin", "*")


def _on_api_error(req: falcon.Request, resp: falcon.Response, ex: ApiError, params: Any) -> None:
    if isinstance(ex, RateLimited):
        resp.set_header("Retry-After", str(ex.retry_after))
    if ex.code == "unauthenticated":
        resp.set_header("WWW-Authenticate", 'Bearer realm="spliceway"')
    _send(resp, envelope_error(ex, getattr(req.context, "request_id", None)), ex.http_status)


def _on_http_error(
    req: falcon.Request, resp: falcon.Response, ex: falcon.HTTPError, params: Any
) -> None:
    status = ex.status_code
    code = code_for_http_status(status)
    if status == 404:
        message = f"no endpoint {req.path}"
    elif status == 405:
        message = f"{req.method} is not supported on {req.path}"
    else:
        message = ex.description or ex.title or f"HTTP {status}"
    for name, value in (ex.headers or {}).items():
        resp.set_header(name, value)
    error = ApiError(code, message, http_status=status)
    _send(resp, envelope_error(error, getattr(req.context, "request_id", None)), status)


def _on_exception(req: falcon.Request, resp: falcon.Response, ex: Exception, params: Any) -> None:
    logger.exception("control API: unexpected error on %s %s", req.method, req.path)
    error = ApiError("internal", f"internal error: {type(ex).__name__}")
    _send(resp, envelope_error(error, getattr(req.context, "request_id", None)), 500)


class _Query:
    """A plain query resource answered from the engine's query table."""

    def __init__(self, state: ControlState, name: str, params: tuple[str, ...] = ()) -> None:
        self._state = state
        self._name = name
        self._params = params

    def on_get(self, req: falcon.Request, resp: falcon.Response, **path: str) -> None:
        args: dict[str, Any] = dict(path)
        for key in self._params:
            value = req.get_param(key)
            if value is not None:
                args[key] = value
        _send(resp, envelope_ok(queries.run_query(self._state.core, self._name, args)))


class _Capabilities:
    def __init__(self, state: ControlState) -> None:
        self._state = state

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        enabled = self._state.core.config.api.control.enabled
        perms = _principal(req).effective_permissions
        _send(resp, envelope_ok(capabilities(perms, api_enabled=enabled)))


class _Commands:
    def __init__(self, state: ControlState) -> None:
        self._state = state

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        # A declared length over the cap is refused before reading any of it.
        declared_too_large = (req.content_length or 0) > MAX_BODY_BYTES
        raw = b"" if declared_too_large else req.bounded_stream.read(MAX_BODY_BYTES + 1)
        if declared_too_large or len(raw) > MAX_BODY_BYTES:
            raise invalid_argument(f"body larger than {MAX_BODY_BYTES} bytes")
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as ex:
            raise invalid_argument(f"body is not JSON: {ex}") from ex
        if not isinstance(body, dict):
            raise invalid_argument("body must be a JSON object")
        request_id = body.get("id")
        if request_id is not None and (
            isinstance(request_id, bool) or not isinstance(request_id, str | int | float)
        ):
            raise invalid_argument("id must be a string, a number or null", field_path="id")
        req.context.request_id = request_id
        for key in body:
            if key not in _COMMAND_KEYS:
                raise invalid_argument(f"unknown field {key!r}", field_path=key)
        result = commands.execute(
            self._state.core,
            body.get("method"),
            body.get("params"),
            _principal(req).permissions,
        )
        _send(resp, envelope_ok(result, request_id))


class _EventStream:
    def __init__(self, state: ControlState) -> None:
        self._state = state

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        state = self._state
        types = parse_types(req.get_param("types"))
        since = parse_since(req.get_param("since"), req.get_header("Last-Event-ID"))
        if not state.sse_slots.acquire():
            raise RateLimited(f"at most {state.sse_slots.capacity} concurrent event streams", 1.0)
        try:
            sub, preface = open_stream(state.core.log, types, since, state.core.flows.records)
        except BaseException:
            state.sse_slots.release()
            raise

        def release() -> None:
            with state.lock:
                state.streams.discard(stream)
            state.sse_slots.release()

        disconnected = req.env.get("waitress.client_disconnected") or (lambda: False)
        stream = EventStream(sub, state.frames, release, disconnected, state.keepalive_s, preface)
        with state.lock:
            state.streams.add(stream)
        resp.content_type = "text/event-stream"
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Accel-Buffering", "no")
        resp.stream = stream


class _OpenApi:
    def __init__(self) -> None:
        self._body = orjson.dumps(openapi_document())

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        _send(resp, self._body)


class ControlApp(falcon.App):
    """The control API app; ``state`` is what its requests share."""

    state: ControlState


def create_app(
    engine: Engine,
    *,
    keys: KeyTable | None = None,
    limits: Limits | None = None,
    keepalive_s: float = KEEPALIVE_S,
) -> ControlApp:
    """The control API's WSGI app for ``engine``.

    ``keys`` defaults to the keys ``api.control`` names in the environment;
    ``limits`` to interface.md 8 (tests and benchmarks may pass others).
    """
    core = engine.core
    if keys is None:
        keys = KeyTable.from_config(core.config.api.control)
    state = ControlState(core, keys, limits or Limits(), keepalive_s)
    app = ControlApp(middleware=[_Gate(state)])
    app.req_options.strip_url_path_trailing_slash = True
    app.resp_options.default_media_type = falcon.MEDIA_JSON
    plain = ("health", "config", "runtime", "stats", "policies", "sinks", "tun_status", "events")
    for name in plain:
        app.add_route(f"{PREFIX}/{name}", _Query(state, name))
    app.add_route(f"{PREFIX}/capabilities", _Capabilities(state))
    app.add_route(
        f"{PREFIX}/flows", _Query(state, "flows", ("limit", "inbound_tag", "principal_key"))
    )
    app.add_route(f"{PREFIX}/flows/{{flow_id}}", _Query(state, "flow"))
    app.add_route(f"{PREFIX}/policies/{{policy_tag}}", _Query(state, "policy"))
    app.add_route(COMMANDS_PATH, _Commands(state))
    app.add_route(f"{PREFIX}/events/stream", _EventStream(state))
    app.add_route(f"{PREFIX}/openapi.json", _OpenApi())
    app.add_error_handler(Exception, _on_exception)
    app.add_error_handler(falcon.HTTPError, _on_http_error)
    app.add_error_handler(ApiError, _on_api_error)
    app.state = state
    return app
