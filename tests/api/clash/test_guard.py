"""The Clash listener's guard: CORS before the secret, the secret (Bearer, or ``?token=``
on WebSocket upgrades only), the keyless browser rules, the body limit and mihomo's
``{"message"}`` error shape.

Real engines with their Clash API on loopback, called with ``http.client`` (each header
exactly as a browser or a tool sends it), raw sockets where the bytes on the wire
matter, and the WebSocket clients dashboards' tools use (``websockets``,
``websocket-client``). Where a route of a kind the Clash app does not have yet is
needed (a WebSocket that accepts, a route that fails), the test serves the real guard
around a small Starlette app of its own on the real uvicorn listener.
"""

from __future__ import annotations

import http.client
import json
import logging
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import websocket
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import connect
from websockets.typing import Origin

from spliceway.api.clash import guard
from spliceway.api.clash.context import ClashContext
from spliceway.api.clash.server import ClashServer
from spliceway.api.clash.storage import storage_routes
from spliceway.config import ClashApi
from spliceway.errors import ApiError
from tests.api.clash.conftest import ClashEngine
from tests.conftest import wait_until

SECRET = "s3cr\u00e9t-token"
EVIL = "https://evil.example"
BOARD = "https://board.example"
MIB = 1 << 20

Answer = tuple[int, dict[str, str], bytes]


def request(
    base_url: str,
    method: str,
    path: str,
    *,
    body: bytes | Iterable[bytes] | None = None,
    headers: dict[str, str] | None = None,
    chunked: bool = False,
) -> Answer:
    """One request with exactly ``headers`` (plus the Host http.client derives unless
    given); status, lower-cased headers, raw body."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {}, encode_chunked=chunked)
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, raw
    finally:
        conn.close()


def message_of(answer: Answer, status: int) -> str:
    """Assert a mihomo-shaped error answer with ``status``; its message."""
    got, headers, raw = answer
    assert got == status, raw
    assert headers["content-type"] == "application/json"
    body = json.loads(raw)
    assert list(body) == ["message"], body
    message: str = body["message"]
    return message


def bearer(secret: str = SECRET) -> dict[str, str]:
    # http.client sends header values as Latin-1; the secret goes as its UTF-8 bytes.
    return {"Authorization": "Bearer " + secret.encode().decode("latin-1")}


def ws_url(base_url: str, path: str) -> str:
    return "ws" + base_url.removeprefix("http") + path


def port_of(base_url: str) -> int:
    port = urllib.parse.urlsplit(base_url).port
    assert port is not None
    return port


@pytest.fixture
def with_secret(
    make_clash: Callable[..., ClashEngine], monkeypatch: pytest.MonkeyPatch
) -> Callable[..., ClashEngine]:
    """Start an engine whose Clash API holds :data:`SECRET`."""
    monkeypatch.setenv("SW_CLASH_SECRET", SECRET)

    def start(**clash: Any) -> ClashEngine:
        return make_clash(secret_env="SW_CLASH_SECRET", **clash)

    return start


# -- a small app behind the real guard, on the real listener -------------------------------


async def _echo(ws: WebSocket) -> None:
    await ws.accept()
    text = await ws.receive_text()
    await ws.send_text(text)
    await ws.close()


async def _boom(request: Request) -> Response:
    raise RuntimeError("a route that fails")


async def _refuse(request: Request) -> Response:
    raise ApiError("not_found", "no proxy named x")


async def _length(request: Request) -> Response:
    body = await request.body()
    return JSONResponse({"length": len(body)})


async def _ws_boom(ws: WebSocket) -> None:
    raise RuntimeError("a stream that fails before accepting")


async def _ws_refuse(ws: WebSocket) -> None:
    raise ApiError("invalid_argument", "unknown level x")


async def _ws_late(ws: WebSocket) -> None:
    await ws.accept()
    await ws.send_text("first")
    if ws.query_params.get("boom"):
        raise RuntimeError("a stream that fails while open")
    raise ApiError("not_found", "the flow went away")


@pytest.fixture
def serve_guarded(clash: ClashEngine, tmp_path: Path) -> Iterator[Callable[..., str]]:
    """Serve the guard around a test app (``/echo`` WebSocket, ``/boom``, ``/refuse``,
    ``/length`` and the storage routes) over the engine's control plane; its base URL."""
    servers: list[ClashServer] = []

    def serve(secret: str | None = None, **settings: Any) -> str:
        ctx = ClashContext(
            clash.engine.control_plane,
            ClashApi(enabled=True, **settings),
            secret,
            storage_dir=str(tmp_path / "guarded-storage"),
        )
        app = Starlette(
            routes=[
                WebSocketRoute("/echo", _echo),
                WebSocketRoute("/ws-boom", _ws_boom),
                WebSocketRoute("/ws-refuse", _ws_refuse),
                WebSocketRoute("/ws-late", _ws_late),
                Route("/boom", _boom),
                Route("/refuse", _refuse),
                Route("/length", _length, methods=["POST", "PUT"]),
                *storage_routes(ctx),
            ],
            exception_handlers=guard.exception_handlers(),
        )
        server = ClashServer(guard.wrap(app, ctx), "127.0.0.1", 0)
        ctx.listen = server.bind()
        server.start()
        servers.append(server)
        return server.base_url

    yield serve
    for server in servers:
        server.stop()


# -- keyless: the browser rules ------------------------------------------------------------


def test_keyless_tool_request_is_served_without_cors(clash: ClashEngine) -> None:
    status, headers, raw = request(clash.url, "GET", "/storage/k")
    assert (status, raw) == (200, b"null")
    assert "access-control-allow-origin" not in headers


@pytest.mark.parametrize(
    ("host", "why"),
    [
        ("evil.example:{port}", "is not a loopback name"),
        ("127.0.0.1:1", "names port 1, but this API listens on port {port}"),
        ("10.1.2.3:{port}", "is neither this API's listen address nor a loopback address"),
    ],
)
def test_keyless_foreign_host_is_refused(clash: ClashEngine, host: str, why: str) -> None:
    port = port_of(clash.url)
    answer = request(clash.url, "GET", "/storage/k", headers={"Host": host.format(port=port)})
    message = message_of(answer, 403)
    assert why.format(port=port) in message
    assert "a Clash API without a secret" in message and "api.clash.secret_env" in message


def test_keyless_foreign_origin_is_refused_and_changes_nothing(clash: ClashEngine) -> None:
    answer = request(
        clash.url,
        "PUT",
        "/storage/k",
        body=b'{"x": 1}',
        headers={"Origin": EVIL, "Content-Type": "application/json"},
    )
    message = message_of(answer, 403)
    assert message.startswith(f"cross-origin request refused: Origin {EVIL}")
    assert "nor listed in api.clash.cors_allow_origins" in message
    assert "access-control-allow-origin" not in answer[1]
    assert request(clash.url, "GET", "/storage/k")[2] == b"null"


def test_keyless_origin_null_and_cross_site_fetch_are_refused(clash: ClashEngine) -> None:
    message_of(request(clash.url, "GET", "/storage/k", headers={"Origin": "null"}), 403)
    answer = request(clash.url, "GET", "/storage/k", headers={"Sec-Fetch-Site": "cross-site"})
    assert "Sec-Fetch-Site is cross-site" in message_of(answer, 403)


def test_keyless_same_origin_page_is_served_with_cors(clash: ClashEngine) -> None:
    own = f"http://127.0.0.1:{port_of(clash.url)}"
    status, headers, raw = request(
        clash.url, "GET", "/storage/k", headers={"Origin": own, "Sec-Fetch-Site": "same-origin"}
    )
    assert (status, raw) == (200, b"null")
    assert headers["access-control-allow-origin"] == own
    assert headers["vary"] == "Origin"


def test_keyless_foreign_origin_websocket_upgrade_is_refused(clash: ClashEngine) -> None:
    with pytest.raises(InvalidStatus) as info:
        connect(ws_url(clash.url, "/logs"), origin=Origin(EVIL), open_timeout=5)
    response = info.value.response
    assert response.status_code == 403
    assert response.headers["Content-Type"] == "application/json"
    assert json.loads(response.body or b"")["message"].startswith(
        f"cross-origin request refused: Origin {EVIL}"
    )


def test_keyless_foreign_host_websocket_upgrade_is_refused(clash: ClashEngine) -> None:
    port = port_of(clash.url)
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(
            ws_url(clash.url, "/logs"), host=f"rebind.example:{port}", timeout=5
        )
    assert info.value.status_code == 403
    assert b"rebind.example" in (info.value.resp_body or b"")


def test_keyless_own_origin_websocket_is_accepted(serve_guarded: Callable[..., str]) -> None:
    url = serve_guarded()
    own = url  # http://127.0.0.1:<port>: the page's origin when served by this API
    with connect(ws_url(url, "/echo"), origin=Origin(own), open_timeout=5) as ws:
        ws.send("ping")
        assert ws.recv(timeout=5) == "ping"


def preflight(base_url: str, origin: str, **extra: str) -> Answer:
    """A browser's CORS preflight from ``origin`` for a ``PUT`` to ``/storage/k`` with a
    token and a body (``extra``: more headers)."""
    headers = {
        "Origin": origin,
        "Access-Control-Request-Method": "PUT",
        "Access-Control-Request-Headers": "authorization,content-type",
        **extra,
    }
    return request(base_url, "OPTIONS", "/storage/k", headers=headers)


def test_keyless_configured_origin_is_allowed_cross_site(
    make_clash: Callable[..., ClashEngine],
) -> None:
    clash = make_clash(cors_allow_origins=[BOARD])
    status, headers, raw = request(
        clash.url, "GET", "/storage/k", headers={"Origin": BOARD, "Sec-Fetch-Site": "cross-site"}
    )
    assert (status, raw) == (200, b"null")
    assert headers["access-control-allow-origin"] == BOARD
    assert preflight(clash.url, BOARD, **{"Sec-Fetch-Site": "cross-site"})[0] == 204
    # Another origin is still refused, and so is the configured one on a foreign Host.
    message_of(request(clash.url, "GET", "/storage/k", headers={"Origin": EVIL}), 403)
    answer = preflight(clash.url, BOARD, Host=f"rebind.example:{port_of(clash.url)}")
    assert "Host rebind.example" in message_of(answer, 403)


# -- CORS: preflights before the secret ----------------------------------------------------


def test_preflight_from_an_allowed_origin_needs_no_secret(
    with_secret: Callable[..., ClashEngine],
) -> None:
    clash = with_secret(cors_allow_origins=[BOARD])
    status, headers, raw = preflight(clash.url, BOARD)
    assert (status, raw) == (204, b"")
    assert headers["access-control-allow-origin"] == BOARD
    assert headers["vary"] == "Origin"
    assert headers["access-control-allow-methods"] == "GET, POST, PUT, PATCH, DELETE"
    assert headers["access-control-allow-headers"] == "Content-Type, Authorization"
    assert headers["access-control-max-age"] == "300"
    assert "access-control-allow-private-network" not in headers
    # Chrome's Private Network Access: a public page asking for a loopback API.
    answer = preflight(clash.url, BOARD, **{"Access-Control-Request-Private-Network": "true"})
    assert answer[0] == 204
    assert answer[1]["access-control-allow-private-network"] == "true"


def test_preflight_from_a_foreign_origin_is_refused(
    with_secret: Callable[..., ClashEngine],
) -> None:
    clash = with_secret(cors_allow_origins=[BOARD])
    answer = preflight(clash.url, EVIL)
    message = message_of(answer, 403)
    assert message.startswith(f"CORS preflight refused: Origin {EVIL}")
    assert "access-control-allow-origin" not in answer[1]
    assert "access-control-allow-methods" not in answer[1]


def test_star_allows_every_origin(with_secret: Callable[..., ClashEngine]) -> None:
    clash = with_secret(cors_allow_origins=["*"])
    answer = preflight(clash.url, EVIL)
    assert answer[0] == 204
    assert answer[1]["access-control-allow-origin"] == EVIL


def test_refusals_to_an_allowed_origin_are_readable(
    with_secret: Callable[..., ClashEngine],
) -> None:
    # A dashboard tells "wrong secret" from "unreachable" only if it may read the 401.
    clash = with_secret(cors_allow_origins=[BOARD])
    answer = request(clash.url, "GET", "/version", headers={"Origin": BOARD})
    assert message_of(answer, 401) == "Unauthorized"
    assert answer[1]["access-control-allow-origin"] == BOARD
    status, headers, raw = request(
        clash.url, "GET", "/storage/k", headers={"Origin": BOARD, **bearer()}
    )
    assert (status, raw) == (200, b"null")
    assert headers["access-control-allow-origin"] == BOARD
    # Not an allowed origin: served (the secret is the protection) but not readable.
    status, headers, _ = request(
        clash.url, "GET", "/storage/k", headers={"Origin": EVIL, **bearer()}
    )
    assert status == 200 and "access-control-allow-origin" not in headers


# -- the secret ------------------------------------------------------------------------------


def test_bearer_secret_is_required(with_secret: Callable[..., ClashEngine]) -> None:
    clash = with_secret()
    status, _, raw = request(clash.url, "GET", "/storage/k", headers=bearer())
    assert (status, raw) == (200, b"null")
    wrong = [
        {},
        bearer("wrong"),
        bearer(SECRET + "x"),
        bearer(SECRET[:-1]),
        {"Authorization": "bearer " + bearer()["Authorization"].split(" ", 1)[1]},
        {"Authorization": "Bearer  " + bearer()["Authorization"].split(" ", 1)[1]},
        {"Authorization": "Bearer"},
        {"Authorization": "Basic " + bearer()["Authorization"].split(" ", 1)[1]},
        {"X-Api-Key": SECRET.encode().decode("latin-1")},
    ]
    for headers in wrong:
        answer = request(clash.url, "GET", "/storage/k", headers=headers)
        assert message_of(answer, 401) == "Unauthorized", headers


def test_secret_applies_before_routing_and_to_writes(
    with_secret: Callable[..., ClashEngine],
) -> None:
    clash = with_secret()
    assert message_of(request(clash.url, "GET", "/no/such/route"), 401) == "Unauthorized"
    answer = request(clash.url, "PUT", "/storage/k", body=b"1", headers=bearer("wrong"))
    message_of(answer, 401)
    assert request(clash.url, "GET", "/storage/k", headers=bearer())[2] == b"null"


def test_token_on_a_plain_request_does_not_authenticate(
    with_secret: Callable[..., ClashEngine],
) -> None:
    clash = with_secret()
    token = urllib.parse.quote(SECRET)
    answer = request(clash.url, "GET", f"/storage/k?token={token}")
    assert message_of(answer, 401) == "Unauthorized"
    # A plain request that names an upgrade without making one is a plain request.
    answer = request(
        clash.url, "GET", f"/storage/k?token={token}", headers={"Upgrade": "websocket"}
    )
    assert message_of(answer, 401) == "Unauthorized"


def test_websocket_token(serve_guarded: Callable[..., str]) -> None:
    url = serve_guarded(secret=SECRET)
    token = urllib.parse.quote(SECRET)
    with connect(ws_url(url, f"/echo?token={token}"), open_timeout=5) as ws:
        ws.send("hello")
        assert ws.recv(timeout=5) == "hello"
    # The header works on an upgrade too (the tools that can set it).
    with connect(ws_url(url, "/echo"), additional_headers=bearer(), open_timeout=5) as ws:
        ws.send("hi")
        assert ws.recv(timeout=5) == "hi"
    for path in ("/echo?token=wrong", "/echo", "/echo?token="):
        with pytest.raises(InvalidStatus) as info:
            connect(ws_url(url, path), open_timeout=5)
        response = info.value.response
        assert response.status_code == 401, path
        assert response.headers["Content-Type"] == "application/json"
        assert json.loads(response.body or b"") == {"message": "Unauthorized"}


def test_wrong_websocket_token_as_websocket_client_sees_it(
    serve_guarded: Callable[..., str],
) -> None:
    url = serve_guarded(secret=SECRET)
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(ws_url(url, "/echo?token=wrong"), timeout=5)
    assert info.value.status_code == 401
    assert json.loads(info.value.resp_body or b"") == {"message": "Unauthorized"}
    # A non-empty wrong token is refused even with the right header (mihomo's order).
    with pytest.raises(websocket.WebSocketBadStatusException) as info:
        websocket.create_connection(
            ws_url(url, "/echo?token=wrong"),
            header=[f"Authorization: {bearer()['Authorization']}"],
            timeout=5,
        )
    assert info.value.status_code == 401
    ws = websocket.create_connection(
        ws_url(url, "/echo?token=" + urllib.parse.quote(SECRET)), timeout=5
    )
    try:
        ws.send("x")
        assert ws.recv() == "x"
    finally:
        ws.close()


# -- bodies ------------------------------------------------------------------------------------


def raw_exchange(base_url: str, head: bytes, body: bytes = b"") -> bytes:
    """Send ``head`` (and ``body``) on a new connection; everything the server answers
    until it closes."""
    url = urllib.parse.urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(head + body)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_declared_body_over_the_limit_is_refused_on_the_head(clash: ClashEngine) -> None:
    port = port_of(clash.url)
    head = (
        f"PUT /storage/k HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {MIB + 1}\r\n\r\n"
    ).encode()
    # No byte of the body is sent: the answer comes on the head alone.
    answer = raw_exchange(clash.url, head)
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413 ")
    assert rest.endswith(b'\r\n\r\n{"message":"Body too large"}')
    assert request(clash.url, "GET", "/storage/k")[2] == b"null"


def test_refused_body_is_drained_and_the_connection_kept(clash: ClashEngine) -> None:
    # A client sending its whole over-limit body reads the 413 (no reset), and its
    # connection serves the next request.
    url = urllib.parse.urlsplit(clash.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=10)
    try:
        for _ in range(3):
            conn.request("PUT", "/storage/k", body=b"[" + b"0," * (MIB // 2) + b"0]")
            resp = conn.getresponse()
            assert (resp.status, resp.read()) == (413, b'{"message":"Body too large"}')
            assert not resp.will_close
        conn.request("GET", "/storage/k")
        resp = conn.getresponse()
        assert (resp.status, resp.read()) == (200, b"null")
    finally:
        conn.close()


def test_body_limit_is_one_mebibyte(clash: ClashEngine) -> None:
    exact = b'"' + b"a" * (MIB - 2) + b'"'
    assert len(exact) == MIB
    assert request(clash.url, "PUT", "/storage/big", body=exact)[0] == 204
    assert request(clash.url, "GET", "/storage/big")[2] == exact
    over = b'"' + b"a" * (MIB - 1) + b'"'
    answer = request(clash.url, "PUT", "/storage/big", body=over)
    assert message_of(answer, 413) == "Body too large"
    assert request(clash.url, "GET", "/storage/big")[2] == exact


def test_chunked_body_is_counted(serve_guarded: Callable[..., str]) -> None:
    url = serve_guarded()

    def chunks(total: int, size: int = 64 * 1024) -> Iterator[bytes]:
        while total > 0:
            yield b"x" * min(size, total)
            total -= size

    status, _, raw = request(url, "POST", "/length", body=chunks(MIB), chunked=True)
    assert (status, json.loads(raw)) == (200, {"length": MIB})
    answer = request(url, "POST", "/length", body=chunks(MIB + 1), chunked=True)
    assert message_of(answer, 413) == "Body too large"


# -- mihomo's error shape ------------------------------------------------------------------


def test_unknown_route_and_wrong_method(clash: ClashEngine) -> None:
    assert message_of(request(clash.url, "GET", "/no/such/route"), 404) == "Resource not found"
    answer = request(clash.url, "POST", "/storage/k", body=b"{}")
    assert message_of(answer, 405) == "Method not allowed"
    assert set(answer[1]["allow"].split(", ")) == {"GET", "HEAD", "PUT", "DELETE"}


def test_websocket_to_no_route_is_404(
    clash: ClashEngine, serve_guarded: Callable[..., str]
) -> None:
    for url in (clash.url, serve_guarded()):
        # /storage/k is a plain route: it takes no upgrade either.
        for path in ("/no-such-stream", "/storage/k"):
            with pytest.raises(InvalidStatus) as info:
                connect(ws_url(url, path), open_timeout=5)
            response = info.value.response
            assert response.status_code == 404, (url, path)
            assert json.loads(response.body or b"") == {"message": "Resource not found"}


def test_api_error_from_a_route_is_mihomo_shaped(serve_guarded: Callable[..., str]) -> None:
    url = serve_guarded()
    assert message_of(request(url, "GET", "/refuse"), 404) == "no proxy named x"


def test_exception_in_a_route_is_500_and_logged(
    serve_guarded: Callable[..., str], caplog: pytest.LogCaptureFixture
) -> None:
    url = serve_guarded()

    def logged() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "spliceway.api.clash.guard"]

    with caplog.at_level(logging.ERROR, logger="spliceway.api.clash.guard"):
        answer = request(url, "GET", "/boom")
        assert message_of(answer, 500) == "internal error"
        # Starlette answers first and re-raises after: the record follows the answer.
        (record,) = wait_until(logged, 10, "the error logged")
    assert record.exc_info is not None and record.exc_info[0] is RuntimeError
    assert "GET /boom" in record.getMessage()
    # The server thread is unharmed: the next requests are served.
    assert request(url, "GET", "/storage/k")[:1] == (200,)
    with pytest.raises(InvalidStatus) as info:
        connect(ws_url(url, "/ws-boom"), open_timeout=5)
    assert info.value.response.status_code == 500
    with connect(ws_url(url, "/echo"), open_timeout=5) as ws:
        ws.send("still")
        assert ws.recv(timeout=5) == "still"


def test_errors_on_a_websocket(serve_guarded: Callable[..., str]) -> None:
    url = serve_guarded()
    # Before accepting: the upgrade's HTTP answer, as for a plain request.
    with pytest.raises(InvalidStatus) as info:
        connect(ws_url(url, "/ws-refuse"), open_timeout=5)
    assert info.value.response.status_code == 400
    assert json.loads(info.value.response.body or b"") == {"message": "unknown level x"}
    # Once open: a close frame, 1011, saying why (never a dropped connection, 1006).
    for path, reason in (("/ws-late", "the flow went away"), ("/ws-late?boom=1", "internal error")):
        with connect(ws_url(url, path), open_timeout=5) as ws:
            assert ws.recv(timeout=5) == "first"
            with pytest.raises(ConnectionClosedError) as closed:
                ws.recv(timeout=5)
        assert closed.value.rcvd is not None
        assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1011, reason)


def test_concurrent_refusals_do_not_disturb_served_clients(
    serve_guarded: Callable[..., str],
) -> None:
    url = serve_guarded(secret=SECRET)
    results: list[int] = []

    def hammer() -> None:
        for _ in range(20):
            results.append(request(url, "GET", "/storage/k", headers=bearer("bad"))[0])

    threads = [threading.Thread(target=hammer) for _ in range(3)]
    for thread in threads:
        thread.start()
    served = [request(url, "GET", "/storage/k", headers=bearer())[0] for _ in range(20)]
    for thread in threads:
        thread.join(30)
    assert served == [200] * 20
    assert results == [401] * 60
