"""spliceway's query results in mihomo's shapes (api/clash/mapping.py): on the answers of
a real engine's queries, and on rule texts compiled by the real rule compiler."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from spliceway.api.clash import mapping
from spliceway.api.clash.mapping import GLOBAL, Observation
from spliceway.config import parse_config
from spliceway.routing.rules import compile_rules
from tests.api.clash.conftest import ClashEngine
from tests.conftest import base_config, wait_until

#: Keys mihomo gives every proxy (leaf and group), from its ``/proxies`` answer.
COMMON_KEYS = {
    "name", "type", "udp", "xudp", "tfo", "mptcp", "smux", "uot", "interface",
    "routing-mark", "dialer-proxy", "provider-name", "alive", "history", "extra",
}  # fmt: skip


def _condition(**rule: Any) -> str:
    """The ``matched_rule.condition`` text the engine's compiler writes for ``rule``."""
    cfg = base_config(rules=[{**rule, "outbound": "direct"}])
    matched = compile_rules(parse_config(cfg).rules).rules[0].decision.matched_rule
    assert matched is not None
    return matched.condition


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ({"domain_suffix": "example.com"}, ("DomainSuffix", "example.com")),
        ({"domain": ["a.com"]}, ("Domain", "a.com")),
        ({"domain_keyword": "goo"}, ("DomainKeyword", "goo")),
        ({"ip_cidr": "10.0.0.0/8"}, ("IPCIDR", "10.0.0.0/8")),
        ({"ip_cidr": "2001:db8::/32"}, ("IPCIDR", "2001:db8::/32")),
        ({"source_ip_cidr": "192.168.0.0/16"}, ("SrcIPCIDR", "192.168.0.0/16")),
        ({"network": "udp"}, ("Network", "udp")),
        ({"process_name": "curl"}, ("ProcessName", "curl")),
        ({"inbound_tag": "mixed-in"}, ("InName", "mixed-in")),
        ({"principal_key": "bob"}, ("InUser", "bob")),
        ({"source_port": "1000-2000"}, ("SrcPort", "1000-2000")),
        # Lists mihomo holds in one payload: "/"-separated, as it prints them.
        ({"port": ["80", "443", "8000-9000"]}, ("DstPort", "80/443/8000-9000")),
        ({"inbound_tag": ["socks-in", "mixed-in"]}, ("InName", "socks-in/mixed-in")),
        # Other lists: an OR of one sub-rule per item, in mihomo's payload syntax.
        ({"domain": ["a.com", "b.com"]}, ("OR", "((Domain,a.com) || (Domain,b.com))")),
        (
            {"ip_cidr": ["10.0.0.0/8", "192.168.0.0/16"]},
            ("OR", "((IPCIDR,10.0.0.0/8) || (IPCIDR,192.168.0.0/16))"),
        ),
        # Several conditions: AND, each sub-rule as mihomo prints it.
        ({"port": "443", "network": "tcp"}, ("AND", "((Network,tcp) && (DstPort,443))")),
        (
            {"domain": ["a.com", "b.com"], "port": "443"},
            ("AND", "((OR,((Domain,a.com) || (Domain,b.com))) && (DstPort,443))"),
        ),
        # A regex keeps its "|" and ","; a list of them is their alternation.
        ({"domain_regex": "^(a|b)\\.com$"}, ("DomainRegex", "^(a|b)\\.com$")),
        ({"domain_regex": ["^a{1,3}\\.", "x$"]}, ("DomainRegex", "^a{1,3}\\.|x$")),
        (
            {"domain_regex": "^a{1,3}\\.", "network": "tcp"},
            ("AND", "((Network,tcp) && (DomainRegex,^a{1,3}\\.))"),
        ),
    ],
)
def test_rule_type_and_payload_of_compiled_rules(
    rule: dict[str, Any], expected: tuple[str, str]
) -> None:
    text = _condition(**rule)
    type_, payload = mapping.rule_type_and_payload(text)
    if type_ == "AND":
        # The compiler orders conditions by CONDITION_KEYS: compare the parts as a set.
        assert payload.startswith("((") and payload.endswith("))")
        assert set(payload[1:-1].split(" && ")) == set(expected[1][1:-1].split(" && "))
    else:
        assert (type_, payload) == expected


@pytest.mark.parametrize(
    ("rule", "expected"),
    [
        ({"ip_cidr": "1.0.0.0/8", "no_resolve": True}, ("IPCIDR", "1.0.0.0/8")),
        ({"domain": "baidu.com", "invert": True}, ("NOT", "(!(Domain,baidu.com))")),
        (
            {
                "type": "logical",
                "mode": "or",
                "rules": [
                    {"domain": "a.com"},
                    {"port": "53", "invert": True},
                    {
                        "type": "logical",
                        "mode": "and",
                        "rules": [{"network": "udp"}, {"port": 443}],
                    },
                ],
            },
            (
                "OR",
                "((Domain,a.com) || (NOT,(!(DstPort,53)))"
                " || (AND,((Network,udp) && (DstPort,443))))",
            ),
        ),
    ],
)
def test_logical_inverted_and_flagged_rules_as_mihomo_prints_them(
    rule: dict[str, Any], expected: tuple[str, str]
) -> None:
    # mihomo's Logic.Payload: "(!(T,p))" for NOT, "((T,p) && ...)" / " || " for AND / OR;
    # no-resolve is a parameter, not payload.
    assert mapping.rule_type_and_payload(_condition(**rule)) == expected


def test_rule_set_and_geo_conditions_keep_their_names() -> None:
    assert mapping.rule_type_and_payload("rule_set=ads") == ("RuleSet", "ads")
    assert mapping.rule_type_and_payload("rule_set=lan,rule_set_ip_cidr_match_source") == (
        "RuleSet",
        "lan",
    )
    assert mapping.rule_type_and_payload("geosite=google") == ("GeoSite", "google")
    assert mapping.rule_type_and_payload("ip_asn=13335") == ("IPASN", "13335")
    assert mapping.rule_type_and_payload("logical(xor: a=b)") == ("Unknown", "logical(xor: a=b)")


def test_no_rule_is_match() -> None:
    assert mapping.rule_type_and_payload("") == ("Match", "")


def test_rules_end_with_final_match_and_block_is_reject() -> None:
    config = {
        "rules": [
            {"index": 0, "condition": "domain=a.com", "action": "route", "outbound": "Proxy"},
            {"index": 1, "condition": "network=udp", "action": "block", "outbound": None},
        ],
        "final": "direct",
    }
    assert mapping.rules(config) == [
        {"index": 0, "type": "Domain", "payload": "a.com", "proxy": "Proxy", "size": -1},
        {"index": 1, "type": "Network", "payload": "udp", "proxy": "REJECT", "size": -1},
        {"index": 2, "type": "Match", "payload": "", "proxy": "direct", "size": -1},
    ]


def test_rfc3339_and_delays() -> None:
    assert mapping.rfc3339(1_767_225_600_123) == "2026-01-01T00:00:00.123Z"
    assert datetime.fromisoformat(mapping.rfc3339(0)).timestamp() == 0
    assert mapping.delay_of(None) == 0
    assert mapping.delay_of(0.2) == 1  # measured: never mihomo's "failed" 0
    assert mapping.delay_of(12.5) == 12
    assert mapping.delay_of(12.51) == 13
    assert mapping.delay_of(1e9) == 65535


def test_version_is_a_core_without_upgrade_channel() -> None:
    answer = mapping.version("1.2.3")
    assert answer == {
        "version": "spliceway 1.2.3 (sing-box compatible)",
        "meta": True,
        "premium": True,
    }
    # What zashboard's detectCore and metacubexd's isSingBoxVersion look for.
    assert "sing-box" in answer["version"].lower()


def test_log_levels_both_ways() -> None:
    assert {k: mapping.LOG_LEVELS[k] for k in ("debug", "info", "warning", "error", "silent")} == {
        "debug": "debug",
        "info": "info",
        "warning": "warn",
        "error": "error",
        "silent": "error",
    }
    assert [mapping.clash_log_level(x) for x in ("trace", "debug", "info", "warn", "error")] == [
        "debug",
        "debug",
        "info",
        "warning",
        "error",
    ]


def test_dns_answer_sections_only_when_present() -> None:
    result = {
        "rcode": 0,
        "question": {"name": "a.test.", "type": 1, "class": 1},
        "flags": {"tc": False, "rd": True, "ra": True, "ad": False, "cd": False},
        "answer": [{"name": "a.test.", "type": 1, "ttl": 300, "data": "192.0.2.1"}],
        "authority": [],
        "additional": [],
    }
    assert mapping.dns_answer(result) == {
        "Status": 0,
        "Question": [{"Name": "a.test.", "Qtype": 1, "Qclass": 1}],
        "TC": False,
        "RD": True,
        "RA": True,
        "AD": False,
        "CD": False,
        "Answer": [{"name": "a.test.", "type": 1, "TTL": 300, "data": "192.0.2.1"}],
    }


# -- on a real engine's query results ---------------------------------------------------


def _probed(clash: ClashEngine) -> dict[str, Any]:
    """The ``config`` query once ``auto``'s startup round has checked both members."""

    def ready() -> dict[str, Any] | None:
        config = clash.engine.query("config")
        auto = next(g for g in config["outbound_groups"] if g["tag"] == "auto")
        done = all(m["last_checked_unix_ms"] for m in auto["url_test_members"])
        return config if done else None

    return wait_until(ready, what="auto's first probe round")


def test_proxies_of_a_real_config(clash: ClashEngine) -> None:
    config = _probed(clash)
    proxies = mapping.proxies(config)
    assert list(proxies) == ["direct", "block", "s5", "Proxy", "auto", GLOBAL]
    assert {n: p["type"] for n, p in proxies.items()} == {
        "direct": "Direct",
        "block": "Reject",
        "s5": "Socks5",
        "Proxy": "Selector",
        "auto": "URLTest",
        GLOBAL: "Selector",
    }
    for name, proxy in proxies.items():
        assert set(proxy) >= COMMON_KEYS, name
        assert proxy["name"] == name
    # Leaves have an id (stable: the same next time), groups none (as mihomo).
    assert {n for n, p in proxies.items() if "id" in p} == {"direct", "block", "s5"}
    assert proxies["s5"]["id"] == mapping.proxies(config)["s5"]["id"]
    assert proxies["Proxy"]["all"] == ["auto", "s5", "direct"]
    assert proxies["Proxy"]["now"] == "auto"
    assert "fixed" not in proxies["Proxy"] and "expectedStatus" not in proxies["Proxy"]
    auto = proxies["auto"]
    assert auto["all"] == ["s5", "direct"]
    assert auto["now"] in ("s5", "direct")
    assert auto["fixed"] == ""
    assert auto["testUrl"] == f"http://127.0.0.1:{clash.origin[1]}/generate_204"
    assert auto["expectedStatus"] == "*"
    # GLOBAL: every outbound then every group, in configuration order; now = route.final.
    assert proxies[GLOBAL]["all"] == ["direct", "block", "s5", "Proxy", "auto"]
    assert proxies[GLOBAL]["now"] == "direct"
    # udp: a selector carries what it selects (auto, then its choice).
    assert proxies["s5"]["udp"] is True and proxies["Proxy"]["udp"] is True


def test_history_and_extra_from_probe_rounds(clash: ClashEngine) -> None:
    config = _probed(clash)
    auto = next(g for g in config["outbound_groups"] if g["tag"] == "auto")
    proxies = mapping.proxies(config)
    for member in auto["url_test_members"]:
        proxy = proxies[member["member_tag"]]
        expected = {
            "time": mapping.rfc3339(member["last_checked_unix_ms"]),
            "delay": mapping.delay_of(member["latency_ms"]),
        }
        assert proxy["alive"] is True
        assert proxy["history"] == [expected]
        assert proxy["extra"] == {auto["url"]: {"alive": True, "history": [expected]}}
    # Nothing checked block: no history, alive as mihomo's default.
    assert proxies["block"]["history"] == [] and proxies["block"]["alive"] is True


def test_local_delay_tests_show_for_names_no_group_lists(clash: ClashEngine) -> None:
    config = _probed(clash)
    local = {
        "block": [Observation(1_000, 0, "http://x/"), Observation(2_000, 0, "http://y/")],
        # s5 is a group member: the engine's own record wins over a local one.
        "s5": [Observation(3_000, 99, "http://z/")],
    }
    proxies = mapping.proxies(config, local=local)
    block = proxies["block"]
    assert block["alive"] is False
    assert block["history"] == [
        {"time": mapping.rfc3339(1_000), "delay": 0},
        {"time": mapping.rfc3339(2_000), "delay": 0},
    ]
    assert set(block["extra"]) == {"http://x/", "http://y/"}
    assert all(h["delay"] != 99 for h in proxies["s5"]["history"])


def test_global_now_follows_mode_and_choice(clash: ClashEngine) -> None:
    config = clash.engine.query("config")
    assert mapping.global_now(config, None) == "direct"
    assert mapping.global_now(config, "s5") == "s5"
    assert mapping.global_now(config, "gone") == "direct"  # a tag no longer configured
    clash.engine.execute("mode.set", {"mode": "global", "outbound": "Proxy"})
    config = clash.engine.query("config")
    assert mapping.global_now(config, "s5") == "Proxy"
    assert mapping.proxies(config, "s5")[GLOBAL]["now"] == "Proxy"


def test_own_global_tag_is_not_shadowed(make_clash: Any) -> None:
    def prepare(cfg: dict[str, Any]) -> None:
        cfg["outbound_groups"].append(
            {"tag": GLOBAL, "kind": "selector", "outbounds": ["s5", "direct"]}
        )

    clash = make_clash(prepare)
    proxies = mapping.proxies(clash.engine.query("config"))
    assert proxies[GLOBAL]["all"] == ["s5", "direct"]
    assert list(proxies).count(GLOBAL) == 1


def test_general_of_a_real_engine(clash: ClashEngine) -> None:
    engine = clash.engine
    listeners = {x["tag"]: x["listen_port"] for x in engine.query("config")["listeners"]}
    general = mapping.general(
        engine.query("config"), engine.query("runtime"), engine.query("tun_status")
    )
    assert general["port"] == listeners["http-in"]
    assert general["socks-port"] == listeners["socks-in"]
    assert general["mixed-port"] == listeners["mixed-in"]
    assert (general["redir-port"], general["tproxy-port"]) == (0, 0)
    assert general["allow-lan"] is False and general["bind-address"] == "*"
    assert general["mode"] == "rule"
    assert general["mode-list"] == ["rule", "global", "direct"]
    assert general["log-level"] == "info"
    assert general["tun"]["enable"] is False
    assert general["authentication"] is None


def test_general_allow_lan_from_where_inbounds_listen() -> None:
    def ports(*addresses: str) -> dict[str, Any]:
        listeners = [
            {"tag": f"in{i}", "protocol": "mixed", "listen_address": a, "listen_port": 1000 + i}
            for i, a in enumerate(addresses)
        ]
        general = mapping.general({"listeners": listeners}, {}, {"running": False})
        return {k: general[k] for k in ("allow-lan", "bind-address", "mixed-port")}

    assert ports("127.0.0.1") == {"allow-lan": False, "bind-address": "*", "mixed-port": 1000}
    assert ports("::1") == {"allow-lan": False, "bind-address": "*", "mixed-port": 1000}
    assert ports("0.0.0.0") == {"allow-lan": True, "bind-address": "*", "mixed-port": 1000}
    assert ports("127.0.0.1", "192.0.2.7") == {
        "allow-lan": True,
        "bind-address": "192.0.2.7",
        "mixed-port": 1000,
    }


def test_general_tun_when_running() -> None:
    status = {
        "running": True,
        "name": "sw0",
        "addr": "172.19.0.1/30",
        "addresses": ["172.19.0.1/30", "fdfe::1/126"],
        "mtu": 1500,
        "auto_route": True,
        "strict_route": True,
        "dns_hijack": True,
    }
    tun = mapping.general({}, {}, status)["tun"]
    assert tun == {
        "enable": True,
        "device": "sw0",
        "stack": "System",
        "dns-hijack": ["any:53"],
        "auto-route": True,
        "auto-detect-interface": True,
        "inet4-address": ["172.19.0.1/30"],
        "inet6-address": ["fdfe::1/126"],
        "mtu": 1500,
        "strict-route": True,
        "file-descriptor": 0,
        "recvmsgx": False,
        "processors-per-channel": 0,
    }
