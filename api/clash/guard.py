"""CORS, the secret and browser protection in front of every Clash API route.

One pure-ASGI middleware (:func:`wrap`), for plain HTTP requests and WebSocket upgrades
alike, decides in mihomo's order before any route runs:

1. **CORS preflights** (``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``)
   are answered here and never reach a route or need the secret: 204 with
   ``Access-Control-Allow-*`` to an allowed origin, 403 ``{"message"}`` to another.
   Allowed: the API's own origin (``http://`` + ``Host``) and the origins of
   ``cors_allow_origins`` (``*``: every origin). Every other answer to an allowed
   origin carries ``Access-Control-Allow-Origin`` (that origin) and ``Vary: Origin``,
   refusals included, so a dashboard can read why it was refused.
2. **With a secret**: ``Authorization: Bearer <secret>`` (the first word exactly
   ``Bearer``), or, on a WebSocket upgrade only, a non-empty ``?token=<secret>``
   (browsers cannot set headers on a WebSocket); both compared in constant time.
   Anything else is 401 ``{"message": "Unauthorized"}``; a WebSocket upgrade is refused
   with that same HTTP answer (uvicorn's ``websocket.http.response`` extension). The
   dashboard's files (``/ui``, when ``external_ui`` is set) need no secret, as in mihomo.
3. **Without a secret**: the keyless rules of the control API (:mod:`spliceway.api.browser`,
   docs/security.md) on every request, preflights and upgrades included: a foreign
   ``Host``, an ``Origin`` neither the API's own nor configured, or a cross-site
   ``Sec-Fetch-Site`` is 403 ``{"message"}`` saying why.
4. **Bodies**: a declared ``Content-Length`` over 1 MiB is 413 ``{"message": "Body too
   large"}`` on the head; a chunked body is read here, at most 1 MiB of it, before the
   route runs (413 past that), so no route ever reads or acts on more.

Refusals do not close the connection: a client still sending its body would get a
reset that loses the answer, while uvicorn, once the answer is out, reads and drops the
rest of a body no route took. A WebSocket upgrade no route takes is answered 404
``{"message": "Resource not found"}``, as a plain request is. An exception escaping a
route is logged with its traceback and answered 500 ``{"message": "internal error"}``
when nothing was sent yet; it never reaches the server's thread.
:func:`exception_handlers` gives the Starlette app mihomo's error shape for its own
answers (404, 405) and for an :class:`~spliceway.errors.ApiError` a route lets through.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping
from typing import Any, cast
from urllib.parse import parse_qsl

from starlette.datastructures import Headers, MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, HTTPConnection
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, ExceptionHandler, Message, Receive, Scope, Send
from starlette.websockets import WebSocket, WebSocketDisconnect
from uvicorn.protocols.utils import ClientDisconnected

from spliceway.api.browser import KeylessRules, foreign_refusal, is_same_origin
from spliceway.api.clash.context import ClashContext
from spliceway.api.clash.static import UI_PATH
from spliceway.errors import ApiError

__all__ = [
    "MAX_BODY_BYTES",
    "error_response",
    "exception_handlers",
    "wrap",
]

logger = logging.getLogger(__name__)

#: The largest request body any route is given (mihomo's ``/storage`` limit; no Clash
#: route needs more).
MAX_BODY_BYTES = 1 << 20
UNAUTHORIZED = "Unauthorized"
BODY_TOO_LARGE = "Body too large"
NOT_FOUND = "Resource not found"
METHOD_NOT_ALLOWED = "Method not allowed"
INTERNAL_ERROR = "internal error"

_ALLOW_METHODS = "GET, POST, PUT, PATCH, DELETE"
_ALLOW_HEADERS = "Content-Type, Authorization"
_MAX_AGE = "300"
_ORIGINS_SETTING = "api.clash.cors_allow_origins"
#: Set in a WebSocket scope once the socket is accepted: error handlers then close it.
_ACCEPTED = "spliceway.clash.accepted"
#: Disconnections are the client's doing, not a fault of the route: no traceback.
_GONE = (ClientDisconnect, WebSocketDisconnect, ClientDisconnected)


def wrap(app: ASGIApp, ctx: ClashContext) -> ASGIApp:
    """``app`` behind the Clash listener's guard (see the module's docstring)."""
    return _Guard(app, ctx)


def error_response(
    status: int, message: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """mihomo's error answer: ``{"message": ...}`` as ``application/json``."""
    return JSONResponse({"message": message}, status_code=status, headers=headers)


def exception_handlers() -> dict[Any, ExceptionHandler]:
    """Starlette ``exception_handlers`` giving every answer of the app mihomo's shape:

    - its router's and ``StaticFiles``' 404 and 405 (``{"message": "Resource not found"}``,
      ``{"message": "Method not allowed"}`` with ``Allow``), any other ``HTTPException``
      as ``{"message": <detail>}``;
    - an :class:`~spliceway.errors.ApiError` a route lets through: its HTTP status
      (``invalid_argument`` 400, ``not_found`` 404, ...) and its message;
    - any other exception: 500 ``{"message": "internal error"}`` (the guard logs it).

    On a WebSocket these answer the upgrade when raised before it is accepted; after, the
    socket is closed with code 1011 and the message as its reason.
    """
    # One handler serves both kinds of connection; Starlette types them apart.
    return {
        HTTPException: cast(ExceptionHandler, _on_http_exception),
        ApiError: cast(ExceptionHandler, _on_api_error),
        Exception: cast(ExceptionHandler, _on_exception),
    }


async def _answer(
    conn: HTTPConnection, status: int, message: str, headers: Mapping[str, str] | None = None
) -> Response | None:
    """The error answer for ``conn``; None when it is an open WebSocket, which an HTTP
    answer can no longer reach: it is closed (1011) with the message as its reason."""
    if isinstance(conn, WebSocket) and conn.scope.get(_ACCEPTED):
        await _close_socket(conn.send, message)
        return None
    return error_response(status, message, headers)


async def _on_http_exception(conn: HTTPConnection, exc: Exception) -> Response | None:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 404:
        message = NOT_FOUND
    elif exc.status_code == 405:
        message = METHOD_NOT_ALLOWED
    else:
        message = exc.detail
    return await _answer(conn, exc.status_code, message, exc.headers)


async def _on_api_error(conn: HTTPConnection, exc: Exception) -> Response | None:
    assert isinstance(exc, ApiError)
    return await _answer(conn, exc.http_status, exc.message)


async def _on_exception(conn: HTTPConnection, exc: Exception) -> Response | None:
    # Logged by the guard, which sees the exception Starlette re-raises after this answer.
    return error_response(500, INTERNAL_ERROR)


async def _close_socket(send: Send, message: str) -> None:
    # A close frame's reason holds 123 bytes at most.
    reason = message.encode("utf-8")[:123].decode("utf-8", "ignore")
    await send({"type": "websocket.close", "code": 1011, "reason": reason})


def _is_ui(path: str) -> bool:
    return path == UI_PATH or path.startswith(UI_PATH + "/")


def _ws_token(scope: Scope) -> bytes:
    """The first ``token`` of the query string, percent-decoded, as bytes (empty: none)."""
    # Latin-1 maps bytes to code points one to one: the percent-decoded bytes come back
    # exactly, UTF-8 or not, to be compared with the secret's bytes.
    query = scope.get("query_string", b"").decode("latin-1")
    for name, value in parse_qsl(query, keep_blank_values=True, encoding="latin-1"):
        if name == "token":
            return value.encode("latin-1")
    return b""


class _Guard:
    """The middleware :func:`wrap` returns."""

    def __init__(self, app: ASGIApp, ctx: ClashContext) -> None:
        self._app = app
        self._ctx = ctx
        settings = ctx.settings
        self._secret = None if ctx.secret is None else ctx.secret.encode("utf-8")
        self._ui = settings.external_ui is not None
        self._rules = KeylessRules(
            subject="a Clash API without a secret",
            remedy="set api.clash.secret_env, or list trusted origins in "
            f"{_ORIGINS_SETTING}, to allow",
            see="docs/clash-api.md",
            allowed_origins=settings.cors_allow_origins,
            origins_setting=_ORIGINS_SETTING,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind not in ("http", "websocket"):
            await self._app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        origin = headers.get("origin")
        cors: dict[str, str] = {}
        if origin is not None and (
            is_same_origin(origin, headers.get("host")) or self._rules.allows_origin(origin)
        ):
            cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if (
            kind == "http"
            and scope["method"] == "OPTIONS"
            and origin is not None
            and "access-control-request-method" in headers
        ):
            await self._preflight(scope, send, headers, origin, cors)
            return
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            status, message = refusal
            await _deny(scope, send, status, message, cors)
            return
        if kind == "http":
            bounded = await _bounded_body(scope, receive, headers)
            if bounded is None:
                await _deny(scope, send, 413, BODY_TOO_LARGE, cors)
                return
            receive = bounded
        await self._run(scope, receive, send, cors)

    def _listen(self, scope: Scope) -> tuple[str | None, int]:
        if self._ctx.listen is not None:
            return self._ctx.listen
        server = scope.get("server") or (None, 80)
        return None, int(server[1] or 80)

    def _foreign(self, scope: Scope, headers: Headers) -> str | None:
        """Why the keyless rules refuse this request, or None."""
        return foreign_refusal(
            self._rules,
            self._listen(scope),
            headers.get("host"),
            headers.get("origin"),
            headers.get("sec-fetch-site"),
        )

    def _refusal(self, scope: Scope, headers: Headers) -> tuple[int, str] | None:
        """``(status, message)`` of a request that must not reach a route, or None."""
        secret = self._secret
        if secret is None:
            problem = self._foreign(scope, headers)
            return None if problem is None else (403, problem)
        if self._ui and _is_ui(scope["path"]):
            return None
        if scope["type"] == "websocket":
            token = _ws_token(scope)
            if token:
                return None if hmac.compare_digest(token, secret) else (401, UNAUTHORIZED)
        # Latin-1 gives back the header's bytes as sent: the secret is compared as bytes.
        raw = headers.get("authorization", "").encode("latin-1")
        scheme, space, token = raw.partition(b" ")
        if scheme != b"Bearer" or not space or not hmac.compare_digest(token, secret):
            return 401, UNAUTHORIZED
        return None

    async def _preflight(
        self, scope: Scope, send: Send, headers: Headers, origin: str, cors: dict[str, str]
    ) -> None:
        if self._secret is None:
            problem = self._foreign(scope, headers)
            if problem is not None:
                await _deny(scope, send, 403, problem, cors)
                return
        if not cors:
            await _deny(
                scope,
                send,
                403,
                f"CORS preflight refused: Origin {origin} is not this API's origin nor listed "
                f"in {_ORIGINS_SETTING}",
                {},
            )
            return
        answer = {
            **cors,
            "Access-Control-Allow-Methods": _ALLOW_METHODS,
            "Access-Control-Allow-Headers": _ALLOW_HEADERS,
            "Access-Control-Max-Age": _MAX_AGE,
        }
        if headers.get("access-control-request-private-network", "").lower() == "true":
            answer["Access-Control-Allow-Private-Network"] = "true"
        await Response(status_code=204, headers=answer)(scope, _no_receive, send)

    async def _run(self, scope: Scope, receive: Receive, send: Send, cors: dict[str, str]) -> None:
        started = closed = False

        async def guarded_send(message: Message) -> None:
            nonlocal started, closed
            kind = message["type"]
            if kind in ("http.response.start", "websocket.http.response.start"):
                started = True
                if cors:
                    out = MutableHeaders(scope=message)
                    out["Access-Control-Allow-Origin"] = cors["Access-Control-Allow-Origin"]
                    out.add_vary_header("Origin")
            elif kind == "websocket.close" and not started and "route" not in scope:
                # Starlette's router closes an upgrade no route matched (a "403" to the
                # client); a missing stream is a 404 as a missing page is. A route's own
                # close before accepting (scope["route"] set) is left as it is.
                started = True
                await _deny(scope, send, 404, NOT_FOUND, cors)
                return
            elif kind == "websocket.accept":
                started = True
                scope[_ACCEPTED] = True
            elif kind == "websocket.close":
                started = closed = True
            await send(message)

        try:
            await self._app(scope, receive, guarded_send)
        except _GONE:
            logger.debug("Clash API: the client of %s went away", scope.get("path"))
        except Exception:
            logger.exception(
                "Clash API: unexpected error on %s %s", scope.get("method", "WS"), scope["path"]
            )
            if not started:
                await _deny(scope, send, 500, INTERNAL_ERROR, cors)
            elif scope.get(_ACCEPTED) and not closed:
                # Returning would drop the connection without a close frame (1006).
                await _close_socket(send, INTERNAL_ERROR)


async def _no_receive() -> Message:
    raise RuntimeError("a guard answer reads nothing")


async def _deny(
    scope: Scope, send: Send, status: int, message: str, cors: Mapping[str, str]
) -> None:
    """Answer ``{"message"}`` with ``status``; on a WebSocket scope, as the HTTP answer
    to the upgrade (or, on a server without that extension, a close before accepting,
    which clients see as 403)."""
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get(
        "extensions", {}
    ):
        await send({"type": "websocket.close", "code": 1008})
        return
    await error_response(status, message, cors)(scope, _no_receive, send)


async def _bounded_body(scope: Scope, receive: Receive, headers: Headers) -> Receive | None:
    """``receive`` for a body of at most :data:`MAX_BODY_BYTES`, or None for a larger one.

    A declared length is trusted (the server delivers exactly that many bytes); a chunked
    body is read here, so the route gets it whole or not at all.
    """
    declared = headers.get("content-length")
    if declared is not None:
        # The HTTP parser has refused a malformed length already; should one get through,
        # it is not trusted to be small.
        length = int(declared) if declared.strip().isdigit() else MAX_BODY_BYTES + 1
        return None if length > MAX_BODY_BYTES else receive
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        return receive
    chunks: list[bytes] = []
    total = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            # Gone before the body ended: the route sees the disconnect.
            break
        body = message.get("body", b"")
        total += len(body)
        if total > MAX_BODY_BYTES:
            return None
        chunks.append(body)
        if not message.get("more_body", False):
            message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            break
    pending = [message]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay
