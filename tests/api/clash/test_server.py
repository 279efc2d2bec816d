"""The Clash listener itself: bound on its own port, a taken port refused, stopped with
the engine."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

from spliceway.errors import ApiError
from tests.api.clash.conftest import ClashEngine, clash_config


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
