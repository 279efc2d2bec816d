"""Proxy providers end to end: a real engine, a subscription origin on loopback that changes,
fails, stalls and lies, real SOCKS5 upstreams (microsocks) behind counting forwarders, and
real flows through the engine's inbound.

Each provider's body lists "nodes": socks5 proxies at the ports of counting forwarders in
front of one microsocks, so which node carried a flow is counted, not inferred.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from spliceway import ApiError
from spliceway.api.openapi import openapi_document
from spliceway.config import parse_config
from spliceway.config.provider_paths import provider_content_path
from spliceway.engine import providers as engine_providers
from spliceway.protocols import socks5
from tests.conftest import base_config, wait_until
from tests.events.test_catalogue import check_event
from tests.helpers.flows import STATUS_ONLY, socks_curl
from tests.helpers.provider_origin import Answer, ProviderOrigin, make_ca, provider_origin
from tests.helpers.socks import socks5_connect
from tests.helpers.upstreams import CountingForwarder, microsocks, refused_port

_DOC = openapi_document()


def _schema_check(name: str, value: Any) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": _DOC["components"]}
    jsonschema.Draft202012Validator(schema).validate(value)


@pytest.fixture(scope="module")
def upstream() -> Iterator[int]:
    with microsocks() as port:
        yield port


@pytest.fixture
def nodes(upstream: int) -> Iterator[dict[str, CountingForwarder]]:
    """Four nodes (counting forwarders to the one microsocks), by name."""
    made = {name: CountingForwarder(("127.0.0.1", upstream)) for name in ("n1", "n2", "n3", "n4")}
    try:
        yield made
    finally:
        for node in made.values():
            node.close()


@pytest.fixture
def origin() -> Iterator[ProviderOrigin]:
    with provider_origin() as server:
        yield server


@pytest.fixture
def target() -> Iterator[tuple[str, int]]:
    from tests.helpers.servers import http_origin

    with http_origin() as address:
        yield address


def clash(nodes: dict[str, CountingForwarder], *names: str, extra: str = "") -> bytes:
    """A Clash subscription listing ``names`` (socks5 proxies at their nodes)."""
    lines = ["proxies:"]
    for name in names:
        port = nodes[name].port
        lines.append(f"  - {{name: {name}, type: socks5, server: 127.0.0.1, port: {port}}}")
    return ("\n".join(lines) + "\n" + extra).encode()


VMESS = (
    "  - {name: vm, type: vmess, server: 192.0.2.1, port: 443, alterId: 0, cipher: auto,\n"
    "     uuid: 5a8d3d3a-6a3e-4d1e-9c1d-2d0d2d3b9e4f}\n"
)
USERINFO = "upload=1024; download=2048; total=1073741824; expire=1893456000"


def provider_config(url: str, cache: Path, **provider: Any) -> dict[str, Any]:
    """One provider ``sub`` behind a selector ``proxy``, where every flow goes."""
    return base_config(
        providers={"proxies": {"sub": {"url": url, **provider}}},
        outbound_groups=[{"tag": "proxy", "kind": "selector", "providers": ["sub"]}],
        route={"final": "proxy"},
        runtime={"stats_interval_ms": 200, "providers_cache_dir": str(cache)},
    )


def members(engine: Any, group: str = "proxy") -> list[str]:
    return engine.query("policy", {"policy_tag": group})["outbounds"]


def status(engine: Any, name: str = "sub", kind: str = "proxies") -> dict[str, Any]:
    return next(
        s for s in engine.query("providers")["providers"] if (s["name"], s["kind"]) == (name, kind)
    )


def events(engine: Any, *types: str) -> list[dict[str, Any]]:
    return engine.query("events", {"types": ",".join(types)})["events"]


def fetch_through(engine: Any, target: tuple[str, int]) -> str:
    return socks_curl(engine, f"http://127.0.0.1:{target[1]}/", *STATUS_ONLY).stdout


def update(engine: Any, **params: Any) -> list[dict[str, Any]]:
    result = engine.execute("providers.update", params)
    _schema_check("ProvidersUpdateResult", result)
    return result["results"]


# -- start, routing, events, status ---------------------------------------------------


def test_start_fetches_and_routes_through_the_providers_members(
    make_engine, origin, nodes, target, tmp_path
) -> None:
    origin.serve(
        "/sub",
        Answer(
            clash(nodes, "n1", "n2", extra=VMESS),
            headers={"subscription-userinfo": USERINFO, "ETag": '"v1"'},
        ),
    )
    config = provider_config(origin.url("/sub?token=s3cret"), tmp_path / "cache")
    engine = make_engine(config)
    # Fetched during the start: the first routes have the members.
    assert members(engine) == ["n1", "n2"]
    assert fetch_through(engine, target) == "200"
    assert (nodes["n1"].connections, nodes["n2"].connections) == (1, 0)

    (changed,) = events(engine, "config.changed")
    assert changed["payload"]["trigger"] == "provider"
    assert changed["payload"]["changed_components"] == ["outbounds", "policy_groups"]
    (updated,) = events(engine, "provider.updated")
    assert check_event(updated) == []
    payload = updated["payload"]
    assert payload == {
        "name": "sub",
        "kind": "proxies",
        "source": "url",
        "url": f"http://127.0.0.1:{origin.port}",
        "trigger": "startup",
        "updated_at_unix_ms": payload["updated_at_unix_ms"],
        "sha256": payload["sha256"],
        "outbounds": 2,
        "skipped": 1,
    }
    assert updated["sequence"] > changed["sequence"]
    assert "s3cret" not in json.dumps(engine.query("events"))

    state = status(engine)
    _schema_check("ProviderList", engine.query("providers"))
    assert state["members"] == ["n1", "n2"] and state["outbounds"] == 2
    assert state["format"] == "clash" and state["source"] == "url"
    assert state["skipped"] == 1
    assert state["skipped_proxies"] == [
        {"name": "vm", "type": "vmess", "reason": "spliceway has no vmess outbound in this build"}
    ]
    assert state["subscription_info"] == {
        "upload": 1024,
        "download": 2048,
        "total": 1073741824,
        "expire": 1893456000,
    }
    assert state["last_error"] is None and state["updating"] is False
    assert state["next_update_at_unix_ms"] == state["updated_at_unix_ms"] + 3600 * 1000
    assert state["path"] == provider_content_path(parse_config(config), "proxies", "sub")
    meta = json.loads(Path(state["path"] + ".meta.json").read_text())
    assert meta["etag"] == '"v1"' and meta["userinfo"] == USERINFO
    assert meta["fetched_at_unix_ms"] == state["updated_at_unix_ms"]
    assert Path(state["path"]).read_bytes() == clash(nodes, "n1", "n2", extra=VMESS)

    # Where each member came from, in the policy views and the config summary.
    view = engine.query("policy", {"policy_tag": "proxy"})
    assert view["providers"] == ["sub"]
    assert [(m["member_tag"], m["provider"]) for m in view["member_health"]] == [
        ("n1", "sub"),
        ("n2", "sub"),
    ]
    summary = {o["tag"]: o["provider"] for o in engine.query("config")["outbounds"]}
    assert summary["n1"] == "sub" and summary["direct"] is None


def test_a_refresh_changes_members_live_and_keeps_the_selection(
    make_engine, origin, nodes, target, tmp_path
) -> None:
    origin.serve("/sub", Answer(clash(nodes, "n1", "n2", "n3")))
    engine = make_engine(provider_config(origin.url("/sub"), tmp_path / "cache"))
    engine.execute("policies.select", {"policy_tag": "proxy", "target_tag": "n2"})
    with socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", target[1]) as held:
        # n1 and n3 go, n4 comes: n2 (selected) stays selected, the open flow stays open.
        origin.serve("/sub", Answer(clash(nodes, "n4", "n2")))
        (result,) = update(engine)
        assert result["outcome"] == "updated" and result["outbounds"] == 2
        assert members(engine) == ["n4", "n2"]
        assert engine.query("policy", {"policy_tag": "proxy"})["selected"] == "n2"
        held.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert held.recv(12) == b"HTTP/1.1 200"
    assert fetch_through(engine, target) == "200"
    assert nodes["n2"].connections == 2 and nodes["n4"].connections == 0

    # The same body again: nothing applied, nothing emitted.
    before = len(events(engine, "config.changed", "provider.updated"))
    (result,) = update(engine)
    assert result["outcome"] == "unchanged"
    assert len(events(engine, "config.changed", "provider.updated")) == before

    # The selected member goes: the selector starts on its first member again.
    origin.serve("/sub", Answer(clash(nodes, "n3", "n4")))
    assert update(engine)[0]["outcome"] == "updated"
    assert engine.query("policy", {"policy_tag": "proxy"})["selected"] == "n3"
    assert fetch_through(engine, target) == "200"
    assert nodes["n3"].connections == 1


def test_groups_filter_one_provider_fetched_once_and_a_refresh_refilters(
    make_engine, origin, nodes, target, tmp_path
) -> None:
    origin.serve("/sub", Answer(clash(nodes, "n1", "n2", "n3")))
    config = provider_config(origin.url("/sub"), tmp_path / "cache")
    config["outbounds"].append({"tag": "local", "protocol": "direct"})
    config["outbound_groups"] = [
        # Two expressions over inline and provider members: n3, then n1, then `local`.
        {
            "tag": "proxy",
            "kind": "selector",
            "outbounds": ["local"],
            "providers": ["sub"],
            "filter": ["n3", "n1"],
        },
        {"tag": "odd", "kind": "selector", "providers": ["sub"], "exclude_filter": ["n2|n4"]},
        {"tag": "four", "kind": "selector", "providers": ["sub"], "filter": ["n4"]},
    ]
    config["inbounds"][0]["sniff"] = False
    engine = make_engine(config)
    assert members(engine) == ["n3", "n1", "local"]
    assert members(engine, "odd") == ["n1", "n3"]
    assert members(engine, "four") == []
    # One provider, fetched once, however many groups filter it; each member's provider.
    assert origin.count("/sub") == 1
    assert [s["name"] for s in engine.query("providers")["providers"]] == ["sub"]
    view = engine.query("policy", {"policy_tag": "proxy"})
    assert [(m["member_tag"], m["provider"]) for m in view["member_health"]] == [
        ("n3", "sub"),
        ("n1", "sub"),
        ("local", None),
    ]
    config["route"] = {"final": "odd"}
    engine.execute("config.apply", {"config": config})
    assert fetch_through(engine, target) == "200"
    assert nodes["n1"].connections == 1

    # A group filtered to nothing fails its flows as a group without members does.
    config["route"] = {"final": "four"}
    engine.execute("config.apply", {"config": config})
    with pytest.raises(ConnectionError, match=f"socks reply {socks5.REP_GENERAL_FAILURE}"):
        socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", target[1])
    failed = wait_until(
        lambda: [
            e["payload"]["record"]["result"]["failure"]
            for e in events(engine, "flow.completed")
            if e["payload"]["record"]["result"]["outcome"] == "failed"
        ],
        what="the failed flow",
    )
    assert [f["code"] for f in failed] == ["no_member"]

    # A refresh applies the groups' filters to the new content.
    origin.serve("/sub", Answer(clash(nodes, "n4", "n2", "n1")))
    (result,) = update(engine)
    assert result["outcome"] == "updated" and result["outbounds"] == 3
    assert status(engine)["members"] == ["n4", "n2", "n1"]
    assert members(engine) == ["n1", "local"]
    assert members(engine, "odd") == ["n1"]
    assert members(engine, "four") == ["n4"]
    assert origin.count("/sub") == 2
    assert fetch_through(engine, target) == "200"
    assert nodes["n4"].connections == 1 and nodes["n2"].connections == 0


# -- bad answers keep the last good copy ----------------------------------------------

BAD = [
    ("500", Answer(b"<html>Internal Server Error</html>", 500), "the origin answered HTTP 500"),
    ("reset", Answer(mode="reset"), "closed before an answer|reset"),
    ("stall", Answer(mode="stall"), r"sent nothing for 0\.5 s \(stalled\)"),
    (
        "10MiB",
        Answer(b"#" * (10 << 20), mode="stream"),
        r"larger than size_limit_bytes \(1048576\)",
    ),
    (
        "html",
        Answer(b"<!DOCTYPE html><html><body>Please log in</body></html>"),
        "an HTML page",
    ),
    ("garbage", Answer(bytes(range(256)) * 8), "not UTF-8 text"),
    (
        "duplicate-names",
        Answer(
            b"proxies:\n  - {name: a, type: socks5, server: 127.0.0.1, port: 1}\n"
            b"  - {name: a, type: socks5, server: 127.0.0.1, port: 2}\n"
        ),
        r"two proxies are named 'a' \(#1 and #2\)",
    ),
    ("no-proxies", Answer(b"port: 7890\nrules: []\n"), "no share link|no `proxies`"),
]


def test_bad_answers_never_replace_the_last_good_copy(
    make_engine, origin, nodes, target, tmp_path, monkeypatch
) -> None:
    monkeypatch.setattr(engine_providers, "STALL_TIMEOUT_S", 0.5)
    origin.serve("/sub", Answer(clash(nodes, "n1")))
    config = provider_config(origin.url("/sub"), tmp_path / "cache", size_limit_bytes=1 << 20)
    engine = make_engine(config)
    good = status(engine)
    cached = Path(good["path"]).read_bytes()
    for name, answer, message in BAD:
        origin.serve("/sub", answer)
        (result,) = update(engine)
        assert result["outcome"] == "failed", name
        assert result["updated_at_unix_ms"] == good["updated_at_unix_ms"], name
        assert result["error"] and __import__("re").search(message, result["error"]), (
            name,
            result["error"],
        )
        failed = events(engine, "provider.failed")[-1]
        assert check_event(failed) == [], name
        assert failed["payload"] == {
            "name": "sub",
            "kind": "proxies",
            "source": "url",
            "url": f"http://127.0.0.1:{origin.port}",
            "trigger": "manual",
            "error": result["error"],
            "kept_copy_at_unix_ms": good["updated_at_unix_ms"],
        }
        state = status(engine)
        assert state["last_error"] == result["error"], name
        assert state["members"] == ["n1"] and state["sha256"] == good["sha256"], name
        assert Path(state["path"]).read_bytes() == cached, name
        # Still routing through the last good copy.
        assert fetch_through(engine, target) == "200", name
    assert nodes["n1"].connections == len(BAD)
    assert len(events(engine, "provider.failed")) == len(BAD)
    assert len(events(engine, "config.changed")) == 1  # the start's only
    # A good body again clears the error.
    origin.serve("/sub", Answer(clash(nodes, "n2")))
    assert update(engine)[0]["outcome"] == "updated"
    assert status(engine)["last_error"] is None and members(engine) == ["n2"]


# -- offline starts ---------------------------------------------------------------------


def test_a_restart_with_the_origin_down_starts_from_the_cache(
    make_engine, nodes, target, tmp_path
) -> None:
    cache = tmp_path / "cache"
    with provider_origin() as first:
        first.serve(
            "/sub", Answer(clash(nodes, "n1", "n2"), headers={"subscription-userinfo": USERINFO})
        )
        url = first.url("/sub")
        engine = make_engine(provider_config(url, cache))
        fetched = status(engine)
        engine.stop()
        assert first.count("/sub") == 1
    # The origin is gone; the copy is fresh (younger than interval_seconds): not fetched.
    again = make_engine(provider_config(url, cache))
    assert members(again) == ["n1", "n2"]
    state = status(again)
    assert state["updated_at_unix_ms"] == fetched["updated_at_unix_ms"]
    assert state["subscription_info"] == fetched["subscription_info"]
    assert state["last_error"] is None
    assert state["next_update_at_unix_ms"] == fetched["updated_at_unix_ms"] + 3600 * 1000
    assert events(again, "provider.failed", "provider.updated", "config.changed") == []
    assert fetch_through(again, target) == "200"
    assert nodes["n1"].connections == 1

    # A refresh now fails (the origin is down) and the cached members keep routing.
    (result,) = update(again)
    assert result["outcome"] == "failed" and "cannot reach" in result["error"]
    assert fetch_through(again, target) == "200"
    assert nodes["n1"].connections == 2


def test_a_stale_cache_is_refetched_at_start(make_engine, origin, nodes, tmp_path) -> None:
    cache = tmp_path / "cache"
    origin.serve("/sub", Answer(clash(nodes, "n1")))
    first = make_engine(provider_config(origin.url("/sub"), cache, interval_seconds=3600))
    path = status(first)["path"]
    first.stop()
    # Age the copy past its interval.
    meta_path = Path(path + ".meta.json")
    meta = json.loads(meta_path.read_text())
    meta["fetched_at_unix_ms"] -= 3601 * 1000
    meta_path.write_text(json.dumps(meta))
    origin.serve("/sub", Answer(clash(nodes, "n2")))
    second = make_engine(provider_config(origin.url("/sub"), cache, interval_seconds=3600))
    # Started on the old copy, then refreshed on schedule (due already).
    (updated,) = wait_until(
        lambda: events(second, "provider.updated"), what="the scheduled refresh"
    )
    assert updated["payload"]["trigger"] == "scheduled"
    assert members(second) == ["n2"] and origin.count("/sub") == 2


def test_a_group_without_members_fails_its_flows_with_no_member(
    make_engine, target, tmp_path
) -> None:
    url = f"http://127.0.0.1:{refused_port()}/sub"
    config = provider_config(url, tmp_path / "cache")
    config["outbound_groups"].append({"tag": "auto", "kind": "url_test", "providers": ["sub"]})
    config["inbounds"][0]["sniff"] = False
    engine = make_engine(config)
    assert members(engine) == [] and members(engine, "auto") == []
    view = engine.query("policy", {"policy_tag": "proxy"})
    assert view["selected"] is None and view["member_health"] == []
    (failed,) = events(engine, "provider.failed")
    assert failed["payload"]["trigger"] == "startup"
    assert failed["payload"]["kept_copy_at_unix_ms"] is None
    assert status(engine)["next_update_at_unix_ms"] is not None

    with pytest.raises(ConnectionError, match=f"socks reply {socks5.REP_GENERAL_FAILURE}"):
        socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", target[1])
    done = wait_until(lambda: events(engine, "flow.completed"), what="the failed flow")
    result = done[0]["payload"]["record"]["result"]
    assert result["outcome"] == "failed"
    assert result["failure"]["code"] == "no_member"
    assert result["failure"]["stage"] == "route"
    assert "group 'proxy' has no member" in result["failure"]["message"]
    # Over HTTP: 503.
    http = engine.listen_address("http-in")
    from tests.helpers.flows import curl

    got = curl("-x", f"http://{http[0]}:{http[1]}", *STATUS_ONLY, f"http://127.0.0.1:{target[1]}/")
    assert got.stdout == "503"
    # A url_test without members runs no probe round and warns of nothing.
    assert not events(engine, "policy.probe.completed")
    assert not events(engine, "engine.warning")


# -- path providers, https, via, the schedule -----------------------------------------


def test_a_path_provider_is_applied_only_when_its_file_changed(
    make_engine, nodes, target, tmp_path
) -> None:
    body = tmp_path / "nodes.yaml"
    body.write_bytes(clash(nodes, "n1"))
    config = provider_config("", tmp_path / "cache")
    config["providers"]["proxies"]["sub"] = {"path": str(body)}
    engine = make_engine(config)
    assert members(engine) == ["n1"]
    state = status(engine)
    assert state["source"] == "path" and state["path"] == str(body) and state["url"] is None
    assert update(engine)[0]["outcome"] == "unchanged"
    body.write_bytes(clash(nodes, "n1", "n2"))
    assert update(engine, name="sub")[0]["outcome"] == "updated"
    assert members(engine) == ["n1", "n2"]
    body.write_bytes(b"\x00\x01garbage")
    (failed,) = update(engine)
    assert failed["outcome"] == "failed" and "NUL bytes" in failed["error"]
    assert members(engine) == ["n1", "n2"]
    body.unlink()
    (gone,) = update(engine)
    assert gone["outcome"] == "failed" and "No such file" in gone["error"]
    assert fetch_through(engine, target) == "200"


def test_https_fetched_through_a_socks5_via(
    make_engine, nodes, upstream, tmp_path, monkeypatch
) -> None:
    ca, context = make_ca(tmp_path)
    monkeypatch.setenv("SSL_CERT_FILE", str(ca))
    with provider_origin(context) as secure, CountingForwarder(("127.0.0.1", upstream)) as hop:
        secure.serve("/sub", Answer(clash(nodes, "n1")))
        config = provider_config(secure.url("/sub"), tmp_path / "cache", via="fetcher")
        config["outbounds"].append(
            {"tag": "fetcher", "protocol": "socks5", "server": "127.0.0.1", "port": hop.port}
        )
        engine = make_engine(config)
        assert members(engine) == ["n1"]
        assert hop.connections == 1  # the fetch went through the via outbound
        assert status(engine)["url"] == f"https://127.0.0.1:{secure.port}"
        assert status(engine)["via"] == "fetcher"


def test_a_provider_is_refreshed_on_its_interval(make_engine, origin, nodes, tmp_path) -> None:
    origin.serve("/sub", Answer(clash(nodes, "n1")))
    engine = make_engine(
        provider_config(origin.url("/sub"), tmp_path / "cache", interval_seconds=1)
    )
    origin.serve("/sub", Answer(clash(nodes, "n2")))
    wait_until(
        lambda: [
            e for e in events(engine, "provider.updated") if e["payload"]["trigger"] == "scheduled"
        ],
        timeout=10,
        what="the scheduled refresh",
    )
    assert members(engine) == ["n2"]
    assert origin.count("/sub") >= 2


# -- races and the command ----------------------------------------------------------------


def test_a_refresh_racing_an_apply_never_installs_stale_content(
    make_engine, origin, nodes, target, tmp_path
) -> None:
    origin.serve("/sub", Answer(clash(nodes, "n1")))
    config = provider_config(origin.url("/sub"), tmp_path / "cache")
    engine = make_engine(config)
    gate = threading.Event()
    origin.serve("/sub", Answer(clash(nodes, "n2"), gate=gate))
    results: list[Any] = []
    refresh = threading.Thread(target=lambda: results.append(update(engine)))
    refresh.start()
    wait_until(lambda: origin.count("/sub") == 2, what="the held request")
    # Meanwhile the provider is reconfigured to another URL.
    origin.serve("/other", Answer(clash(nodes, "n3")))
    changed = provider_config(origin.url("/other"), tmp_path / "cache")
    engine.execute("config.apply_runtime", {"config": changed})
    gate.set()
    refresh.join(30)
    (result,) = results[0]
    assert result["outcome"] == "failed"
    assert result["error"] == "the provider was reconfigured meanwhile"
    # The held body (n2) was for the old URL: never installed. The new URL is fetched.
    wait_until(lambda: members(engine) == ["n3"], what="the new URL's first fetch")
    assert "n2" not in [o["tag"] for o in engine.query("config")["outbounds"]]
    assert fetch_through(engine, target) == "200"
    assert nodes["n3"].connections == 1 and nodes["n2"].connections == 0


def test_an_apply_keeps_the_content_and_the_providers_members(
    make_engine, origin, nodes, tmp_path
) -> None:
    origin.serve("/sub", Answer(clash(nodes, "n1", "n2")))
    config = provider_config(origin.url("/sub"), tmp_path / "cache")
    engine = make_engine(config)
    # An unrelated change: the provider is not fetched again, its members stay.
    config["runtime"]["stats_interval_ms"] = 300
    engine.execute("config.apply_runtime", {"config": config})
    assert members(engine) == ["n1", "n2"] and origin.count("/sub") == 1
    # A filter is applied to the content in hand.
    config["providers"]["proxies"]["sub"]["exclude_filter"] = ["1$"]
    engine.execute("config.apply_runtime", {"config": config})
    assert members(engine) == ["n2"] and origin.count("/sub") == 1
    assert status(engine)["filtered_out"] == 1


def test_providers_update_names_and_kinds(make_engine, origin, nodes, tmp_path) -> None:
    origin.serve("/sub", Answer(clash(nodes, "n1")))
    engine = make_engine(provider_config(origin.url("/sub"), tmp_path / "cache"))
    with pytest.raises(ApiError, match="no provider is named 'nope'") as caught:
        engine.execute("providers.update", {"name": "nope"})
    assert caught.value.code == "not_found"
    with pytest.raises(ApiError, match="no rules provider is named 'sub'"):
        engine.execute("providers.update", {"name": "sub", "kind": "rules"})
    with pytest.raises(ApiError) as bad:
        engine.execute("providers.update", {"name": ""})
    assert bad.value.code == "invalid_argument" and bad.value.field_path == "params.name"
    assert [r["name"] for r in update(engine, name="sub", kind="proxies")] == ["sub"]


def test_a_health_check_records_each_members_health(
    make_engine, origin, nodes, target, tmp_path
) -> None:
    origin.serve("/sub", Answer(clash(nodes, "n1", "n2")))
    nodes["n2"].close()  # refuses: its check fails
    check = {"enabled": True, "url": f"http://127.0.0.1:{target[1]}/", "interval_seconds": 1}
    engine = make_engine(
        provider_config(origin.url("/sub"), tmp_path / "cache", health_check=check)
    )
    assert status(engine)["health_check"] == {
        "enabled": True,
        "url": check["url"],
        "interval_seconds": 1,
    }

    def checked() -> dict[str, Any]:
        view = engine.query("policy", {"policy_tag": "proxy"})
        found = {m["member_tag"]: m for m in view["member_health"] if m["healthy"] is not None}
        return found if len(found) == 2 else {}

    found = wait_until(checked, timeout=10, what="the provider's health check")
    assert found["n1"]["healthy"] is True and found["n1"]["latency_ms"] is not None
    assert found["n2"]["healthy"] is False and found["n2"]["last_error"]
    assert found["n1"]["checked_by"] is None  # not a group's round
    assert nodes["n1"].connections >= 1


# -- the CLI over IPC, and the source file --------------------------------------------------


def test_the_cli_shows_and_updates_providers(nodes, tmp_path, sock_path) -> None:
    import subprocess

    from spliceway import Engine
    from tests.helpers.program import SPLICEWAY

    body = tmp_path / "nodes.yaml"
    body.write_bytes(clash(nodes, "n1", extra=VMESS))
    config = provider_config("", tmp_path / "cache")
    config["providers"]["proxies"]["sub"] = {"path": str(body)}
    config["api"]["ipc"] = {"enabled": True, "path": str(sock_path)}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [*SPLICEWAY, "--ipc", str(sock_path), *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    with Engine(config):
        table = cli("providers")
        assert table.returncode == 0, table.stderr
        header, row = table.stdout.splitlines()
        assert header.split() == [
            "PROVIDER",
            "KIND",
            "SOURCE",
            "UPDATED",
            "NEXT",
            "HOLDS",
            "SKIPPED",
            "ERROR",
        ]
        assert row.split()[:3] == ["sub", "proxies", str(body)]
        assert "1 outbounds, 1 members" in row
        doc = json.loads(cli("providers", "--json").stdout)
        assert doc["providers"][0]["members"] == ["n1"]
        body.write_bytes(clash(nodes, "n1", "n2"))
        updated = cli("providers", "update", "sub")
        assert updated.returncode == 0, updated.stderr
        assert updated.stdout.splitlines()[1].split() == ["sub", "proxies", "updated", "-"]
        result = json.loads(cli("providers", "update", "--json").stdout)
        assert result == {
            "results": [
                {
                    "name": "sub",
                    "kind": "proxies",
                    "outcome": "unchanged",
                    "error": None,
                    "updated_at_unix_ms": result["results"][0]["updated_at_unix_ms"],
                    "outbounds": 2,
                    "skipped": 0,
                }
            ]
        }
        missing = cli("providers", "update", "nope")
        assert missing.returncode == 1
        assert missing.stderr.startswith("spliceway: not_found: no provider is named 'nope'")


def test_the_source_file_never_holds_provider_outbounds(origin, nodes, tmp_path) -> None:
    from spliceway import Engine

    origin.serve("/sub", Answer(clash(nodes, "n1")))
    doc = provider_config(origin.url("/sub"), tmp_path / "cache")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with Engine.from_file(str(path)) as engine:
        assert members(engine) == ["n1"]
        doc["runtime"]["stats_interval_ms"] = 300
        engine.execute("config.apply", {"config": doc})
        written = json.loads(path.read_text())
        assert [o["tag"] for o in written["outbounds"]] == ["direct", "block"]
        assert written["outbound_groups"][0].get("outbounds", []) == []
        assert members(engine) == ["n1"]
        # The config summary (the running, merged configuration) has them.
        tags = [o["tag"] for o in engine.query("config")["outbounds"]]
        assert "n1" in tags


def test_a_base64_share_link_subscription(make_engine, origin, nodes, target, tmp_path) -> None:
    import base64

    links = "\n".join(
        [
            f"socks5://127.0.0.1:{nodes['n1'].port}#HK%201",
            f"socks5://127.0.0.1:{nodes['n2'].port}#JP%201",
            "vmess://not-even-json",
        ]
    )
    origin.serve("/sub", Answer(base64.b64encode(links.encode())))
    config = provider_config(origin.url("/sub"), tmp_path / "cache", filter=["^JP"])
    engine = make_engine(config)
    assert members(engine) == ["JP 1"]
    state = status(engine)
    assert state["format"] == "links" and state["outbounds"] == 2 and state["filtered_out"] == 1
    assert [p["type"] for p in state["skipped_proxies"]] == ["vmess"]
    assert fetch_through(engine, target) == "200"
    assert (nodes["n1"].connections, nodes["n2"].connections) == (0, 1)
