"""The Clash API's plain HTTP routes (api/clash/routes.py) against a real engine: every
route, the GLOBAL selector, and bad input answered with mihomo's status and
``{"message"}``, nothing changed."""

from __future__ import annotations

import http.client
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import dns.message
import dns.query
import dns.rdatatype
import pytest
import yaml

import spliceway
from spliceway import Engine
from tests.api.clash.conftest import ClashEngine, call, clash_config
from tests.conftest import wait_until
from tests.helpers.dnsserver import dns_server
from tests.helpers.servers import SilentPeer


def _events(clash: ClashEngine, kind: str) -> list[dict[str, Any]]:
    return list(clash.engine.query("events", {"types": kind})["events"])


def _policy(clash: ClashEngine, tag: str) -> dict[str, Any]:
    return dict(clash.engine.query("policy", {"policy_tag": tag}))


def _mode(clash: ClashEngine) -> dict[str, Any]:
    return dict(clash.engine.query("config")["mode"])


def _probed(clash: ClashEngine) -> None:
    """Wait for ``auto``'s startup round (its choice settles, histories appear)."""

    def done() -> bool:
        members = _policy(clash, "auto")["url_test_members"]
        return all(m["last_checked_unix_ms"] for m in members)

    wait_until(done, what="auto's first probe round")


@pytest.fixture
def silent() -> Iterator[SilentPeer]:
    """A peer a probe reaches and never hears from (its delay test times out)."""
    with SilentPeer() as peer:
        yield peer


def status_of(url: str, method: str = "GET") -> int:
    """Only the status of one request (its body may not be JSON)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as ex:
        return int(ex.code)


# -- /, /version, providers, refusals ---------------------------------------------------


def test_hello_version_and_providers(clash: ClashEngine) -> None:
    assert call(clash.url + "/") == (200, {"hello": "clash"})
    assert call(clash.url + "/version") == (
        200,
        {
            "version": f"spliceway {spliceway.__version__} (sing-box compatible)",
            "meta": True,
            "premium": True,
        },
    )
    status, body = call(clash.url + "/providers/proxies")
    # No proxy provider: mihomo's Compatible ones, for the groups and `default`.
    assert status == 200 and set(body["providers"]) == {"Proxy", "auto", "default"}
    assert call(clash.url + "/providers/rules") == (200, {"providers": {}})
    not_found = (404, {"message": "Resource not found"})
    assert call(clash.url + "/providers/proxies/p") == not_found
    assert call(clash.url + "/providers/proxies/p/healthcheck") == not_found
    assert call(clash.url + "/providers/proxies/p/s5") == not_found
    assert call(clash.url + "/providers/proxies/p", "PUT") == not_found
    assert call(clash.url + "/providers/rules/r", "PUT") == not_found


def test_hello_sends_a_browser_to_the_dashboard(
    make_clash: Callable[..., ClashEngine], tmp_path: Path
) -> None:
    clash = make_clash(external_ui=str(tmp_path))
    host, port = clash.url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        connection.request("GET", "/", headers={"Accept": "text/html,*/*"})
        response = connection.getresponse()
        response.read()
        assert (response.status, response.getheader("Location")) == (307, "/ui/")
    finally:
        connection.close()
    assert call(clash.url + "/") == (200, {"hello": "clash"})


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/restart"),
        ("POST", "/upgrade"),
        ("POST", "/upgrade/ui"),
        ("POST", "/upgrade/geo"),
        ("POST", "/configs/geo"),
        ("PATCH", "/rules/disable"),
    ],
)
def test_refused_routes_answer_an_error(clash: ClashEngine, method: str, path: str) -> None:
    status, body = call(clash.url + path, method, {"0": True} if method == "PATCH" else None)
    assert status == 501
    assert set(body) == {"message"} and body["message"].startswith("spliceway ")
    assert clash.engine.query("health")["healthy"] is True


def test_restart_is_post_only(clash: ClashEngine) -> None:
    # clash-controller-api probes GET /restart and /cache/*/flush and expects 405.
    for path in ("/restart", "/cache/fakeip/flush", "/cache/dns/flush"):
        assert status_of(clash.url + path) == 405


# -- /proxies and /group ----------------------------------------------------------------


def test_proxies_and_groups(clash: ClashEngine) -> None:
    status, body = call(clash.url + "/proxies")
    assert status == 200
    proxies = body["proxies"]
    assert list(proxies) == ["direct", "block", "s5", "Proxy", "auto", "GLOBAL"]
    assert proxies["GLOBAL"]["all"] == ["direct", "block", "s5", "Proxy", "auto"]
    assert proxies["GLOBAL"]["now"] == "direct"
    assert proxies["Proxy"]["now"] == "auto"
    for name in proxies:
        status, one = call(f"{clash.url}/proxies/{quote(name)}")
        assert status == 200
        assert (one["name"], one["type"]) == (name, proxies[name]["type"])
    # A trailing slash is the same resource.
    assert call(clash.url + "/proxies/")[1]["proxies"].keys() == proxies.keys()
    assert call(clash.url + "/proxies/s5/")[1]["name"] == "s5"

    status, body = call(clash.url + "/group")
    assert status == 200
    assert [g["name"] for g in body["proxies"]] == ["Proxy", "auto", "GLOBAL"]
    assert call(clash.url + "/group/Proxy")[1]["type"] == "Selector"
    assert call(clash.url + "/group/GLOBAL")[1]["type"] == "Selector"

    not_found = (404, {"message": "Resource not found"})
    for path in (
        "/proxies/nope",
        "/proxies/nope/delay?timeout=100",
        "/proxies/s5/nope",
        "/proxies/s5/delay/x",
        "/group/s5",  # a leaf is no group
        "/group/nope",
        "/group/Proxy/nope",
    ):
        assert call(clash.url + path) == not_found, path


def test_selector_switch_is_policies_select(clash: ClashEngine) -> None:
    before = len(_events(clash, "policy.selected"))
    assert call(clash.url + "/proxies/Proxy", "PUT", {"name": "s5"}) == (204, None)
    assert _policy(clash, "Proxy")["selected"] == "s5"
    events = _events(clash, "policy.selected")
    assert len(events) == before + 1
    payload = events[-1]["payload"]
    assert (payload["policy_tag"], payload["selected"], payload["previous"]) == (
        "Proxy",
        "s5",
        "auto",
    )
    assert call(clash.url + "/proxies/Proxy")[1]["now"] == "s5"
    assert call(clash.url + "/group/Proxy")[1]["now"] == "s5"


@pytest.mark.parametrize(
    ("path", "body", "status", "message"),
    [
        ("/proxies/nope", {"name": "s5"}, 404, "Resource not found"),
        ("/proxies/Proxy", {"name": "nope"}, 400, None),
        ("/proxies/Proxy", {"name": "Proxy"}, 400, None),
        ("/proxies/s5", {"name": "direct"}, 400, "Must be a Selector"),
        ("/proxies/Proxy", b"{bad", 400, "Body invalid"),
        ("/proxies/Proxy", b"", 400, "Body invalid"),
        ("/proxies/Proxy", b"[]", 400, "Body invalid"),
        ("/proxies/Proxy", {"name": 5}, 400, "Body invalid"),
        ("/proxies/Proxy", {}, 400, "Body invalid"),
        ("/proxies/GLOBAL", {"name": "nope"}, 400, None),
    ],
)
def test_bad_selections_change_nothing(
    clash: ClashEngine, path: str, body: Any, status: int, message: str | None
) -> None:
    before = len(_events(clash, "policy.selected"))
    got_status, got = call(clash.url + path, "PUT", body)
    assert got_status == status
    assert set(got) == {"message"}
    if message is not None:
        assert got["message"] == message
    assert _policy(clash, "Proxy")["selected"] == "auto"
    assert len(_events(clash, "policy.selected")) == before
    assert call(clash.url + "/proxies/GLOBAL")[1]["now"] == "direct"


def test_names_are_percent_decoded_once(make_clash: Callable[..., ClashEngine]) -> None:
    odd = "HK 01/fast 🇭🇰"

    def prepare(cfg: dict[str, Any]) -> None:
        group = {"tag": odd, "kind": "selector", "outbounds": ["s5", "direct"]}
        cfg["outbound_groups"].append(group)

    clash = make_clash(prepare)
    url = f"{clash.url}/proxies/{quote(odd, safe='')}"
    assert call(url)[1]["name"] == odd
    assert call(url, "PUT", {"name": "direct"}) == (204, None)
    assert _policy(clash, odd)["selected"] == "direct"
    assert call(f"{clash.url}/group/{quote(odd, safe='')}")[1]["now"] == "direct"
    # Unescaped, the "/" splits the path: not that proxy.
    assert call(f"{clash.url}/proxies/{quote(odd, safe='/')}")[0] == 404


def test_global_selector_and_mode(clash: ClashEngine) -> None:
    # Outside mode global, GLOBAL's member is remembered, nothing routes through it.
    assert call(clash.url + "/proxies/GLOBAL", "PUT", {"name": "s5"}) == (204, None)
    assert _mode(clash) == {"kind": "rule", "outbound": None}
    assert call(clash.url + "/proxies/GLOBAL")[1]["now"] == "s5"
    # Mode global takes it.
    assert call(clash.url + "/configs", "PATCH", {"mode": "global"}) == (204, None)
    assert _mode(clash) == {"kind": "global", "outbound": "s5"}
    assert call(clash.url + "/configs")[1]["mode"] == "global"
    # In mode global, GLOBAL's member is the mode's outbound (a mode.set).
    assert call(clash.url + "/proxies/GLOBAL", "PUT", {"name": "Proxy"}) == (204, None)
    assert _mode(clash) == {"kind": "global", "outbound": "Proxy"}
    assert call(clash.url + "/proxies/GLOBAL")[1]["now"] == "Proxy"
    # Back to rule: GLOBAL keeps showing what it routed to, and a later global takes it.
    assert call(clash.url + "/configs", "PATCH", {"mode": "RULE"}) == (204, None)
    assert _mode(clash) == {"kind": "rule", "outbound": None}
    assert call(clash.url + "/proxies/GLOBAL")[1]["now"] == "Proxy"
    assert call(clash.url + "/configs", "PATCH", {"mode": "Global"}) == (204, None)
    assert _mode(clash) == {"kind": "global", "outbound": "Proxy"}


def test_global_mode_defaults_to_final(clash: ClashEngine) -> None:
    assert call(clash.url + "/configs", "PATCH", {"mode": "global"}) == (204, None)
    assert _mode(clash) == {"kind": "global", "outbound": "direct"}
    assert call(clash.url + "/configs", "PATCH", {"mode": "direct"}) == (204, None)
    assert _mode(clash) == {"kind": "direct", "outbound": None}


def test_pin_and_unfix_url_test(clash: ClashEngine) -> None:
    _probed(clash)
    assert call(clash.url + "/proxies/auto", "PUT", {"name": "direct"}) == (204, None)
    assert _policy(clash, "auto")["fixed"] == "direct"
    auto = call(clash.url + "/proxies/auto")[1]
    assert (auto["fixed"], auto["now"]) == ("direct", "direct")
    assert call(clash.url + "/proxies/auto", "DELETE") == (204, None)
    assert _policy(clash, "auto")["fixed"] is None
    assert call(clash.url + "/proxies/auto")[1]["fixed"] == ""
    # A selector has no pin (mihomo: 400); an unknown name is 404.
    status, body = call(clash.url + "/proxies/Proxy", "DELETE")
    assert status == 400 and set(body) == {"message"}
    assert call(clash.url + "/proxies/s5", "DELETE")[0] == 400
    assert call(clash.url + "/proxies/nope", "DELETE") == (404, {"message": "Resource not found"})
    assert _policy(clash, "Proxy")["selected"] == "auto"


# -- /configs ---------------------------------------------------------------------------


def test_get_configs(clash: ClashEngine) -> None:
    listeners = {x["tag"]: x["listen_port"] for x in clash.engine.query("config")["listeners"]}
    status, general = call(clash.url + "/configs")
    assert status == 200
    assert general["port"] == listeners["http-in"]
    assert general["socks-port"] == listeners["socks-in"]
    assert general["mixed-port"] == listeners["mixed-in"]
    assert general["mode"] == "rule"
    assert general["mode-list"] == ["rule", "global", "direct"]
    assert general["log-level"] == "info"
    assert general["allow-lan"] is False
    assert general["tun"]["enable"] is False


@pytest.mark.parametrize(
    ("body", "refused"),
    [
        ({"port": 1}, "port"),
        ({"mode": "global", "socks-port": 1}, "socks-port"),
        ({"allow-lan": True}, "allow-lan"),
        ({"tun": {"enable": True}}, "tun"),
        ({"mixed-port": True}, "mixed-port"),
        ({"foo": 1}, "foo"),
    ],
)
def test_patch_refuses_what_it_cannot_apply(
    clash: ClashEngine, body: dict[str, Any], refused: str
) -> None:
    status, answer = call(clash.url + "/configs", "PATCH", body)
    assert status == 400
    assert refused in answer["message"] and "nothing was changed" in answer["message"]
    assert _mode(clash)["kind"] == "rule"


def test_patch_accepts_what_already_holds(clash: ClashEngine) -> None:
    general = call(clash.url + "/configs")[1]
    keys = ("port", "socks-port", "mixed-port", "allow-lan", "bind-address")
    same = {k: general[k] for k in keys}
    same["tun"] = {"enable": False}
    same["mode"] = "direct"
    assert call(clash.url + "/configs", "PATCH", same) == (204, None)
    assert _mode(clash)["kind"] == "direct"
    assert call(clash.url + "/configs", "PATCH", {}) == (204, None)


@pytest.mark.parametrize(
    "body",
    [b"{bad", b"", b"[]", b'"rule"', {"mode": "bogus"}, {"mode": 5}, {"log-level": "loud"}],
)
def test_patch_bad_input_changes_nothing(clash: ClashEngine, body: Any) -> None:
    status, answer = call(clash.url + "/configs", "PATCH", body)
    assert status == 400 and set(answer) == {"message"}
    if isinstance(body, bytes):
        assert answer["message"] == "Body invalid"
    assert _mode(clash)["kind"] == "rule"
    assert clash.engine.query("runtime")["log_level"] == "info"


def test_patch_log_level(clash: ClashEngine) -> None:
    for given, engine_level, shown in (
        ("warning", "warn", "warning"),
        ("DEBUG", "debug", "debug"),
        ("silent", "error", "error"),
        ("warn", "warn", "warning"),
        ("info", "info", "info"),
    ):
        assert call(clash.url + "/configs", "PATCH", {"log-level": given}) == (204, None)
        assert clash.engine.query("runtime")["log_level"] == engine_level
        assert call(clash.url + "/configs")[1]["log-level"] == shown


def test_put_configs_payload(clash: ClashEngine, tmp_path: Path) -> None:
    document = clash_config(clash.origin, clash.socks_port, tmp_path)
    document["route"] = {"final": "s5"}
    assert call(clash.url + "/configs", "PUT", {"payload": json.dumps(document)}) == (204, None)
    assert clash.engine.query("config")["final"] == "s5"
    assert call(clash.url + "/rules")[1]["rules"][-1]["proxy"] == "s5"
    # YAML too (JSON is YAML; block style here).
    document["route"] = {"final": "Proxy"}
    assert call(clash.url + "/configs", "PUT", {"payload": yaml.safe_dump(document)}) == (204, None)
    assert clash.engine.query("config")["final"] == "Proxy"


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{bad", "Body invalid"),
        ({"payload": 5}, "Body invalid"),
        ({"path": "", "payload": ""}, "without a configuration file"),
        ({"payload": "mixed-port: 7890\nproxies: []\n"}, "Clash configuration"),
        ({"payload": "[1, 2]"}, "not a configuration document"),
        ({"payload": '{"route": {"final": "nowhere"}}'}, ""),
        ({"payload": "route: &r {final: nowhere}\nx: *r\n"}, "aliases"),
        ({"payload": "route: [unclosed\n"}, "neither JSON nor YAML"),
    ],
)
def test_put_configs_refusals_change_nothing(clash: ClashEngine, body: Any, says: str) -> None:
    status, answer = call(clash.url + "/configs", "PUT", body)
    assert status == 400 and set(answer) == {"message"}
    assert says in answer["message"]
    assert clash.engine.query("config")["final"] == "direct"


def test_put_configs_reloads_the_source_file(
    origin: tuple[str, int], socks_upstream: int, tmp_path: Path
) -> None:
    document = clash_config(origin, socks_upstream, tmp_path)
    source = tmp_path / "spliceway.json"
    source.write_text(json.dumps(document))
    engine = Engine.from_file(source)
    engine.start()
    try:
        url = engine.clash_url
        document["route"] = {"final": "s5"}
        source.write_text(json.dumps(document))
        assert call(url + "/configs", "PUT", {"path": "/elsewhere.json"})[0] == 400
        assert call(url + "/configs", "PUT", {"path": "relative.json"})[0] == 400
        assert engine.query("config")["final"] == "direct"
        assert call(url + "/configs?force=true", "PUT", {"path": "", "payload": ""}) == (204, None)
        assert engine.query("config")["final"] == "s5"
        # The file is read, not rewritten.
        assert json.loads(source.read_text()) == document
        assert call(url + "/configs", "PUT", {"path": str(source)}) == (204, None)
    finally:
        engine.stop()


# -- delay tests ------------------------------------------------------------------------


def test_proxy_delay(clash: ClashEngine, silent: SilentPeer) -> None:
    origin_url = f"http://127.0.0.1:{clash.origin[1]}/generate_204"
    status, body = call(f"{clash.url}/proxies/s5/delay?timeout=5000&url={quote(origin_url)}")
    assert status == 200 and set(body) == {"delay"}
    assert isinstance(body["delay"], int) and body["delay"] >= 1
    history = call(clash.url + "/proxies/s5")[1]["history"]
    assert history[-1]["delay"] >= 1
    # Through a group: its current choice.
    assert call(f"{clash.url}/proxies/Proxy/delay?timeout=5000&url={quote(origin_url)}")[0] == 200
    # block refuses every dial: mihomo's 503; and its history shows the failure.
    assert call(f"{clash.url}/proxies/block/delay?timeout=2000&url={quote(origin_url)}") == (
        503,
        {"message": "An error occurred in the delay test"},
    )
    block = call(clash.url + "/proxies/block")[1]
    assert block["alive"] is False and block["history"][-1]["delay"] == 0
    # An answer outside the expected statuses is a failed test.
    expect_500 = f"timeout=5000&expected=500&url={quote(origin_url)}"
    assert call(f"{clash.url}/proxies/s5/delay?{expect_500}")[0] == 503
    # No answer in time: 504.
    silent_url = f"http://127.0.0.1:{silent.port}/"
    assert call(f"{clash.url}/proxies/direct/delay?timeout=300&url={quote(silent_url)}") == (
        504,
        {"message": "Timeout"},
    )
    assert call(f"{clash.url}/proxies/direct/delay?timeout=0") == (504, {"message": "Timeout"})
    assert call(f"{clash.url}/proxies/direct/delay?timeout=-5") == (504, {"message": "Timeout"})


@pytest.mark.parametrize(
    "query",
    [
        "",
        "?timeout=",
        "?timeout=abc",
        "?timeout=1.5",
        "?timeout=40000",
        "?timeout=1000&expected=abc",
        "?timeout=1000&url=ftp://x/",
    ],
)
def test_proxy_delay_bad_parameters(clash: ClashEngine, query: str) -> None:
    status, body = call(f"{clash.url}/proxies/s5/delay{query}")
    assert status == 400 and set(body) == {"message"}


def test_group_delay(make_clash: Callable[..., ClashEngine], silent: SilentPeer) -> None:
    def prepare(cfg: dict[str, Any]) -> None:
        cfg["outbound_groups"].append(
            {"tag": "with-block", "kind": "selector", "outbounds": ["block", "s5", "direct"]}
        )

    clash = make_clash(prepare)
    _probed(clash)
    origin_url = quote(f"http://127.0.0.1:{clash.origin[1]}/generate_204")
    status, body = call(f"{clash.url}/group/auto/delay?timeout=5000&url={origin_url}")
    assert status == 200 and set(body) == {"s5", "direct"}
    assert all(isinstance(v, int) and v >= 1 for v in body.values())
    # Without a url, the group's own URL (the origin).
    status, body = call(f"{clash.url}/group/auto/delay?timeout=5000")
    assert status == 200 and set(body) == {"s5", "direct"}
    # Failed members are left out.
    status, body = call(f"{clash.url}/group/with-block/delay?timeout=5000&url={origin_url}")
    assert status == 200 and set(body) == {"s5", "direct"}
    # A group member that is a group is tested through its choice.
    status, body = call(f"{clash.url}/group/Proxy/delay?timeout=5000&url={origin_url}")
    assert status == 200 and set(body) == {"auto", "s5", "direct"}
    # It drops the group's pin (mihomo).
    assert call(clash.url + "/proxies/auto", "PUT", {"name": "direct"}) == (204, None)
    assert _policy(clash, "auto")["fixed"] == "direct"
    assert call(f"{clash.url}/group/auto/delay?timeout=5000&url={origin_url}")[0] == 200
    assert _policy(clash, "auto")["fixed"] is None
    # Every member failing: 504 (a selector: a url_test group tests its own URL).
    silent_url = quote(f"http://127.0.0.1:{silent.port}/")
    assert call(f"{clash.url}/group/with-block/delay?timeout=300&url={silent_url}") == (
        504,
        {"message": "get delay: all proxies timeout"},
    )
    # Bad input: 400, and the pin stays.
    assert call(clash.url + "/proxies/auto", "PUT", {"name": "s5"}) == (204, None)
    assert call(f"{clash.url}/group/auto/delay")[0] == 400
    assert call(f"{clash.url}/group/auto/delay?timeout=1000&expected=x")[0] == 400
    assert _policy(clash, "auto")["fixed"] == "s5"
    assert call(f"{clash.url}/group/s5/delay?timeout=1000") == (
        404,
        {"message": "Resource not found"},
    )


# -- /rules, /dns, /cache ---------------------------------------------------------------


def test_rules(clash: ClashEngine) -> None:
    port = clash.origin[1]
    assert call(clash.url + "/rules") == (
        200,
        {
            "rules": [
                {
                    "index": 0,
                    "type": "DomainSuffix",
                    "payload": "example.test",
                    "proxy": "Proxy",
                    "size": -1,
                },
                {
                    "index": 1,
                    "type": "AND",
                    "payload": f"((DstPort,{port}) && (Network,tcp))",
                    "proxy": "Proxy",
                    "size": -1,
                },
                {"index": 2, "type": "Match", "payload": "", "proxy": "direct", "size": -1},
            ]
        },
    )


def test_dns_query(make_clash: Callable[..., ClashEngine]) -> None:
    with dns_server({"a.test": ["192.0.2.1", "2001:db8::1"]}) as server:

        def prepare(cfg: dict[str, Any]) -> None:
            cfg["runtime"]["dns"] = {"servers": [f"udp://127.0.0.1:{server.port}"]}

        clash = make_clash(prepare)
        status, body = call(clash.url + "/dns/query?name=a.test")
        assert status == 200
        assert body["Status"] == 0
        assert body["Question"] == [{"Name": "a.test.", "Qtype": 1, "Qclass": 1}]
        assert [(a["name"], a["type"], a["data"]) for a in body["Answer"]] == [
            ("a.test.", 1, "192.0.2.1")
        ]
        assert {"TC", "RD", "RA", "AD", "CD"} <= set(body)
        status, body = call(clash.url + "/dns/query?name=a.test&type=AAAA")
        assert status == 200 and body["Answer"][0]["data"] == "2001:db8::1"
        # NXDOMAIN is an answer.
        status, body = call(clash.url + "/dns/query?name=nope.test")
        assert status == 200 and body["Status"] == 3 and "Answer" not in body
        status, body = call(clash.url + "/dns/query?name=a.test&type=BOGUS")
        assert status == 400 and set(body) == {"message"}
        # Every server failing is mihomo's 500.
        server.fail = True
        status, body = call(clash.url + "/dns/query?name=other.test")
        assert status == 500 and set(body) == {"message"}


def test_cache_flushes(make_clash: Callable[..., ClashEngine]) -> None:
    with dns_server({"a.test": ["192.0.2.1"]}) as server:

        def prepare(cfg: dict[str, Any]) -> None:
            cfg["runtime"]["dns"]["servers"] = [f"udp://127.0.0.1:{server.port}"]
            cfg["runtime"]["dns"]["listen"] = {"address": "127.0.0.1", "port": 0}

        clash = make_clash(prepare)
        engine = clash.engine
        port = engine.query("runtime")["dns_server"]["listen_port"]
        query = dns.message.make_query("flush.example.test", dns.rdatatype.A)
        fake = dns.query.udp(query, "127.0.0.1", port=port, timeout=5).answer[0][0].to_text()
        lookup = {"domain": "flush.example.test"}
        assert engine.execute("diagnostics.fakeip_lookup", lookup)["fake_ip"] == fake
        assert call(clash.url + "/cache/fakeip/flush", "POST") == (204, None)
        assert engine.execute("diagnostics.fakeip_lookup", lookup)["fake_ip"] is None

        engine.execute("diagnostics.dns_lookup", {"hostname": "a.test"})
        assert engine.execute("diagnostics.dns_cache", {"domain": "a.test"})["hit"] is True
        assert call(clash.url + "/cache/dns/flush", "POST") == (204, None)
        assert engine.execute("diagnostics.dns_cache", {"domain": "a.test"})["hit"] is False


def test_blocking_routes_leave_the_loop_free(clash: ClashEngine, silent: SilentPeer) -> None:
    """A route that blocks (a delay test) runs in the thread pool: other requests are
    answered meanwhile."""
    silent_url = quote(f"http://127.0.0.1:{silent.port}/")
    slow: list[Any] = []
    worker = threading.Thread(
        target=lambda: slow.append(
            call(f"{clash.url}/proxies/direct/delay?timeout=3000&url={silent_url}")
        )
    )
    worker.start()
    wait_until(lambda: silent.conns, what="the probe's connection")
    assert call(clash.url + "/version")[0] == 200
    assert not slow  # the delay test is still waiting for its answer
    worker.join(10)
    assert slow == [(504, {"message": "Timeout"})]
