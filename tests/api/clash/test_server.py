"""The Clash listener itself: bound on its own port, a taken port refused, stopped with
the engine."""

from __future__ import annotations

import json
import logging
import signal
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spliceway.errors import ApiError
from tests.api.clash.conftest import ClashEngine, call, clash_config
from tests.helpers.program import running, wait_for_line


def test_listens_on_its_own_port(clash: ClashEngine) -> None:
    host, port = clash.url.removeprefix("http://").rsplit(":", 1)
    assert host == "127.0.0.1"
    with socket.create_connection((host, int(port)), timeout=5):
        pass


def test_taken_port_is_a_conflict_and_nothing_runs(
    make_engine: Callable[..., Any], origin: tuple[str, int], socks_upstream: int, tmp_path: Any
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cfg = clash_config(origin, socks_upstream, tmp_path)
        cfg["api"]["clash"]["listen"]["port"] = taken.getsockname()[1]
        with pytest.raises(ApiError) as info:
            make_engine(cfg)
    assert info.value.code == "conflict"
    assert info.value.field_path == "api.clash.listen"


def test_capabilities_list_the_clash_adapter(clash: ClashEngine) -> None:
    adapters = clash.engine.query("capabilities")["adapters"]
    assert {"kind": "clash", "enabled": True} in adapters


def test_refused_upgrades_log_no_uvicorn_error(
    make_clash: Callable[..., ClashEngine],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A WebSocket upgrade refused with an HTTP answer is a refusal, not a server error:
    uvicorn's misleading ERROR line for it is filtered."""
    from websockets.exceptions import InvalidStatus
    from websockets.sync.client import connect

    monkeypatch.setenv("SW_CLASH_SECRET", "s3cret")
    engine = make_clash(secret_env="SW_CLASH_SECRET")
    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        with pytest.raises(InvalidStatus) as info:
            connect(engine.url.replace("http://", "ws://") + "/traffic?token=wrong", open_timeout=5)
        assert info.value.response.status_code == 401
        # uvicorn logs the line after the answer is sent: a request after it on the same
        # server is served only once that task ran on the one event loop.
        assert call(engine.url + "/version", headers={"Authorization": "Bearer s3cret"})[0] == 200
    assert [r.getMessage() for r in caplog.records if r.name == "uvicorn.error"] == []


def test_mixed_port_fixture(clash: ClashEngine) -> None:
    with socket.create_connection(("127.0.0.1", clash.mixed_port), timeout=5):
        pass


def test_spliceway_run_logs_the_clash_url(
    origin: tuple[str, int], socks_upstream: int, tmp_path: Path
) -> None:
    """``spliceway run`` says where the Clash API listens (port 0 resolved), as it does
    for the control API, and the URL answers."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(clash_config(origin, socks_upstream, tmp_path)))
    with running(path) as proc:
        url = wait_for_line(proc, r"Clash API listening on (http://\S+)", timeout=30).group(1)
        assert call(url + "/version")[0] == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
