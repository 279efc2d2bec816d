"""A keyless control API that a web page cannot drive through a visitor's browser.

Real engines with their real Waitress listener on 127.0.0.1, requests sent with
``http.client`` carrying exactly the headers a browser would (and curl, once).
With no key configured the gate refuses a foreign ``Host`` (DNS rebinding), a
foreign ``Origin`` and a cross-site ``Sec-Fetch-Site`` with 403; a command body
not declared ``application/json`` is 415 whatever the keys. Every refusal is
checked to have changed nothing, and every response to carry
``Access-Control-Allow-Origin: *``.
"""

from __future__ import annotations

import json
import subprocess
import urllib.parse
from collections.abc import Callable
from typing import Any

import falcon.testing
import pytest

from spliceway.api.app import create_app
from spliceway.api.auth import KeyTable
from tests.api.conftest import RELAXED, control_config, send
from tests.api.sse_client import Stream
from tests.api.test_openapi import validate_response

API = "/api/v1"
COMMANDS = f"{API}/commands"
EVIL = "https://evil.example"
GLOBAL_BLOCK = json.dumps(
    {"method": "mode.set", "params": {"mode": "global", "outbound": "block"}}
).encode()
RULE_MODE = {"kind": "rule", "outbound": None}
GLOBAL_BLOCK_MODE = {"kind": "global", "outbound": "block"}
KEY = "browser-test-key"


def port_of(base_url: str) -> int:
    port = urllib.parse.urlsplit(base_url).port
    assert port is not None
    return port


def refused(answer: tuple[int, dict[str, str], dict[str, Any]], status: int, code: str) -> str:
    """Assert an enveloped refusal with CORS; its message."""
    got, headers, body = answer
    assert got == status, body
    assert headers["access-control-allow-origin"] == "*"
    assert body["ok"] is False and body["error"]["code"] == code, body
    message: str = body["error"]["message"]
    return message


def succeeded(answer: tuple[int, dict[str, str], dict[str, Any]]) -> Any:
    """Assert a success envelope with CORS; its result."""
    got, headers, body = answer
    assert got == 200, body
    assert headers["access-control-allow-origin"] == "*"
    assert body["ok"] is True
    return body["result"]


def mode(base_url: str, headers: dict[str, str] | None = None) -> dict[str, Any]:
    """The engine's mode, asked as curl would (no Origin)."""
    result = succeeded(send(base_url, "GET", f"{API}/config", headers=headers))
    mode: dict[str, Any] = result["mode"]
    return mode


def json_headers(**extra: str) -> dict[str, str]:
    return {"Content-Type": "application/json", **extra}


# -- cross-origin pages (keyless) ---------------------------------------------------------


def test_cross_origin_text_plain_post_is_refused_and_changes_nothing(base_url: str) -> None:
    # The "simple request" a page sends with fetch(..., {mode: "no-cors"}): no preflight.
    answer = send(
        base_url,
        "POST",
        COMMANDS,
        body=GLOBAL_BLOCK,
        headers={"Origin": EVIL, "Content-Type": "text/plain;charset=UTF-8"},
    )
    message = refused(answer, 403, "permission_denied")
    assert "cross-origin request refused: Origin https://evil.example" in message
    assert "api_key_env" in message and "docs/security.md" in message
    assert mode(base_url) == RULE_MODE


def test_cross_origin_json_post_is_refused(base_url: str) -> None:
    answer = send(base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=json_headers(Origin=EVIL))
    refused(answer, 403, "permission_denied")
    assert mode(base_url) == RULE_MODE


def test_cross_origin_get_is_refused(base_url: str) -> None:
    answer = send(base_url, "GET", f"{API}/flows", headers={"Origin": EVIL})
    assert "Origin https://evil.example" in refused(answer, 403, "permission_denied")


def test_cross_origin_preflight_is_refused(base_url: str) -> None:
    answer = send(
        base_url,
        "OPTIONS",
        COMMANDS,
        headers={
            "Origin": EVIL,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    refused(answer, 403, "permission_denied")
    assert "access-control-allow-methods" not in answer[1]


def test_origin_null_is_refused(base_url: str) -> None:
    # Sandboxed iframes and file:// pages send Origin: null.
    answer = send(
        base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=json_headers(Origin="null")
    )
    assert "Origin null" in refused(answer, 403, "permission_denied")
    assert mode(base_url) == RULE_MODE


def test_cross_origin_event_stream_is_refused(base_url: str) -> None:
    with Stream(base_url, headers={"Origin": EVIL}) as stream:
        assert stream.status == 403
        assert stream.response.getheader("Access-Control-Allow-Origin") == "*"
        assert stream.error_body()["error"]["code"] == "permission_denied"


# -- DNS rebinding (keyless) ---------------------------------------------------------------


def test_rebound_host_with_its_own_origin_is_refused(base_url: str) -> None:
    # evil.example resolves to 127.0.0.1 now: the page is same-origin with itself.
    host = f"evil.example:{port_of(base_url)}"
    answer = send(
        base_url,
        "POST",
        COMMANDS,
        body=GLOBAL_BLOCK,
        headers=json_headers(Host=host, Origin=f"http://{host}"),
    )
    message = refused(answer, 403, "permission_denied")
    assert f"Host {host}" in message and "DNS rebinding" in message
    assert mode(base_url) == RULE_MODE


def test_rebound_host_without_origin_is_refused(base_url: str) -> None:
    host = f"evil.example:{port_of(base_url)}"
    answer = send(base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=json_headers(Host=host))
    refused(answer, 403, "permission_denied")
    refused(send(base_url, "GET", f"{API}/flows", headers={"Host": host}), 403, "permission_denied")
    assert mode(base_url) == RULE_MODE


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:{other}",  # a loopback address, but another port
        "localhost",  # no port: 80
        "10.0.0.1:{port}",  # an address the API does not listen on
        "[127.0.0.1]:{port}",
        "127.0.0.1:{port} x",
        "localhost.:{port}",
    ],
)
def test_foreign_hosts_are_refused(base_url: str, host: str) -> None:
    port = port_of(base_url)
    host = host.format(port=port, other=port + 1 if port < 65535 else port - 1)
    answer = send(base_url, "GET", f"{API}/health", headers={"Host": host})
    assert f"Host {host}" in refused(answer, 403, "permission_denied")


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:{port}",
        "127.3.4.5:{port}",
        "LOCALHOST:{port}",
        "[::1]:{port}",
        "app.localhost:{port}",
    ],
)
def test_loopback_hosts_are_accepted(base_url: str, host: str) -> None:
    host = host.format(port=port_of(base_url))
    assert succeeded(send(base_url, "GET", f"{API}/health", headers={"Host": host}))["healthy"]


# -- Sec-Fetch-Site (keyless) --------------------------------------------------------------


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
def test_cross_site_fetch_is_refused(base_url: str, site: str) -> None:
    # <img src=...> and other no-cors GETs carry no Origin, but browsers mark them.
    answer = send(base_url, "GET", f"{API}/flows", headers={"Sec-Fetch-Site": site})
    assert f"Sec-Fetch-Site is {site}" in refused(answer, 403, "permission_denied")


def test_typed_in_address_bar_is_accepted(base_url: str) -> None:
    assert succeeded(send(base_url, "GET", f"{API}/health", headers={"Sec-Fetch-Site": "none"}))


# -- same-origin callers (keyless) ---------------------------------------------------------


def test_same_origin_page_may_post(base_url: str) -> None:
    host = f"127.0.0.1:{port_of(base_url)}"
    browser = {"Host": host, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
    answer = send(base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=json_headers(**browser))
    assert succeeded(answer) == {"accepted": True}
    assert mode(base_url) == GLOBAL_BLOCK_MODE
    # Its preflight (e.g. for an Authorization header) is answered too.
    preflight = send(
        base_url, "OPTIONS", COMMANDS, headers={**browser, "Access-Control-Request-Method": "POST"}
    )
    assert succeeded(preflight) == {}


def test_same_origin_page_on_localhost_may_post(base_url: str) -> None:
    host = f"localhost:{port_of(base_url)}"
    # Origin compared without case, as browsers may differ from the Host in case.
    headers = json_headers(Host=host, Origin=f"HTTP://LOCALHOST:{port_of(base_url)}")
    assert succeeded(send(base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=headers))
    assert mode(base_url) == GLOBAL_BLOCK_MODE


def test_curl_like_request_without_origin_is_accepted(base_url: str) -> None:
    assert succeeded(send(base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=json_headers()))
    assert mode(base_url) == GLOBAL_BLOCK_MODE


def test_origin_of_another_port_is_refused(base_url: str) -> None:
    # http://127.0.0.1:<other port> is another origin, whatever runs there.
    port = port_of(base_url)
    origin = f"http://127.0.0.1:{port + 1 if port < 65535 else port - 1}"
    answer = send(
        base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=json_headers(Origin=origin)
    )
    refused(answer, 403, "permission_denied")
    assert mode(base_url) == RULE_MODE


# -- Content-Type of commands (keyed or not) ----------------------------------------------


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain;charset=UTF-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        "application/json-patch+json",
        "",
        None,
    ],
)
def test_command_without_json_content_type_is_415(base_url: str, content_type: str | None) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    answer = send(base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=headers)
    message = refused(answer, 415, "invalid_argument")
    assert answer[2]["error"]["field_path"] == "Content-Type"
    assert "application/json" in message
    assert mode(base_url) == RULE_MODE


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", " application/json "]
)
def test_command_with_json_content_type_and_parameters_is_accepted(
    base_url: str, content_type: str
) -> None:
    headers = {"Content-Type": content_type}
    assert succeeded(send(base_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=headers))
    assert mode(base_url) == GLOBAL_BLOCK_MODE


def test_curl_json_is_accepted_and_curl_form_is_415(base_url: str) -> None:
    body = '{"method": "mode.set", "params": {"mode": "global", "outbound": "block"}}'
    url = f"{base_url}{COMMANDS}"

    def curl(*args: str) -> tuple[int, dict[str, Any]]:
        out = subprocess.run(
            ["/usr/bin/curl", "-sS", "--max-time", "10", "-w", "\n%{http_code}", *args, url],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
        text, _, status = out.rpartition("\n")
        return int(status), json.loads(text)

    status, answer = curl("-d", body)  # application/x-www-form-urlencoded
    assert status == 415 and answer["error"]["code"] == "invalid_argument"
    assert answer["error"]["field_path"] == "Content-Type"
    assert mode(base_url) == RULE_MODE
    status, answer = curl("--json", body)
    assert status == 200 and answer["result"] == {"accepted": True}
    assert mode(base_url) == GLOBAL_BLOCK_MODE


def test_refusals_are_documented(base_url: str) -> None:
    """403 and 415 answers validate against the OpenAPI document (status, body, headers)."""
    cases = [
        ("POST", COMMANDS, {"Origin": EVIL, "Content-Type": "text/plain"}, 403),
        ("OPTIONS", COMMANDS, {"Origin": EVIL, "Access-Control-Request-Method": "POST"}, 403),
        ("GET", f"{API}/flows", {"Sec-Fetch-Site": "cross-site"}, 403),
        ("GET", f"{API}/openapi.json", {"Origin": "null"}, 403),
        ("POST", COMMANDS, {"Content-Type": "text/plain"}, 415),
        ("POST", COMMANDS, {}, 415),
    ]
    for method, path, headers, status in cases:
        body = GLOBAL_BLOCK if method == "POST" else None
        got, response_headers, envelope = send(base_url, method, path, body=body, headers=headers)
        assert got == status, envelope
        validate_response(method, path, got, envelope, headers=response_headers)


# -- with a key configured ----------------------------------------------------------------


@pytest.fixture
def keyed_url(make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("SW_BROWSER_TEST_KEY", KEY)
    return str(make_engine(control_config(api_key_env="SW_BROWSER_TEST_KEY")).control_url)


def test_keyed_cross_origin_caller_with_the_key_works(keyed_url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    preflight = send(
        keyed_url,
        "OPTIONS",
        COMMANDS,
        headers={"Origin": EVIL, "Access-Control-Request-Method": "POST"},
    )
    assert succeeded(preflight) == {}
    answer = send(
        keyed_url,
        "POST",
        COMMANDS,
        body=GLOBAL_BLOCK,
        headers=json_headers(Origin=EVIL, **{"Sec-Fetch-Site": "cross-site"}, **auth),
    )
    assert succeeded(answer) == {"accepted": True}
    assert mode(keyed_url, auth) == GLOBAL_BLOCK_MODE
    # Without the key the cross-origin caller is unauthenticated, not refused for its origin.
    refused(
        send(keyed_url, "GET", f"{API}/flows", headers={"Origin": EVIL}), 401, "unauthenticated"
    )


def test_keyed_foreign_host_with_the_key_works(keyed_url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    host = f"evil.example:{port_of(keyed_url)}"
    answer = send(
        keyed_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=json_headers(Host=host, **auth)
    )
    assert succeeded(answer) == {"accepted": True}
    assert mode(keyed_url, auth) == GLOBAL_BLOCK_MODE


def test_keyed_command_still_needs_json(keyed_url: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    headers = {"Content-Type": "text/plain", **auth}
    answer = send(keyed_url, "POST", COMMANDS, body=GLOBAL_BLOCK, headers=headers)
    assert refused(answer, 415, "invalid_argument")
    assert mode(keyed_url, auth) == RULE_MODE


# -- the listen address (in process: no listener on anything but loopback) -----------------


@pytest.mark.parametrize(
    ("listen", "host", "status"),
    [
        (("192.0.2.7", 80), "192.0.2.7", 200),  # the listen address itself
        (("192.0.2.7", 80), "192.0.2.8", 403),
        (("192.0.2.7", 80), "127.0.0.1", 200),
        (("192.0.2.7", 80), "lan-name.example", 403),
        (("0.0.0.0", 80), "192.0.2.8", 200),  # wildcard: any IP literal
        (("0.0.0.0", 80), "[2001:db8::1]", 200),
        (("0.0.0.0", 80), "lan-name.example", 403),  # but never a name
        (("::", 80), "198.51.100.1", 200),
        (("2001:db8::7", 80), "[2001:db8::7]", 200),
        (("2001:db8::7", 80), "[2001:db8::8]", 403),
        (("0.0.0.0", 8080), "192.0.2.8", 403),  # no port: 80, not the bound 8080
        (("0.0.0.0", 8080), "192.0.2.8:8080", 200),
    ],
)
def test_listen_address_decides_the_accepted_hosts(
    make_engine: Callable[..., Any], listen: tuple[str, int], host: str, status: int
) -> None:
    engine = make_engine()
    app = create_app(engine.control_plane, keys=KeyTable([]), limits=RELAXED, listen=listen)
    client = falcon.testing.TestClient(app)
    result = client.simulate_get(f"{API}/health", headers={"Host": host})
    assert result.status_code == status, result.text
    assert result.headers["Access-Control-Allow-Origin"] == "*"
