"""runtime.process_lookup with real client processes (curl, wget) through the engine's
socks5 and http inbounds on this host: the record's source.process_*, process_name rules,
the modes. (A client on another host is never looked up: tests/routing/test_process_lookup.py
and tests/csrc/test_route_diff.py.)"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway.routing.process_lookup import LocalAddresses, is_loopback
from tests.conftest import base_config, wait_until
from tests.helpers.flows import STATUS_ONLY, completed
from tests.helpers.servers import read_head

CURL = shutil.which("curl")
pytestmark = pytest.mark.skipif(CURL is None, reason="curl is not installed")


def _config(mode: str, rules: list[dict[str, Any]] | None = None, **kw: Any) -> dict:
    cfg = base_config(rules=rules or [], **kw)
    cfg["runtime"]["process_lookup"] = mode
    return cfg


def _run(argv: list[str]) -> tuple[int, int, str]:
    """Run a client to its end: its pid, exit status and output."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=30)
    return proc.pid, proc.returncode, out + err


def _curl(engine: Any, inbound: str, url: str) -> tuple[int, str]:
    """curl ``url`` through ``inbound``: its pid and the HTTP status it printed."""
    host, port = engine.listen_address(inbound)
    proxy = ("--socks5-hostname" if inbound == "socks-in" else "-x", f"{host}:{port}")
    pid, _, out = _run([CURL, "-s", "--max-time", "10", *proxy, *STATUS_ONLY, url])
    return pid, out


@pytest.fixture
def other_client(tmp_path: Path) -> tuple[str, list[str]]:
    """A second client program with its own executable name: wget, else a renamed copy
    of the Python binary fetching with urllib. (name, argv prefix taking proxy and url)"""
    wget = shutil.which("wget")
    if wget is not None:
        return "wget", [wget, "-q", "-O", "-", "-T", "10", "-t", "1"]
    exe = tmp_path / "fetcher"
    shutil.copy(os.path.realpath(sys.executable), exe)
    return "fetcher", [str(exe)]


def _other(engine: Any, client: tuple[str, list[str]], url: str) -> int:
    """Fetch ``url`` with the other client through http-in (it must succeed): its pid."""
    name, argv = client
    proxy = "http://{}:{}".format(*engine.listen_address("http-in"))
    if name == "wget":
        argv = [*argv, "-e", "use_proxy=yes", "-e", f"http_proxy={proxy}", url]
    else:
        script = (
            "import sys, urllib.request as u; "
            "o = u.build_opener(u.ProxyHandler({'http': sys.argv[1]})); "
            "o.open(sys.argv[2], timeout=10).read()"
        )
        argv = [*argv, "-c", script, proxy, url]
    pid, status, out = _run(argv)
    assert status == 0, out
    return pid


def _source(event: dict) -> dict:
    return event["payload"]["record"]["source"]


def test_curl_through_socks5_and_http_has_its_process(make_engine, origin):
    engine = make_engine(_config("always"))
    url = f"http://127.0.0.1:{origin[1]}/bytes/100"
    runs = [_curl(engine, inbound, url) for inbound in ("socks-in", "http-in")]
    assert [out for _, out in runs] == ["200", "200"]
    events = completed(engine, 2)
    path = os.path.realpath(CURL)
    for (pid, _), event in zip(runs, events, strict=True):
        assert _source(event)["process_id"] == pid
        assert _source(event)["process_name"] == os.path.basename(path) == "curl"
        assert _source(event)["process_path"] == path
        assert event["payload"]["outcome"] == "direct_relayed"
    # Every record of those flows carries it (always: looked up before routing).
    for e in engine.query("events")["events"]:
        if e["event_type"].startswith("flow."):
            assert _source(e)["process_name"] == "curl", e["event_type"]


def test_process_name_rule_blocks_curl_but_not_another_client(make_engine, origin, other_client):
    rules = [{"process_name": ["curl"], "action": "block"}]
    engine = make_engine(_config("auto", rules))
    url = f"http://127.0.0.1:{origin[1]}/bytes/64"
    curl_pid, curl_out = _curl(engine, "http-in", url)
    assert curl_out == "403"
    other_pid = _other(engine, other_client, url)
    socks_pid, socks_out = _curl(engine, "socks-in", url)
    assert socks_out != "200"
    blocked, passed, socks = completed(engine, 3)
    assert blocked["payload"]["outcome"] == "blocked"
    assert blocked["payload"]["record"]["route"]["matched_rule"] == {
        "index": 0,
        "condition": "process_name=curl",
    }
    assert _source(blocked)["process_id"] == curl_pid
    assert passed["payload"]["outcome"] == "direct_relayed"
    assert _source(passed)["process_id"] == other_pid
    assert _source(passed)["process_name"] == other_client[0]
    assert socks["payload"]["outcome"] == "blocked"
    assert _source(socks)["process_id"] == socks_pid


def test_lookup_off_fills_nothing_and_matches_nothing(make_engine, origin):
    rules = [{"process_name": ["curl"], "action": "block"}]
    engine = make_engine(_config("off", rules))
    _, out = _curl(engine, "socks-in", f"http://127.0.0.1:{origin[1]}/bytes/10")
    assert out == "200"
    (event,) = completed(engine, 1)
    assert set(_source(event)) == {"ip", "port"}
    assert engine.core.process_lookup.looked_up == 0


def test_auto_without_process_rules_looks_nothing_up(make_engine, origin):
    engine = make_engine(_config("auto", [{"port": "1", "action": "block"}]))
    _, out = _curl(engine, "http-in", f"http://127.0.0.1:{origin[1]}/bytes/10")
    assert out == "200"
    (event,) = completed(engine, 1)
    assert set(_source(event)) == {"ip", "port"}
    assert engine.core.process_lookup.looked_up == 0


class HeldOrigin:
    """An HTTP origin that answers one request only once released: its client is alive
    (and connected) until then."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.release = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.sock.accept()
        with conn:
            if b"\r\n\r\n" not in read_head(conn):
                return
            self.release.wait(20)
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok")

    def close(self) -> None:
        self.release.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def held_origin() -> Iterator[HeldOrigin]:
    server = HeldOrigin()
    yield server
    server.close()


def test_flow_c_routes_by_an_earlier_rule_carries_its_process(make_engine, held_origin):
    # The first rule decides (C routes the flow at once); the process_name rule after it
    # makes auto look the client up anyway, for the record.
    rules = [
        {"port": str(held_origin.port), "outbound": "direct"},
        {"process_name": ["nothing-here"], "action": "block"},
    ]
    engine = make_engine(_config("auto", rules))
    host, port = engine.listen_address("socks-in")
    argv = [CURL, "-sS", "--max-time", "15", "--socks5-hostname", f"{host}:{port}"]
    curl = subprocess.Popen(
        [*argv, f"http://127.0.0.1:{held_origin.port}/"], stdout=subprocess.PIPE, text=True
    )
    try:
        # Listed once its record has both the process (Python's lookup) and the route (C's
        # ROUTED record): under load the lookup can land first.
        flows = wait_until(
            lambda: [
                f
                for f in engine.query("flows")["active_flows"]
                if f["route"]["matched_rule"] is not None
            ],
            what="the flow is listed, routed",
        )
        (record,) = flows
        assert record["source"]["process_id"] == curl.pid
        assert record["source"]["process_name"] == "curl"
        assert record["route"]["matched_rule"]["index"] == 0
        assert engine.core.bridge.conn.stats()["routed"] >= 1  # C routed it
    finally:
        held_origin.release.set()
        out, _ = curl.communicate(timeout=20)
    assert out == "ok"


def _host_address() -> str | None:
    """A non-loopback IPv4 address of this host, if it has one."""
    for text in sorted(LocalAddresses().refresh()):
        if ":" not in text and not is_loopback(text):
            return text
    return None


def test_client_on_a_host_address_through_a_wildcard_listener(make_engine, origin):
    address = _host_address()
    if address is None:
        pytest.skip("this host has no non-loopback IPv4 address")
    cfg = _config("always")
    cfg["inbounds"] = [{"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}}]
    cfg["inbounds"][0]["listen"]["address"] = "0.0.0.0"
    engine = make_engine(cfg)
    port = engine.listen_address("socks-in")[1]
    argv = [CURL, "-sS", "--max-time", "10", "--socks5-hostname", f"{address}:{port}"]
    pid, _, out = _run([*argv, *STATUS_ONLY, f"http://127.0.0.1:{origin[1]}/bytes/10"])
    assert out == "200"
    (event,) = completed(engine, 1)
    assert _source(event)["ip"] == address
    assert _source(event)["process_id"] == pid
    # And a client elsewhere would not be looked up at all.
    assert not engine.core.flow_deps.lookup_wanted("198.51.100.7")
