"""A whole Clash/mihomo configuration (or a share-link list) as a spliceway configuration.

:func:`import_text` reads a source's bytes: a YAML mapping is a mihomo configuration
(:func:`import_document`), anything else is tried as a share-link list
(:func:`import_links`), as mihomo reads a subscription. The result is a spliceway
document that :func:`spliceway.config.parse_config` accepts (checked before it is
returned), the files to write beside it (inline providers' content) and a
:class:`~spliceway.clash.report.Report` naming everything converted, changed in meaning
or skipped, with why. :class:`ClashImportError` means nothing usable came out (not YAML
and no share link, not a mapping, no mihomo key at all).

The passes, in mihomo's order: inbounds (:mod:`spliceway.clash.inbounds`), proxies and
their ``dialer-proxy`` chains, proxy providers, groups (:mod:`spliceway.clash.groups`),
rule providers (:mod:`spliceway.clash.provider_specs`), rules (through
:func:`spliceway.clash.rule_lines.parse_rule_line`; ``MATCH`` is ``route.final``, lines
after it are reported, a target that was skipped is the ``block`` outbound), then
``mode``, ``log-level``, the external controller (``api.clash``; ``secret`` goes to the
variable ``SPLICEWAY_CLASH_SECRET``, never into the output), ``dns``, ``tun``,
``sniffer`` and the geodata paths. Every other top-level key is reported with why it is
not carried; unknown keys too (mihomo ignores them silently).

spliceway's own HTTP control API is turned off in the output (Clash tools use
``api.clash``; ``spliceway status`` and friends still work over the IPC socket): left on,
it would need ``SPLICEWAY_API_KEY`` and would take mihomo's usual controller port 9090.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from spliceway.clash.groups import (
    build_dialer_chains,
    convert_groups,
    convert_proxies,
    ensure_global,
)
from spliceway.clash.inbounds import InboundIndex, ListenerRoute, convert_inbounds
from spliceway.clash.links import parse_links
from spliceway.clash.provider_specs import (
    convert_proxy_providers,
    convert_rule_providers,
    finish_providers,
)
from spliceway.clash.proxies import Converted, convert_proxy
from spliceway.clash.report import Report
from spliceway.clash.rule_lines import (
    InboundContext,
    ParsedRule,
    Unsupported,
    parse_rule_line,
)
from spliceway.clash.state import BLOCK_TAG, ImportState
from spliceway.clash.weak import WeakTypeError, weak_bool, weak_int, weak_str
from spliceway.clash.yaml12 import YamlError, load
from spliceway.config import validate_document

__all__ = [
    "SECRET_ENV",
    "ClashImportError",
    "ImportResult",
    "import_document",
    "import_links",
    "import_text",
]

#: The variable the Clash API's secret is read from (the secret itself is never written).
SECRET_ENV = "SPLICEWAY_CLASH_SECRET"

#: Top-level keys mihomo reads that are not carried, with why.
_NOT_CARRIED: dict[str, str] = {
    "redir-port": "spliceway has no redirect (iptables REDIRECT) inbound",
    "tproxy-port": "spliceway has no TProxy inbound",
    "ss-config": "spliceway has no Shadowsocks inbound",
    "vmess-config": "spliceway has no VMess inbound",
    "tuic-server": "spliceway has no TUIC inbound",
    "inbound-tfo": "spliceway's inbounds do not use TCP Fast Open",
    "inbound-mptcp": "spliceway's inbounds do not use Multipath TCP",
    "lan-allowed-ips": "spliceway's inbounds have no client address allow list",
    "lan-disallowed-ips": "spliceway's inbounds have no client address deny list",
    "unified-delay": "spliceway measures a probe's whole HEAD round trip",
    "ipv6": "spliceway uses IPv6 whenever the resolver gives IPv6 addresses",
    "external-controller-unix": "the Clash API listens on TCP only",
    "external-controller-pipe": "the Clash API listens on TCP only",
    "external-controller-tls": "the Clash API has no TLS listener",
    "external-ui-url": "spliceway downloads no dashboard: give external_ui a directory",
    "external-ui-name": "spliceway downloads no dashboard: give external_ui a directory",
    "external-doh-server": "spliceway's Clash API serves no DNS over HTTPS",
    "interface-name": "spliceway does not bind outgoing connections to an interface",
    "routing-mark": "spliceway does not set a routing mark on outgoing connections",
    "tunnels": "spliceway has no port-forwarding tunnels",
    "geo-auto-update": "geodata is downloaded by providers.update when its URL is set",
    "geo-update-interval": "geodata is downloaded by providers.update when its URL is set",
    "geodata-loader": "spliceway reads geodata its own way",
    "geosite-matcher": "spliceway matches geosite lists its own way (in C)",
    "tcp-concurrent": "spliceway dials the first address the resolver gives",
    "global-client-fingerprint": "no TLS outbound here uses a uTLS fingerprint",
    "global-ua": "spliceway fetches providers with its own User-Agent",
    "etag-support": "spliceway's provider fetches send no If-None-Match",
    "keep-alive-idle": "spliceway uses the system's TCP keep-alive settings",
    "keep-alive-interval": "spliceway uses the system's TCP keep-alive settings",
    "disable-keep-alive": "spliceway uses the system's TCP keep-alive settings",
    "sub-rules": "spliceway has no sub-rule lists (SUB-RULE rules are skipped)",
    "hosts": "spliceway's resolver reads /etc/hosts (server `system`) but not this map",
    "ntp": "spliceway keeps no clock of its own",
    "iptables": "spliceway installs no iptables rules (see runtime.tun)",
    "experimental": "mihomo-only tuning",
    "tls": "spliceway's Clash API and inbounds have no TLS certificates",
    "clash-for-android": "an Android client setting",
}
#: Keys the passes read.
_HANDLED = frozenset(
    {
        "port",
        "socks-port",
        "mixed-port",
        "allow-lan",
        "bind-address",
        "authentication",
        "skip-auth-prefixes",
        "listeners",
        "mode",
        "log-level",
        "external-controller",
        "external-controller-cors",
        "external-ui",
        "secret",
        "proxies",
        "proxy-groups",
        "proxy-providers",
        "rule-providers",
        "rules",
        "dns",
        "tun",
        "sniffer",
        "profile",
        "geox-url",
        "geodata-mode",
        "find-process-mode",
    }
)
_LEGACY = {"Proxy": "proxies", "Proxy Group": "proxy-groups", "Rule": "rules"}
#: Keys that make a document more than a list of proxies (a subscription's body).
_MORE_THAN_PROXIES = (_HANDLED | set(_NOT_CARRIED)) - {"proxies"}
_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}
_PROCESS_MODES = {"off": "off", "strict": "auto", "always": "always"}
_MMDB_NAMES = ("Country.mmdb", "geoip.db", "geoip.metadb")


class ClashImportError(ValueError):
    """Nothing usable came out of the source: the message says why."""


@dataclass(slots=True)
class ImportResult:
    """A validated spliceway ``config`` (a JSON document), the ``files`` to write beside
    it (absolute path -> text) and the ``report``; ``source`` says what was read."""

    config: dict[str, Any]
    report: Report
    files: dict[str, str] = field(default_factory=dict)
    source: Literal["clash", "links"] = "clash"


def _walk_rules(rules: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for rule in rules:
        yield rule
        parts = rule.get("rules")
        if isinstance(parts, list):
            yield from _walk_rules(parts)


# ---------------------------------------------------------------------------
# Rules
# ---------------------------------------------------------------------------


def _target_tag(target: str, path: str, line: str, state: ImportState) -> str | None:
    """The tag a rule's target becomes (None: the rule is dropped, reported)."""
    info = state.names.get(target)
    if info is None and target == "GLOBAL":
        return ensure_global(state)
    if info is None:
        state.report.add(
            "skipped", path, "", line, f"proxy [{target}] not found (mihomo refuses the file)"
        )
        return None
    if info.kind == "skipped":
        state.report.add(
            "changed",
            path,
            "",
            f"{line} → block outbound {BLOCK_TAG!r}",
            f"its target proxy {target!r} was skipped ({info.why}): matching traffic is "
            "refused, not sent elsewhere",
        )
        return state.names.block()
    if info.kind == "builtin":
        return state.names.block() if info.tag == BLOCK_TAG else info.tag
    return info.tag


def _rule_target(
    parsed: ParsedRule | Unsupported, path: str, line: str, state: ImportState
) -> str | None:
    """The outbound tag of a parsed ``rules:`` line; None when it is not carried
    (reported)."""
    if not isinstance(parsed, ParsedRule):
        state.report.add("skipped", path, "", line, f"{parsed.type}: {parsed.reason}")
        return None
    target = parsed.target or ""
    if target == "PASS":
        state.report.add("converted", path, "", line, "PASS lets matching go on: no rule")
        return None
    tag = _target_tag(target, path, line, state)
    if tag is None:
        return None
    missing = [n for n in parsed.rule.get("rule_set", ()) if n not in state.rule_providers]
    if missing:
        state.report.add(
            "skipped",
            path,
            "",
            line,
            f"rule set {missing[0]!r} was not carried (mihomo refuses an unknown one)",
        )
        return None
    for note in parsed.notes:
        state.report.add("changed", path, "", line, note)
    return tag


def _context(index: InboundIndex) -> InboundContext:
    return InboundContext(
        by_port=index.by_port, by_type=index.by_type, by_name=index.by_name, users=index.users
    )


def _convert_rules(
    raw: Any, state: ImportState, index: InboundIndex, routes: list[ListenerRoute]
) -> tuple[list[dict[str, Any]], str]:
    """The rules and ``route.final``."""
    rules: list[dict[str, Any]] = []
    for route in routes:
        tag = _target_tag(route.target, route.path, f"listener proxy {route.target}", state)
        if tag is not None:
            rules.append({"inbound_tag": [route.tag], "outbound": tag})
            state.report.add(
                "converted", route.path, route.tag, f"rule: inbound {route.tag!r} → {tag!r}"
            )
    final = "direct"
    if raw is None:
        return rules, final
    if not isinstance(raw, list):
        state.report.add("skipped", "rules", "", "rules", "must be a list of strings")
        return rules, final
    context = _context(index)
    carried = 0
    matched: str | None = None
    in_type_seen = False
    for i, line in enumerate(raw):
        path = f"rules[{i}]"
        if not isinstance(line, str):
            state.report.add("skipped", path, "", repr(line), "a rule is a string")
            continue
        if matched is not None:
            state.report.add(
                "skipped", path, "", line, f"after {matched}: never reached (in mihomo either)"
            )
            continue
        parsed = parse_rule_line(line, context=context)
        tag = _rule_target(parsed, path, line, state)
        if tag is None or not isinstance(parsed, ParsedRule):
            continue
        if parsed.type == "IN-TYPE":
            in_type_seen = True
        if parsed.type == "MATCH":
            final = tag
            matched = line
            state.report.add("converted", path, "", line, f"route.final {tag!r}")
            continue
        rules.append({**parsed.rule, "outbound": tag})
        carried += 1
    if in_type_seen and index.has_mixed:
        state.report.add(
            "changed",
            "rules",
            "",
            "IN-TYPE on a mixed inbound",
            "spliceway matches a mixed inbound by tag, whether the client spoke HTTP or SOCKS",
        )
    if carried:
        state.report.add("converted", "rules", "", f"{carried} rules")
    return rules, final


# ---------------------------------------------------------------------------
# General settings, the Clash API, DNS, TUN, geodata
# ---------------------------------------------------------------------------


def _mode(doc: Mapping[str, Any], state: ImportState) -> dict[str, Any]:
    raw = doc.get("mode")
    if raw is None:
        return {"kind": "rule"}
    kind = str(raw).lower()
    if kind not in ("rule", "global", "direct"):
        state.report.add(
            "changed", "mode", str(raw), "mode rule", "unknown mode (mihomo refuses it)"
        )
        return {"kind": "rule"}
    state.report.add("converted", "mode", str(raw), f"mode {kind}")
    if kind == "global":
        return {"kind": "global", "outbound": ensure_global(state)}
    return {"kind": kind}


def _runtime_general(doc: Mapping[str, Any], state: ImportState, runtime: dict[str, Any]) -> None:
    level = doc.get("log-level")
    if level is not None:
        text = str(level).lower()
        if text in _LOG_LEVELS:
            runtime["log_level"] = _LOG_LEVELS[text]
            state.report.add("converted", "log-level", str(level), f"log_level {_LOG_LEVELS[text]}")
        elif text == "silent":
            runtime["log_level"] = "error"
            state.report.add(
                "changed", "log-level", "silent", "log_level error", "spliceway always logs errors"
            )
        else:
            state.report.add("skipped", "log-level", str(level), "log level", "unknown level")
    process = doc.get("find-process-mode")
    if process is not None:
        mode = _PROCESS_MODES.get(str(process).lower())
        if mode is None:
            state.report.add(
                "skipped", "find-process-mode", str(process), "process lookup", "unknown mode"
            )
        else:
            runtime["process_lookup"] = mode
            state.report.add(
                "converted", "find-process-mode", str(process), f"process_lookup {mode}"
            )


def _controller(doc: Mapping[str, Any], state: ImportState) -> dict[str, Any] | None:
    raw = doc.get("external-controller")
    if raw is None or raw == "":
        if doc.get("secret"):
            state.report.add("skipped", "secret", "", "secret", "no external-controller to guard")
        return None
    text = str(raw)
    host, sep, port_text = text.rpartition(":")
    if not sep:
        state.report.add("skipped", "external-controller", text, "Clash API", "not host:port")
        return None
    host = host.strip("[]")
    try:
        port = weak_int(port_text, "external-controller")
        if not 0 <= port <= 65535:
            raise WeakTypeError(f"port {port} is not 0..65535")
    except WeakTypeError as ex:
        state.report.add("skipped", "external-controller", text, "Clash API", str(ex))
        return None
    clash: dict[str, Any] = {"enabled": True}
    secret = doc.get("secret")
    has_secret = secret not in (None, "")
    if host in ("", "0.0.0.0", "::", "*"):
        if has_secret:
            address = "0.0.0.0"
        else:
            address = "127.0.0.1"
            state.report.add(
                "changed",
                "external-controller",
                text,
                "Clash API on 127.0.0.1 only",
                "it has no secret: spliceway serves a keyless Clash API on loopback only",
            )
    else:
        try:
            address = str(ipaddress.ip_address(host))
        except ValueError:
            address = "127.0.0.1" if host == "localhost" else ""
        if not address:
            state.report.add(
                "skipped", "external-controller", text, "Clash API", f"{host!r} is not an IP"
            )
            return None
    clash["listen"] = {"address": address, "port": port}
    state.report.add("converted", "external-controller", text, f"api.clash on {address}:{port}")
    if has_secret:
        clash["secret_env"] = SECRET_ENV
        state.report.add(
            "changed",
            "secret",
            "",
            f"api.clash.secret_env {SECRET_ENV}",
            "the secret is not written to the output",
        )
        state.report.note(
            f"export {SECRET_ENV} with the value of `secret` from the Clash file before "
            "starting: the Clash API refuses to start without it"
        )
    ui = doc.get("external-ui")
    if ui:
        directory = state.resolve(str(ui))
        if not state.inside_home(directory):
            state.report.add(
                "skipped",
                "external-ui",
                str(ui),
                "dashboard directory",
                f"{directory} is outside mihomo's home (mihomo refuses it too unless "
                "SAFE_PATHS lists it): set api.clash.external_ui yourself",
            )
        elif os.path.isdir(directory):
            clash["external_ui"] = directory
            state.report.add(
                "converted", "external-ui", str(ui), f"api.clash.external_ui {directory}"
            )
        else:
            state.report.add(
                "skipped",
                "external-ui",
                str(ui),
                "dashboard directory",
                f"{directory} is not a directory (mihomo would download a dashboard there; "
                "spliceway serves only one that exists)",
            )
    cors = doc.get("external-controller-cors")
    origins = cors.get("allow-origins") if isinstance(cors, Mapping) else None
    if isinstance(origins, list) and all(isinstance(o, str) and o for o in origins):
        clash["cors_allow_origins"] = list(origins)
        state.report.add(
            "converted", "external-controller-cors", "", "api.clash.cors_allow_origins"
        )
    else:
        state.report.add(
            "changed",
            "external-controller-cors",
            "",
            "no cross-origin callers",
            "mihomo lets every origin call its controller by default; list origins in "
            "api.clash.cors_allow_origins for a dashboard served elsewhere",
        )
    return clash


def _dns_server(text: str) -> tuple[str | None, str]:
    """A mihomo nameserver as a ``runtime.dns.servers`` item, or None and why not."""
    server = text.strip()
    if server == "system" or server == "system://" or server == "dhcp://system":
        return "system", ""
    if "://" not in server:
        server = "udp://" + (f"[{server}]" if server.count(":") > 1 else server)
    scheme, _, rest = server.partition("://")
    scheme = scheme.lower()
    rest, _, fragment = rest.partition("#")
    if scheme not in ("udp", "tcp"):
        names = {
            "tls": "DNS over TLS",
            "https": "DNS over HTTPS",
            "http": "DNS over HTTP",
            "quic": "DNS over QUIC",
            "dhcp": "DHCP-given DNS",
            "rcode": "a fixed answer",
        }
        what = names.get(scheme, f"scheme {scheme}://")
        return None, f"{what} is not supported by spliceway's resolver (udp:// and tcp:// only)"
    host = rest.split("/")[0]
    bare = host
    if host.startswith("["):
        bare = host[1 : host.find("]")]
    elif host.count(":") == 1:
        bare = host.partition(":")[0]
    try:
        ipaddress.ip_address(bare)
    except ValueError:
        return None, f"{bare!r} is a name: spliceway's servers are IP addresses"
    out = f"{scheme}://{host}"
    if fragment:
        return out, f"the #{fragment} (which outbound the queries go through) is not carried"
    return out, ""


def _servers(raw: Mapping[Any, Any], key: str, state: ImportState) -> list[str]:
    """The carried servers of ``dns.<key>`` (each reported)."""
    items = raw.get(key) or []
    if not isinstance(items, list):
        state.report.add("skipped", f"dns.{key}", "", "name servers", "must be a list")
        return []
    servers: list[str] = []
    for i, item in enumerate(items):
        path = f"dns.{key}[{i}]"
        server, why = _dns_server(str(item))
        if server is None:
            state.report.add("skipped", path, str(item), "name server", why)
            continue
        if why:
            state.report.add("changed", path, str(item), f"server {server}", why)
        else:
            state.report.add("converted", path, str(item), f"server {server}")
        if server not in servers:
            servers.append(server)
    return servers


def _fake_ip(raw: Mapping[Any, Any], state: ImportState) -> dict[str, Any] | None:
    """``enhanced-mode: fake-ip`` as a fake-ip answer (None: real answers)."""
    mode = str(raw.get("enhanced-mode", "redir-host")).lower()
    if mode in ("redir-host", "normal"):
        return None
    if mode != "fake-ip":
        state.report.add("skipped", "dns.enhanced-mode", mode, "DNS mode", "unknown mode")
        return None
    answer: dict[str, Any] = {"type": "fake_ip", "fake_ip_range": "198.18.0.0/16"}
    rng = raw.get("fake-ip-range")
    if rng is not None:
        try:
            answer["fake_ip_range"] = str(ipaddress.ip_network(str(rng), strict=False))
        except ValueError:
            state.report.add(
                "skipped", "dns.fake-ip-range", str(rng), "fake-ip range", "not a CIDR"
            )
    state.report.add(
        "converted",
        "dns.enhanced-mode",
        "fake-ip",
        f"fake_ip answers from {answer['fake_ip_range']}",
    )
    names = raw.get("fake-ip-filter")
    if names:
        count = len(names) if isinstance(names, list) else 1
        state.report.add(
            "skipped",
            "dns.fake-ip-filter",
            "",
            f"{count} names mihomo answers with real addresses",
            "spliceway answers every name with a fake address in fake-ip mode",
        )
    return answer


def _dns_listen(listen: Any, state: ImportState) -> dict[str, Any] | None:
    """``dns.listen`` (``host:port``; no host: every address) as ``runtime.dns.listen``."""
    if not listen:
        return None
    host, _, port_text = str(listen).rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = weak_int(port_text, "listen")
        address = str(ipaddress.ip_address(host))
        if not 1 <= port <= 65535:
            raise ValueError(f"port {port} is not 1..65535")
    except (ValueError, WeakTypeError) as ex:
        state.report.add("skipped", "dns.listen", str(listen), "DNS server", str(ex))
        return None
    state.report.add("converted", "dns.listen", str(listen), f"DNS server on {address}:{port}")
    return {"address": address, "port": port}


def _all_servers(raw: Mapping[Any, Any], state: ImportState) -> list[str]:
    """``nameserver`` (else ``default-nameserver``, else ``system``) as ``servers``."""
    servers = _servers(raw, "nameserver", state)
    if servers:
        for i, item in enumerate(raw.get("default-nameserver") or []):
            state.report.add(
                "skipped",
                f"dns.default-nameserver[{i}]",
                str(item),
                "name server",
                "in mihomo it only resolves the names of the other servers",
            )
    else:
        servers = _servers(raw, "default-nameserver", state)
        if servers:
            state.report.add(
                "changed",
                "dns.default-nameserver",
                "",
                f"servers {servers}",
                "no `nameserver` could be carried: the default nameservers answer instead",
            )
    if not servers:
        servers = ["system"]
        state.report.add(
            "changed",
            "dns.nameserver",
            "",
            "runtime.dns servers [system]",
            "no name server could be carried",
        )
    elif len(servers) > 1:
        state.report.add(
            "changed",
            "dns.nameserver",
            "",
            "servers asked in order",
            "mihomo asks its nameservers at once and takes the first answer",
        )
    return servers


def _dns(doc: Mapping[str, Any], state: ImportState, runtime: dict[str, Any]) -> None:
    """``dns`` as ``runtime.dns``: servers, fake-ip answers, the DNS server."""
    raw = doc.get("dns")
    if raw is None:
        return
    if not isinstance(raw, Mapping):
        state.report.add("skipped", "dns", "", "dns", "must be a mapping")
        return
    try:
        enabled = weak_bool(raw.get("enable", False), "enable")
    except WeakTypeError as ex:
        state.report.add("skipped", "dns.enable", "", "dns", str(ex))
        return
    if not enabled:
        state.report.add(
            "converted",
            "dns",
            "",
            "runtime.dns servers [system]",
            "DNS is off in the file: the system resolver",
        )
        for key in raw:
            if key != "enable":
                state.report.add("skipped", f"dns.{key}", "", str(key), "dns is not enabled")
        return
    dns: dict[str, Any] = {"servers": _all_servers(raw, state)}
    answer = _fake_ip(raw, state)
    if answer is not None:
        dns["answer"] = answer
    listen = _dns_listen(raw.get("listen"), state)
    if listen is not None:
        dns["listen"] = listen
    handled = {
        "enable",
        "nameserver",
        "default-nameserver",
        "enhanced-mode",
        "fake-ip-range",
        "fake-ip-filter",
        "listen",
    }
    for key in raw:
        if key not in handled:
            state.report.add(
                "skipped",
                f"dns.{key}",
                "",
                str(key),
                "spliceway's resolver asks runtime.dns.servers in order, with a cache, and "
                "nothing more",
            )
    runtime["dns"] = dns


def _tun(
    doc: Mapping[str, Any], state: ImportState, runtime: dict[str, Any], fake_range: str | None
) -> None:
    raw = doc.get("tun")
    if raw is None:
        return
    if not isinstance(raw, Mapping):
        state.report.add("skipped", "tun", "", "tun", "must be a mapping")
        return
    try:
        if not weak_bool(raw.get("enable", False), "enable"):
            state.report.add(
                "converted", "tun", "", "no TUN inbound", "tun is not enabled in the file"
            )
            return
        base = ipaddress.ip_network(fake_range or "198.18.0.1/16", strict=False)
        addr = str(next(iter(base.hosts())))
        tun: dict[str, Any] = {"addr": addr, "mask": "255.255.255.252", "tag": "DEFAULT-TUN"}
        device = raw.get("device")
        if device:
            tun["name"] = weak_str(device, "device")
        mtu = raw.get("mtu")
        if mtu:
            tun["mtu"] = weak_int(mtu, "mtu")
        tun["auto_route"] = weak_bool(raw.get("auto-route", True), "auto-route")
        tun["strict_route"] = weak_bool(raw.get("strict-route", False), "strict-route")
        hijack = raw.get("dns-hijack", ["0.0.0.0:53"])
        tun["dns_hijack"] = bool(hijack)
        if hijack and hijack not in (["0.0.0.0:53"], ["any:53"]):
            state.report.add(
                "changed",
                "tun.dns-hijack",
                "",
                "dns_hijack true",
                "spliceway hijacks every DNS query through the device",
            )
        ipv6 = doc.get("ipv6", True)
        tun["dual_stack"] = bool(ipv6) if isinstance(ipv6, bool) else True
        includes = [
            str(c)
            for k in ("route-address", "inet4-route-address", "inet6-route-address")
            for c in raw.get(k) or []
        ]
        excludes = [
            str(c)
            for k in (
                "route-exclude-address",
                "inet4-route-exclude-address",
                "inet6-route-exclude-address",
            )
            for c in raw.get(k) or []
        ]
        if includes:
            tun["include_cidrs"] = includes
        if excludes:
            tun["exclude_cidrs"] = excludes
    except (WeakTypeError, ValueError) as ex:
        state.report.add("skipped", "tun", "", "TUN inbound", str(ex))
        return
    runtime["tun"] = tun
    state.report.add("converted", "tun", "", f"runtime.tun {addr} tag 'DEFAULT-TUN'")
    handled = {
        "enable",
        "device",
        "mtu",
        "auto-route",
        "strict-route",
        "dns-hijack",
        "route-address",
        "inet4-route-address",
        "inet6-route-address",
        "route-exclude-address",
        "inet4-route-exclude-address",
        "inet6-route-exclude-address",
    }
    for key in raw:
        if key not in handled:
            why = {
                "stack": "spliceway's TUN has its own stack (gVisor/system/mixed do not apply)",
                "auto-detect-interface": "spliceway follows the default route's interface itself",
                "auto-redirect": "set runtime.tun.auto_redirect where the build has it",
            }.get(str(key), "not carried by spliceway's TUN")
            state.report.add("skipped", f"tun.{key}", "", str(key), why)


def _find_home_file(home: str, names: tuple[str, ...], default: str) -> str:
    try:
        present = {n.lower(): n for n in os.listdir(home)}
    except OSError:
        present = {}
    for name in names:
        if name.lower() in present:
            return os.path.join(home, present[name.lower()])
    return os.path.join(home, default)


def _report_geox(
    urls: Mapping[Any, Any], need_ip: bool, need_site: bool, state: ImportState
) -> None:
    """What becomes of each ``geox-url`` entry."""
    for key, url in urls.items():
        path = f"geox-url.{key}"
        if key == "mmdb" and need_ip:
            state.report.add("converted", path, str(url), "runtime.geodata.geoip_url")
        elif key == "geosite" and need_site:
            state.report.add("converted", path, str(url), "runtime.geodata.geosite_url")
        elif key in ("mmdb", "geosite"):
            state.report.add("skipped", path, str(url), "download URL", "no rule reads it")
        elif key == "geoip":
            why = "spliceway reads a MaxMind .mmdb for GEOIP, not GeoIP.dat"
            state.report.add("skipped", path, str(url), "download URL", why)
        elif key == "asn":
            why = "spliceway downloads no ASN database: put it at runtime.geodata.asn_path"
            state.report.add("skipped", path, str(url), "download URL", why)
        else:
            state.report.add("skipped", path, str(url), "download URL", "unknown key")


def _geodata(
    doc: Mapping[str, Any], state: ImportState, rules: list[dict[str, Any]], runtime: dict[str, Any]
) -> None:
    keys = {k for rule in _walk_rules(rules) for k in rule}
    for spec in state.rule_providers.values():
        if spec.get("behavior") == "classical":
            # A classical set may hold GEOIP/GEOSITE lines.
            keys |= {"geoip", "geosite"}
    need_ip = bool(keys & {"geoip", "source_geoip"})
    need_asn = bool(keys & {"ip_asn", "source_ip_asn"})
    need_site = "geosite" in keys
    raw_urls = doc.get("geox-url")
    urls: Mapping[Any, Any] = raw_urls if isinstance(raw_urls, Mapping) else {}
    _report_geox(urls, need_ip, need_site, state)
    if not (need_ip or need_asn or need_site):
        return
    geo: dict[str, Any] = {}
    if need_ip:
        if doc.get("geodata-mode") is True:
            state.report.add(
                "changed",
                "geodata-mode",
                "",
                "GEOIP reads a MaxMind .mmdb",
                "spliceway reads no GeoIP.dat: give runtime.geodata.geoip_path a .mmdb",
            )
        geo["geoip_path"] = _find_home_file(state.home, _MMDB_NAMES, "geoip.metadb")
    if need_asn:
        geo["asn_path"] = _find_home_file(state.home, ("ASN.mmdb",), "ASN.mmdb")
    if need_site:
        geo["geosite_path"] = _find_home_file(state.home, ("GeoSite.dat",), "GeoSite.dat")
    if need_ip and urls.get("mmdb"):
        geo["geoip_url"] = str(urls["mmdb"])
    if need_site and urls.get("geosite"):
        geo["geosite_url"] = str(urls["geosite"])
    runtime["geodata"] = geo
    for key in ("geoip_path", "asn_path", "geosite_path"):
        if key in geo:
            state.report.add("converted", "geodata", "", f"runtime.geodata.{key} {geo[key]}")
    state.report.note(
        "GEOIP/IP-ASN/GEOSITE rules read the databases in runtime.geodata: they must exist "
        "when the engine starts; spliceway downloads nothing unless geoip_url/geosite_url "
        "are set (then `providers.update` fetches them)"
    )


def _sniff(doc: Mapping[str, Any], state: ImportState, inbounds: list[dict[str, Any]]) -> None:
    sniffer = doc.get("sniffer")
    enabled = isinstance(sniffer, Mapping) and sniffer.get("enable") is True
    for inbound in inbounds:
        inbound["sniff"] = enabled
    if enabled:
        state.report.add(
            "changed",
            "sniffer",
            "",
            "inbounds sniff TLS SNI and HTTP Host",
            "spliceway sniffs every TCP connection of its inbounds; sniffer's protocol, "
            "port and skip lists are not carried",
        )
    elif inbounds:
        state.report.add(
            "converted",
            "sniffer",
            "",
            "inbounds do not sniff",
            "mihomo's sniffer is off: domain rules see only the name the client asked for",
        )


def _profile(doc: Mapping[str, Any], state: ImportState) -> None:
    profile = doc.get("profile")
    if not isinstance(profile, Mapping):
        return
    for key, why in (
        ("store-selected", "a selection lasts until the engine stops"),
        ("store-fake-ip", "set runtime.dns.answer.persist_path to keep fake addresses"),
    ):
        if profile.get(key):
            state.report.add("skipped", f"profile.{key}", "", key, why)


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def _top_level(doc: Mapping[Any, Any], state: ImportState) -> None:
    for key in doc:
        if key in _HANDLED:
            continue
        text = str(key)
        if text in _NOT_CARRIED:
            state.report.add("skipped", text, "", text, _NOT_CARRIED[text])
        elif text in _LEGACY:
            state.report.add(
                "skipped",
                text,
                "",
                text,
                f"a legacy Clash key mihomo ignores: rename it `{_LEGACY[text]}`",
            )
        else:
            state.report.add("skipped", text, "", text, "unknown key (mihomo ignores it)")


def _validated(config: dict[str, Any]) -> dict[str, Any]:
    details = validate_document(config)
    if details:
        problems = "; ".join(
            f"{d.field_path}: {d.message}" if d.field_path else d.message for d in details[:10]
        )
        raise ClashImportError(f"the converted configuration does not validate: {problems}")
    return config


def import_document(doc: Any, *, home: str, files_dir: str) -> ImportResult:
    """A decoded mihomo configuration as a spliceway one (see the module). ``home`` is
    mihomo's home directory (relative paths resolve against it); ``files_dir`` where
    inline providers' content is to be written."""
    if not isinstance(doc, Mapping):
        raise ClashImportError("not a Clash configuration: the document is not a mapping")
    known = _HANDLED | set(_NOT_CARRIED) | set(_LEGACY)
    if not any(isinstance(k, str) and k in known for k in doc):
        raise ClashImportError("not a Clash configuration: it has none of mihomo's keys")
    if {"inbounds", "outbounds", "outbound_groups"} & set(doc):
        raise ClashImportError(
            "this is a spliceway configuration (it has inbounds/outbounds), not a Clash one"
        )
    if isinstance(doc.get("proxies"), list) and not (set(doc) & _MORE_THAN_PROXIES):
        # A subscription of proxies alone (a provider's body): usable as a selector.
        report = Report()
        for key in doc:
            if key != "proxies":
                report.add("skipped", str(key), "", str(key), "unknown key (mihomo ignores it)")
        return _proxy_list(doc["proxies"], report, "proxy", "Proxy", "clash")
    state = ImportState(home=os.path.abspath(home), files_dir=os.path.abspath(files_dir))
    _top_level(doc, state)
    inbounds, index, routes = convert_inbounds(doc, state)
    carried = convert_proxies(doc.get("proxies"), state)
    convert_proxy_providers(doc.get("proxy-providers"), state)
    groups_raw = doc.get("proxy-groups")
    group_names = (
        {g.get("name") for g in groups_raw if isinstance(g, Mapping)}
        if isinstance(groups_raw, list)
        else set()
    )
    build_dialer_chains(carried, {n for n in group_names if isinstance(n, str)}, state)
    convert_groups(groups_raw, state, set(state.proxy_providers))
    convert_rule_providers(doc.get("rule-providers"), state)
    mode = _mode(doc, state)
    rules, final = _convert_rules(doc.get("rules"), state, index, routes)
    finish_providers(state)
    runtime: dict[str, Any] = {}
    _runtime_general(doc, state, runtime)
    _dns(doc, state, runtime)
    fake = runtime.get("dns", {}).get("answer", {}).get("fake_ip_range")
    _tun(doc, state, runtime, fake)
    _geodata(doc, state, rules, runtime)
    _sniff(doc, state, inbounds)
    _profile(doc, state)
    api: dict[str, Any] = {"control": {"enabled": False}}
    clash = _controller(doc, state)
    if clash is not None:
        api["clash"] = clash
    state.report.note(
        "spliceway's own HTTP control API is off in this configuration (enable api.control "
        "to use it); the spliceway CLI still reaches the engine over its IPC socket"
    )
    if not inbounds:
        state.report.note("no inbound was carried: the engine accepts no connections")
    outbounds = list(state.outbounds)
    if state.names.block_used:
        outbounds.append({"tag": BLOCK_TAG, "protocol": "block"})
    config: dict[str, Any] = {
        "mode": mode,
        "inbounds": inbounds,
        "outbounds": outbounds,
        "outbound_groups": state.groups,
        "rules": rules,
        "route": {"final": final},
        "runtime": runtime,
        "api": api,
    }
    if state.proxy_providers or state.rule_providers:
        config["providers"] = {"proxies": state.proxy_providers, "rules": state.rule_providers}
    return ImportResult(_validated(config), state.report, dict(state.files), "clash")


def import_links(data: str | bytes, *, selector: str = "Proxy") -> ImportResult:
    """A share-link list as a configuration: its outbounds, a selector over them (the
    route's final), a ``mixed`` inbound on 127.0.0.1:7890."""
    links = parse_links(data)
    report = Report()
    for skipped in links.skipped:
        report.add("skipped", f"line {skipped.line}", skipped.scheme, "share link", skipped.reason)
    if not links.proxies:
        raise ClashImportError("nothing usable: no share link was found")
    return _proxy_list(links.proxies, report, "share link", selector, "links")


def _proxy_list(
    proxies: list[Any],
    report: Report,
    label: str,
    selector: str,
    source: Literal["clash", "links"],
) -> ImportResult:
    """Clash proxy mappings alone (a subscription) as a configuration (see
    :func:`import_links`)."""
    outbounds: list[dict[str, Any]] = []
    taken = {"direct", selector}
    for i, proxy in enumerate(proxies):
        result = convert_proxy(proxy)
        path = f"link {i + 1}" if source == "links" else f"proxies[{i}]"
        if not isinstance(result, Converted):
            report.add("skipped", path, result.name, f"{result.type} {label}", result.reason)
            continue
        tag = result.name
        n = 1
        while tag in taken:
            n += 1
            tag = f"{result.name} ({n})"
        taken.add(tag)
        outbound = {**result.outbound, "tag": tag}
        outbounds.append(outbound)
        report.add(
            "converted",
            path,
            result.name,
            f"{result.type} {label} → {outbound['protocol']} outbound {tag!r}",
        )
        for change in result.changes:
            report.add("changed", f"{path}.{change.key}", result.name, change.key, change.why)
    if not outbounds:
        raise ClashImportError(f"nothing usable: no {label} could be carried")
    config: dict[str, Any] = {
        "inbounds": [
            {
                "tag": "mixed-in",
                "protocol": "mixed",
                "listen": {"address": "127.0.0.1", "port": 7890},
            }
        ],
        "outbounds": outbounds,
        "outbound_groups": [
            {"tag": selector, "kind": "selector", "outbounds": [o["tag"] for o in outbounds]}
        ],
        "route": {"final": selector},
        "api": {"control": {"enabled": False}},
    }
    what = "a share-link list" if source == "links" else "a list of proxies alone"
    report.note(
        f"{what}: selector {selector!r} over its {len(outbounds)} outbounds, a mixed "
        "inbound on 127.0.0.1:7890, everything routed to the selector"
    )
    return ImportResult(_validated(config), report, {}, source)


def import_text(data: str | bytes, *, home: str, files_dir: str) -> ImportResult:
    """A source's content: a mihomo configuration (YAML), else a share-link list."""
    try:
        doc = load(data)
    except YamlError as ex:
        try:
            return import_links(data)
        except ClashImportError:
            raise ClashImportError(f"not valid YAML ({ex}) and not a share-link list") from None
    if isinstance(doc, Mapping):
        return import_document(doc, home=home, files_dir=files_dir)
    try:
        return import_links(data)
    except ClashImportError as ex:
        raise ClashImportError(
            f"not a Clash configuration (the document is a {type(doc).__name__}) and {ex}"
        ) from None
