"""Cross-checks over the raw document (defensive: the schema reports type problems).

They need the whole document (tag uniqueness, references, group cycles, relay hops,
listener clashes) and read it as decoded JSON, so a dangling reference is reported even
when an unrelated part fails the schema.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import Any

from spliceway.config.validators import BUILTIN_DIRECT, CONDITION_KEYS, GEOIP_BUILTIN_CODES
from spliceway.errors import Detail


def _items(container: Any, key: str) -> list[tuple[int, Mapping[str, Any]]]:
    value = container.get(key) if isinstance(container, Mapping) else None
    if not isinstance(value, list | tuple):
        return []
    return [(i, item) for i, item in enumerate(value) if isinstance(item, Mapping)]


def _sub(container: Any, key: str) -> Mapping[str, Any]:
    value = container.get(key) if isinstance(container, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _port(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 65535:
        return value
    return None


def _string_items(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(item, path) for a list-or-single-string condition value."""
    if isinstance(value, str):
        yield value, path
    elif isinstance(value, list | tuple):
        for j, item in enumerate(value):
            if isinstance(item, str):
                yield item, f"{path}[{j}]"


def _regexes(value: Any) -> list[re.Pattern[str]]:
    """The expressions of a regex list that compile (the schema reports the others)."""
    out = []
    for item, _ in _string_items(value, ""):
        try:
            out.append(re.compile(item))
        except re.error:
            continue
    return out


#: Outbound protocols a relay group can dial through.
RELAY_HOP_PROTOCOLS = frozenset({"socks5", "http", "shadowsocks"})


class _Checker:
    """Collects cross-check problems for one raw document."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.doc = doc
        self.details: list[Detail] = []
        self.inbound_tags: set[str] = set()
        self.targets: set[str] = {BUILTIN_DIRECT}
        self.group_index: dict[str, int] = {}
        self.protocols: dict[str, Any] = {}
        self.rule_sets: set[str] = set()
        self.geo_paths: dict[str, str | None] = {}

    def add(self, message: str, path: str) -> None:
        self.details.append(Detail(message, path))

    def run(self) -> list[Detail]:
        self.check_inbounds()
        self.check_target_tags()
        self.check_outbounds()
        self.check_groups()
        self.check_providers()
        self.check_rules()
        self.check_mode_and_route()
        self.check_runtime()
        self.check_api()
        self.check_listeners()
        return self.details

    def unique(
        self, first: dict[str, int], what: str, value: str, index: int, also: str, path: str
    ) -> None:
        """Report ``value`` when an earlier item (``also[first[value]]``) already used it."""
        if value in first:
            self.add(f"duplicate {what} {value!r} (also {also}[{first[value]}])", path)
        else:
            first[value] = index

    def ref(self, value: Any, path: str) -> None:
        tag = _str(value)
        if tag is not None and tag not in self.targets:
            self.add(f"unknown outbound or group {tag!r}", path)

    def check_inbounds(self) -> None:
        first: dict[str, int] = {}
        for i, ib in _items(self.doc, "inbounds"):
            tag = _str(ib.get("tag"))
            if tag is not None:
                self.unique(first, "inbound tag", tag, i, "inbounds", f"inbounds[{i}].tag")
            basic = ib.get("protocol") in ("http", "mixed")
            names: dict[str, int] = {}
            for j, user in _items(ib, "users"):
                name = _str(user.get("username"))
                if name is None:
                    continue
                path = f"inbounds[{i}].users[{j}].username"
                self.unique(names, "username", name, j, "users", path)
                if basic and ":" in name:
                    self.add("must not contain ':' on an http or mixed inbound", path)
        self.inbound_tags = set(first)

    def check_target_tags(self) -> None:
        first: dict[str, str] = {}
        for section in ("outbounds", "outbound_groups"):
            for i, item in _items(self.doc, section):
                tag = _str(item.get("tag"))
                if tag is None:
                    continue
                path = f"{section}[{i}].tag"
                if tag == BUILTIN_DIRECT and item.get("protocol") != "direct":
                    self.add(
                        "tag 'direct' is reserved for the built-in direct outbound "
                        "(allowed only on an outbound with protocol 'direct')",
                        path,
                    )
                elif tag in first:
                    self.add(
                        f"duplicate tag {tag!r} (also {first[tag]}); outbounds and "
                        "outbound_groups share one namespace",
                        path,
                    )
                else:
                    first[tag] = path.removesuffix(".tag")
                    if section == "outbound_groups":
                        self.group_index[tag] = i
                    else:
                        self.protocols[tag] = item.get("protocol")
        self.targets |= set(first)

    def check_outbounds(self) -> None:
        for i, ob in _items(self.doc, "outbounds"):
            if ob.get("protocol") not in ("socks5", "http"):
                continue
            has_user = ob.get("username") is not None
            has_pass = ob.get("password") is not None
            if has_user and not has_pass:
                self.add("required when username is set", f"outbounds[{i}].password")
            elif has_pass and not has_user:
                self.add("required when password is set", f"outbounds[{i}].username")

    def check_groups(self) -> None:
        edges: dict[str, list[tuple[str, str]]] = {}
        for i, g in _items(self.doc, "outbound_groups"):
            members = g.get("outbounds", ())
            if not isinstance(members, list | tuple):
                continue  # the schema reports it
            has_providers = self.check_group_providers(g, i)
            if not members and not has_providers:
                self.add(
                    "a group needs members: `outbounds`, or `providers` whose outbounds "
                    "become its members",
                    f"outbound_groups[{i}].outbounds",
                )
            seen: set[str] = set()
            for member, path in _string_items(members, f"outbound_groups[{i}].outbounds"):
                if member in seen:
                    self.add(f"member {member!r} is listed twice", path)
                seen.add(member)
                self.ref(member, path)
            if g.get("kind") == "relay":
                self.check_relay_hops(members, f"outbound_groups[{i}].outbounds")
            if not has_providers:
                self.check_group_exclusions(g, i, seen)
            default = _str(g.get("default"))
            # With providers the default may name a provider's outbound: known only once
            # the provider's content is read (a default that is not there selects the
            # first member).
            if (
                g.get("kind") == "selector"
                and default is not None
                and default not in seen
                and not has_providers
            ):
                self.add(
                    f"{default!r} is not one of this selector's outbounds",
                    f"outbound_groups[{i}].default",
                )
            tag = _str(g.get("tag"))
            if tag is not None and self.group_index.get(tag) == i:
                edges[tag] = [
                    (m, f"outbound_groups[{i}].outbounds[{j}]")
                    for j, m in enumerate(members)
                    if isinstance(m, str) and m in self.group_index
                ]
        self.check_cycles(edges)

    def check_group_exclusions(
        self, group: Mapping[str, Any], index: int, members: set[str]
    ) -> None:
        """A group without providers keeps a member (and its selector's default) through its
        ``exclude_filter``: what it drops is known from the document alone."""
        patterns = _regexes(group.get("exclude_filter"))
        if not patterns or not members:
            return
        dropped = {m for m in members if any(p.search(m) for p in patterns)}
        if dropped == members:
            self.add(
                "drops every member of this group, which has no `providers`",
                f"outbound_groups[{index}].exclude_filter",
            )
            return
        default = _str(group.get("default"))
        if group.get("kind") == "selector" and default in dropped:
            self.add(
                f"{default!r} is dropped by this group's `exclude_filter`",
                f"outbound_groups[{index}].default",
            )

    def check_group_providers(self, group: Mapping[str, Any], index: int) -> bool:
        """A group's ``providers`` name proxy providers, each once; True when it has any."""
        names = group.get("providers", ())
        if not isinstance(names, list | tuple):
            return False  # the schema reports it
        known = _sub(_sub(self.doc, "providers"), "proxies")
        seen: set[str] = set()
        for name, path in _string_items(names, f"outbound_groups[{index}].providers"):
            if name in seen:
                self.add(f"provider {name!r} is listed twice", path)
            elif name not in known:
                self.add(f"unknown proxy provider {name!r} (not in providers.proxies)", path)
            seen.add(name)
        return bool(names)

    def check_providers(self) -> None:
        """Every provider's ``via`` names an outbound or a group."""
        providers = _sub(self.doc, "providers")
        for kind in ("proxies", "rules"):
            for name, spec in _sub(providers, kind).items():
                if isinstance(spec, Mapping):
                    self.ref(spec.get("via"), f"providers.{kind}.{name}.via")

    def check_relay_hops(self, members: list[Any] | tuple[Any, ...], path: str) -> None:
        """Relay hops are proxy outbounds; a shadowsocks hop can only be the last."""
        last = len(members) - 1
        for j, tag in enumerate(members):
            if not isinstance(tag, str):
                continue
            if tag in self.group_index:
                self.add(
                    f"relay hop {tag!r} is a group; hops must be socks5, http or "
                    "shadowsocks outbounds",
                    f"{path}[{j}]",
                )
                continue
            protocol = self.protocols.get(tag, "direct" if tag == BUILTIN_DIRECT else None)
            if not isinstance(protocol, str):
                continue  # unknown tags are reported by ref(), a non-string protocol by the schema
            if protocol not in RELAY_HOP_PROTOCOLS:
                self.add(
                    f"relay hop {tag!r} has protocol {protocol!r}; hops must be socks5, http "
                    "or shadowsocks outbounds",
                    f"{path}[{j}]",
                )
            elif protocol == "shadowsocks" and j != last:
                self.add(
                    f"shadowsocks hop {tag!r} must be the last hop of a relay "
                    "(its stream is encrypted end to end)",
                    f"{path}[{j}]",
                )

    def check_cycles(self, edges: dict[str, list[tuple[str, str]]]) -> None:
        """Report each back edge of a depth-first walk as one cycle."""
        state: dict[str, int] = {}  # 1 = on the stack, 2 = done
        stack: list[str] = []

        def visit(node: str) -> None:
            state[node] = 1
            stack.append(node)
            for nxt, path in edges.get(node, ()):
                if state.get(nxt) == 1:
                    cycle = [*stack[stack.index(nxt) :], nxt]
                    self.add(f"group cycle: {' -> '.join(cycle)}", path)
                elif nxt not in state:
                    visit(nxt)
            stack.pop()
            state[node] = 2

        for tag in edges:
            if tag not in state:
                visit(tag)

    def check_rules(self) -> None:
        providers = _sub(_sub(self.doc, "providers"), "rules")
        geodata = _sub(_sub(self.doc, "runtime"), "geodata")
        self.rule_sets = set(providers)
        self.geo_paths = {
            "geoip": _str(geodata.get("geoip_path")),
            "asn": _str(geodata.get("asn_path")) or _str(geodata.get("geoip_path")),
            "geosite": _str(geodata.get("geosite_path")),
        }
        for i, rule in _items(self.doc, "rules"):
            base = f"rules[{i}]"
            self.check_rule_body(rule, base)
            action = rule.get("action", "route")
            outbound = rule.get("outbound")
            if action == "route":
                if outbound is None:
                    self.add("required when action is 'route'", f"{base}.outbound")
                else:
                    self.ref(outbound, f"{base}.outbound")
            elif action == "block" and outbound is not None:
                self.add("must not be set when action is 'block'", f"{base}.outbound")

    def check_rule_body(self, rule: Mapping[str, Any], base: str) -> None:
        """What a rule or a logical rule's part matches: its conditions' references, or
        its parts (recursively)."""
        if rule.get("type") == "logical":
            parts = _items(rule, "rules")
            if not parts:
                self.add("a logical rule needs at least one rule in `rules`", f"{base}.rules")
            for j, part in parts:
                path = f"{base}.rules[{j}]"
                for key in ("action", "outbound"):
                    if key in part:
                        self.add("not allowed in a logical rule's part", f"{path}.{key}")
                self.check_rule_body(part, path)
            return
        if not any(rule.get(k) is not None for k in CONDITION_KEYS):
            self.add("a rule needs at least one condition", base)
        for tag, path in _string_items(rule.get("inbound_tag"), f"{base}.inbound_tag"):
            if tag not in self.inbound_tags:
                self.add(f"unknown inbound {tag!r}", path)
        for name, path in _string_items(rule.get("rule_set"), f"{base}.rule_set"):
            if name not in self.rule_sets:
                self.add(f"unknown rule provider {name!r} (see providers.rules)", path)
        self.check_geodata(rule, base)

    def check_geodata(self, rule: Mapping[str, Any], base: str) -> None:
        """Geo conditions need their database configured (``private``/``lan`` do not)."""
        for key in ("geoip", "source_geoip"):
            for code, path in _string_items(rule.get(key), f"{base}.{key}"):
                if code.lower() not in GEOIP_BUILTIN_CODES and self.geo_paths["geoip"] is None:
                    self.add(f"needs runtime.geodata.geoip_path (a database for {code!r})", path)
                    break
        for key in ("ip_asn", "source_ip_asn"):
            if rule.get(key) is not None and self.geo_paths["asn"] is None:
                self.add(
                    "needs runtime.geodata.asn_path or geoip_path (an ASN database)",
                    f"{base}.{key}",
                )
        if rule.get("geosite") is not None and self.geo_paths["geosite"] is None:
            self.add("needs runtime.geodata.geosite_path (a geosite.dat)", f"{base}.geosite")

    def check_mode_and_route(self) -> None:
        mode = _sub(self.doc, "mode")
        if mode.get("kind") == "global" and mode.get("outbound") is None:
            self.add("required when mode.kind is 'global'", "mode.outbound")
        self.ref(mode.get("outbound"), "mode.outbound")
        self.ref(_sub(self.doc, "route").get("final", BUILTIN_DIRECT), "route.final")

    def check_runtime(self) -> None:
        cache = _sub(_sub(_sub(self.doc, "runtime"), "dns"), "cache")
        low, high = cache.get("min_ttl_seconds"), cache.get("max_ttl_seconds")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            self.add("must not exceed max_ttl_seconds", "runtime.dns.cache.min_ttl_seconds")

    def check_api(self) -> None:
        api = _sub(self.doc, "api")
        first: dict[str, int] = {}
        for i, sink in _items(api, "event_sinks"):
            tag = _str(sink.get("tag"))
            if tag is not None:
                path = f"api.event_sinks[{i}].tag"
                self.unique(first, "sink tag", tag, i, "api.event_sinks", path)
        names: dict[str, int] = {}
        for i, key in _items(_sub(api, "control"), "keys"):
            name = _str(key.get("name"))
            if name is not None:
                path = f"api.control.keys[{i}].name"
                self.unique(names, "key name", name, i, "api.control.keys", path)
        dispatcher = _sub(api, "dispatcher")
        low, high = dispatcher.get("backoff_initial_ms"), dispatcher.get("backoff_max_ms", 60000)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            self.add("must not exceed backoff_max_ms", "api.dispatcher.backoff_initial_ms")
        hook = _sub(api, "flow_hook")
        tags = hook.get("inbound_tags")
        if isinstance(tags, list | tuple):
            for j, tag in enumerate(tags):
                if isinstance(tag, str) and tag and tag not in self.inbound_tags:
                    self.add(f"unknown inbound {tag!r}", f"api.flow_hook.inbound_tags[{j}]")

    def check_listeners(self) -> None:
        used: dict[tuple[str, int], str] = {}

        def claim(listen: Mapping[str, Any], default_port: int | None, path: str) -> None:
            address = listen.get("address", "127.0.0.1")
            port = _port(listen.get("port", default_port))
            if not isinstance(address, str) or port is None:
                return
            key = (address, port)
            if key in used:
                self.add(f"{address}:{port} is already used by {used[key]}", f"{path}.port")
            else:
                used[key] = path

        control = _sub(_sub(self.doc, "api"), "control")
        if control.get("enabled", True) is True:
            claim(_sub(control, "listen"), 9090, "api.control.listen")
        for i, ib in _items(self.doc, "inbounds"):
            claim(_sub(ib, "listen"), None, f"inbounds[{i}].listen")
