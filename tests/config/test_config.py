"""spliceway.config: schema, cross-checks, field paths, defaults, loading."""

from __future__ import annotations

import copy
import json

import pytest

from spliceway.config import (
    DEFAULT_API_KEY_ENV,
    Config,
    DirectOutbound,
    SelectorGroup,
    Socks5Outbound,
    UrlTestGroup,
    default_config,
    default_ipc_path,
    load_config_file,
    parse_config,
    parse_dns_server,
    resolve_ipc,
    validate_document,
)
from spliceway.errors import ApiError
from spliceway.flows.hook import HookSettings

# A complete example configuration using every section.
EXAMPLE = {
    "mode": {"kind": "rule", "outbound": None},
    "inbounds": [
        {
            "tag": "mixed-in",
            "protocol": "mixed",
            "listen": {"address": "127.0.0.1", "port": 7890},
            "udp": True,
            "sniff": True,
            "users": [{"username": "u", "password": "p", "principal_key": "alice"}],
        }
    ],
    "outbounds": [
        {"tag": "direct", "protocol": "direct"},
        {"tag": "block", "protocol": "block"},
        {
            "tag": "hop-a",
            "protocol": "socks5",
            "server": "127.0.0.1",
            "port": 1081,
            "username": "u",
            "password": "p",
        },
        {"tag": "hop-b", "protocol": "http", "server": "127.0.0.1", "port": 3128},
        {
            "tag": "ss-a",
            "protocol": "shadowsocks",
            "server": "127.0.0.1",
            "port": 8388,
            "method": "chacha20-ietf-poly1305",
            "password": "secret",
        },
    ],
    "outbound_groups": [
        {
            "tag": "proxy",
            "kind": "selector",
            "outbounds": ["auto", "hop-a", "direct"],
            "default": "auto",
        },
        {
            "tag": "auto",
            "kind": "url_test",
            "outbounds": ["hop-a", "hop-b"],
            "url": "http://127.0.0.1:8080/generate_204",
            "interval_seconds": 300,
            "tolerance_ms": 50,
        },
        {"tag": "fb", "kind": "fallback", "outbounds": ["hop-a", "hop-b"], "interval_seconds": 60},
        {"tag": "chain", "kind": "relay", "outbounds": ["hop-a", "hop-b"]},
        {
            "tag": "lb",
            "kind": "load_balance",
            "outbounds": ["hop-a", "hop-b"],
            "strategy": "round_robin",
        },
    ],
    "rules": [
        {"domain_suffix": ["example.com"], "outbound": "proxy"},
        {"domain_keyword": ["ads"], "action": "block"},
        {
            "ip_cidr": ["10.0.0.0/8"],
            "port": ["22", "8000-8100"],
            "network": "tcp",
            "outbound": "direct",
        },
    ],
    "route": {"final": "proxy"},
    "runtime": {
        "log_level": "info",
        "log_files": [],
        "udp_upstream_idle_timeout_seconds": 300,
        "tcp_idle_timeout_seconds": 600,
        "latency_test_url": None,
        "network": {"mtu": 1500},
        "stats_interval_ms": 1000,
        "event_ring_capacity": 8192,
        "dns": {
            "servers": ["system"],
            "cache": {"max_entries": 4096},
            "answer": {"type": "real"},
            "listen": None,
        },
        "tun": None,
    },
    "api": {
        "control": {
            "enabled": True,
            "listen": {"address": "127.0.0.1", "port": 9090},
            "api_key_env": "SPLICEWAY_API_KEY",
        },
        "ipc": {"enabled": True, "path": None},
        "grpc": {"enabled": False},
        "event_sinks": [
            {
                "type": "webhook",
                "tag": "central",
                "url": "http://127.0.0.1:8081/hook",
                "events": ["flow.completed"],
                "source_id": "node-1",
                "headers": {"Authorization": "Bearer x"},
            },
            {
                "type": "jsonl",
                "tag": "audit",
                "path": "/var/log/spliceway/events.jsonl",
                "events": [],
            },
        ],
        "outbox_path": None,
        "dispatcher": {
            "request_timeout_ms": 10000,
            "backoff_initial_ms": 500,
            "backoff_max_ms": 60000,
            "retry_threshold": 10,
            "on_exhausted": "retry_forever",
        },
        "outbox_min_free_bytes": 1073741824,
        "outbox_min_free_percent": 5,
    },
}


def _assert_subset(expected, actual, path="$"):
    """Every key/value of ``expected`` appears in ``actual`` (lists item by item)."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict), path
        for key, value in expected.items():
            assert key in actual, f"{path}.{key} missing"
            _assert_subset(value, actual[key], f"{path}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list), path
        assert len(expected) == len(actual), path
        for i, (e, a) in enumerate(zip(expected, actual, strict=True)):
            _assert_subset(e, a, f"{path}[{i}]")
    else:
        assert expected == actual, f"{path}: {expected!r} != {actual!r}"


# ---------------------------------------------------------------------------
# valid documents
# ---------------------------------------------------------------------------


def test_example_document_round_trips():
    cfg = parse_config(copy.deepcopy(EXAMPLE))
    out = cfg.to_dict()
    _assert_subset(EXAMPLE, out)
    assert parse_config(out) == cfg
    assert parse_config(json.loads(json.dumps(out))).to_dict() == out


def test_example_document_typed_access_and_defaults():
    cfg = parse_config(copy.deepcopy(EXAMPLE))
    assert cfg.inbounds[0].listen.port == 7890
    assert cfg.inbounds[0].sniff_timeout_ms == 300
    assert cfg.inbounds[0].users is not None
    assert cfg.inbounds[0].users[0].principal_key == "alice"
    hop_a = cfg.find_outbound("hop-a")
    assert isinstance(hop_a, Socks5Outbound)
    assert hop_a.connect_timeout_ms == 5000
    assert cfg.find_outbound("direct") == DirectOutbound(tag="direct", protocol="direct")
    proxy = cfg.find_group("proxy")
    assert isinstance(proxy, SelectorGroup)
    assert proxy.default == "auto"
    fb = cfg.find_group("fb")
    assert fb is not None
    assert fb.url is None
    assert cfg.find_group("hop-a") is None
    assert cfg.find_outbound("proxy") is None
    assert cfg.outbound_tags() == ("direct", "block", "hop-a", "hop-b", "ss-a")
    assert cfg.group_tags() == ("proxy", "auto", "fb", "chain", "lb")
    assert cfg.is_target("lb")
    assert not cfg.is_target("nope")
    assert cfg.rules[2].port == ("22", "8000-8100")
    assert cfg.rules[1].action == "block"
    assert cfg.rules[1].outbound is None
    assert cfg.api.event_sinks[0].headers == {"Authorization": "Bearer x"}
    assert cfg.to_dict()["rules"][1] == {"domain_keyword": ["ads"], "action": "block"}


def test_empty_document_takes_every_default():
    cfg = parse_config({})
    assert cfg.mode.kind == "rule"
    assert cfg.mode.outbound is None
    assert cfg.inbounds == ()
    assert cfg.outbounds == ()
    assert cfg.outbound_tags() == ("direct",)
    assert cfg.route.final == "direct"
    rt = cfg.runtime
    assert (rt.log_level, rt.log_files) == ("info", ())
    assert rt.udp_upstream_idle_timeout_seconds == 300
    assert rt.tcp_idle_timeout_seconds == 600
    assert rt.network.mtu == 1500
    assert (rt.stats_interval_ms, rt.event_ring_capacity) == (1000, 8192)
    assert rt.dns.servers == ("system",)
    assert rt.dns.cache is not None
    assert rt.dns.cache.max_entries == 4096
    assert rt.dns.answer.type == "real"
    assert rt.dns.listen is None
    assert rt.tun is None
    api = cfg.api
    assert api.control.enabled is True
    assert (api.control.listen.address, api.control.listen.port) == ("127.0.0.1", 9090)
    assert api.control.api_key_env == DEFAULT_API_KEY_ENV
    # Unset: the entry point decides (spliceway run serves it, an embedded Engine not).
    assert (api.ipc.enabled, api.ipc.path, api.grpc.enabled) == (None, None, False)
    assert api.event_sinks == ()
    assert api.dispatcher.on_exhausted == "retry_forever"
    assert api.dispatcher.request_timeout_ms == 10000
    assert (api.outbox_min_free_bytes, api.outbox_min_free_percent) == (1073741824, 5)


def test_defaults_inside_items():
    cfg = parse_config(
        {
            "inbounds": [
                {
                    "tag": "in",
                    "protocol": "socks5",
                    "listen": {"port": 0},
                    "users": [{"username": "bob", "password": "pw"}],
                }
            ],
            "outbounds": [
                {"tag": "ss", "protocol": "shadowsocks", "server": "h", "port": 1, "password": "x"}
            ],
            "outbound_groups": [
                {"tag": "sel", "kind": "selector", "outbounds": ["ss", "direct"]},
                {"tag": "ut", "kind": "url_test", "outbounds": ["ss"]},
                {"tag": "lb", "kind": "load_balance", "outbounds": ["ss"]},
            ],
            "rules": [{"domain": "example.com", "port": 443, "outbound": "sel"}],
            "runtime": {
                "dns": {"answer": {"type": "fake_ip"}},
                "tun": {"addr": "198.18.0.1/16", "tag": "tun0"},
            },
        }
    )
    ib = cfg.inbounds[0]
    assert (ib.listen.address, ib.listen.port, ib.udp, ib.sniff) == ("127.0.0.1", 0, True, True)
    assert ib.users is not None
    assert ib.users[0].principal_key == "bob"
    ss = cfg.outbounds[0]
    assert ss.method == "chacha20-ietf-poly1305"
    assert ss.connect_timeout_ms == 5000
    sel = cfg.find_group("sel")
    assert isinstance(sel, SelectorGroup)
    assert sel.default == "ss"
    ut = cfg.find_group("ut")
    assert isinstance(ut, UrlTestGroup)
    assert (ut.url, ut.interval_seconds, ut.tolerance_ms) == (None, 300, 50)
    assert cfg.find_group("lb").strategy == "round_robin"
    rule = cfg.rules[0]
    assert (rule.domain, rule.port, rule.action) == (("example.com",), ("443",), "route")
    assert cfg.runtime.dns.answer.fake_ip_range == "198.18.0.0/15"
    tun = cfg.runtime.tun
    assert tun is not None
    assert (tun.mask, tun.mtu, tun.include_cidrs, tun.dns_hijack) == (
        "255.255.255.0",
        None,
        (),
        True,
    )
    out = cfg.to_dict()
    assert out["rules"][0] == {
        "domain": ["example.com"],
        "port": ["443"],
        "action": "route",
        "outbound": "sel",
    }
    assert parse_config(out) == cfg


def test_embedded_default_loads():
    cfg = default_config()
    assert len(cfg.inbounds) == 1
    ib = cfg.inbounds[0]
    assert (ib.protocol, ib.listen.address, ib.listen.port) == ("mixed", "127.0.0.1", 7890)
    assert ib.users is None
    assert [o.protocol for o in cfg.outbounds] == ["direct", "block"]
    assert cfg.mode.kind == "rule"
    assert cfg.rules == ()
    assert cfg.route.final == "direct"
    assert cfg.api.control.enabled is True
    assert cfg.api.control.listen.port == 9090
    assert cfg.api.control.api_key_env is None
    assert cfg.api.control.read_api_key({}) is None
    assert cfg.api.ipc.enabled is None
    assert cfg.api.ipc.path is None
    assert default_config() is cfg


def test_models_are_frozen():
    cfg = default_config()
    with pytest.raises(ValueError, match="frozen"):
        cfg.inbounds[0].listen.port = 1  # type: ignore[misc]


def test_single_string_conditions_become_lists():
    cfg = parse_config(
        {"rules": [{"domain_suffix": "example.com", "process_name": "curl", "outbound": "direct"}]}
    )
    assert cfg.rules[0].domain_suffix == ("example.com",)
    assert cfg.to_dict()["rules"][0]["process_name"] == ["curl"]


def test_listing_direct_with_protocol_direct_is_fine():
    assert validate_document({"outbounds": [{"tag": "direct", "protocol": "direct"}]}) == []


# ---------------------------------------------------------------------------
# invalid documents: (id, document, expected field paths)
# ---------------------------------------------------------------------------

IN = {"tag": "in", "protocol": "mixed", "listen": {"port": 1080}}
HOP = {"tag": "hop", "protocol": "socks5", "server": "127.0.0.1", "port": 1081}


def _inb(**extra):
    return {**IN, **extra}


def _listen(**listen):
    return {"inbounds": [{**IN, "listen": listen}]}


INVALID = [
    ("unknown top-level key", {"modes": {}}, ["modes"]),
    ("unknown key in inbound", {"inbounds": [_inb(sniffing=True)]}, ["inbounds[0].sniffing"]),
    ("unknown key in listen", _listen(port=1, adress="x"), ["inbounds[0].listen.adress"]),
    (
        "unknown key in a union member",
        {"outbounds": [{**HOP, "user": "u"}]},
        ["outbounds[0].user"],
    ),
    (
        "unknown key in a group",
        {"outbound_groups": [{"tag": "g", "kind": "selector", "outbounds": ["direct"], "x": 1}]},
        ["outbound_groups[0].x"],
    ),
    (
        "unknown key deep in runtime",
        {"runtime": {"dns": {"cache": {"max": 1}}}},
        ["runtime.dns.cache.max"],
    ),
    (
        "unknown key in a sink",
        {"api": {"event_sinks": [{"type": "jsonl", "tag": "a", "path": "p", "evnts": []}]}},
        ["api.event_sinks[0].evnts"],
    ),
    (
        "unknown key in tun",
        {"runtime": {"tun": {"addr": "10.0.0.1", "tag": "t", "x": 1}}},
        ["runtime.tun.x"],
    ),
    (
        "unknown key in a rule",
        {"rules": [{"domain": ["a.com"], "outbound": "direct", "y": 1}]},
        ["rules[0].y"],
    ),
    ("missing listen.port", _listen(address="127.0.0.1"), ["inbounds[0].listen.port"]),
    (
        "missing inbound tag",
        {"inbounds": [{"protocol": "http", "listen": {"port": 1}}]},
        ["inbounds[0].tag"],
    ),
    ("missing listen", {"inbounds": [{"tag": "a", "protocol": "http"}]}, ["inbounds[0].listen"]),
    (
        "missing outbound server",
        {"outbounds": [{"tag": "h", "protocol": "http", "port": 1}]},
        ["outbounds[0].server"],
    ),
    ("missing outbound protocol", {"outbounds": [{"tag": "h"}]}, ["outbounds[0].protocol"]),
    (
        "unknown outbound protocol",
        {"outbounds": [{"tag": "h", "protocol": "vmess"}]},
        ["outbounds[0].protocol"],
    ),
    (
        "missing shadowsocks password",
        {"outbounds": [{"tag": "s", "protocol": "shadowsocks", "server": "h", "port": 1}]},
        ["outbounds[0].password"],
    ),
    (
        "bad shadowsocks method",
        {
            "outbounds": [
                {
                    "tag": "s",
                    "protocol": "shadowsocks",
                    "server": "h",
                    "port": 1,
                    "password": "x",
                    "method": "rc4-md5",
                }
            ]
        },
        ["outbounds[0].method"],
    ),
    (
        "missing group members",
        {"outbound_groups": [{"tag": "g", "kind": "relay"}]},
        ["outbound_groups[0].outbounds"],
    ),
    (
        "empty group members",
        {"outbound_groups": [{"tag": "g", "kind": "relay", "outbounds": []}]},
        ["outbound_groups[0].outbounds"],
    ),
    (
        "missing group kind",
        {"outbound_groups": [{"tag": "g", "outbounds": ["direct"]}]},
        ["outbound_groups[0].kind"],
    ),
    (
        "bad load_balance strategy",
        {
            "outbound_groups": [
                {"tag": "g", "kind": "load_balance", "outbounds": ["direct"], "strategy": "random"}
            ]
        },
        ["outbound_groups[0].strategy"],
    ),
    (
        "missing webhook url",
        {"api": {"event_sinks": [{"type": "webhook", "tag": "w"}]}},
        ["api.event_sinks[0].url"],
    ),
    ("missing sink type", {"api": {"event_sinks": [{"tag": "w"}]}}, ["api.event_sinks[0].type"]),
    ("port above 65535", _listen(port=70000), ["inbounds[0].listen.port"]),
    ("negative port", _listen(port=-1), ["inbounds[0].listen.port"]),
    ("port as a string", _listen(port="7890"), ["inbounds[0].listen.port"]),
    ("port as a bool", _listen(port=True), ["inbounds[0].listen.port"]),
    (
        "listen address not an IP",
        _listen(address="example.com", port=1),
        ["inbounds[0].listen.address"],
    ),
    ("outbound port 0", {"outbounds": [{**HOP, "port": 0}]}, ["outbounds[0].port"]),
    ("bool as a string", {"inbounds": [_inb(udp="yes")]}, ["inbounds[0].udp"]),
    (
        "runtime timeout zero",
        {"runtime": {"udp_upstream_idle_timeout_seconds": 0}},
        ["runtime.udp_upstream_idle_timeout_seconds"],
    ),
    ("bad log level", {"runtime": {"log_level": "verbose"}}, ["runtime.log_level"]),
    (
        "bad dns server",
        {"runtime": {"dns": {"servers": ["system", "8.8.8.8"]}}},
        ["runtime.dns.servers[1]"],
    ),
    (
        "bad fake ip range",
        {"runtime": {"dns": {"answer": {"type": "fake_ip", "fake_ip_range": "198.18/99"}}}},
        ["runtime.dns.answer.fake_ip_range"],
    ),
    (
        "bad dns answer type",
        {"runtime": {"dns": {"answer": {"type": "fake"}}}},
        ["runtime.dns.answer.type"],
    ),
    ("missing tun addr", {"runtime": {"tun": {"tag": "t"}}}, ["runtime.tun.addr"]),
    (
        "bad CIDR",
        {"rules": [{"ip_cidr": ["10.0.0.0/8", "10.0.0.0/33"], "outbound": "direct"}]},
        ["rules[0].ip_cidr[1]"],
    ),
    (
        "bad source CIDR",
        {"rules": [{"source_ip_cidr": "nope", "outbound": "direct"}]},
        ["rules[0].source_ip_cidr[0]"],
    ),
    (
        "bad regex",
        {"rules": [{"domain_regex": ["(unclosed"], "outbound": "direct"}]},
        ["rules[0].domain_regex[0]"],
    ),
    (
        "reversed port range",
        {"rules": [{"port": ["8100-8000"], "outbound": "direct"}]},
        ["rules[0].port[0]"],
    ),
    (
        "port spec out of range",
        {"rules": [{"source_port": ["70000"], "outbound": "direct"}]},
        ["rules[0].source_port[0]"],
    ),
    (
        "port spec garbage",
        {"rules": [{"port": ["80", "http"], "outbound": "direct"}]},
        ["rules[0].port[1]"],
    ),
    ("bad network", {"rules": [{"network": "sctp", "outbound": "direct"}]}, ["rules[0].network"]),
    (
        "empty condition list",
        {"rules": [{"domain": [], "outbound": "direct"}]},
        ["rules[0].domain"],
    ),
    (
        "domain with a leading dot",
        {"rules": [{"domain_suffix": [".a.com"], "outbound": "direct"}]},
        ["rules[0].domain_suffix[0]"],
    ),
    ("bad action", {"rules": [{"domain": "a.com", "action": "reject"}]}, ["rules[0].action"]),
    ("rule without a condition", {"rules": [{"outbound": "direct"}]}, ["rules[0]"]),
    ("route rule without outbound", {"rules": [{"domain": "a.com"}]}, ["rules[0].outbound"]),
    (
        "block rule with outbound",
        {"rules": [{"domain": "a.com", "action": "block", "outbound": "direct"}]},
        ["rules[0].outbound"],
    ),
    (
        "dangling rule outbound",
        {
            "rules": [
                {"domain": "a.com", "outbound": "direct"},
                {"port": "1", "action": "block"},
                {"network": "udp", "outbound": "nowhere"},
            ]
        },
        ["rules[2].outbound"],
    ),
    (
        "dangling group member",
        {
            "outbounds": [HOP],
            "outbound_groups": [
                {"tag": "a", "kind": "relay", "outbounds": ["hop"]},
                {"tag": "b", "kind": "fallback", "outbounds": ["ghost", "hop"]},
            ],
        },
        ["outbound_groups[1].outbounds[0]"],
    ),
    (
        "duplicate group member",
        {"outbound_groups": [{"tag": "a", "kind": "selector", "outbounds": ["direct", "direct"]}]},
        ["outbound_groups[0].outbounds[1]"],
    ),
    (
        "relay hop that is not a proxy",
        {
            "outbounds": [{"tag": "s", "protocol": "socks5", "server": "h", "port": 1}],
            "outbound_groups": [
                {"tag": "g", "kind": "selector", "outbounds": ["s"]},
                {"tag": "a", "kind": "relay", "outbounds": ["s", "direct", "g"]},
            ],
        },
        ["outbound_groups[1].outbounds[1]", "outbound_groups[1].outbounds[2]"],
    ),
    (
        "relay hop whose protocol is a list (the schema's error, no crash in the checks)",
        {
            "outbounds": [{"tag": "s", "protocol": ["socks5"], "server": "h", "port": 1}],
            "outbound_groups": [{"tag": "a", "kind": "relay", "outbounds": ["s"]}],
        },
        ["outbounds[0].protocol"],
    ),
    (
        "shadowsocks relay hop before the last",
        {
            "outbounds": [
                {"tag": "s", "protocol": "socks5", "server": "h", "port": 1},
                {"tag": "ss", "protocol": "shadowsocks", "server": "h", "port": 2, "password": "p"},
            ],
            "outbound_groups": [{"tag": "a", "kind": "relay", "outbounds": ["ss", "s"]}],
        },
        ["outbound_groups[0].outbounds[0]"],
    ),
    (
        "probe url that is not http or https",
        {
            "outbound_groups": [
                {"tag": "a", "kind": "url_test", "outbounds": ["direct"], "url": "ws://x/"},
                {"tag": "b", "kind": "load_balance", "outbounds": ["direct"], "url": "http://x/ y"},
            ],
        },
        ["outbound_groups[0].url", "outbound_groups[1].url"],
    ),
    (
        "selector default not a member",
        {
            "outbounds": [HOP],
            "outbound_groups": [
                {"tag": "s", "kind": "selector", "outbounds": ["hop"], "default": "direct"}
            ],
        },
        ["outbound_groups[0].default"],
    ),
    (
        "dangling mode outbound",
        {"mode": {"kind": "global", "outbound": "ghost"}},
        ["mode.outbound"],
    ),
    ("dangling route final", {"route": {"final": "ghost"}}, ["route.final"]),
    (
        "dangling inbound_tag",
        {"inbounds": [IN], "rules": [{"inbound_tag": ["in", "out"], "outbound": "direct"}]},
        ["rules[0].inbound_tag[1]"],
    ),
    (
        "dangling inbound_tag as a string",
        {"rules": [{"inbound_tag": "out", "outbound": "direct"}]},
        ["rules[0].inbound_tag"],
    ),
    ("global without outbound", {"mode": {"kind": "global"}}, ["mode.outbound"]),
    (
        "duplicate inbound tag",
        {"inbounds": [IN, {**IN, "listen": {"port": 1081}}]},
        ["inbounds[1].tag"],
    ),
    (
        "outbound and group share a tag",
        {
            "outbounds": [HOP],
            "outbound_groups": [{"tag": "hop", "kind": "selector", "outbounds": ["direct"]}],
        },
        ["outbound_groups[0].tag"],
    ),
    ("duplicate outbound tag", {"outbounds": [HOP, {**HOP, "port": 2}]}, ["outbounds[1].tag"]),
    ("direct tag on a proxy", {"outbounds": [{**HOP, "tag": "direct"}]}, ["outbounds[0].tag"]),
    (
        "direct tag on a group",
        {
            "outbound_groups": [{"tag": "direct", "kind": "selector", "outbounds": ["block"]}],
            "outbounds": [{"tag": "block", "protocol": "block"}],
        },
        ["outbound_groups[0].tag"],
    ),
    (
        "duplicate sink tag",
        {
            "api": {
                "event_sinks": [
                    {"type": "jsonl", "tag": "a", "path": "p"},
                    {"type": "webhook", "tag": "a", "url": "http://h/"},
                ]
            }
        },
        ["api.event_sinks[1].tag"],
    ),
    (
        "two-group cycle",
        {
            "outbound_groups": [
                {"tag": "a", "kind": "selector", "outbounds": ["b", "direct"]},
                {"tag": "b", "kind": "fallback", "outbounds": ["a"]},
            ]
        },
        ["outbound_groups[1].outbounds[0]"],
    ),
    (
        "self cycle",
        {"outbound_groups": [{"tag": "a", "kind": "selector", "outbounds": ["a"]}]},
        ["outbound_groups[0].outbounds[0]"],
    ),
    (
        "url_test url must be http or https",
        {
            "outbound_groups": [
                {
                    "tag": "u",
                    "kind": "url_test",
                    "outbounds": ["direct"],
                    "url": "gopher://example.com/",
                }
            ]
        },
        ["outbound_groups[0].url"],
    ),
    (
        "fallback url must be http",
        {
            "outbound_groups": [
                {
                    "tag": "u",
                    "kind": "fallback",
                    "outbounds": ["direct"],
                    "url": "ftp://example.com/",
                }
            ]
        },
        ["outbound_groups[0].url"],
    ),
    (
        "webhook url must be http(s)",
        {"api": {"event_sinks": [{"type": "webhook", "tag": "w", "url": "file:///x"}]}},
        ["api.event_sinks[0].url"],
    ),
    (
        "unknown sink event type",
        {
            "api": {
                "event_sinks": [
                    {"type": "jsonl", "tag": "a", "path": "p", "events": ["flow.complete"]}
                ]
            }
        },
        ["api.event_sinks[0].events[0]"],
    ),
    (
        "header value not a string",
        {
            "api": {
                "event_sinks": [
                    {"type": "webhook", "tag": "w", "url": "http://h/", "headers": {"X-N": 1}}
                ]
            }
        },
        ["api.event_sinks[0].headers.X-N"],
    ),
    (
        "free percent above 100",
        {"api": {"outbox_min_free_percent": 101}},
        ["api.outbox_min_free_percent"],
    ),
    ("negative free bytes", {"api": {"outbox_min_free_bytes": -1}}, ["api.outbox_min_free_bytes"]),
    (
        "bad on_exhausted",
        {"api": {"dispatcher": {"on_exhausted": "drop"}}},
        ["api.dispatcher.on_exhausted"],
    ),
    (
        "backoff initial above max",
        {"api": {"dispatcher": {"backoff_initial_ms": 70000}}},
        ["api.dispatcher.backoff_initial_ms"],
    ),
    (
        "bad api_key_env",
        {"api": {"control": {"api_key_env": "MY-KEY"}}},
        ["api.control.api_key_env"],
    ),
    (
        "bad key permission",
        {"api": {"control": {"keys": [{"name": "k", "key_env": "K", "permissions": ["root"]}]}}},
        ["api.control.keys[0].permissions[0]"],
    ),
    (
        "duplicate username",
        {
            "inbounds": [
                _inb(users=[{"username": "a", "password": "x"}, {"username": "a", "password": "y"}])
            ]
        },
        ["inbounds[0].users[1].username"],
    ),
    ("empty users list", {"inbounds": [_inb(users=[])]}, ["inbounds[0].users"]),
    (
        "socks5 outbound username without password",
        {"outbounds": [{**HOP, "username": "u"}]},
        ["outbounds[0].password"],
    ),
    (
        "two listeners on one port",
        {"inbounds": [IN, {**IN, "tag": "in2"}]},
        ["inbounds[1].listen.port"],
    ),
    ("inbound on the control port", _listen(port=9090), ["inbounds[0].listen.port"]),
    (
        "dns cache ttl bounds",
        {"runtime": {"dns": {"cache": {"min_ttl_seconds": 60, "max_ttl_seconds": 10}}}},
        ["runtime.dns.cache.min_ttl_seconds"],
    ),
    ("not an object", [], [None]),
    ("inbounds not a list", {"inbounds": {"tag": "x"}}, ["inbounds"]),
    (
        "flow hook on an unknown inbound",
        {"inbounds": [IN], "api": {"flow_hook": {"path": "/h.sock", "inbound_tags": ["nope"]}}},
        ["api.flow_hook.inbound_tags[0]"],
    ),
    (
        "flow hook keys",
        {
            "api": {
                "flow_hook": {
                    "path": "/" + "x" * 107,
                    "timeout_ms": 0,
                    "networks": ["icmp"],
                    "inbound_tags": [],
                }
            }
        },
        [
            "api.flow_hook.path",
            "api.flow_hook.timeout_ms",
            "api.flow_hook.networks[0]",
            "api.flow_hook.inbound_tags",
        ],
    ),
    ("flow hook without a path", {"api": {"flow_hook": {}}}, ["api.flow_hook.path"]),
]


@pytest.mark.parametrize(("doc", "paths"), [pytest.param(d, p, id=i) for i, d, p in INVALID])
def test_invalid_document_reports_field_path(doc, paths):
    details = validate_document(doc)
    assert [d.field_path for d in details] == paths, details
    with pytest.raises(ApiError) as info:
        parse_config(doc)
    err = info.value
    assert (err.code, err.message) == ("invalid_argument", "configuration is invalid")
    assert err.details == details
    assert err.cause is not None
    assert err.cause.startswith(f"{len(details)} problem")


@pytest.mark.parametrize(
    ("doc", "path", "fragment"),
    [
        ({"modes": {}}, "modes", "unknown key 'modes'"),
        (_listen(address="127.0.0.1"), "inbounds[0].listen.port", "required"),
        (_listen(port=70000), "inbounds[0].listen.port", "65535"),
        ({"outbounds": [{"tag": "h", "protocol": "vmess"}]}, "outbounds[0].protocol", "socks5"),
        (
            {"rules": [{"domain_regex": ["(x"], "outbound": "direct"}]},
            "rules[0].domain_regex[0]",
            "regular expression",
        ),
        ({"mode": {"kind": "global"}}, "mode.outbound", "global"),
        ({"route": {"final": "ghost"}}, "route.final", "'ghost'"),
        (
            {
                "outbound_groups": [
                    {"tag": "a", "kind": "fallback", "outbounds": ["b"]},
                    {"tag": "b", "kind": "fallback", "outbounds": ["a"]},
                ]
            },
            "outbound_groups[1].outbounds[0]",
            "a -> b -> a",
        ),
        ({"inbounds": "x"}, "inbounds", "must be a list"),
    ],
)
def test_messages_are_readable(doc, path, fragment):
    details = validate_document(doc)
    assert len(details) == 1, details
    assert details[0].field_path == path
    assert fragment in details[0].message


def test_every_problem_is_reported_together():
    doc = copy.deepcopy(EXAMPLE)
    doc["inbounds"][0]["listen"]["port"] = 70000  # schema
    doc["inbounds"][0]["bogus"] = 1  # schema
    doc["rules"][0]["outbound"] = "nowhere"  # reference, found despite the schema errors
    doc["outbound_groups"][0]["outbounds"][0] = "ghost"  # reference + selector default
    doc["runtime"]["udp_upstream_idle_timeout_seconds"] = -5  # schema
    doc["api"]["event_sinks"][1]["tag"] = "central"  # duplicate
    paths = [d.field_path for d in validate_document(doc)]
    assert sorted(paths) == sorted(
        [
            "inbounds[0].listen.port",
            "inbounds[0].bogus",
            "runtime.udp_upstream_idle_timeout_seconds",
            "outbound_groups[0].outbounds[0]",
            "outbound_groups[0].default",
            "rules[0].outbound",
            "api.event_sinks[1].tag",
        ]
    )
    with pytest.raises(ApiError) as info:
        parse_config(doc)
    assert info.value.cause is not None
    assert info.value.cause.startswith("7 problems: inbounds[0].listen.port: ")
    assert len(info.value.to_dict()["details"]) == 7


# ---------------------------------------------------------------------------
# loading files
# ---------------------------------------------------------------------------


def test_load_json_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(EXAMPLE))
    assert load_config_file(path) == parse_config(EXAMPLE)
    assert load_config_file(str(path)).route.final == "proxy"


def test_load_yaml_file(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text(
        "inbounds:\n  - tag: in\n    protocol: http\n    listen: {port: 3128}\n"
        "rules:\n  - {port: [22, '8000-8100'], outbound: direct}\n"
    )
    cfg = load_config_file(path)
    assert cfg.inbounds[0].listen.port == 3128
    assert cfg.rules[0].port == ("22", "8000-8100")


def test_bad_yaml_reports_line_and_column(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yml"
    path.write_text("inbounds:\n  - tag: [unclosed\n")
    with pytest.raises(ApiError) as info:
        load_config_file(path)
    assert info.value.code == "invalid_argument"
    assert "line " in info.value.details[0].message


def test_bad_json_reports_line_and_column(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{\n  "mode": {"kind": "rule",}\n}\n')
    with pytest.raises(ApiError) as info:
        load_config_file(path)
    err = info.value
    assert err.code == "invalid_argument"
    assert err.details is not None
    assert "line 2, column 27" in err.details[0].message
    assert err.cause is not None
    assert "line 2" in err.cause


def test_duplicate_json_key_is_an_error(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"route": {"final": "direct"}, "route": {"final": "block"}}')
    with pytest.raises(ApiError) as info:
        load_config_file(path)
    assert "duplicate key 'route'" in info.value.details[0].message


def test_unreadable_file_is_invalid_argument(tmp_path):
    with pytest.raises(ApiError) as info:
        load_config_file(tmp_path / "missing.json")
    assert info.value.code == "invalid_argument"
    assert "missing.json" in info.value.details[0].message


def test_invalid_file_content_is_validated(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"mode": {"kind": "global"}}')
    with pytest.raises(ApiError) as info:
        load_config_file(path)
    assert [d.field_path for d in info.value.details] == ["mode.outbound"]


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def test_default_ipc_path():
    assert default_ipc_path({"XDG_RUNTIME_DIR": "/run/user/7"}) == (
        "/run/user/7/spliceway/control.sock"
    )
    import os

    assert default_ipc_path({}) == f"/tmp/spliceway-{os.getuid()}/control.sock"
    assert default_ipc_path({"XDG_RUNTIME_DIR": ""}).startswith("/tmp/spliceway-")


def test_ipc_resolved_path():
    cfg = parse_config({"api": {"ipc": {"path": "/x/y.sock"}}})
    assert cfg.api.ipc.resolved_path() == "/x/y.sock"


@pytest.mark.parametrize(
    ("ipc", "unset_default", "serves"),
    [
        ({}, False, False),
        ({}, True, True),
        ({"path": "/x/y.sock"}, False, True),
        ({"enabled": False, "path": "/x/y.sock"}, True, False),
        ({"enabled": True}, False, True),
        ({"enabled": False}, True, False),
    ],
)
def test_ipc_unset_enabled_is_the_entry_points_choice(ipc, unset_default, serves):
    cfg = parse_config({"api": {"ipc": ipc}})
    assert cfg.api.ipc.serves(unset_default) is serves
    resolved = resolve_ipc(cfg, unset_default)
    assert resolved.api.ipc.enabled is serves
    assert resolved.api.ipc.path == cfg.api.ipc.path
    assert resolved.api.control == cfg.api.control


def test_read_api_key():
    control = parse_config({}).api.control
    assert control.read_api_key({"SPLICEWAY_API_KEY": "k1"}) == "k1"
    with pytest.raises(ApiError) as info:
        control.read_api_key({})
    assert "SPLICEWAY_API_KEY" in info.value.message
    assert info.value.field_path == "api.control.api_key_env"


@pytest.mark.parametrize(
    ("spec", "parsed"),
    [
        ("system", ("system", None, None)),
        ("udp://1.1.1.1", ("udp", "1.1.1.1", 53)),
        ("tcp://8.8.8.8:5353", ("tcp", "8.8.8.8", 5353)),
        ("udp://[::1]:53", ("udp", "::1", 53)),
    ],
)
def test_parse_dns_server(spec, parsed):
    assert parse_dns_server(spec) == parsed


@pytest.mark.parametrize(
    "spec", ["8.8.8.8", "udp://::1", "tls://1.1.1.1", "udp://a.b:53", "udp://1.1.1.1:0"]
)
def test_parse_dns_server_rejects(spec):
    with pytest.raises(ValueError, match=r"\w"):
        parse_dns_server(spec)


def test_config_is_hashable_free_of_side_effects():
    a = parse_config(copy.deepcopy(EXAMPLE))
    b = parse_config(copy.deepcopy(EXAMPLE))
    assert a == b
    assert isinstance(a, Config)


# ---------------------------------------------------------------------------
# YAML: a key given twice is an error, as in JSON
# ---------------------------------------------------------------------------


def _yaml_problem(tmp_path, text):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ApiError) as info:
        load_config_file(path)
    err = info.value
    assert err.code == "invalid_argument"
    assert err.message == "configuration file is not valid YAML"
    assert len(err.details) == 1
    return str(path), err.details[0].message


def test_yaml_duplicate_top_level_key(tmp_path):
    path, message = _yaml_problem(
        tmp_path, "mode: {kind: rule}\nroute: {final: direct}\nmode: {kind: direct}\n"
    )
    assert message == (
        f"{path}: line 3, column 1: duplicate key 'mode' in a mapping (first given at line 1)"
    )


def test_yaml_duplicate_nested_key(tmp_path):
    path, message = _yaml_problem(
        tmp_path,
        "inbounds:\n"
        "  - tag: in\n"
        "    protocol: http\n"
        "    listen:\n"
        "      port: 3128\n"
        "      port: 3129\n",
    )
    assert message == (
        f"{path}: line 6, column 7: duplicate key 'port' in a mapping (first given at line 5)"
    )


def test_yaml_duplicate_key_in_flow_mapping(tmp_path):
    _, message = _yaml_problem(tmp_path, "runtime: {log_level: info, log_level: debug}\n")
    assert "line 1, column 28: duplicate key 'log_level'" in message


def test_yaml_without_duplicates_still_loads(tmp_path):
    pytest.importorskip("yaml")
    path = tmp_path / "c.yml"
    path.write_text(
        "inbounds:\n"
        "  - {tag: a, protocol: socks5, listen: {port: 1080}}\n"
        "  - {tag: b, protocol: http, listen: {port: 3128}}\n"
        "route: {final: direct}\n"
    )
    cfg = load_config_file(path)
    assert [ib.tag for ib in cfg.inbounds] == ["a", "b"]


def test_yaml_merge_key_may_override_merged_keys(tmp_path):
    """``<<`` keeps its meaning: keys merged in may be overridden, merged maps may overlap."""
    pytest.importorskip("yaml")
    path = tmp_path / "c.yaml"
    path.write_text(
        "outbounds:\n"
        "  - &hop {tag: hop-a, protocol: socks5, server: 127.0.0.1, port: 1080}\n"
        "  - <<: *hop\n"
        "    tag: hop-b\n"
        "    port: 1081\n"
        "  - <<: [{tag: hop-c, port: 1082}, *hop]\n"
    )
    cfg = load_config_file(path)
    assert [(o.tag, o.port) for o in cfg.outbounds] == [
        ("hop-a", 1080),
        ("hop-b", 1081),
        ("hop-c", 1082),
    ]


def test_yaml_merge_key_twice_is_a_duplicate(tmp_path):
    _, message = _yaml_problem(tmp_path, "mode:\n  <<: {kind: global}\n  <<: {outbound: direct}\n")
    assert "line 3, column 3: duplicate key '<<'" in message


def test_yaml_anchor_merged_into_itself_is_an_error_not_a_crash(tmp_path):
    source, message = _yaml_problem(tmp_path, "route: &a {final: direct, <<: *a}\n")
    assert message == f"{source}: line 1, column 8: a mapping merges itself " + (
        "(through an alias of its own anchor)"
    )


def test_yaml_merge_of_a_scalar_is_an_error(tmp_path):
    _, message = _yaml_problem(tmp_path, "route:\n  <<: 5\n")
    assert "expected a mapping or a list of mappings to merge, but found scalar" in message


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("c.json", '{"rules": ' + "[" * 5000 + "]" * 5000 + "}"),
        ("c.yaml", "rules: " + "[" * 5000 + "]" * 5000 + "\n"),
    ],
)
def test_absurd_nesting_is_reported_not_a_crash(tmp_path, name, text):
    if name.endswith(".yaml"):
        pytest.importorskip("yaml")
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ApiError) as info:
        load_config_file(path)
    assert [d.message for d in info.value.details] == [f"{path}: nested too deeply"]


def test_flow_hook_defaults_and_client_settings():
    assert parse_config({}).api.flow_hook is None
    cfg = parse_config({"inbounds": [IN], "api": {"flow_hook": {"path": "/run/h.sock"}}})
    hook = cfg.api.flow_hook
    assert hook is not None
    assert (hook.timeout_ms, hook.networks, hook.inbound_tags) == (200, ("tcp", "udp"), None)
    settings = HookSettings.from_config(hook)
    assert settings.selects("tcp", IN["tag"]) and settings.path == "/run/h.sock"
    only = parse_config(
        {
            "inbounds": [IN],
            "api": {"flow_hook": {"path": "/h", "networks": ["tcp"], "inbound_tags": [IN["tag"]]}},
        }
    ).api.flow_hook
    assert only is not None and HookSettings.from_config(only).inbound_tags == (IN["tag"],)
    assert not HookSettings.from_config(only).selects("tcp", "other")
    # Round trip: the normalised document validates again.
    assert parse_config(cfg.to_dict()) == cfg
