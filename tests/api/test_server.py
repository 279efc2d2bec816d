"""The control API on a real Waitress listener: auth, CORS, limits, start rules, the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from spliceway import Engine
from spliceway.errors import ApiError
from tests.api.conftest import control_config
from tests.api.sse_client import Stream
from tests.helpers.program import SPLICEWAY, running, wait_for_line

KEY = "s3cret-admin-key"


def curl(*args: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """Run curl; return (status, lower-cased headers, JSON body)."""
    out = subprocess.run(
        ["curl", "-sS", "-i", "--max-time", "10", *args],
        check=True,
        capture_output=True,
        timeout=20,
    ).stdout.decode()
    head, _, body = out.partition("\r\n\r\n")
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, json.loads(body) if body else {}


@pytest.fixture
def keyed(make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> str:
    """An engine requiring KEY (admin) or a read-only dashboard key; returns its base URL."""
    monkeypatch.setenv("SW_TEST_ADMIN_KEY", KEY)
    monkeypatch.setenv("SW_TEST_DASH_KEY", "dash-key")
    cfg = control_config(
        api_key_env="SW_TEST_ADMIN_KEY",
        keys=[{"name": "dash", "key_env": "SW_TEST_DASH_KEY", "permissions": ["read"]}],
    )
    return str(make_engine(cfg).control_url)


def test_curl_auth_headers(keyed: str) -> None:
    url = f"{keyed}/api/v1/health"
    status, headers, body = curl(url)
    assert status == 401 and body["error"]["code"] == "unauthenticated"
    assert headers["www-authenticate"].startswith("Bearer")
    assert headers["access-control-allow-origin"] == "*"
    status, _, body = curl("-H", "Authorization: Bearer wrong", url)
    assert status == 401
    status, _, body = curl("-H", f"Authorization: Bearer {KEY}", url)
    assert status == 200 and body["result"]["healthy"] is True
    status, _, body = curl("-H", f"X-Service-Api-Key: {KEY}", url)
    assert status == 200
    status, _, body = curl(
        "-H",
        "X-Service-Api-Key: dash-key",
        "-H",
        "Content-Type: application/json",
        "-d",
        '{"method": "mode.set", "params": {"mode": "direct"}}',
        f"{keyed}/api/v1/commands",
    )
    assert status == 403 and body["error"]["code"] == "permission_denied"


def test_curl_cors_preflight_and_headers(keyed: str) -> None:
    status, headers, body = curl(
        "-X",
        "OPTIONS",
        "-H",
        "Origin: http://dashboard.local",
        "-H",
        "Access-Control-Request-Method: POST",
        "-H",
        "Access-Control-Request-Headers: authorization, content-type",
        f"{keyed}/api/v1/commands",
    )
    assert status == 200 and body["ok"] is True
    assert headers["access-control-allow-origin"] == "*"
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    status, headers, body = curl("-H", f"Authorization: Bearer {KEY}", f"{keyed}/api/v1/nope")
    assert status == 404 and headers["access-control-allow-origin"] == "*"
    assert body == {
        "api_id": "service.api.v1",
        "id": None,
        "ok": False,
        "error": {"code": "not_found", "message": "no endpoint /api/v1/nope"},
    }


def test_sse_needs_the_key(keyed: str) -> None:
    with Stream(keyed) as stream:
        assert stream.status == 401
    with Stream(keyed, headers={"Authorization": "Bearer dash-key"}) as stream:
        assert stream.status == 200
        assert next(stream.events()).event == "flow.snapshot"


def _status(url: str, data: bytes | None = None) -> tuple[int, dict[str, Any], str | None]:
    headers = {"Content-Type": "application/json"} if data else {}
    req = urllib.request.Request(url, data=data, method="POST" if data else "GET", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, json.loads(resp.read()), None
    except urllib.error.HTTPError as ex:
        return ex.code, json.loads(ex.read()), ex.headers.get("Retry-After")


def test_query_rate_limit_is_100_per_second(base_url: str) -> None:
    started = time.monotonic()
    results = [_status(f"{base_url}/api/v1/health") for _ in range(160)]
    elapsed = time.monotonic() - started
    granted = sum(1 for status, _, _ in results if status == 200)
    limited = [r for r in results if r[0] == 429]
    # A bucket of 100 refilled at 100/s admits at most 100 + 100 * elapsed.
    assert granted <= 100 + 100 * elapsed + 1
    assert granted >= 100
    if elapsed < 0.5:
        assert limited
    for _, body, retry_after in limited:
        assert body["error"]["code"] == "rate_limited"
        assert retry_after is not None and int(retry_after) >= 1


def test_command_rate_limit_is_10_per_second(base_url: str) -> None:
    body = json.dumps({"method": "mode.set", "params": {"mode": "rule"}}).encode()
    started = time.monotonic()
    results = [_status(f"{base_url}/api/v1/commands", body) for _ in range(25)]
    elapsed = time.monotonic() - started
    granted = sum(1 for status, _, _ in results if status == 200)
    assert 10 <= granted <= 10 + 10 * elapsed + 1
    assert any(status == 429 for status, _, _ in results)
    # Queries have their own bucket.
    assert _status(f"{base_url}/api/v1/health")[0] == 200


def test_unset_api_key_env_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SW_TEST_UNSET_KEY", raising=False)
    engine = Engine(control_config(api_key_env="SW_TEST_UNSET_KEY"))
    with pytest.raises(ApiError) as info:
        engine.start()
    assert "SW_TEST_UNSET_KEY" in info.value.message
    assert not engine.running


def test_control_port_in_use_fails_the_start_and_leaves_nothing_running(
    make_engine: Callable[..., Any],
) -> None:
    first = make_engine(control_config())
    port = int(first.control_url.rsplit(":", 1)[1])
    engine = Engine(control_config(listen={"address": "127.0.0.1", "port": port}))
    with pytest.raises(ApiError) as info:
        engine.start()
    assert info.value.code == "conflict" and info.value.field_path == "api.control.listen"
    assert not engine.running


def test_cli_run_serves_the_api_and_refuses_an_unset_key(tmp_path: Any) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(control_config(api_key_env="SW_TEST_NEVER_SET")))
    env = {k: v for k, v in os.environ.items() if k != "SW_TEST_NEVER_SET"}
    proc = subprocess.run(
        [*SPLICEWAY, "run", "-c", str(path)], capture_output=True, text=True, timeout=60, env=env
    )
    assert proc.returncode == 2
    assert "SW_TEST_NEVER_SET" in proc.stderr

    path.write_text(json.dumps(control_config()))
    with running(path) as proc2:
        pattern = r"control API listening on (http://\S+)/api/v1/"
        url = wait_for_line(proc2, pattern, timeout=30).group(1)
        status, body, _ = _status(f"{url}/api/v1/health")
        assert status == 200 and body["result"]["healthy"] is True
        proc2.send_signal(signal.SIGTERM)
        assert proc2.wait(timeout=30) == 0
