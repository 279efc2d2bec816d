"""Fixtures for the Clash API: a real engine with ``api.clash`` on a free loopback port,
two groups over real upstreams (Debian's microsocks, direct) and a local HTTP origin."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import base_config
from tests.helpers.servers import EchoServer
from tests.helpers.upstreams import microsocks


def clash_config(
    origin: tuple[str, int],
    socks_port: int,
    tmp: Path,
    **clash: Any,
) -> dict[str, Any]:
    """``base_config`` with the Clash API on a free port and two groups:

    - ``Proxy``: selector over ``auto``, ``s5`` (microsocks) and ``direct``;
    - ``auto``: url_test over ``s5`` and ``direct``, probing ``origin``.

    Rules: ``domain_suffix=example.test`` goes to ``Proxy``; ``port=<origin port>`` to
    ``Proxy``; everything else to ``direct`` (``route.final``). Fake-ip state (and so the
    Clash ``/storage`` directory) lives under ``tmp``.
    """
    cfg = base_config()
    cfg["outbounds"] = [
        {"tag": "direct", "protocol": "direct"},
        {"tag": "block", "protocol": "block"},
        {"tag": "s5", "protocol": "socks5", "server": "127.0.0.1", "port": socks_port},
    ]
    cfg["outbound_groups"] = [
        {"tag": "Proxy", "kind": "selector", "outbounds": ["auto", "s5", "direct"]},
        {
            "tag": "auto",
            "kind": "url_test",
            "outbounds": ["s5", "direct"],
            "url": f"http://127.0.0.1:{origin[1]}/generate_204",
        },
    ]
    cfg["rules"] = [
        {"domain_suffix": ["example.test"], "outbound": "Proxy"},
        {"port": [str(origin[1])], "network": "tcp", "outbound": "Proxy"},
    ]
    cfg["route"] = {"final": "direct"}
    settings: dict[str, Any] = {"enabled": True, "listen": {"address": "127.0.0.1", "port": 0}}
    settings.update(clash)
    cfg["api"]["clash"] = settings
    cfg["runtime"]["dns"] = {
        "answer": {"type": "fake_ip", "persist_path": str(tmp / "fakeip.json")},
    }
    return cfg


@dataclass
class ClashEngine:
    """A running engine with its Clash API; ``url`` is ``http://127.0.0.1:<port>``."""

    engine: Any
    url: str
    origin: tuple[str, int]
    socks_port: int

    @property
    def mixed_port(self) -> int:
        """Port of the ``mixed-in`` inbound (HTTP and SOCKS5 clients)."""
        return int(self.engine.listen_address("mixed-in")[1])


def call(
    url: str,
    method: str = "GET",
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 10,
) -> tuple[int, Any]:
    """One request; ``(status, parsed JSON body or None when empty)``, errors included."""
    data = None
    hdrs = dict(headers or {})
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        hdrs.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as ex:
        raw = ex.read()
        status = ex.code
    return status, (json.loads(raw) if raw else None)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    """A loopback echo server."""
    with EchoServer() as server:
        yield server


@pytest.fixture
def socks_upstream() -> Iterator[int]:
    """Debian's microsocks on loopback."""
    with microsocks() as port:
        yield port


@pytest.fixture
def make_clash(
    make_engine: Callable[..., Any],
    origin: tuple[str, int],
    socks_upstream: int,
    tmp_path: Path,
) -> Callable[..., ClashEngine]:
    """Start an engine from :func:`clash_config` (keyword arguments go to ``api.clash``;
    ``prepare`` may edit the whole config first)."""

    def start(prepare: Callable[[dict[str, Any]], None] | None = None, **clash: Any) -> ClashEngine:
        cfg = clash_config(origin, socks_upstream, tmp_path, **clash)
        if prepare is not None:
            prepare(cfg)
        engine = make_engine(cfg)
        return ClashEngine(engine, engine.clash_url, origin, socks_upstream)

    return start


@pytest.fixture
def clash(make_clash: Callable[..., ClashEngine]) -> ClashEngine:
    """An engine with a keyless Clash API (see :func:`clash_config`)."""
    return make_clash()
