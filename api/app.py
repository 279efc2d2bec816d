"""The HTTP control API: a Falcon WSGI app over the engine (docs/http-api.md, docs/security.md).

``create_app(plane)`` builds it over a :class:`~spliceway.api.plane.ControlPlane`
(the running engine as its transports see it); ``api.server`` serves it on Waitress. Every
response carries the envelope ``{api_id, id, ok, result | error}`` and
``Access-Control-Allow-Origin: *`` (the SSE stream and the OpenAPI document
are bodies of their own formats). One gate checks, authenticates, authorises
and rate-limits every request before routing; one error handler turns every
failure, Falcon's own routing errors included, into the envelope and the
status of ``spliceway.errors``.

Browser protection (the gate; the rules are :mod:`spliceway.api.browser`'s, shared
with the Clash API; see docs/security.md). With no key configured anyone who can
reach the port may call the API, so a web page must not be able to act through a
visitor's browser. Every request, preflights included,
is then refused with 403 ``permission_denied`` when
- its ``Host`` names neither the listen address nor a loopback name
  (``localhost``, ``*.localhost``, 127.0.0.0/8, ``[::1]``; any IP literal when
  listening on a wildcard address) with the bound port (no port: 80), which
  stops DNS rebinding;
- its ``Origin`` is not ``http://`` + that ``Host`` (compared without case);
  ``Origin: null`` included;
- its ``Sec-Fetch-Site`` is neither ``same-origin`` nor ``none`` (no-cors GETs,
  which carry no Origin).
With a key configured none of this applies: the key is the protection, and
cross-origin callers holding it work. Whatever the keys, ``POST
/api/v1/commands`` needs ``Content-Type: application/json`` (415
``invalid_argument`` otherwise, checked before the body is read): that is the
one type a browser will not send cross-origin without a preflight.

Query strings: no endpoint ignores a parameter. A name given twice, or one
the endpoint does not declare (the query table's declarations for queries),
is 400 ``invalid_argument`` naming it; blank values are kept, not dropped.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import falcon
import orjson

from spliceway.api.auth import KeyTable, Principal
from spliceway.api.browser import KeylessRules, foreign_refusal
from spliceway.api.http_guard import UNSENT_BYTES_KEY, source_key
from spliceway.api.limits import FailureLimiter, Limits, RateLimited, Slots, TokenBucket
from spliceway.api.metrics import MetricsResource
from spliceway.api.openapi import openapi_document
from spliceway.api.plane import ControlPlane
from spliceway.api.sse import (
    KEEPALIVE_S,
    EventStream,
    FrameCache,
    open_stream,
    parse_since,
)
from spliceway.api.ui_files import UI_PATH, UiFiles, is_ui_path
from spliceway.control import queries
from spliceway.control.capabilities import API_ID, capabilities
from spliceway.errors import ApiError, code_for_http_status, invalid_argument
from spliceway.events.log import parse_types

logger = logging.getLogger(__name__)

PREFIX = "/api/v1"
COMMANDS_PATH = f"{PREFIX}/commands"
MAX_BODY_BYTES = 16 * 1024 * 1024
_ALLOW_HEADERS = "Authorization, X-Service-Api-Key, Content-Type, Last-Event-ID"
_COMMAND_KEYS = frozenset({"id", "method", "params"})
_STREAM_PARAMS = ("types", "since")


def envelope_ok(result: Any, request_id: Any = None) -> bytes:
    """A success envelope."""
    return orjson.dumps({"api_id": API_ID, "id": request_id, "ok": True, "result": result})


def body_request_id(body: dict[str, Any]) -> Any:
    """A request body's ``id`` (a string, a number or null), else ``invalid_argument``."""
    value = body.get("id")
    if value is not None and (isinstance(value, bool) or not isinstance(value, str | int | float)):
        raise invalid_argument("id must be a string, a number or null", field_path="id")
    return value


def body_too_large(limit: int = MAX_BODY_BYTES) -> ApiError:
    """The error for a request body over ``limit`` bytes: 413 ``invalid_argument``."""
    return ApiError("invalid_argument", f"body larger than {limit} bytes", http_status=413)


def envelope_error(error: ApiError, request_id: Any = None) -> bytes:
    """An error envelope."""
    return orjson.dumps({"api_id": API_ID, "id": request_id, "ok": False, "error": error.to_dict()})


def require_read(principal: Principal) -> None:
    """Every query and event stream needs ``read`` (docs/security.md); commands need what
    their table entry says, which ``commands.execute`` checks."""
    if not principal.grants("read"):
        raise ApiError("permission_denied", "this endpoint needs the read permission")


def caller_capabilities(plane: ControlPlane, principal: Principal) -> dict[str, Any]:
    """The capabilities resource as ``principal`` sees it: its own grants, and which
    transports this engine serves."""
    api = plane.api_settings
    return capabilities(
        principal.effective_permissions,
        api_enabled=api.control.enabled,
        # A running engine's is decided (config.resolve_ipc): never None here.
        ipc_enabled=bool(api.ipc.enabled),
        grpc_enabled=api.grpc.enabled,
        clash_enabled=api.clash.enabled,
    )


@dataclass
class ControlState:
    """What every request of one app shares."""

    plane: ControlPlane
    keys: KeyTable
    limits: Limits
    keepalive_s: float
    #: The bound ``(address, port)`` the app answers on: set by ``ControlServer`` once
    #: it has bound (or by ``create_app(listen=...)``). None: the address is unknown
    #: (only loopback names pass the Host check) and the port is the WSGI
    #: server's ``SERVER_PORT``.
    listen: tuple[str, int] | None = None
    query_bucket: TokenBucket = field(init=False)
    command_bucket: TokenBucket = field(init=False)
    sse_slots: Slots = field(init=False)
    auth_failures: FailureLimiter = field(init=False)
    frames: FrameCache = field(init=False)
    streams: set[EventStream] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.query_bucket = TokenBucket(self.limits.queries_per_second)
        self.command_bucket = TokenBucket(self.limits.commands_per_second)
        self.sse_slots = Slots(self.limits.sse_streams)
        limits = self.limits
        self.auth_failures = FailureLimiter(
            limits.failed_auth_per_source_per_second,
            limits.failed_auth_per_source_burst,
            limits.failed_auth_per_second,
            limits.failed_auth_burst,
        )
        self.frames = FrameCache(encode=self.plane.log.encoded)

    def authenticate(
        self, authorization: str | None, api_key: str | None, source: str
    ) -> Principal:
        """The caller the key headers name; a missing or wrong key is ``unauthenticated``,
        or ``rate_limited`` once ``source`` (see ``http_guard.source_key``) or the engine
        is over the failed-authentication limits. A valid key is never limited here."""
        try:
            return self.keys.authenticate(authorization, api_key)
        except ApiError:
            wait = self.auth_failures.failed(source)
            if wait:
                raise RateLimited(
                    "too many requests with a missing or wrong API key from this address "
                    "or in all; retry later",
                    wait,
                ) from None
            raise

    def open_streams(self) -> int:
        """How many SSE streams are open now."""
        with self.lock:
            return len(self.streams)

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


#: How the control API words a keyless refusal (the rules: ``api.browser``).
_KEYLESS = KeylessRules(
    subject="a control API without a key",
    remedy="configure a key (api.control.api_key_env or api.control.keys) to allow",
    see="docs/security.md",
)


def _refuse_foreign(req: falcon.Request, listen: tuple[str, int] | None) -> None:
    """Refuse (403) a request a keyless API must not answer: foreign Host, Origin or site."""
    if listen is None:
        listen_or_env: tuple[str | None, int] = (None, int(req.env.get("SERVER_PORT") or 80))
    else:
        listen_or_env = listen
    problem = foreign_refusal(
        _KEYLESS,
        listen_or_env,
        req.get_header("Host"),
        req.get_header("Origin"),
        req.get_header("Sec-Fetch-Site"),
    )
    if problem is not None:
        raise ApiError("permission_denied", problem)


def _require_json(req: falcon.Request) -> None:
    """Refuse (415) a command whose body is not declared ``application/json``."""
    declared = req.content_type
    media = (declared or "").split(";", 1)[0].strip().lower()
    if media != falcon.MEDIA_JSON:
        got = f"Content-Type {declared}" if declared else "no Content-Type"
        raise ApiError(
            "invalid_argument",
            f"POST {COMMANDS_PATH} needs Content-Type: application/json (this request has "
            f"{got}); send the JSON body with that header",
            field_path="Content-Type",
            http_status=415,
        )


class _Gate:
    """Middleware: browser protection, CORS, preflight, authentication, read permission,
    the command body's media type, rate limits."""

    def __init__(self, state: ControlState) -> None:
        self._state = state

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        req.context.request_id = None
        state = self._state
        if not state.keys.required:
            _refuse_foreign(req, state.listen)
        if req.method == "OPTIONS":
            resp.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS")
            resp.set_header("Access-Control-Allow-Headers", _ALLOW_HEADERS)
            resp.set_header("Access-Control-Max-Age", "600")
            _send(resp, envelope_ok({}))
            resp.complete = True
            return
        if is_ui_path(req.path):
            # The dashboard's files hold no data; the page asks for the key itself.
            return
        # Behind api.server's Waitress a missing or wrong key was refused on the head
        # already, before the body was read; this serves any other WSGI server.
        principal = state.authenticate(
            req.get_header("Authorization"),
            req.get_header("X-Service-Api-Key"),
            source_key(req.remote_addr or ""),
        )
        req.context.principal = principal
        is_command = req.path == COMMANDS_PATH and req.method == "POST"
        if not is_command:
            require_read(principal)
        if is_command:
            # Before the rate limit: a request refused for its form spends no command token.
            _require_json(req)
        bucket = state.command_bucket if is_command else state.query_bucket
        wait = bucket.take()
        if wait:
            kind = "command" if is_command else "query"
            raise RateLimited(f"{kind} rate limit exceeded", wait)

    def process_response(
        self, req: falcon.Request, resp: falcon.Response, resource: object, ok: bool
    ) -> None:
        # Falcon runs this for every response, errors, refusals and preflights included.
        resp.set_header("Access-Control-Allow-Origin", "*")
        resp.set_header("Access-Control-Expose-Headers", "Retry-After, WWW-Authenticate")


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
    # Falcon types them as a mapping or (name, value) pairs; dict() takes both.
    for name, value in dict(ex.headers or {}).items():
        resp.set_header(name, value)
    error = ApiError(code, message, http_status=status)
    _send(resp, envelope_error(error, getattr(req.context, "request_id", None)), status)


def _on_exception(req: falcon.Request, resp: falcon.Response, ex: Exception, params: Any) -> None:
    logger.exception("control API: unexpected error on %s %s", req.method, req.path)
    error = ApiError("internal", f"internal error: {type(ex).__name__}")
    _send(resp, envelope_error(error, getattr(req.context, "request_id", None)), 500)


def _query_args(req: falcon.Request) -> dict[str, str]:
    """The query string, one value per name (blank values kept); a name given twice is
    ``invalid_argument`` naming it."""
    args: dict[str, str] = {}
    for name, value in req.params.items():
        if isinstance(value, list):
            raise invalid_argument(
                f"query parameter {name!r} is given {len(value)} times; give it once", name
            )
        args[name] = value
    return args


class _Query:
    """A query resource answered from the engine's query table (which checks the names)."""

    def __init__(self, state: ControlState, name: str) -> None:
        self._state = state
        self._name = name

    def on_get(self, req: falcon.Request, resp: falcon.Response, **path: str) -> None:
        args: dict[str, Any] = _query_args(req)
        for key, value in path.items():
            if key in args:
                raise invalid_argument(f"{key} is given both in the path and in the query", key)
            args[key] = value
        _send(resp, envelope_ok(self._state.plane.run_query(self._name, args)))


class _Capabilities:
    def __init__(self, state: ControlState) -> None:
        self._state = state

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        queries.check_params("capabilities", _query_args(req))
        _send(resp, envelope_ok(caller_capabilities(self._state.plane, _principal(req))))


class _Commands:
    def __init__(self, state: ControlState) -> None:
        self._state = state

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        queries.reject_unknown(_query_args(req), (), f"POST {COMMANDS_PATH}")
        # A declared length over the cap is refused before reading any of it.
        declared_too_large = (req.content_length or 0) > MAX_BODY_BYTES
        raw = b"" if declared_too_large else req.bounded_stream.read(MAX_BODY_BYTES + 1)
        if declared_too_large or len(raw) > MAX_BODY_BYTES:
            raise body_too_large()
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as ex:
            raise invalid_argument(f"body is not JSON: {ex}") from ex
        if not isinstance(body, dict):
            raise invalid_argument("body must be a JSON object")
        req.context.request_id = rid = body_request_id(body)
        for key in body:
            if key not in _COMMAND_KEYS:
                raise invalid_argument(f"unknown field {key!r}", field_path=key)
        result = self._state.plane.execute(
            body.get("method"),
            body.get("params"),
            _principal(req).permissions,
            transport="http",
        )
        _send(resp, envelope_ok(result, rid))


class _EventStream:
    def __init__(self, state: ControlState) -> None:
        self._state = state

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        state = self._state
        args = _query_args(req)
        queries.reject_unknown(args, _STREAM_PARAMS, f"GET {PREFIX}/events/stream")
        if args.get("since") == "":
            raise invalid_argument("since must be a non-negative event sequence", "since")
        types = parse_types(args.get("types"))
        since = parse_since(args.get("since"), req.get_header("Last-Event-ID"))
        if not state.sse_slots.acquire():
            raise RateLimited(f"at most {state.sse_slots.capacity} concurrent event streams", 1.0)
        try:
            sub, preface = open_stream(state.plane.log, types, since, state.plane.flow_records)
        except BaseException:
            state.sse_slots.release()
            raise

        def release() -> None:
            with state.lock:
                state.streams.discard(stream)
            state.sse_slots.release()

        disconnected = req.env.get("waitress.client_disconnected") or (lambda: False)
        stream = EventStream(
            sub,
            state.frames,
            release,
            disconnected,
            state.keepalive_s,
            preface,
            unsent=req.env.get(UNSENT_BYTES_KEY),
        )
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
        queries.reject_unknown(_query_args(req), (), f"GET {PREFIX}/openapi.json")
        _send(resp, self._body)


class ControlApp(falcon.App):
    """The control API app; ``state`` is what its requests share."""

    state: ControlState


def create_app(
    plane: ControlPlane,
    *,
    keys: KeyTable | None = None,
    limits: Limits | None = None,
    keepalive_s: float = KEEPALIVE_S,
    listen: tuple[str, int] | None = None,
) -> ControlApp:
    """The control API's WSGI app over ``plane`` (``Engine.control_plane``).

    ``keys`` defaults to the keys ``api.control`` names in the environment;
    ``limits`` to the documented limits (tests and benchmarks may pass others).
    ``listen`` is the bound ``(address, port)`` the keyless Host check accepts;
    ``ControlServer`` sets it once it has bound, so only an app served by another
    WSGI server needs it (without it, only loopback names pass, on ``SERVER_PORT``).
    """
    if keys is None:
        keys = KeyTable.from_config(plane.api_settings.control)
    state = ControlState(plane, keys, limits or Limits(), keepalive_s, listen)
    app = ControlApp(middleware=[_Gate(state)])
    app.req_options.strip_url_path_trailing_slash = True
    # Falcon's default, stated: a blank ``?x=`` reaches the checks instead of vanishing.
    app.req_options.keep_blank_qs_values = True
    app.resp_options.default_media_type = falcon.MEDIA_JSON
    plain = (
        "health",
        "config",
        "runtime",
        "stats",
        "flows",
        "policies",
        "providers",
        "sinks",
        "tun_status",
        "events",
        "logs",
    )
    for name in plain:
        app.add_route(f"{PREFIX}/{name}", _Query(state, name))
    app.add_route(f"{PREFIX}/capabilities", _Capabilities(state))
    app.add_route(f"{PREFIX}/flows/{{flow_id}}", _Query(state, "flow"))
    app.add_route(f"{PREFIX}/policies/{{policy_tag}}", _Query(state, "policy"))
    app.add_route(COMMANDS_PATH, _Commands(state))
    app.add_route(f"{PREFIX}/events/stream", _EventStream(state))
    app.add_route(f"{PREFIX}/openapi.json", _OpenApi())
    app.add_route("/metrics", MetricsResource(plane.metrics_registry(state.open_streams)))
    ui = UiFiles()
    app.add_route(UI_PATH, ui)
    app.add_route(f"{UI_PATH}/{{name}}", ui)
    app.add_error_handler(Exception, _on_exception)
    app.add_error_handler(falcon.HTTPError, _on_http_error)
    app.add_error_handler(ApiError, _on_api_error)
    app.state = state
    return app
