"""Clash ``proxies`` and ``proxy-groups`` as spliceway outbounds and outbound groups.

Proxies go through :func:`spliceway.clash.proxies.convert_proxy`; a name used twice
(mihomo refuses the file) keeps its first proxy, the second is renamed and reported. A
proxy with ``dialer-proxy`` becomes a ``relay`` group under its own name over the
dialer's hops and the proxy itself (tagged ``<name> (last hop)``), when spliceway's
relay can chain them (``socks5``/``http`` hops, a ``shadowsocks`` one only last);
otherwise it connects directly and the report says so.

Groups: ``select`` is ``selector``, ``url-test`` ``url_test`` (``interval``,
``tolerance`` only when it is an integer, as mihomo reads it), ``fallback``,
``load-balance`` ``load_balance`` (``strategy``), ``relay``. Members are resolved as
mihomo resolves them: ``include-all``/``include-all-proxies`` (every proxy, sorted by
name, kept by ``filter``), ``include-all-providers`` (every provider), ``proxies``,
then ``exclude-type`` and ``exclude-filter`` on every member; ``filter`` applies to
provider members only (as in mihomo). ``use`` is the group's ``providers``, and a group
with providers carries its ``filter`` and ``exclude-filter`` as its own ``filter`` and
``exclude_filter`` (the engine applies them to the members each provider gives, as mihomo
does: one provider, fetched once, however many groups filter it). Built-ins:
``DIRECT`` is the built-in ``direct``, ``REJECT``/``REJECT-DROP``/``COMPATIBLE`` the
``block`` outbound ``REJECT``.

A member that was skipped or never defined is dropped and reported. A group that loses
every proxy and group it had (only built-ins or nothing left) is kept with the ``block``
outbound as its first member and reported: traffic routed to it is refused, never sent
direct because its proxies could not be carried. Group cycles (mihomo refuses them) are
broken at the member that closes the cycle, reported.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from spliceway.clash.proxies import Converted, Skipped, convert_proxy
from spliceway.clash.state import ADAPTER_TYPES, BLOCK_TAG, ImportState
from spliceway.clash.weak import (
    MISSING,
    WeakTypeError,
    lookup,
    unknown_keys,
    weak_bool,
    weak_int,
    weak_str,
    weak_str_list,
)
from spliceway.config.models_outbounds import SelectorGroup
from spliceway.support.probe_url import parse_probe_url

__all__ = [
    "build_dialer_chains",
    "convert_groups",
    "convert_proxies",
    "ensure_global",
    "python_regex",
    "split_filter",
]

_GROUP_KINDS = {
    "select": "selector",
    "url-test": "url_test",
    "fallback": "fallback",
    "load-balance": "load_balance",
    "relay": "relay",
}
_STRATEGIES = {
    "consistent-hashing": "consistent_hashing",
    "round-robin": "round_robin",
    "sticky-sessions": "sticky_sessions",
}
_GROUP_KEYS = (
    "name",
    "type",
    "proxies",
    "use",
    "url",
    "interval",
    "tolerance",
    "strategy",
    "filter",
    "exclude-filter",
    "exclude-type",
    "include-all",
    "include-all-proxies",
    "include-all-providers",
)
#: Group keys that are read but not carried, with why.
_GROUP_NOT_CARRIED = {
    "timeout": "spliceway's probes have a fixed 5 s budget",
    "max-failed-times": "spliceway re-probes a member at its first failed dial",
    "lazy": "spliceway probes groups on their interval whether used or not",
    "disable-udp": "spliceway sends UDP flows to the group's member like TCP ones",
    "expected-status": "spliceway's probes accept any HTTP answer",
    "hidden": "display only (dashboards)",
    "icon": "display only (dashboards)",
    "interface-name": "spliceway does not bind a group's connections to an interface",
    "routing-mark": "spliceway does not set a routing mark per group",
    "dialer-proxy": "mihomo ignores dialer-proxy on groups too",
    "default-selected": "spliceway's selector starts on its first member",
    "empty-fallback": "a group that lost its members refuses traffic here",
}
_RELAY_HOPS = frozenset({"socks5", "http"})
_RELAY_LAST = frozenset({"socks5", "http", "shadowsocks"})
#: Whether this build's groups list providers (``providers`` beside ``outbounds``).
GROUPS_TAKE_PROVIDERS = "providers" in SelectorGroup.model_fields


def split_filter(text: str) -> list[str]:
    """mihomo's filter list: several regular expressions joined with a backtick."""
    return [part for part in text.split("`") if part != ""]


def python_regex(pattern: str) -> str | None:
    """``pattern`` (a Go ``regexp2`` expression) when Python's ``re`` compiles it, else
    ``None``."""
    try:
        re.compile(pattern)
    except re.error:
        return None
    return pattern


# ---------------------------------------------------------------------------
# Proxies
# ---------------------------------------------------------------------------


def convert_proxies(raw: Any, state: ImportState) -> dict[str, Converted]:
    """Every item of ``proxies``: outbounds into ``state``, names registered, the report
    told; the carried ones by Clash name."""
    carried: dict[str, Converted] = {}
    if raw is None:
        return carried
    if not isinstance(raw, list):
        state.report.add("skipped", "proxies", "", "proxies", "must be a list")
        return carried
    for i, mapping in enumerate(raw):
        path = f"proxies[{i}]"
        result = convert_proxy(mapping)
        name = result.name
        existing = state.names.get(name) if name else None
        if existing is not None:
            kind = "a built-in" if existing.kind == "builtin" else "another proxy"
            if isinstance(result, Skipped):
                state.report.add(
                    "skipped",
                    path,
                    name,
                    f"{result.type} proxy",
                    f"{result.reason}; its name is also {kind}'s",
                )
                continue
            tag = state.names.free_tag(name)
            state.report.add(
                "changed",
                path,
                name,
                f"renamed to {tag!r}",
                f"the name is {kind}'s (mihomo refuses the file); references to "
                f"{name!r} mean the first one",
            )
            result.outbound["tag"] = tag
            state.outbounds.append(result.outbound)
            _report_changes(path, name, result, state)
            continue
        if isinstance(result, Skipped):
            if name:
                state.names.add(name, "skipped", result.type, result.reason)
            label = f"{result.type} proxy" if result.type else "proxy"
            state.report.add("skipped", path, name, label, result.reason)
            continue
        info = state.names.add(name, "proxy", result.type, protocol=result.outbound["protocol"])
        result.outbound["tag"] = info.tag
        if info.tag != name:
            state.report.add(
                "changed", path, name, f"tag {info.tag!r}", "the name is taken in spliceway"
            )
        state.outbounds.append(result.outbound)
        carried[name] = result
        state.report.add(
            "converted", path, name, f"{result.type} proxy → {result.outbound['protocol']} outbound"
        )
        _report_changes(path, name, result, state)
    return carried


def _report_changes(path: str, name: str, result: Converted, state: ImportState) -> None:
    for change in result.changes:
        if change.why.startswith("unknown key"):
            state.report.add("skipped", f"{path}.{change.key}", name, change.key, change.why)
        else:
            state.report.add("changed", f"{path}.{change.key}", name, change.key, change.why)


def _chain(
    name: str,
    seen: tuple[str, ...],
    carried: dict[str, Converted],
    group_names: set[str],
    chains: dict[str, list[str]],
    by_tag: dict[str, dict[str, Any]],
    state: ImportState,
) -> list[str] | str:
    """The hops (outbound tags) that reach proxy ``name``, or why there are none."""
    if name in chains:
        return chains[name]
    result = carried.get(name)
    if result is None:
        return f"{name!r} is not a carried proxy"
    info = state.names.get(name)
    assert info is not None
    tag = info.tag
    if result.dialer_proxy is None or result.dialer_proxy == "DIRECT":
        return [tag]
    dialer = result.dialer_proxy
    if dialer in seen:
        return "the dialer-proxy chain loops"
    if dialer in group_names:
        return f"dialer-proxy {dialer!r} is a group; spliceway's relay chains proxies only"
    before = _chain(dialer, (*seen, name), carried, group_names, chains, by_tag, state)
    if isinstance(before, str):
        return before
    protocols = [by_tag[t]["protocol"] for t in before]
    if any(p not in _RELAY_HOPS for p in protocols):
        return "only socks5 and http proxies can be hops of a spliceway relay before the last"
    if result.outbound["protocol"] not in _RELAY_LAST:
        return f"a {result.outbound['protocol']} outbound cannot end a spliceway relay"
    return [*before, tag]


def build_dialer_chains(
    carried: dict[str, Converted], group_names: set[str], state: ImportState
) -> None:
    """Proxies with ``dialer-proxy``: relay groups where spliceway can chain the hops."""
    chains: dict[str, list[str]] = {}
    by_tag = {ob["tag"]: ob for ob in state.outbounds}

    for i, (name, result) in enumerate(carried.items()):
        if result.dialer_proxy is None:
            continue
        path = next(
            (f"proxies[{j}].dialer-proxy" for j, n in enumerate(carried) if n == name),
            f"proxies[{i}].dialer-proxy",
        )
        if result.dialer_proxy == "DIRECT":
            state.report.add(
                "converted", path, name, "no chain", "dialer-proxy DIRECT is a direct dial"
            )
            continue
        hops = _chain(name, (), carried, group_names, chains, by_tag, state)
        if isinstance(hops, str):
            state.report.add(
                "changed",
                path,
                name,
                f"connects directly, not through {result.dialer_proxy!r}",
                hops,
            )
            continue
        chains[name] = hops
    # Rename each chained proxy's outbound and put a relay under its name; a hop that is
    # itself chained is its renamed outbound (the relay dials the whole chain).
    inner: dict[str, str] = {}
    for name in chains:
        info = state.names.get(name)
        assert info is not None
        inner[info.tag] = state.names.free_tag(f"{info.tag} (last hop)")
        by_tag[info.tag]["tag"] = inner[info.tag]
    for name, hops in chains.items():
        info = state.names.get(name)
        assert info is not None
        final = [inner.get(h, h) for h in hops]
        state.groups.append({"tag": info.tag, "kind": "relay", "outbounds": final})
        info.protocol = "relay"
        state.report.add(
            "converted",
            f"{name}.dialer-proxy",
            name,
            f"relay group {info.tag!r} over {final}",
        )


# ---------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Group:
    index: int
    name: str
    ctype: str
    raw: Mapping[Any, Any]
    tag: str = ""
    members: list[str] = field(default_factory=list)  # spliceway tags
    member_names: list[str] = field(default_factory=list)  # Clash names behind members
    providers: list[str] = field(default_factory=list)
    #: The group's ``filter`` and ``exclude-filter`` (those Python compiles), carried
    #: when it has providers.
    filters: list[str] = field(default_factory=list)
    excludes: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    had_real: bool = False
    broken: str = ""  # why the group refuses traffic, when it does

    @property
    def path(self) -> str:
        return f"proxy-groups[{self.index}]"


def _str_field(raw: Mapping[Any, Any], key: str) -> str:
    value = lookup(raw, key, dashes=False)
    return "" if value is MISSING else weak_str(value, key)


def _bool_field(raw: Mapping[Any, Any], key: str) -> bool:
    value = lookup(raw, key, dashes=False)
    return False if value is MISSING else weak_bool(value, key)


def _list_field(raw: Mapping[Any, Any], key: str) -> list[str]:
    value = lookup(raw, key, dashes=False)
    return [] if value is MISSING else weak_str_list(value, key)


def _filters(text: str, key: str, g: _Group, state: ImportState) -> list[str]:
    out = []
    for part in split_filter(text):
        if python_regex(part) is None:
            state.report.add(
                "changed",
                f"{g.path}.{key}",
                g.name,
                f"{key} {part!r} dropped",
                "Python's re cannot compile it (mihomo uses .NET-style regexp2)",
            )
            continue
        out.append(part)
    return out


def _member_type(name: str, state: ImportState, groups: dict[str, _Group]) -> str:
    if name in groups:
        return ADAPTER_TYPES.get(groups[name].ctype, "")
    info = state.names.get(name)
    return ADAPTER_TYPES.get(info.type, "") if info is not None else ""


def _resolve_members(
    g: _Group,
    groups: dict[str, _Group],
    state: ImportState,
    all_proxies: list[str],
    all_providers: list[str],
    providers: set[str],
) -> None:
    raw = g.raw
    names = _list_field(raw, "proxies")
    use = _list_field(raw, "use")
    filters = _filters(_str_field(raw, "filter"), "filter", g, state)
    excludes = _filters(_str_field(raw, "exclude-filter"), "exclude-filter", g, state)
    g.filters, g.excludes = filters, excludes
    exclude_types = [t for t in _str_field(raw, "exclude-type").split("|") if t]
    include_all = _bool_field(raw, "include-all")
    if include_all or _bool_field(raw, "include-all-providers"):
        use = list(all_providers)
    if include_all or _bool_field(raw, "include-all-proxies"):
        if filters:
            names += [p for f in filters for p in all_proxies if re.search(f, p)]
        else:
            names += all_proxies
        if not names and not use:
            names = ["COMPATIBLE"]
    if not names and not use:
        g.broken = "it has neither `proxies` nor `use` (mihomo refuses the file)"
        return
    for member in names:
        if exclude_types and any(
            _member_type(member, state, groups).lower() == t.lower() for t in exclude_types
        ):
            continue
        if excludes and any(re.search(e, member) for e in excludes):
            continue
        _add_member(g, member, groups, state)
    for pname in use:
        if not GROUPS_TAKE_PROVIDERS:
            state.report.add(
                "skipped",
                f"{g.path}.use",
                g.name,
                f"provider {pname!r}",
                "groups of this build cannot list providers",
            )
            g.lost.append(pname)
            g.had_real = True
            continue
        if pname not in providers:
            state.report.add(
                "skipped",
                f"{g.path}.use",
                g.name,
                f"provider {pname!r}",
                "no such proxy provider was carried (mihomo refuses an unknown one)",
            )
            g.lost.append(pname)
            g.had_real = True
            continue
        g.had_real = True
        if pname not in g.providers:
            g.providers.append(pname)
    if use and exclude_types:
        state.report.add(
            "changed",
            f"{g.path}.exclude-type",
            g.name,
            "exclude-type not applied to provider members",
            "spliceway's providers filter by name only",
        )


def _add_member(g: _Group, member: str, groups: dict[str, _Group], state: ImportState) -> None:
    info = state.names.get(member)
    if info is None:
        state.report.add(
            "skipped",
            f"{g.path}.proxies",
            g.name,
            f"member {member!r}",
            "no proxy or group has this name (mihomo refuses the file)",
        )
        g.had_real = True
        g.lost.append(member)
        return
    if info.kind == "builtin":
        if member == "PASS":
            state.report.add(
                "skipped", f"{g.path}.proxies", g.name, "member 'PASS'", "PASS is not a proxy"
            )
            return
        tag = state.names.block() if info.tag == BLOCK_TAG else info.tag
        if member in ("REJECT-DROP", "COMPATIBLE"):
            state.report.add(
                "changed",
                f"{g.path}.proxies",
                g.name,
                f"member {member!r} is the block outbound {BLOCK_TAG!r}",
                "spliceway refuses at once (mihomo's REJECT-DROP holds the connection first)"
                if member == "REJECT-DROP"
                else "COMPATIBLE refuses every connection",
            )
    elif info.kind == "skipped":
        g.had_real = True
        g.lost.append(member)
        state.report.add(
            "changed",
            f"{g.path}.proxies",
            g.name,
            f"member {member!r} dropped",
            f"the proxy was skipped: {info.why}",
        )
        return
    else:
        g.had_real = True
        tag = info.tag
    if tag not in g.members:
        g.members.append(tag)
        g.member_names.append(member)


def _break_cycles(groups: dict[str, _Group], state: ImportState) -> None:
    by_tag = {g.tag: g for g in groups.values()}
    color: dict[str, int] = {}

    def visit(g: _Group) -> None:
        color[g.tag] = 1
        for member in list(g.members):
            child = by_tag.get(member)
            if child is None:
                continue
            if color.get(child.tag) == 1:
                index = g.members.index(member)
                del g.members[index]
                del g.member_names[index]
                g.lost.append(child.name)
                state.report.add(
                    "skipped",
                    f"{g.path}.proxies",
                    g.name,
                    f"member {child.name!r}",
                    "it closes a cycle of groups (mihomo refuses the file)",
                )
            elif color.get(child.tag) is None:
                visit(child)
        color[g.tag] = 2

    for g in groups.values():
        if g.tag not in color:
            visit(g)


def _probe_url(g: _Group, state: ImportState) -> str | None:
    url = _str_field(g.raw, "url")
    if not url:
        for pname in g.providers:
            hc = state.proxy_providers.get(pname, {}).get("health_check", {})
            if hc.get("url"):
                return str(hc["url"])
        return None
    try:
        parse_probe_url(url)
    except ValueError as ex:
        state.report.add(
            "changed",
            f"{g.path}.url",
            g.name,
            "default probe URL",
            f"{url!r} cannot be probed: {ex}",
        )
        return None
    return url


def _interval(g: _Group, state: ImportState) -> int:
    value = lookup(g.raw, "interval", dashes=False)
    if value is MISSING:
        return 300
    interval = weak_int(value, "interval")
    if interval <= 0:
        if g.providers and not g.members:
            state.report.add(
                "changed",
                f"{g.path}.interval",
                g.name,
                "probed every 300 s",
                "mihomo leaves a group of provider members to the providers' health checks",
            )
        return 300
    return interval


def _finish(g: _Group, state: ImportState) -> dict[str, Any]:
    """The spliceway group entry of ``g``."""
    kind = _GROUP_KINDS.get(g.ctype)
    if not g.broken:
        g.broken = _why_broken(g, kind, state)
    if g.broken:
        block = state.names.block()
        members = [block, *[m for m in g.members if m != block]]
        state.report.add(
            "changed",
            g.path,
            g.name,
            f"selector {g.tag!r} refusing traffic (block outbound {block!r} first)",
            g.broken,
        )
        out: dict[str, Any] = {"tag": g.tag, "kind": "selector", "outbounds": members}
        if g.providers and kind != "relay":
            out["providers"] = g.providers
            # Never the filter that would drop the block outbound that refuses the traffic.
            excludes = [e for e in g.excludes if not re.search(e, block)]
            out.update(_group_filters(g.filters, excludes))
        return out
    assert kind is not None
    out = {"tag": g.tag, "kind": kind}
    if g.members:
        out["outbounds"] = list(g.members)
    if g.providers:
        out["providers"] = list(g.providers)
        out.update(_group_filters(g.filters, g.excludes))
    if kind in ("url_test", "fallback", "load_balance"):
        url = _probe_url(g, state)
        if url is not None:
            out["url"] = url
        out["interval_seconds"] = _interval(g, state)
    if kind == "url_test":
        out["tolerance_ms"] = _tolerance(g, state)
    if kind == "load_balance":
        out["strategy"] = _strategy(g, state)
    state.report.add(
        "converted",
        g.path,
        g.name,
        f"{g.ctype} group → {kind} {g.tag!r}",
    )
    return out


def _group_filters(filters: list[str], excludes: list[str]) -> dict[str, list[str]]:
    """A group's ``filter`` and ``exclude_filter`` entries (inline members were already
    excluded at import, by their Clash names)."""
    out = {}
    if filters:
        out["filter"] = list(filters)
    if excludes:
        out["exclude_filter"] = list(excludes)
    return out


def _why_broken(g: _Group, kind: str | None, state: ImportState) -> str:
    """Why ``g`` must refuse traffic (empty: it need not)."""
    real = [t for t in g.members if t not in ("direct", BLOCK_TAG)]
    if g.had_real and not real and not g.providers:
        lost = ", ".join(repr(n) for n in g.lost) or "none"
        return f"it lost every proxy and group it had ({lost})"
    if not g.members and not g.providers:
        return "no member is left (PASS, or members every filter excluded)"
    if kind is None:
        return f"unsupported group type {g.ctype!r} (mihomo refuses it too)"
    if kind == "relay":
        return _relay_problem(g, state)
    return ""


def _tolerance(g: _Group, state: ImportState) -> int:
    """``tolerance`` as mihomo reads it: only an integer counts (default 0)."""
    tolerance = lookup(g.raw, "tolerance", dashes=False)
    if tolerance is MISSING:
        return 0
    if isinstance(tolerance, int) and not isinstance(tolerance, bool):
        return max(0, min(tolerance, 65535))
    state.report.add(
        "changed",
        f"{g.path}.tolerance",
        g.name,
        "tolerance 0",
        f"{tolerance!r} is not an integer: mihomo ignores it too",
    )
    return 0


def _strategy(g: _Group, state: ImportState) -> str:
    """A load-balance group's ``strategy`` (mihomo's default: consistent-hashing)."""
    strategy = lookup(g.raw, "strategy", dashes=False)
    text = strategy if isinstance(strategy, str) else "consistent-hashing"
    mapped = _STRATEGIES.get(text)
    if mapped is None:
        state.report.add(
            "changed",
            f"{g.path}.strategy",
            g.name,
            "strategy round_robin",
            f"unknown strategy {text!r} (mihomo refuses it)",
        )
        return "round_robin"
    if mapped == "consistent_hashing":
        state.report.add(
            "changed",
            f"{g.path}.strategy",
            g.name,
            "consistent_hashing by target host",
            "mihomo hashes the destination's registered domain (eTLD+1), spliceway the "
            "whole host name",
        )
    elif mapped == "sticky_sessions":
        state.report.add(
            "changed",
            f"{g.path}.strategy",
            g.name,
            "sticky_sessions by source IP",
            "mihomo keys on source and destination (10-minute cache), spliceway on the "
            "client's address",
        )
    return mapped


def _relay_problem(g: _Group, state: ImportState) -> str:
    if g.providers:
        return "a relay over provider members cannot be chained by spliceway"
    protocols = []
    for name in g.member_names:
        info = state.names.get(name)
        protocols.append(info.protocol if info is not None and info.kind == "proxy" else "")
    if not protocols:
        return "the relay has no hops left"
    if any(p not in _RELAY_HOPS for p in protocols[:-1]) or protocols[-1] not in _RELAY_LAST:
        return (
            "spliceway's relay chains socks5/http proxies (a shadowsocks one only last), "
            "not groups or other outbounds"
        )
    return ""


def convert_groups(raw: Any, state: ImportState, providers: set[str]) -> None:
    """Every item of ``proxy-groups`` (see the module) into ``state.groups``."""
    if raw is None:
        return
    if not isinstance(raw, list):
        state.report.add("skipped", "proxy-groups", "", "proxy-groups", "must be a list")
        return
    groups: dict[str, _Group] = {}
    order: list[_Group] = []
    for i, item in enumerate(raw):
        path = f"proxy-groups[{i}]"
        if not isinstance(item, Mapping):
            state.report.add("skipped", path, "", "group", "must be a mapping")
            continue
        name = item.get("name")
        if not isinstance(name, str) or not name:
            state.report.add("skipped", path, "", "group", "missing name (mihomo refuses it)")
            continue
        raw_type = lookup(item, "type", dashes=False)
        ctype = raw_type if isinstance(raw_type, str) else ""
        g = _Group(i, name, ctype, item)
        if state.names.defined(name) or name in groups:
            g.tag = state.names.free_tag(name)
            state.report.add(
                "changed",
                path,
                name,
                f"renamed to {g.tag!r}",
                "the name is already a proxy's, a group's or a built-in's (mihomo refuses "
                f"the file); references to {name!r} mean the first one",
            )
            order.append(g)
            continue
        g.tag = state.names.add(name, "group", ctype).tag
        groups[name] = g
        order.append(g)
    all_proxies = sorted(state.names.proxies())
    all_providers = sorted(providers)
    for g in order:
        try:
            _resolve_members(g, groups, state, all_proxies, all_providers, providers)
        except (WeakTypeError, re.error) as ex:
            g.broken = str(ex)
        for key in unknown_keys(g.raw, (*_GROUP_KEYS, *_GROUP_NOT_CARRIED), dashes=False):
            state.report.add(
                "skipped", f"{g.path}.{key}", g.name, key, "unknown key (mihomo ignores it too)"
            )
        for key, why in _GROUP_NOT_CARRIED.items():
            if lookup(g.raw, key, dashes=False) is not MISSING:
                state.report.add("skipped", f"{g.path}.{key}", g.name, key, why)
    _break_cycles({g.tag: g for g in order}, state)
    for g in order:
        try:
            state.groups.append(_finish(g, state))
        except WeakTypeError as ex:
            g.broken = str(ex)
            state.groups.append(_finish(g, state))


def ensure_global(state: ImportState) -> str:
    """The tag of ``GLOBAL``: the user's group of that name, else mihomo's own selector
    over ``DIRECT``, ``REJECT``, every proxy and every group (made on first use)."""
    info = state.names.get("GLOBAL")
    if info is not None and info.kind == "group":
        return info.tag
    members = ["direct", state.names.block()]
    members += [state.names.get(n).tag for n in state.names.proxies()]  # type: ignore[union-attr]
    members += [g["tag"] for g in state.groups]
    tag = state.names.add("GLOBAL", "group", "select").tag
    state.groups.append({"tag": tag, "kind": "selector", "outbounds": list(dict.fromkeys(members))})
    state.report.add(
        "converted",
        "GLOBAL",
        "GLOBAL",
        f"selector {tag!r} over DIRECT, REJECT, every proxy and group",
        "mihomo's built-in GLOBAL group",
    )
    return tag
