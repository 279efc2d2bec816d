"""``spliceway status`` shows the engine's uptime and ``spliceway policies`` its probing
groups' member health: the real CLI over IPC against a real engine."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from spliceway import Engine
from spliceway.cli.remote import duration_text
from tests.conftest import base_config, wait_until
from tests.helpers.program import SPLICEWAY
from tests.helpers.servers import http_origin
from tests.helpers.upstreams import refused_port


def cli(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    argv = [*SPLICEWAY, "--ipc", str(path), *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def test_duration_text() -> None:
    assert [duration_text(n) for n in (0, 59, 60, 3600, 90061, 86400)] == [
        "0s",
        "59s",
        "1m 0s",
        "1h 0m 0s",
        "1d 1h 1m 1s",
        "1d 0h 0m 0s",
    ]


def test_status_shows_the_uptime(sock_path: Path) -> None:
    cfg = base_config(api={"control": {"enabled": False}, "ipc": {"path": str(sock_path)}})
    engine = Engine(cfg).start()
    try:
        started_ms = engine.query("health")["started_at_unix_ms"]
        # At least a second: the uptime is not trivially 0.
        wait_until(lambda: time.time() * 1000 - started_ms >= 1100, what="one second of uptime")
        before = int(time.time() * 1000 - started_ms) // 1000
        as_json = cli(sock_path, "status", "--json")
        table = cli(sock_path, "status")
        after = int(time.time() * 1000 - started_ms) // 1000
    finally:
        engine.stop()
    assert as_json.returncode == 0, as_json.stderr
    doc = json.loads(as_json.stdout)
    assert before <= doc["uptime_seconds"] <= after
    assert doc["health"]["started_at_unix_ms"] == started_ms
    assert table.returncode == 0, table.stderr
    rows = [line.split(None, 1) for line in table.stdout.splitlines()]
    assert rows[0] == ["FIELD", "VALUE"]
    uptime = dict(rows[1:])["uptime"]
    assert uptime in {duration_text(n) for n in range(before, after + 1)}, uptime


def probing_config(sock_path: Path, origin_port: int, dead_port: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{origin_port}/generate_204"
    return base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            {"tag": "dead", "protocol": "socks5", "server": "127.0.0.1", "port": dead_port},
        ],
        outbound_groups=[
            {"tag": "pick", "kind": "selector", "outbounds": ["auto", "direct"]},
            {"tag": "auto", "kind": "url_test", "outbounds": ["dead", "direct"], "url": url},
        ],
        api={"control": {"enabled": False}, "ipc": {"path": str(sock_path)}},
    )


def test_policies_shows_member_health(sock_path: Path) -> None:
    dead_port = refused_port()
    with http_origin() as (_, origin_port):
        engine = Engine(probing_config(sock_path, origin_port, dead_port)).start()
        try:

            def probed() -> dict[str, Any] | None:
                snap = engine.query("policy", {"policy_tag": "auto"})
                members = snap["url_test_members"]
                return snap if all(m["last_checked_unix_ms"] for m in members) else None

            snap = wait_until(probed, what="the first probe round")
            table = cli(sock_path, "policies")
            as_json = cli(sock_path, "policies", "--json")
        finally:
            engine.stop()
    assert table.returncode == 0, table.stderr
    groups, members = table.stdout.split("\n\n")
    group_rows = [re.split(r"\s{2,}", line) for line in groups.splitlines()]
    assert group_rows[0] == ["POLICY", "KIND", "SELECTED", "LATENCY_MS", "MEMBERS", "HEALTHY"]
    latency = snap["latency_ms"]
    assert group_rows[1:] == [
        ["pick", "selector", "auto", str(latency), "auto,direct", "-"],
        ["auto", "url_test", "direct", str(latency), "dead,direct", "1/2"],
    ]
    member_rows = [re.split(r"\s{2,}", line) for line in members.splitlines()]
    assert member_rows[0] == [
        "POLICY",
        "MEMBER",
        "HEALTH",
        "LATENCY_MS",
        "CHECKED",
        "BY",
        "ERROR",
    ]
    by_member = {m["member_tag"]: m for m in snap["url_test_members"]}
    pick_auto, pick_direct, dead, direct = member_rows[1:]
    # The selector's members: auto (a group) unchecked, direct as auto found it.
    assert pick_auto == ["pick", "auto", "unchecked", "-", "-", "-", "-"]
    latency = str(by_member["direct"]["latency_ms"])
    assert pick_direct[:4] == ["pick", "direct", "up", latency]
    assert re.fullmatch(r"\d+s ago", pick_direct[4]) and pick_direct[5:] == ["auto", "-"]
    assert dead[:4] == ["auto", "dead", "down", "-"]
    assert re.fullmatch(r"\d+s ago", dead[4])
    assert dead[5:] == ["auto", by_member["dead"]["last_error"]]
    assert direct[:4] == ["auto", "direct", "up", latency]
    assert re.fullmatch(r"\d+s ago", direct[4]) and direct[5:] == ["auto", "-"]
    # --json is the query's result, member health included.
    doc = json.loads(as_json.stdout)
    (auto,) = [p for p in doc["policies"] if p["tag"] == "auto"]
    assert [(m["member_tag"], m["healthy"]) for m in auto["url_test_members"]] == [
        ("dead", False),
        ("direct", True),
    ]
