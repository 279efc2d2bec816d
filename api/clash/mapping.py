"""spliceway's query results in mihomo's shapes: pure functions, no I/O.

Each function takes what a query or command of the control plane answered (the
``config``, ``runtime`` and ``tun_status`` queries, a ``diagnostics.*`` result) and
returns the JSON mihomo's external controller answers for the same thing
(docs/clash-api.md). The routes (:mod:`.routes`) run the queries and commands; this
module only translates, so every translation is tested on real query results without a
listener.

Decisions, where mihomo's world and spliceway's differ:

- Outbounds and groups are proxies under their own tags (no ``DIRECT``/``REJECT``
  built-ins: spliceway's are ordinary outbounds, ``direct`` and ``block`` by default),
  plus mihomo's synthetic ``GLOBAL`` selector unless a tag is already ``GLOBAL``.
- A proxy's ``history`` is the latest health the engine knows of it (its probe
  rounds, a dial failure, a delay test), ``[]`` while nothing has checked it; a failed
  check is ``delay: 0`` with ``alive: false``, as mihomo records it. ``extra`` holds the
  same per probing group's URL.
- A rule's conditions all have to match and a list matches when any item does, so a
  rule of several conditions is mihomo's ``AND`` and a list mihomo takes in one payload
  only when mihomo itself does (ports, inbound names and users joined by ``/``) —
  otherwise an ``OR`` of one sub-rule per item.
"""

from __future__ import annotations

import functools
import re
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_PROVIDER",
    "GLOBAL",
    "GROUP_TYPES",
    "LOG_LEVELS",
    "MODES",
    "PROXY_TYPES",
    "Observation",
    "camel_case",
    "clash_log_level",
    "delay_of",
    "dns_answer",
    "general",
    "global_members",
    "global_now",
    "group_names",
    "proxies",
    "proxy_provider",
    "proxy_providers",
    "rfc3339",
    "rule_providers",
    "rule_type_and_payload",
    "rules",
    "version",
]

#: mihomo's built-in selector: every outbound and group, routing everything in mode global.
GLOBAL = "GLOBAL"

#: Outbound protocol → mihomo's adapter type string (``constant/adapters.go``).
PROXY_TYPES: Mapping[str, str] = {
    "direct": "Direct",
    "block": "Reject",
    "socks5": "Socks5",
    "http": "Http",
    "shadowsocks": "Shadowsocks",
    "vless": "Vless",
    "vmess": "Vmess",
    "trojan": "Trojan",
    "hysteria2": "Hysteria2",
    "tuic": "Tuic",
    "wireguard": "WireGuard",
}

#: Group kind → mihomo's group type string.
GROUP_TYPES: Mapping[str, str] = {
    "selector": "Selector",
    "url_test": "URLTest",
    "fallback": "Fallback",
    "load_balance": "LoadBalance",
    "relay": "Relay",
}

#: Outbound protocols that carry UDP (mihomo's ``udp``); an http proxy cannot.
_UDP_PROTOCOLS = frozenset(
    {"direct", "block", "socks5", "shadowsocks", "vless", "vmess", "trojan", "hysteria2", "tuic",
     "wireguard"}
)  # fmt: skip

#: The routing modes, lower-case as mihomo writes them (its ``mode-list``).
MODES = ("rule", "global", "direct")

#: mihomo's (and sing-box's) log level names → spliceway's. ``silent`` has no spliceway
#: counterpart: the quietest level, ``error``, stands for it.
LOG_LEVELS: Mapping[str, str] = {
    "trace": "trace",
    "debug": "debug",
    "info": "info",
    "warning": "warn",
    "warn": "warn",
    "error": "error",
    "silent": "error",
}

#: spliceway's log level → mihomo's ``log-level`` (mihomo has no ``trace``).
_CLASH_LEVEL = {"trace": "debug", "debug": "debug", "info": "info", "warn": "warning",
                "error": "error"}  # fmt: skip

#: Fields every mihomo proxy carries that spliceway has no counterpart for.
_ADAPTER_DEFAULTS: Mapping[str, Any] = {
    "xudp": False,
    "tfo": False,
    "mptcp": False,
    "smux": False,
    "uot": False,
    "interface": "",
    "routing-mark": 0,
    "dialer-proxy": "",
    "provider-name": "",
}

_ID_NAMESPACE = uuid.UUID("5d0e4f7a-2b57-4c52-9a55-6c6173686170")


# -- time and delays --------------------------------------------------------------------


def rfc3339(unix_ms: int) -> str:
    """``unix_ms`` as RFC 3339 in UTC with milliseconds (``2026-01-01T00:00:00.123Z``)."""
    # strftime, not datetime: every new connection of a snapshot formats its start.
    seconds, millis = divmod(unix_ms, 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{millis:03d}Z"


def delay_of(latency_ms: float | None) -> int:
    """A measured latency as mihomo's ``delay``: whole milliseconds, at least 1 (mihomo's
    0 means failed) and at most 65535 (its uint16); 0 when nothing was measured."""
    if latency_ms is None:
        return 0
    return min(65535, max(1, round(latency_ms)))


@dataclass(frozen=True, slots=True)
class Observation:
    """One health check of a proxy: when, how long (0: failed), and through which URL
    (None when not known)."""

    time_ms: int
    delay: int
    url: str | None = None

    @property
    def alive(self) -> bool:
        """mihomo's ``alive`` after this check."""
        return self.delay > 0

    def entry(self) -> dict[str, Any]:
        """mihomo's ``history`` item."""
        return {"time": rfc3339(self.time_ms), "delay": self.delay}


def _observed(health: Mapping[str, Any], url: str | None) -> Observation | None:
    """A ``member_health`` / ``url_test_members`` item as an Observation (None when the
    member was never checked)."""
    checked = health.get("last_checked_unix_ms")
    if checked is None or health.get("healthy") is None:
        return None
    # A healthy member whose latency was not kept still answered: mihomo's smallest delay.
    delay = (delay_of(health.get("latency_ms")) or 1) if health["healthy"] else 0
    return Observation(int(checked), delay, url)


# -- proxies ----------------------------------------------------------------------------


def _outbounds(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(config.get("outbounds") or [])


def _groups(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list(config.get("outbound_groups") or [])


def group_names(config: Mapping[str, Any]) -> list[str]:
    """Tags of the configured groups, in configuration order."""
    return [g["tag"] for g in _groups(config)]


def _has_own_global(config: Mapping[str, Any]) -> bool:
    return any(o["tag"] == GLOBAL for o in _outbounds(config)) or GLOBAL in group_names(config)


def global_members(config: Mapping[str, Any]) -> list[str]:
    """``GLOBAL``'s ``all``: every outbound, then every group, in configuration order (as
    mihomo lists its proxies, then its groups); dashboards order their groups by it."""
    return [o["tag"] for o in _outbounds(config)] + group_names(config)


def global_now(config: Mapping[str, Any], choice: str | None) -> str:
    """``GLOBAL``'s ``now``: the global mode's outbound while the mode is global, else the
    member a client picked (``choice``, when it still exists), else ``route.final``."""
    mode = config.get("mode") or {}
    if mode.get("kind") == "global" and mode.get("outbound"):
        return str(mode["outbound"])
    if choice is not None and choice in global_members(config):
        return choice
    return str(config.get("final") or "")


def _histories(
    config: Mapping[str, Any], local: Mapping[str, Sequence[Observation]]
) -> tuple[dict[str, list[Observation]], dict[str, dict[str, Observation]]]:
    """Per proxy name: its history (oldest first) and its latest check per test URL.

    The engine keeps one latest health per tag, the same in every group's
    ``member_health`` (a probe round, a dial failure, a delay test); a group's own
    ``url_test_members`` are its rounds through its URL. A name no group lists has
    only what this listener's delay tests saw (``local``).
    """
    latest: dict[str, Observation] = {}
    per_url: dict[str, dict[str, Observation]] = {}
    for group in _groups(config):
        url = group.get("url")
        for health in group.get("member_health") or []:
            seen = _observed(health, None)
            name = health["member_tag"]
            if seen is not None and (name not in latest or seen.time_ms > latest[name].time_ms):
                latest[name] = seen
        for health in group.get("url_test_members") or []:
            seen = _observed(health, url)
            if seen is not None and url:
                per_url.setdefault(health["member_tag"], {})[url] = seen
    history: dict[str, list[Observation]] = {name: [seen] for name, seen in latest.items()}
    for name, seen_list in local.items():
        if not seen_list:
            continue
        if name not in history:
            history[name] = list(seen_list)
        # mihomo keeps every delay test under its URL too (``extra[url]``), where
        # zashboard's independent latency and metacubexd read a node's latency.
        urls = per_url.setdefault(name, {})
        for seen in seen_list:
            if seen.url and (seen.url not in urls or seen.time_ms >= urls[seen.url].time_ms):
                urls[seen.url] = seen
    return history, per_url


def _common(
    name: str,
    type_: str,
    udp: bool,
    history: Sequence[Observation],
    extra: Mapping[str, Observation],
) -> dict[str, Any]:
    return {
        "name": name,
        "type": type_,
        "udp": udp,
        **_ADAPTER_DEFAULTS,
        "alive": history[-1].alive if history else True,
        "history": [seen.entry() for seen in history],
        "extra": {
            url: {"alive": seen.alive, "history": [seen.entry()]} for url, seen in extra.items()
        },
    }


def _leaf_udp(
    name: str,
    protocols: Mapping[str, str],
    groups: Mapping[str, Mapping[str, Any]],
    seen: frozenset[str] = frozenset(),
) -> bool:
    """Whether ``name`` carries UDP now: an outbound by its protocol, a group by what it
    chooses (every member for load_balance; never through a relay's hops)."""
    if name in protocols:
        return protocols[name] in _UDP_PROTOCOLS
    group = groups.get(name)
    if group is None or name in seen:
        return False
    seen = seen | {name}
    kind = group.get("kind")
    if kind == "relay":
        return False
    if kind == "load_balance":
        members = group.get("outbounds") or []
        return bool(members) and all(_leaf_udp(m, protocols, groups, seen) for m in members)
    selected = group.get("selected")
    return isinstance(selected, str) and _leaf_udp(selected, protocols, groups, seen)


def _group_proxy(
    group: Mapping[str, Any],
    udp: bool,
    history: Sequence[Observation],
    extra: Mapping[str, Observation],
) -> dict[str, Any]:
    kind = str(group.get("kind"))
    name = str(group["tag"])
    out = _common(name, GROUP_TYPES.get(kind, kind), udp, history, extra)
    out["all"] = list(group.get("outbounds") or [])
    if kind in ("selector", "url_test", "fallback"):
        out["now"] = group.get("selected") or ""
    if kind in ("url_test", "fallback"):
        out["fixed"] = group.get("fixed") or ""
    probing = kind in ("url_test", "fallback", "load_balance")
    out["testUrl"] = str(group.get("url") or "") if probing else ""
    if probing:
        # spliceway's groups take any answer as healthy.
        out["expectedStatus"] = "*"
    out["hidden"] = False
    out["icon"] = ""
    return out


def proxies(
    config: Mapping[str, Any],
    global_choice: str | None = None,
    local: Mapping[str, Sequence[Observation]] | None = None,
) -> dict[str, dict[str, Any]]:
    """``GET /proxies``'s ``proxies``: every outbound and group of the ``config`` query's
    answer, then ``GLOBAL``, by name.

    ``global_choice`` is the member a client gave ``GLOBAL`` outside mode global;
    ``local`` the delay tests this listener ran, by name (see :func:`_histories`).
    """
    history, per_url = _histories(config, local or {})
    protocols = {str(o["tag"]): str(o["protocol"]) for o in _outbounds(config)}
    groups = {str(g["tag"]): g for g in _groups(config)}
    out: dict[str, dict[str, Any]] = {}
    for ob in _outbounds(config):
        name, protocol = str(ob["tag"]), str(ob["protocol"])
        item = _common(
            name,
            PROXY_TYPES.get(protocol, protocol.capitalize()),
            protocol in _UDP_PROTOCOLS,
            history.get(name, []),
            per_url.get(name, {}),
        )
        # mihomo gives every leaf a random id per start; a name's uuid5 is as unique and
        # stays the same across reloads.
        item["id"] = str(uuid.uuid5(_ID_NAMESPACE, name))
        item["provider-name"] = str(ob.get("provider") or "")
        out[name] = item
    for name, group in groups.items():
        out[name] = _group_proxy(
            group,
            _leaf_udp(name, protocols, groups),
            history.get(name, []),
            per_url.get(name, {}),
        )
    if not _has_own_global(config):
        item = _common(GLOBAL, "Selector", True, [], {})
        item.update(
            {
                "all": global_members(config),
                "now": global_now(config, global_choice),
                "testUrl": "",
                "hidden": False,
                "icon": "",
            }
        )
        out[GLOBAL] = item
    return out


# -- /providers -------------------------------------------------------------------------

#: mihomo's zero ``time.Time`` (``updatedAt`` of a provider that has no content, and of
#: the ``Compatible`` ones, which never have any).
ZERO_TIME = "0001-01-01T00:00:00Z"
#: The test URL mihomo gives a group without one of its own.
MIHOMO_TEST_URL = "https://www.gstatic.com/generate_204"
#: mihomo's provider of every proxy and group the configuration itself defines.
DEFAULT_PROVIDER = "default"
#: A provider health check's budget per member (mihomo's ``health-check.timeout``
#: default, ``adapter/provider/healthcheck.go``).
PROVIDER_CHECK_TIMEOUT_MS = 5000
_BEHAVIORS = {"domain": "Domain", "ipcidr": "IPCIDR", "classical": "Classical"}
_RULE_FORMATS = {"yaml": "YamlRule", "text": "TextRule", "mrs": "MrsRule"}


def _provider_time(unix_ms: int | None) -> str:
    return rfc3339(unix_ms) if unix_ms is not None else ZERO_TIME


def _compatible(name: str, members: Iterable[dict[str, Any]], test_url: str) -> dict[str, Any]:
    return {
        "name": name,
        "type": "Proxy",
        "vehicleType": "Compatible",
        "proxies": list(members),
        "testUrl": test_url,
        "expectedStatus": "*",
        "updatedAt": ZERO_TIME,
    }


def proxy_provider(state: Mapping[str, Any], everything: Mapping[str, Any]) -> dict[str, Any]:
    """One proxy provider (an item of the ``providers`` query) as mihomo's provider:
    its members as ``/proxies`` shows them (``everything``)."""
    check = state.get("health_check") or {}
    out: dict[str, Any] = {
        "name": state["name"],
        "type": "Proxy",
        "vehicleType": "HTTP" if state["source"] == "url" else "File",
        "proxies": [everything[m] for m in state.get("members") or [] if m in everything],
        "testUrl": str(check.get("url") or MIHOMO_TEST_URL),
        "expectedStatus": "*",
        "updatedAt": _provider_time(state.get("updated_at_unix_ms")),
    }
    info = state.get("subscription_info")
    if info is not None:
        out["subscriptionInfo"] = {
            "Upload": info["upload"],
            "Download": info["download"],
            "Total": info["total"],
            "Expire": info["expire"],
        }
    return out


def proxy_providers(
    config: Mapping[str, Any], states: Iterable[Mapping[str, Any]], everything: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """``GET /providers/proxies``'s ``providers``, by name, as mihomo lists them: a
    ``Compatible`` provider for each group with members of its own (named after the group),
    ``default`` with every outbound and group the configuration defines, then every proxy
    provider (which wins over a ``Compatible`` one of the same name)."""
    out: dict[str, dict[str, Any]] = {}
    for group in _groups(config):
        own = [h["member_tag"] for h in group.get("member_health") or [] if not h.get("provider")]
        if own:
            url = str(group.get("url") or MIHOMO_TEST_URL)
            out[str(group["tag"])] = _compatible(
                str(group["tag"]), (everything[m] for m in own if m in everything), url
            )
    defined = [str(o["tag"]) for o in _outbounds(config) if not o.get("provider")]
    defined += group_names(config)
    out[DEFAULT_PROVIDER] = _compatible(
        DEFAULT_PROVIDER, (everything[m] for m in defined if m in everything), ""
    )
    for state in states:
        if state["kind"] == "proxies":
            out[str(state["name"])] = proxy_provider(state, everything)
    return out


def rule_providers(states: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """``GET /providers/rules``'s ``providers``, by name."""
    out: dict[str, dict[str, Any]] = {}
    for state in states:
        if state["kind"] != "rules":
            continue
        out[str(state["name"])] = {
            "behavior": _BEHAVIORS.get(str(state.get("behavior")), str(state.get("behavior"))),
            "format": _RULE_FORMATS.get(str(state.get("format")), str(state.get("format"))),
            "name": state["name"],
            "ruleCount": state.get("rules") or 0,
            "type": "Rule",
            "vehicleType": "HTTP" if state["source"] == "url" else "File",
            "updatedAt": _provider_time(state.get("updated_at_unix_ms")),
        }
    return out


# -- /configs ---------------------------------------------------------------------------


def clash_log_level(level: str) -> str:
    """spliceway's log level as mihomo's ``log-level``."""
    return _CLASH_LEVEL.get(level, level)


_LOOPBACK = re.compile(r"^(127\.|::1$|localhost$|::ffff:127\.)")
_WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def _ports(listeners: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """mihomo's port keys from the first inbound of each protocol, and ``allow-lan`` /
    ``bind-address`` from where the proxy inbounds listen."""
    first: dict[str, int] = {}
    addresses: list[str] = []
    for listener in listeners:
        protocol = listener.get("protocol")
        if protocol not in ("http", "socks5", "mixed"):
            continue
        first.setdefault(str(protocol), int(listener.get("listen_port") or 0))
        addresses.append(str(listener.get("listen_address") or ""))
    lan = [a for a in addresses if not _LOOPBACK.match(a)]
    bind = "*"
    if lan and lan[0] not in _WILDCARDS:
        bind = lan[0]
    return {
        "port": first.get("http", 0),
        "socks-port": first.get("socks5", 0),
        "redir-port": 0,
        "tproxy-port": 0,
        "mixed-port": first.get("mixed", 0),
        "allow-lan": bool(lan),
        "bind-address": bind,
    }


#: mihomo 1.19's tuning knobs of its own TUN stacks (batched reads, per-channel workers):
#: spliceway's TUN has neither, so they are off.
_TUN_STACK_KNOBS: Mapping[str, Any] = {"recvmsgx": False, "processors-per-channel": 0}


def _tun(status: Mapping[str, Any]) -> dict[str, Any]:
    """mihomo's ``tun`` object from the ``tun_status`` query."""
    if not status.get("running"):
        return {
            "enable": False,
            "device": "",
            "stack": "System",
            "dns-hijack": [],
            "auto-route": False,
            "auto-detect-interface": False,
            "inet4-address": [],
            "inet6-address": [],
            "file-descriptor": 0,
            **_TUN_STACK_KNOBS,
        }
    addresses = [str(a) for a in status.get("addresses") or [status.get("addr")] if a]
    return {
        "enable": True,
        "device": status.get("name") or "",
        # spliceway's TUN runs its own packet loop over the host's stack.
        "stack": "System",
        "dns-hijack": ["any:53"] if status.get("dns_hijack") else [],
        "auto-route": bool(status.get("auto_route")),
        # The TUN follows the egress interface as it changes (tun_status's egress fields).
        "auto-detect-interface": True,
        "inet4-address": [a for a in addresses if ":" not in a],
        "inet6-address": [a for a in addresses if ":" in a],
        "mtu": int(status.get("mtu") or 0),
        "strict-route": bool(status.get("strict_route")),
        "file-descriptor": 0,
        **_TUN_STACK_KNOBS,
    }


def general(
    config: Mapping[str, Any], runtime: Mapping[str, Any], tun_status: Mapping[str, Any]
) -> dict[str, Any]:
    """``GET /configs``: mihomo's ``General`` with spliceway's values (the ``config``,
    ``runtime`` and ``tun_status`` queries' answers); zeros, empty strings and false
    where spliceway has no such thing (TUIC server, geodata, keep-alive tuning)."""
    mode = (config.get("mode") or {}).get("kind") or "rule"
    out: dict[str, Any] = _ports(config.get("listeners") or [])
    out.update(
        {
            "tun": _tun(tun_status),
            "tuic-server": {
                "enable": False,
                "listen": "",
                "certificate": "",
                "private-key": "",
                "ech-key": "",
                "mux-option": {"brutal": {"enabled": False}},
            },
            "ss-config": "",
            "vmess-config": "",
            # Credentials stay in the configuration: never listed here.
            "authentication": None,
            "skip-auth-prefixes": None,
            # spliceway filters no client address (only inbound users authenticate).
            "lan-allowed-ips": ["0.0.0.0/0", "::/0"],
            "lan-disallowed-ips": None,
            "inbound-tfo": False,
            "inbound-mptcp": False,
            "mode": mode,
            "mode-list": list(MODES),
            # spliceway's delay counts the whole exchange, handshakes included.
            "unified-delay": False,
            "log-level": clash_log_level(str(runtime.get("log_level") or "info")),
            "ipv6": True,
            "interface-name": "",
            "routing-mark": 0,
            "geox-url": {"geo-ip": "", "mmdb": "", "asn": "", "geo-site": ""},
            "geo-auto-update": False,
            "geo-update-interval": 0,
            "geodata-mode": False,
            "geodata-loader": "",
            "geosite-matcher": "",
            "tcp-concurrent": False,
            "global-ua": "",
            "etag-support": False,
            "keep-alive-idle": 0,
            "keep-alive-interval": 0,
            "disable-keep-alive": False,
        }
    )
    return out


# -- /rules -----------------------------------------------------------------------------

#: Condition key → mihomo's RuleType string (``constant/rule.go``).
_RULE_TYPES: Mapping[str, str] = {
    "domain": "Domain",
    "domain_suffix": "DomainSuffix",
    "domain_keyword": "DomainKeyword",
    "domain_regex": "DomainRegex",
    "ip_cidr": "IPCIDR",
    "source_ip_cidr": "SrcIPCIDR",
    "port": "DstPort",
    "source_port": "SrcPort",
    "network": "Network",
    "inbound_tag": "InName",
    "principal_key": "InUser",
    "process_name": "ProcessName",
    "process_path": "ProcessPath",
    "rule_set": "RuleSet",
    "geoip": "GeoIP",
    "source_geoip": "SrcGeoIP",
    "geosite": "GeoSite",
}

#: mihomo rules that take several values in one payload, ``/``-separated
#: (``DST-PORT,80/443/8000-9000``, ``IN-NAME,a/b``, ``IN-USER,u1/u2``).
_SLASH_LISTS = frozenset({"DstPort", "SrcPort", "InName", "InUser"})

#: Conditions whose items are never split: ``|`` is part of a regular expression, and a
#: list of them matches exactly as their alternation does.
_WHOLE = frozenset({"domain_regex"})

#: ``key=`` starts each condition of the text; a value never contains ``,key=``.
_CONDITION_START = re.compile(r",(?=[a-z][a-z0-9_]*=)")


def camel_case(key: str) -> str:
    """``snake_case`` as mihomo's type names write it (``rule_set`` → ``RuleSet``)."""
    return "".join(part.capitalize() for part in key.split("_"))


def _one_rule(key: str, raw: str) -> tuple[str, str]:
    """``(type, payload)`` of one ``key=value`` condition; several items become one
    ``/`` list where mihomo takes one, else an ``OR`` of single rules. A key mihomo has
    no name for keeps its own, in mihomo's CamelCase."""
    rule_type = _RULE_TYPES.get(key) or camel_case(key)
    items = [raw] if key in _WHOLE else raw.split("|")
    if rule_type in _SLASH_LISTS:
        return rule_type, "/".join(items)
    if len(items) == 1:
        return rule_type, items[0]
    return "OR", "(" + " || ".join(f"({rule_type},{item})" for item in items) + ")"


@functools.lru_cache(maxsize=4096)
def rule_type_and_payload(condition: str) -> tuple[str, str]:
    """A spliceway rule's condition text (``matched_rule.condition``, the ``config``
    query's ``rules[].condition``) as mihomo's rule ``type`` and ``payload``: one
    condition is its RuleType (``domain_suffix`` → ``DomainSuffix``...); several are
    ``AND`` with mihomo's payload syntax (``((DstPort,443) && (Network,tcp))``); a list
    mihomo cannot hold in one payload is an ``OR`` of one sub-rule per item. Empty text
    (no rule: ``route.final``) is ``("Match", "")``; text that is not ``key=value`` is
    ``("Unknown", text)``, shown rather than dropped. Pure; cached, because every
    connection of a snapshot asks."""
    if not condition:
        return "Match", ""
    parts: list[tuple[str, str]] = []
    for chunk in _CONDITION_START.split(condition):
        key, sep, raw = chunk.partition("=")
        if not sep:
            return "Unknown", condition
        parts.append(_one_rule(key, raw))
    if len(parts) == 1:
        return parts[0]
    return "AND", "(" + " && ".join(f"({t},{p})" for t, p in parts) + ")"


def rules(config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """``GET /rules``'s ``rules``: each rule of the ``config`` query in order, then
    mihomo's final ``Match`` to ``route.final``. ``proxy`` is the rule's outbound, or
    ``REJECT`` for ``action: block``; ``size`` is -1 (no rule holds a rule set yet)."""
    out: list[dict[str, Any]] = []
    for rule in config.get("rules") or []:
        type_, payload = rule_type_and_payload(str(rule.get("condition") or ""))
        proxy = "REJECT" if rule.get("action") == "block" else str(rule.get("outbound") or "")
        out.append(
            {"index": len(out), "type": type_, "payload": payload, "proxy": proxy, "size": -1}
        )
    out.append(
        {
            "index": len(out),
            "type": "Match",
            "payload": "",
            "proxy": str(config.get("final") or ""),
            "size": -1,
        }
    )
    return out


# -- /dns/query and /version ------------------------------------------------------------


def _records(items: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": r["name"], "type": r["type"], "TTL": r["ttl"], "data": r["data"]} for r in items
    ]


def dns_answer(result: Mapping[str, Any]) -> dict[str, Any]:
    """A ``diagnostics.dns_query`` result as mihomo's ``/dns/query`` answer: ``Status``,
    ``Question``, the header flags, and ``Answer`` / ``Authority`` / ``Additional`` only
    when not empty (as mihomo)."""
    question = result.get("question") or {}
    flags = result.get("flags") or {}
    out: dict[str, Any] = {
        "Status": int(result.get("rcode") or 0),
        "Question": [
            {
                "Name": question.get("name", ""),
                "Qtype": question.get("type") or 0,
                "Qclass": question.get("class") or 1,
            }
        ],
        "TC": bool(flags.get("tc")),
        "RD": bool(flags.get("rd")),
        "RA": bool(flags.get("ra")),
        "AD": bool(flags.get("ad")),
        "CD": bool(flags.get("cd")),
    }
    for key, section in (
        ("Answer", "answer"),
        ("Authority", "authority"),
        ("Additional", "additional"),
    ):
        records = result.get(section) or []
        if records:
            out[key] = _records(records)
    return out


def version(engine_version: str) -> dict[str, Any]:
    """``GET /version``: spliceway's own version, named so dashboards take it for a core
    that is not mihomo and has no upgrade channel.

    zashboard (``detectCore``) and metacubexd (``isSingBoxVersion``) treat a version
    containing ``sing-box`` as a core they neither check for updates nor offer to
    upgrade, restart or re-download geodata for; Yacd does the same for ``meta`` with
    ``premium``. spliceway's Clash API is the subset sing-box's ``clash_api`` serves
    (plus the mihomo extras it can honour), so it says so in those words.
    """
    return {
        "version": f"spliceway {engine_version} (sing-box compatible)",
        "meta": True,
        "premium": True,
    }
