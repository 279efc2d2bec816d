"""``member_health`` in policy snapshots (``GET /api/v1/policies``): every member of
every group, a selector's included, shows the newest health any probing group recorded
for it, over real HTTP against an engine whose url_test and fallback groups probe a
loopback origin through a live and a dead member."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from typing import Any

from tests.api.conftest import JSON_BODY, control_config, get_result
from tests.conftest import wait_until
from tests.helpers.servers import http_origin
from tests.helpers.upstreams import refused_port

TIMEOUT = 15.0


def health_config(origin_port: int, dead_port: int) -> dict[str, Any]:
    """``pick`` (selector) over ``live`` and ``dead``; ``auto`` (url_test) and ``fb``
    (fallback) probe both through the loopback origin; ``lone`` is in no probing group."""
    cfg = control_config()
    cfg["outbounds"] = [
        {"tag": "live", "protocol": "direct"},
        {"tag": "dead", "protocol": "socks5", "server": "127.0.0.1", "port": dead_port},
        {"tag": "lone", "protocol": "direct"},
    ]
    url = f"http://127.0.0.1:{origin_port}/generate_204"
    cfg["outbound_groups"] = [
        {"tag": "pick", "kind": "selector", "outbounds": ["live", "dead", "lone", "auto"]},
        {"tag": "auto", "kind": "url_test", "outbounds": ["live", "dead"], "url": url},
        {"tag": "fb", "kind": "fallback", "outbounds": ["dead", "live"], "url": url},
    ]
    return cfg


def get(base_url: str, path: str) -> dict[str, Any]:
    return get_result(base_url, path, TIMEOUT)


def command(base_url: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base_url}/api/v1/commands",
        data=json.dumps({"method": method, "params": params}).encode(),
        headers=JSON_BODY,
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=TIMEOUT) as resp:
        body = json.loads(resp.read())
    assert body["ok"], body
    result: dict[str, Any] = body["result"]
    return result


def groups(base_url: str) -> dict[str, dict[str, Any]]:
    return {g["tag"]: g for g in get(base_url, "/api/v1/policies")["policies"]}


def by_member(group: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {m["member_tag"]: m for m in group["member_health"]}


def newest_own_check(snapshots: dict[str, dict[str, Any]], member: str) -> int:
    """The newest ``last_checked_unix_ms`` of ``member`` in any group's own view."""
    return max(
        m["last_checked_unix_ms"] or 0
        for g in snapshots.values()
        for m in g["url_test_members"]
        if m["member_tag"] == member
    )


def test_a_selector_shows_what_a_probing_group_found(make_engine: Callable[..., Any]) -> None:
    with http_origin() as origin:
        engine = make_engine(health_config(origin[1], refused_port()))
        base = engine.control_url

        def probed() -> dict[str, dict[str, Any]] | None:
            snap = groups(base)
            pick = by_member(snap["pick"])
            done = pick["dead"]["healthy"] is False and pick["live"]["healthy"] is True
            return snap if done else None

        snap = wait_until(probed, TIMEOUT, "the startup probes reported in pick's members")
        pick = by_member(snap["pick"])
        # In the selector's order, every member listed.
        assert [m["member_tag"] for m in snap["pick"]["member_health"]] == [
            "live",
            "dead",
            "lone",
            "auto",
        ]
        assert pick["dead"]["checked_by"] in {"auto", "fb"}
        assert pick["dead"]["last_error"]
        assert pick["dead"]["latency_ms"] is None
        assert pick["live"]["latency_ms"] is not None
        # Never checked by anyone: all null, not "healthy" by default.
        assert pick["lone"] == {
            "member_tag": "lone",
            "healthy": None,
            "latency_ms": None,
            "last_checked_unix_ms": None,
            "last_error": None,
            "checked_by": None,
            "provider": None,
        }
        # The selector itself still probes nothing of its own.
        assert snap["pick"]["url_test_members"] == []

        # A manual round of auto: the newest check wins wherever the member appears,
        # in the groups that did not probe (pick) and in those that did (fb).
        before = pick["dead"]["last_checked_unix_ms"]
        assert command(base, "policies.probe", {"policy_tag": "auto"})["probe_triggered"]

        def reprobed() -> dict[str, dict[str, Any]] | None:
            snap = groups(base)
            own = {m["member_tag"]: m for m in snap["auto"]["url_test_members"]}
            return snap if (own["dead"]["last_checked_unix_ms"] or 0) > before else None

        snap = wait_until(reprobed, TIMEOUT, "auto's manual round")
        for tag in ("pick", "auto", "fb"):
            dead = by_member(snap[tag])["dead"]
            assert dead["last_checked_unix_ms"] == newest_own_check(snap, "dead"), tag
            assert dead["healthy"] is False, tag
        assert by_member(snap["fb"])["dead"]["checked_by"] == "auto"
        # The config summary's groups carry it too, and one group's resource.
        config_groups = {g["tag"]: g for g in get(base, "/api/v1/config")["outbound_groups"]}
        assert config_groups["pick"]["member_health"] == snap["pick"]["member_health"]
        assert get(base, "/api/v1/policies/pick")["member_health"] == snap["pick"]["member_health"]
