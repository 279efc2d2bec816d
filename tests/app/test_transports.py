"""``app.transports``: the control transports built over an engine's ``ControlPlane``,
started after the core and stopped around it, each one real (sockets, threads)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from spliceway import ApiError, Engine
from spliceway.app.transports import CorePlane, Transports
from tests.conftest import base_config


def _control_config(**control: Any) -> dict[str, Any]:
    cfg = base_config()
    cfg["api"]["control"] = {
        "enabled": True,
        "listen": {"address": "127.0.0.1", "port": 0},
        "api_key_env": None,
        **control,
    }
    return cfg


def _health(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{base_url}/api/v1/health", timeout=10) as response:
        body: dict[str, Any] = json.loads(response.read())
    return body


def test_the_engines_plane_answers_what_the_engine_answers(make_engine: Callable[..., Any]):
    engine = make_engine(base_config())
    plane = engine.control_plane
    assert isinstance(plane, CorePlane)
    assert plane.running and engine.running
    assert plane.api_settings is engine.core.config.api
    assert plane.run_query("config") == engine.query("config")
    result = plane.execute("mode.set", {"mode": "direct"}, ["admin"], transport="embedded")
    assert result == {"accepted": True}
    assert engine.query("config")["mode"] == {"kind": "direct", "outbound": None}
    with pytest.raises(ApiError) as refused:
        plane.execute("mode.set", {"mode": "global"}, ["control"], transport="embedded")
    assert refused.value.code == "permission_denied"


def test_a_second_set_of_transports_serves_the_same_engine_and_stops_whole(
    make_engine: Callable[..., Any],
):
    engine = make_engine(_control_config())
    transports = Transports(engine.control_plane)
    transports.prepare()
    transports.start()
    try:
        ours = transports.control_url
        assert ours != engine.control_url
        body = _health(ours)
        assert body["ok"] is True
        assert set(body["result"]) == set(_health(engine.control_url)["result"])
        assert transports.ipc is None and transports.grpc is None
    finally:
        transports.stop_accepting()
        transports.stop()
    transports.stop()  # idempotent
    with pytest.raises(ApiError) as gone:
        transports.control_url  # noqa: B018
    assert gone.value.code == "not_found"
    # The engine's own transports are untouched.
    assert _health(engine.control_url)["ok"] is True


def test_start_before_prepare_is_a_programming_error(make_engine: Callable[..., Any]):
    engine = make_engine(base_config())
    with pytest.raises(RuntimeError):
        Transports(engine.control_plane).start()


def test_an_unset_key_variable_refuses_the_start_before_anything_binds():
    name = f"SPLICEWAY_TEST_UNSET_{os.getpid()}"
    os.environ.pop(name, None)
    engine = Engine(_control_config(api_key_env=name))
    with pytest.raises(ApiError):
        engine.start()
    assert not engine.running
    with pytest.raises(ApiError) as gone:
        engine.control_url  # noqa: B018
    assert gone.value.code == "not_found"
