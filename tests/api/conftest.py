"""Fixtures for the control API: a real engine with its HTTP API on a free loopback port."""

from __future__ import annotations

import copy
import http.client
import json
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

import falcon.testing
import pytest

from spliceway.api.app import ControlApp, create_app
from spliceway.api.auth import KeyTable
from spliceway.api.limits import Limits
from tests.conftest import base_config

#: Limits high enough that a test issuing many requests never trips them by accident.
RELAXED = Limits(queries_per_second=100000.0, commands_per_second=100000.0, sse_streams=5)

#: What a local caller sends with a command body.
JSON_BODY = {"Content-Type": "application/json"}


def get_result(base_url: str, path: str, timeout: float) -> dict[str, Any]:
    """The ``result`` of a successful GET of ``path`` from the control API."""
    with urllib.request.urlopen(base_url + path, timeout=timeout) as resp:
        body = json.loads(resp.read())
    assert body["ok"], body
    result: dict[str, Any] = body["result"]
    return result


def local_client(app: ControlApp) -> falcon.testing.TestClient:
    """A TestClient that addresses the app as a local caller does (``Host: 127.0.0.1``,
    TestClient's port 80). Its default Host, ``falconframework.org``, is a foreign
    name, which a keyless API refuses (DNS rebinding protection)."""
    return falcon.testing.TestClient(app, headers={"Host": "127.0.0.1"})


def control_config(**control: Any) -> dict[str, Any]:
    """``base_config`` with the HTTP control API on a free port (no key unless given)."""
    cfg = base_config()
    settings: dict[str, Any] = {
        "enabled": True,
        "listen": {"address": "127.0.0.1", "port": 0},
        "api_key_env": None,
    }
    settings.update(copy.deepcopy(control))
    cfg["api"]["control"] = settings
    return cfg


@pytest.fixture
def engine(make_engine: Callable[..., Any]) -> Any:
    """A running engine whose control API listens (spec limits, no key)."""
    return make_engine(control_config())


@pytest.fixture
def base_url(engine: Any) -> str:
    """``http://127.0.0.1:<port>`` of that engine's control API."""
    return str(engine.control_url)


@pytest.fixture
def app_for(make_engine: Callable[..., Any]) -> Callable[..., ControlApp]:
    """Build Falcon apps (for TestClient) over a running engine with no HTTP listener."""

    def _make(
        keys: KeyTable | None = None, limits: Limits = RELAXED, config: dict[str, Any] | None = None
    ) -> ControlApp:
        engine = make_engine(config or base_config())
        return create_app(engine.control_plane, keys=keys or KeyTable([]), limits=limits)

    return _make


def send(
    base_url: str,
    method: str,
    path: str,
    *,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], dict[str, Any]]:
    """One request with exactly ``headers`` (plus the Host http.client derives unless
    given, and Content-Length for a body): status, lower-cased headers, JSON body."""
    url = urllib.parse.urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(raw)
    finally:
        conn.close()
