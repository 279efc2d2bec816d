"""What a test reads of a running engine process from outside: /proc figures, and one
kept-alive control API connection that needs no new descriptor in the engine (the
out-of-descriptor tests of the API, the DNS server and the listeners share them)."""

from __future__ import annotations

import http.client
import json
import os
import urllib.request
from typing import Any
from urllib.parse import urlsplit

from tests.conftest import base_config

_CLK_TCK = os.sysconf("SC_CLK_TCK")


def command_request(base_url: str, method: str, params: dict[str, Any]) -> urllib.request.Request:
    """The control API's POST of command ``method`` with ``params``."""
    return urllib.request.Request(
        f"{base_url}/api/v1/commands",
        data=json.dumps({"method": method, "params": params}).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )


def socks_and_keyless_api_config() -> dict[str, Any]:
    """A socks inbound and a keyless control API on free loopback ports, no periodic
    stats: the engine the out-of-descriptor tests exhaust."""
    cfg = base_config(
        inbounds=[{"tag": "socks-in", "protocol": "socks5", "listen": {"port": 0}}],
        runtime={"stats_interval_ms": 3_600_000},
    )
    cfg["api"]["control"] = {
        "enabled": True,
        "listen": {"address": "127.0.0.1", "port": 0},
        "api_key_env": None,
    }
    return cfg


def open_fds(pid: int) -> int:
    """How many descriptors ``pid`` holds now."""
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of every thread of ``pid`` so far."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        # The command name may hold spaces: fields count from after its ')'.
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


class KeptApi:
    """One kept-alive control API connection: answers through it need no new descriptor
    in the engine."""

    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        assert url.hostname is not None and url.port is not None
        self.address = (url.hostname, url.port)
        self.conn = http.client.HTTPConnection(url.hostname, url.port, timeout=5)

    def get(self, path: str) -> dict[str, Any]:
        """``GET /api/v1/<path>``'s result; the connection must stay open."""
        self.conn.request("GET", f"/api/v1/{path}")
        answer = self.conn.getresponse()
        doc = json.loads(answer.read())
        assert answer.status == 200 and doc["ok"] is True, doc
        assert answer.getheader("Connection", "").lower() != "close"
        return doc["result"]

    def fd_warnings(self) -> list[dict[str, Any]]:
        """The payloads of the ``engine.warning`` ``fd_exhausted`` events in the ring."""
        return [
            e["payload"]
            for e in self.get("events")["events"]
            if e["event_type"] == "engine.warning" and e["payload"]["code"] == "fd_exhausted"
        ]

    def close(self) -> None:
        """Close the connection."""
        self.conn.close()
