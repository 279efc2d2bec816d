"""The dashboard's files at ``/ui/``: served without a key, with their types and a strict
content security policy; only the package's files exist; a keyless API still refuses
foreign Hosts for them."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from typing import Any

import pytest

from tests.api.conftest import control_config

KEY_ENV, KEY = "SW_TEST_UI_KEY", "ui-test-admin-key"


def get(base_url: str, path: str, headers: dict[str, str] | None = None):
    """``(status, lower-cased headers, raw body)`` of one GET."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


@pytest.fixture
def keyed_url(make_engine: Any, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(KEY_ENV, KEY)
    return str(make_engine(control_config(api_key_env=KEY_ENV)).control_url)


def test_ui_redirects_to_its_directory(base_url: str) -> None:
    status, headers, _ = get(base_url, "/ui")
    assert status == 301
    assert headers["location"] == "/ui/"


@pytest.mark.parametrize(
    ("path", "content_type", "marker"),
    [
        ("/ui/", "text/html; charset=utf-8", b"<!doctype html"),
        ("/ui/app.js", "text/javascript; charset=utf-8", b"sessionstorage"),
        ("/ui/style.css", "text/css; charset=utf-8", b"{"),
        ("/ui/icon.svg", "image/svg+xml", b"<svg"),
    ],
)
def test_files_are_served_without_a_key(
    keyed_url: str, path: str, content_type: str, marker: bytes
) -> None:
    status, headers, body = get(keyed_url, path)
    assert status == 200
    assert headers["content-type"] == content_type
    assert marker in body.lower()
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    # The API itself still wants the key.
    assert get(keyed_url, "/api/v1/stats")[0] == 401


@pytest.mark.parametrize("path", ["/ui/nope.js", "/ui/..%2Fapi", "/ui/.hidden.js", "/ui/app.py"])
def test_only_the_package_files_exist(base_url: str, path: str) -> None:
    status, _, body = get(base_url, path)
    assert status == 404
    assert json.loads(body)["error"]["code"] == "not_found"


def test_a_keyless_api_refuses_a_foreign_host_for_the_page(base_url: str) -> None:
    status, _, body = get(base_url, "/ui/", headers={"Host": "attacker.example"})
    assert status == 403
    assert json.loads(body)["error"]["code"] == "permission_denied"
