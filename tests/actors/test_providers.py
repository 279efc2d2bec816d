"""The providers' refresher: its plan (when each provider is due), and the first round at
start, which the engine waits for only a short while."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from spliceway.actors.providers import due_at
from spliceway.engine import core as engine_core
from spliceway.engine.providers import RETRY_S, ProviderState
from tests.conftest import base_config, wait_until
from tests.engine.test_providers import clash, members, provider_config
from tests.helpers.provider_origin import Answer, ProviderOrigin, provider_origin
from tests.helpers.upstreams import CountingForwarder, microsocks

START = 1_000_000


def _state(**fields: object) -> ProviderState:
    base: dict[str, object] = {
        "kind": "proxies",
        "name": "sub",
        "identity": (),
        "url": "https://sub.example/x",
        "path": "/cache/sub",
        "interval_seconds": 600,
        "via": None,
        "size_limit": 1 << 20,
    }
    base.update(fields)
    return ProviderState(**base)  # type: ignore[arg-type]


def test_a_url_provider_is_due_an_interval_after_its_copy() -> None:
    assert due_at(_state(updated_at_ms=500_000), START) == 500_000 + 600_000
    # Never fetched: at once.
    assert due_at(_state(), START) == START


def test_after_a_failure_it_is_tried_again_sooner() -> None:
    failed = _state(last_error="boom", checked_at_ms=2_000_000, updated_at_ms=1_000)
    assert due_at(failed, START) == 2_000_000 + RETRY_S * 1000
    short = _state(last_error="boom", checked_at_ms=2_000_000, interval_seconds=5)
    assert due_at(short, START) == 2_000_000 + 5000


def test_a_path_provider_is_reread_every_interval() -> None:
    assert due_at(_state(url=None), START) == START + 600_000
    assert due_at(_state(url=None, checked_at_ms=3_000_000), START) == 3_000_000 + 600_000


def test_geodata_is_never_scheduled() -> None:
    assert due_at(_state(kind="geodata", interval_seconds=None), START) is None


@pytest.fixture
def origin() -> Iterator[ProviderOrigin]:
    with provider_origin() as server:
        yield server


def test_the_start_waits_a_short_bound_for_a_slow_origin(
    make_engine, origin, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(engine_core, "PROVIDER_START_WAIT_S", 0.5)
    gate = threading.Event()
    with microsocks() as port, CountingForwarder(("127.0.0.1", port)) as node:
        nodes = {"n1": node}
        origin.serve("/sub", Answer(clash(nodes, "n1"), gate=gate))
        started = time.monotonic()
        engine = make_engine(provider_config(origin.url("/sub"), tmp_path / "cache"))
        took = time.monotonic() - started
        try:
            assert took < 5, took
            # Started without members; the fetch goes on and applies when it ends.
            assert members(engine) == []
            assert origin.count("/sub") == 1
        finally:
            gate.set()
        wait_until(lambda: members(engine) == ["n1"], what="the first fetch's members")


def test_an_engine_without_providers_starts_no_round(make_engine) -> None:
    engine = make_engine(base_config())
    assert engine.query("providers") == {"providers": []}
    assert engine.execute("providers.update", {}) == {"results": []}
