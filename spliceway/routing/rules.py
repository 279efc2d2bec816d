"""Rule matching: pure functions from configuration rules and flow facts to a route decision.

Reference: docs/configuration.md (rules), docs/commands.md (``diagnostics.trace_route``'s
``matched_rule``).
No I/O. :func:`compile_rules` does all the work that does not depend on the flow (domain
and suffix sets, compiled regexes, sorted IP intervals, port sets, condition text, the
decision each rule returns) once per configuration. :func:`decide` runs per connection:
it normalises the host and parses IP literals once, then each condition is a set lookup,
an interval bisect or a substring/regex search. ``domain_suffix`` works by intersecting
the suffix set with the host's dot-suffixes (``a.b.c`` -> ``a.b.c``, ``b.c``, ``c``).

Semantics:

- A rule matches when every condition it names matches; a list matches when any item
  does. Rules are tried in order; the first match wins; otherwise ``final``.
- Domain conditions look at the target host when it is a domain name, and also at the
  sniffed host (either may match). Hosts are compared lowercased with a trailing dot
  removed. ``domain``: equality. ``domain_suffix`` ``s``: the host equals ``s`` or ends
  with ``"." + s`` (so never ``bad`` + ``s``). ``domain_keyword``: substring.
  ``domain_regex``: ``re.search``, case-insensitive.
- ``ip_cidr`` looks at the target when it reads as an IP address, in any spelling
  :func:`spliceway.routing.hostnorm.target_address` knows (``2130706433``, ``127.1``,
  ``0x7f.0.0.1``, ``127.0.0.1.``, ``0``...), else at ``resolved_ip`` when given;
  ``source_ip_cidr`` at ``source_ip``. IPv4-mapped IPv6 addresses (``::ffff:a.b.c.d``)
  count as IPv4; the unspecified target addresses 0.0.0.0 and ``::`` are the loopback
  ones (Linux connects there). An unparsable address never matches. A target that reads
  as an address is never a domain name (domain conditions do not see it); nor is such a
  sniffed host.
- A domain target has no address until someone resolves it: :func:`needs_address` says
  when deciding reaches an ``ip_cidr`` rule first, so the caller resolves the name and
  decides again with ``resolved_ip`` (mihomo's rule matching without ``no-resolve``).
- ``port``/``source_port``: inclusive ranges. ``network``, ``inbound_tag``,
  ``principal_key``, ``process_name``: exact, case-sensitive equality.
  A condition on a fact that is ``None`` does not match.
- ``geoip``/``ip_asn`` (and their ``source_`` twins) are networks too: the database's
  networks of those codes or numbers (:mod:`spliceway.routing.geodata`, merged into
  sorted ranges once per load), ``private``/``lan`` the built-in ranges. ``geosite``
  and ``rule_set`` are sets of domain entries (and networks, and Clash rule parts) as
  :class:`spliceway.routing.ruleset.RuleSetData` describes; a set matches when one of
  its entries does.
- Resolving (mihomo's ``ShouldResolveIP``): a rule *resolves* when it has an address
  condition (``ip_cidr``, ``geoip``, ``ip_asn``, a ``rule_set`` whose sets resolve)
  without ``no_resolve``; a logical rule when one of its parts does. ``first_ip_rule`` is
  the first such rule. The engine resolves a domain target when matching reaches it,
  so the rules from it on see ``resolved_ip``; the rules before it only ever see an
  address the client sent, ``no_resolve`` or not (mihomo resolves once, at that rule,
  and every later rule sees the address).
- ``invert`` negates what the rule's conditions (or a logical rule's ``mode`` over its
  ``rules``) say; ``and``/``or`` combine parts, each a plain or logical rule.

``matched_rule.condition`` text: conditions in :data:`spliceway.config.CONDITION_KEYS`
order, each ``key=item|item``, joined by ``,`` — e.g.
``domain_suffix=example.com|example.org,port=443``. Items are written as configured.
Flags follow: ``no_resolve``, ``rule_set_ip_cidr_match_source``. A logical rule is
``logical(and: <part>; <part>)``; an inverted one is wrapped in ``not(...)``.
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
import re
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from spliceway.config import Rule, SubRule, parse_port_spec
from spliceway.config.validators import ADDRESS_CONDITION_KEYS, GEOIP_BUILTIN_CODES
from spliceway.routing import hostnorm
from spliceway.routing.ruleset import Cidr, RuleSetData, parse_cidr

if TYPE_CHECKING:
    from spliceway.routing.geodata import GeoDatabases

__all__ = [
    "PRIVATE_CIDRS",
    "FlowFacts",
    "MatchedRule",
    "RouteDecision",
    "RuleSet",
    "compile_rules",
    "decide",
    "needs_address",
]


@dataclass(frozen=True, slots=True)
class FlowFacts:
    """What routing knows about a flow."""

    network: str
    host: str
    port: int
    sniffed_host: str | None = None
    resolved_ip: str | None = None
    source_ip: str | None = None
    source_port: int | None = None
    inbound_tag: str | None = None
    principal_key: str | None = None
    process_name: str | None = None


@dataclass(frozen=True, slots=True)
class MatchedRule:
    """The rule that decided a route: 0-based ``index`` and its ``condition`` text."""

    index: int
    condition: str

    def to_dict(self) -> dict[str, Any]:
        """``{index, condition}`` as flow records and trace_route carry it."""
        return {"index": self.index, "condition": self.condition}


@dataclass(frozen=True, slots=True)
class RouteDecision:
    """Outcome of :func:`decide`; ``target`` is None when ``action`` is ``block``."""

    mode: str
    action: Literal["route", "block"]
    target: str | None
    matched_rule: MatchedRule | None


# An IP is (version, integer value).
_Ip = tuple[int, int]

#: What ``geoip: private`` (and ``lan``) matches, as mihomo's ``GEOIP,LAN`` does (Go's
#: ``netip`` ``IsPrivate``, ``IsLoopback``, ``IsLinkLocalUnicast``, ``IsMulticast``,
#: ``IsUnspecified``).
PRIVATE_CIDRS: tuple[str, ...] = (
    "0.0.0.0/32",
    "10.0.0.0/8",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "224.0.0.0/4",
    "::/128",
    "::1/128",
    "fc00::/7",
    "fe80::/10",
    "ff00::/8",
)


class _View(NamedTuple):
    """What one decision derives from the facts, once, before trying the rules."""

    hosts: tuple[str, ...]  # normalised domain names: target (if a domain), sniffed host
    suffixes: frozenset[str]  # every dot-suffix of those hosts, themselves included
    parents: frozenset[str]  # every proper dot-suffix of those hosts (strict subdomains)
    ip: _Ip | None  # target IP literal, else resolved_ip
    lit: _Ip | None  # target IP literal only (what rules before first_ip_rule see)
    src: _Ip | None  # source_ip


# One check per condition.
_Check = Callable[[FlowFacts, _View], bool]
_EMPTY_VIEW = _View((), frozenset(), frozenset(), None, None, None)


def _parse_ip(text: str | None) -> _Ip | None:
    """Parse an IP literal (brackets allowed), IPv4-mapped IPv6 as IPv4; else None."""
    if not text:
        return None
    if text[0] == "[" and text[-1] == "]":
        text = text[1:-1]
    elif ":" not in text and not text[-1].isdigit():
        return None  # cheap rejection of domain names, no exception raised
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return None
    if ip.version == 6:
        mapped = ip.ipv4_mapped
        if mapped is not None:
            return 4, int(mapped)
    return ip.version, int(ip)


def _parse_target(text: str | None) -> _Ip | None:
    """A target (or resolved, or sniffed) host as the address it reads as, else None."""
    if not text:
        return None
    address = hostnorm.target_address(text)
    return None if address is None else _parse_ip(address)


def _norm_host(host: str) -> str:
    host = host.lower()
    return host[:-1] if host.endswith(".") else host


_V4_MAPPED = 0xFFFF << 32


class _IpSet:
    """Networks as sorted, merged integer intervals per IP version (bisect per lookup)."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, cidrs: Iterable[Cidr]) -> None:
        spans: dict[int, list[tuple[int, int]]] = {4: [], 6: []}
        for version, first, prefix in cidrs:
            size = 1 << ((32 if version == 4 else 128) - prefix)
            last = first + size - 1
            if version == 6 and prefix >= 96 and first >> 32 == 0xFFFF:
                # ::ffff:a.b.c.d/n also covers a.b.c.d as IPv4
                v4 = first - _V4_MAPPED
                spans[4].append((v4, v4 + size - 1))
            spans[version].append((first, last))
        self._starts: dict[int, list[int]] = {}
        self._ends: dict[int, list[int]] = {}
        for version, items in spans.items():
            merged: list[list[int]] = []
            for lo, hi in sorted(items):
                if merged and lo <= merged[-1][1] + 1:
                    merged[-1][1] = max(merged[-1][1], hi)
                else:
                    merged.append([lo, hi])
            self._starts[version] = [lo for lo, _ in merged]
            self._ends[version] = [hi for _, hi in merged]

    @classmethod
    def of_text(cls, cidrs: Iterable[str]) -> _IpSet:
        """From configuration text (``10.0.0.0/8``; validated already)."""
        out: list[Cidr] = []
        for text in cidrs:
            net = ipaddress.ip_network(text, strict=False)
            out.append((net.version, int(net.network_address), net.prefixlen))
        return cls(out)

    def __bool__(self) -> bool:
        return bool(self._starts[4] or self._starts[6])

    def __contains__(self, ip: _Ip) -> bool:
        version, value = ip
        starts = self._starts[version]
        k = bisect.bisect_right(starts, value) - 1
        return k >= 0 and value <= self._ends[version][k]


_PRIVATE = _IpSet(parse_cidr(c) for c in PRIVATE_CIDRS)


class _PortSet:
    __slots__ = ("_ranges", "_singles")

    def __init__(self, specs: Sequence[str]) -> None:
        singles: set[int] = set()
        ranges: list[tuple[int, int]] = []
        for spec in specs:
            lo, hi = parse_port_spec(spec)
            if hi - lo < 16:
                singles.update(range(lo, hi + 1))
            else:
                ranges.append((lo, hi))
        self._singles = frozenset(singles)
        self._ranges = tuple(ranges)

    def __contains__(self, port: int) -> bool:
        if port in self._singles:
            return True
        return any(lo <= port <= hi for lo, hi in self._ranges)


# ---------------------------------------------------------------------------
# Domain sets (rule sets, geosite lists)
# ---------------------------------------------------------------------------

#: Above this many keywords one alternation regex searches them (else a loop).
_KEYWORD_LOOP_MAX = 8


def _wildcard_regex(patterns: Sequence[str]) -> re.Pattern[str] | None:
    """One regex for every wildcard pattern: ``*`` is one label; a leading ``.`` is one
    or more labels in front."""
    if not patterns:
        return None
    parts = []
    for pattern in patterns:
        below = pattern.startswith(".")
        labels = (pattern[1:] if below else pattern).split(".")
        body = r"\.".join("[^.]+" if label == "*" else re.escape(label) for label in labels)
        parts.append(rf"(?:[^.]+\.)+{body}" if below else body)
    return re.compile("(?:" + "|".join(parts) + r")\Z")


class _DomainMatcher:
    """A :class:`RuleSetData`'s domain entries, ready for lookups."""

    __slots__ = ("exact", "keyword_re", "keywords", "regexes", "subdomain", "suffix", "wild")

    def __init__(self, data: RuleSetData) -> None:
        self.exact = data.exact
        self.suffix = data.suffix
        self.subdomain = data.subdomain
        self.wild = _wildcard_regex(data.wildcard)
        keywords = tuple(dict.fromkeys(k.lower() for k in data.keyword))
        self.keywords = keywords if len(keywords) <= _KEYWORD_LOOP_MAX else ()
        self.keyword_re = (
            re.compile("|".join(map(re.escape, keywords)))
            if len(keywords) > _KEYWORD_LOOP_MAX
            else None
        )
        regexes = []
        for text in data.regex:
            try:
                regexes.append(re.compile(text, re.IGNORECASE))
            except re.error:
                continue  # ruleset/geodata skip these; a stale object may still hold one
        self.regexes = tuple(regexes)

    def match(self, view: _View) -> bool:
        hosts = view.hosts
        if not hosts:
            return False
        if self.exact and not self.exact.isdisjoint(hosts):
            return True
        if self.suffix and not self.suffix.isdisjoint(view.suffixes):
            return True
        if self.subdomain and not self.subdomain.isdisjoint(view.parents):
            return True
        for h in hosts:
            for k in self.keywords:
                if k in h:
                    return True
            if self.keyword_re is not None and self.keyword_re.search(h) is not None:
                return True
            if self.wild is not None and self.wild.match(h) is not None:
                return True
            for p in self.regexes:
                if p.search(h) is not None:
                    return True
        return False


# Built once per RuleSetData (a set shared by many rules, or kept across reloads).
_DOMAIN_MATCHERS: weakref.WeakKeyDictionary[RuleSetData, _DomainMatcher] = (
    weakref.WeakKeyDictionary()
)
_CIDR_SETS: weakref.WeakKeyDictionary[RuleSetData, _IpSet] = weakref.WeakKeyDictionary()


def _domain_matcher(data: RuleSetData) -> _DomainMatcher:
    matcher = _DOMAIN_MATCHERS.get(data)
    if matcher is None:
        matcher = _DOMAIN_MATCHERS[data] = _DomainMatcher(data)
    return matcher


def _cidr_set(data: RuleSetData) -> _IpSet:
    nets = _CIDR_SETS.get(data)
    if nets is None:
        nets = _CIDR_SETS[data] = _IpSet(data.cidr)
    return nets


# ---------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------


@dataclass(slots=True)
class _Ctx:
    """What compiling one rule list needs and finds out."""

    rule_sets: Mapping[str, RuleSetData]
    geo: GeoDatabases | None
    #: Facts the view must derive: "hosts", "suffixes", "parents", "ip", "src".
    needs: set[str] = field(default_factory=set)
    uses_process: bool = False
    #: Rule sets and databases named but not given (warnings; they match nothing).
    missing: dict[str, None] = field(default_factory=dict)
    #: Whether the rule being compiled sees a resolved address (index >= first_ip_rule).
    resolved_ok: bool = True


def _address_check(nets: _IpSet, ctx: _Ctx) -> _Check:
    ctx.needs.add("ip")
    if not nets:
        return _never
    if ctx.resolved_ok:

        def check(facts: FlowFacts, view: _View) -> bool:
            ip = view.ip
            return ip is not None and ip in nets

    else:

        def check(facts: FlowFacts, view: _View) -> bool:
            ip = view.lit
            return ip is not None and ip in nets

    return check


def _source_check(nets: _IpSet, ctx: _Ctx) -> _Check:
    ctx.needs.add("src")
    if not nets:
        return _never

    def check(facts: FlowFacts, view: _View) -> bool:
        src = view.src
        return src is not None and src in nets

    return check


def _never(facts: FlowFacts, view: _View) -> bool:
    return False


def _domain_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    ctx.needs.add("hosts")
    names = frozenset(_norm_host(v) for v in values)

    def check(facts: FlowFacts, view: _View) -> bool:
        return not names.isdisjoint(view.hosts)

    return check


def _suffix_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    # view.suffixes holds every dot-suffix of the hosts ("a.example.com", "example.com",
    # "com"), so one set intersection answers "equal to s or ends with '.' + s".
    ctx.needs.update(("hosts", "suffixes"))
    suffixes = frozenset(_norm_host(v) for v in values)

    def check(facts: FlowFacts, view: _View) -> bool:
        return not suffixes.isdisjoint(view.suffixes)

    return check


def _keyword_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    ctx.needs.add("hosts")
    keywords = tuple(dict.fromkeys(v.lower() for v in values))

    def check(facts: FlowFacts, view: _View) -> bool:
        for h in view.hosts:
            for k in keywords:
                if k in h:
                    return True
        return False

    return check


def _regex_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    ctx.needs.add("hosts")
    patterns = tuple(re.compile(v, re.IGNORECASE) for v in values)

    def check(facts: FlowFacts, view: _View) -> bool:
        for h in view.hosts:
            for p in patterns:
                if p.search(h) is not None:
                    return True
        return False

    return check


def _matchers_check(matchers: Sequence[_DomainMatcher], ctx: _Ctx) -> _Check:
    ctx.needs.update(("hosts", "suffixes", "parents"))
    if not matchers:
        return _never
    if len(matchers) == 1:
        only = matchers[0]

        def check_one(facts: FlowFacts, view: _View) -> bool:
            return only.match(view)

        return check_one

    def check(facts: FlowFacts, view: _View) -> bool:
        return any(m.match(view) for m in matchers)

    return check


def _geosite_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    matchers = []
    geosite = ctx.geo.geosite if ctx.geo is not None else None
    for name in values:
        if geosite is None:
            ctx.missing[f"geosite database (for {name!r})"] = None
            continue
        try:
            matchers.append(_domain_matcher(geosite.domains(name)))
        except KeyError:
            ctx.missing[f"geosite list {name!r}"] = None
    return _matchers_check(matchers, ctx)


def _geo_nets(values: Sequence[str], ctx: _Ctx, *, asn: bool) -> _IpSet:
    cidrs: list[Cidr] = []
    db = None if ctx.geo is None else (ctx.geo.asn if asn else ctx.geo.geoip)
    builtin = False
    for value in values:
        if not asn and value.lower() in GEOIP_BUILTIN_CODES:
            builtin = True
            continue
        if db is None:
            ctx.missing[f"{'ASN' if asn else 'GeoIP'} database (for {value!r})"] = None
            continue
        cidrs.extend(db.asn_networks(int(value)) if asn else db.networks(value))
    if builtin:
        cidrs.extend(parse_cidr(c) for c in PRIVATE_CIDRS)
    return _IpSet(cidrs)


def _ip_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    return _address_check(_IpSet.of_text(values), ctx)


def _source_ip_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    return _source_check(_IpSet.of_text(values), ctx)


def _geoip_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    return _address_check(_geo_nets(values, ctx, asn=False), ctx)


def _source_geoip_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    return _source_check(_geo_nets(values, ctx, asn=False), ctx)


def _asn_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    return _address_check(_geo_nets(values, ctx, asn=True), ctx)


def _source_asn_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    return _source_check(_geo_nets(values, ctx, asn=True), ctx)


def _port_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    ports = _PortSet(values)

    def check(facts: FlowFacts, view: _View) -> bool:
        return facts.port in ports

    return check


def _source_port_check(values: Sequence[str], ctx: _Ctx) -> _Check:
    ports = _PortSet(values)

    def check(facts: FlowFacts, view: _View) -> bool:
        return facts.source_port is not None and facts.source_port in ports

    return check


def _network_check(value: str, ctx: _Ctx) -> _Check:
    def check(facts: FlowFacts, view: _View) -> bool:
        return facts.network == value

    return check


def _attr_check(attr: str) -> Callable[[Sequence[str], _Ctx], _Check]:
    def build(values: Sequence[str], ctx: _Ctx) -> _Check:
        if attr == "process_name":
            ctx.uses_process = True
        allowed = frozenset(values)

        def check(facts: FlowFacts, view: _View) -> bool:
            return getattr(facts, attr) in allowed

        return check

    return build


def _any_of(checks: Sequence[_Check]) -> _Check:
    if not checks:
        return _never
    if len(checks) == 1:
        return checks[0]

    def check(facts: FlowFacts, view: _View) -> bool:
        for c in checks:  # noqa: SIM110 - a plain loop costs less than any() per flow
            if c(facts, view):
                return True
        return False

    return check


def _all_of(checks: Sequence[_Check]) -> _Check:
    if len(checks) == 1:
        return checks[0]

    def check(facts: FlowFacts, view: _View) -> bool:
        for c in checks:  # noqa: SIM110 - a plain loop costs less than all() per flow
            if not c(facts, view):
                return False
        return True

    return check


def _rule_set_check(rule: SubRule | Rule, ctx: _Ctx) -> _Check:
    """``rule_set`` (with ``rule_set_ip_cidr_match_source``): any named set matches."""
    checks: list[_Check] = []
    matchers: list[_DomainMatcher] = []
    for name in rule.rule_set or ():
        data = ctx.rule_sets.get(name)
        if data is None:
            ctx.missing[f"rule set {name!r}"] = None
            continue
        if _has_domain_items(data):
            matchers.append(_domain_matcher(data))
        if data.cidr:
            nets = _cidr_set(data)
            if rule.rule_set_ip_cidr_match_source:
                checks.append(_source_check(nets, ctx))
            else:
                checks.append(_address_check(nets, ctx))
        checks.extend(_part_check(part, ctx) for part in data.classical)
    if matchers:
        checks.insert(0, _matchers_check(matchers, ctx))
    return _any_of(checks)


# Cheapest checks first: a rule fails as soon as one condition does.
_BUILDERS: tuple[tuple[str, Callable[[Any, _Ctx], _Check]], ...] = (
    ("network", _network_check),
    ("port", _port_check),
    ("inbound_tag", _attr_check("inbound_tag")),
    ("principal_key", _attr_check("principal_key")),
    ("process_name", _attr_check("process_name")),
    ("source_port", _source_port_check),
    ("ip_cidr", _ip_check),
    ("source_ip_cidr", _source_ip_check),
    ("domain", _domain_check),
    ("domain_suffix", _suffix_check),
    ("domain_keyword", _keyword_check),
    ("geoip", _geoip_check),
    ("source_geoip", _source_geoip_check),
    ("ip_asn", _asn_check),
    ("source_ip_asn", _source_asn_check),
    ("domain_regex", _regex_check),
    ("geosite", _geosite_check),
)


def _plain_checks(rule: SubRule | Rule, ctx: _Ctx) -> list[_Check]:
    conditions = rule.conditions()
    checks = [build(conditions[key], ctx) for key, build in _BUILDERS if key in conditions]
    if "rule_set" in conditions:
        checks.append(_rule_set_check(rule, ctx))
    return checks


def _part_check(rule: SubRule | Rule, ctx: _Ctx) -> _Check:
    """One predicate for a whole rule (plain or logical, inverted or not)."""
    if rule.is_logical:
        parts = [_part_check(p, ctx) for p in rule.rules or ()]
        check = _all_of(parts) if rule.mode == "and" else _any_of(parts)
        if not parts:
            check = _never
    else:
        check = _all_of(_plain_checks(rule, ctx))
    if rule.invert:
        inner = check

        def check(facts: FlowFacts, view: _View) -> bool:
            return not inner(facts, view)

    return check


# ---------------------------------------------------------------------------
# What a rule looks at (static)
# ---------------------------------------------------------------------------

_DOMAIN_KEYS = frozenset({"domain", "domain_suffix", "domain_keyword", "domain_regex", "geosite"})


def rule_resolves(rule: SubRule | Rule, rule_sets: Mapping[str, RuleSetData]) -> bool:
    """Whether matching ``rule`` wants a domain target's address (mihomo's
    ``ShouldResolveIP``): an address condition without ``no_resolve``, a ``rule_set``
    one of whose sets resolves (not with ``no_resolve`` nor
    ``rule_set_ip_cidr_match_source``), or, for a logical rule, one of its parts."""
    if rule.is_logical:
        return any(rule_resolves(p, rule_sets) for p in rule.rules or ())
    if rule.no_resolve:
        return False
    if any(getattr(rule, key) is not None for key in ADDRESS_CONDITION_KEYS):
        return True
    if rule.rule_set is None or rule.rule_set_ip_cidr_match_source:
        return False
    return any(rule_sets[name].resolves for name in rule.rule_set if name in rule_sets)


def _has_domain_items(data: RuleSetData) -> bool:
    return bool(
        data.exact or data.suffix or data.subdomain or data.wildcard or data.keyword or data.regex
    )


def rule_uses_domains(rule: SubRule | Rule, rule_sets: Mapping[str, RuleSetData]) -> bool:
    """Whether ``rule`` looks at host names (so a sniffed host can change its result)."""
    if rule.is_logical:
        return any(rule_uses_domains(p, rule_sets) for p in rule.rules or ())
    if any(getattr(rule, key) is not None for key in _DOMAIN_KEYS):
        return True
    for name in rule.rule_set or ():
        data = rule_sets.get(name)
        if data is not None and (
            _has_domain_items(data) or any(rule_uses_domains(p, rule_sets) for p in data.classical)
        ):
            return True
    return False


@dataclass(frozen=True, slots=True)
class _CompiledRule:
    checks: tuple[_Check, ...]
    decision: RouteDecision  # prebuilt for mode "rule"


@dataclass(frozen=True, slots=True, weakref_slot=True)
class RuleSet:
    """Precompiled rules; build with :func:`compile_rules`."""

    rules: tuple[_CompiledRule, ...]
    #: Any rule looks at host names (domain conditions, geosite, a rule set's domain
    #: entries), so the sniffed host can change the route.
    has_domain_conditions: bool
    #: Index of the first rule that looks at host names (``len(rules)`` when none): a
    #: sniffed host can change a decision only if this is below the matched index.
    first_domain_rule: int
    has_suffix_conditions: bool
    #: Any rule looks at the target's address.
    has_ip_conditions: bool
    #: Index of the first rule that *resolves* (module docstring; ``len(rules)`` when
    #: none): a domain target's address can change a decision only if this is at or below
    #: the matched index, and only rules from here on see ``resolved_ip``.
    first_ip_rule: int
    has_source_ip_conditions: bool
    #: Any rule (or rule part, or classical rule-set line) names a ``process_name``
    #: (``runtime.process_lookup: auto`` looks up then).
    has_process_conditions: bool
    #: Whether deciding must parse the target host as an IP literal.
    needs_host_ip: bool
    #: Whether deciding derives anything from the facts before trying rules.
    needs_view: bool
    #: Rule sets the rules were compiled with, by provider name (what the C route table
    #: compiles too).
    rule_sets: Mapping[str, RuleSetData] = field(default_factory=dict)
    #: GeoIP / ASN / GeoSite databases the rules were compiled with (None: none given).
    geo: GeoDatabases | None = None
    #: What rules named but was not given (a rule set or database): it matched nothing.
    missing: tuple[str, ...] = ()
    #: Whether deciding derives the hosts' proper dot-suffixes (``.example.com`` entries).
    needs_parents: bool = False


def _text(value: tuple[str, ...] | str) -> str:
    return value if isinstance(value, str) else "|".join(value)


def condition_text(rule: SubRule | Rule) -> str:
    """The ``matched_rule.condition`` text of ``rule`` (see the module docstring)."""
    if rule.is_logical:
        inner = "; ".join(condition_text(p) for p in rule.rules or ())
        text = f"logical({rule.mode}: {inner})"
    else:
        items = [f"{key}={_text(value)}" for key, value in rule.conditions().items()]
        if rule.no_resolve:
            items.append("no_resolve")
        if rule.rule_set_ip_cidr_match_source:
            items.append("rule_set_ip_cidr_match_source")
        text = ",".join(items)
    return f"not({text})" if rule.invert else text


def compile_rules(
    rules: Sequence[Rule],
    *,
    rule_sets: Mapping[str, RuleSetData] | None = None,
    geo: GeoDatabases | None = None,
) -> RuleSet:
    """Precompile validated configuration rules (``Config.rules``) for :func:`decide`.

    ``rule_sets`` are the loaded sets by provider name, ``geo`` the loaded databases. A
    set or database a rule names but that is not given matches nothing (listed in
    :attr:`RuleSet.missing`); the engine refuses a configuration whose geodata files
    are missing before it gets here.
    """
    sets: Mapping[str, RuleSetData] = dict(rule_sets) if rule_sets else {}
    ctx = _Ctx(rule_sets=sets, geo=geo)
    n = len(rules)
    first_ip_rule = next((i for i, r in enumerate(rules) if rule_resolves(r, sets)), n)
    first_domain_rule = next((i for i, r in enumerate(rules) if rule_uses_domains(r, sets)), n)
    compiled: list[_CompiledRule] = []
    for index, rule in enumerate(rules):
        ctx.resolved_ok = index >= first_ip_rule
        if rule.is_logical or rule.invert:
            checks: tuple[_Check, ...] = (_part_check(rule, ctx),)
        else:
            checks = tuple(_plain_checks(rule, ctx))
        matched = MatchedRule(index, condition_text(rule))
        if rule.action == "block":
            decision = RouteDecision("rule", "block", None, matched)
        else:
            decision = RouteDecision("rule", "route", rule.outbound, matched)
        compiled.append(_CompiledRule(checks, decision))
    needs = ctx.needs
    has_domain = "hosts" in needs
    has_ip = "ip" in needs
    has_source_ip = "src" in needs
    return RuleSet(
        rules=tuple(compiled),
        has_domain_conditions=has_domain,
        first_domain_rule=first_domain_rule,
        has_suffix_conditions="suffixes" in needs,
        has_ip_conditions=has_ip,
        first_ip_rule=first_ip_rule,
        has_source_ip_conditions=has_source_ip,
        has_process_conditions=ctx.uses_process,
        needs_host_ip=has_domain or has_ip,
        needs_view=has_domain or has_ip or has_source_ip,
        rule_sets=sets,
        geo=geo,
        missing=tuple(ctx.missing),
        needs_parents="parents" in needs,
    )


_DIRECT_DECISION = RouteDecision("direct", "route", "direct", None)


def decide(
    ruleset: RuleSet,
    mode_kind: str,
    mode_outbound: str | None,
    final: str,
    facts: FlowFacts,
) -> RouteDecision:
    """Route one flow.

    ``rule``: the first matching rule, else ``final`` (``matched_rule`` None);
    ``global``: everything to ``mode_outbound``; ``direct``: everything to ``direct``.
    Raises ``ValueError`` only for a bad ``mode_kind`` or ``global`` without an outbound;
    any ``facts`` are accepted.
    """
    if mode_kind == "rule":
        return _decide_rules(ruleset, final, facts)
    if mode_kind == "direct":
        return _DIRECT_DECISION
    if mode_kind == "global":
        if not mode_outbound:
            raise ValueError("global mode needs an outbound")
        return RouteDecision("global", "route", mode_outbound, None)
    raise ValueError(f"unknown mode {mode_kind!r}")


#: Longest a flow (or ``diagnostics.trace_route``) waits for its target's address when a
#: resolving rule needs it (:func:`needs_address`); a name that does not resolve in time
#: meets the rules without one.
RULE_RESOLVE_TIMEOUT = 5.0


def needs_address(
    ruleset: RuleSet, mode_kind: str, facts: FlowFacts, decision: RouteDecision
) -> bool:
    """Whether ``decision`` (what :func:`decide` gave for ``facts``) may change once the
    target's address is known: mode ``rule``, a domain target without ``resolved_ip``,
    and a resolving rule (``first_ip_rule``) ranked before the match or at it (a rule
    such as ``invert`` over ``ip_cidr`` matches a name with no address), or any, when
    none matched. A ``no_resolve`` rule never resolves.

    The caller then resolves the target (its first address, as it would dial it) and
    decides again with ``resolved_ip``; a name that does not resolve keeps ``decision``.
    """
    if mode_kind != "rule" or facts.resolved_ip is not None or not facts.host:
        return False
    if _parse_target(facts.host) is not None:
        return False
    bound = decision.matched_rule.index if decision.matched_rule else len(ruleset.rules)
    return ruleset.first_ip_rule <= bound and ruleset.first_ip_rule < len(ruleset.rules)


def _dot_suffixes(hosts: tuple[str, ...]) -> frozenset[str]:
    out: set[str] = set()
    for host in hosts:
        out.add(host)
        dot = host.find(".")
        while dot >= 0:
            out.add(host[dot + 1 :])
            dot = host.find(".", dot + 1)
    return frozenset(out)


def _parent_suffixes(hosts: tuple[str, ...]) -> frozenset[str]:
    out: set[str] = set()
    for host in hosts:
        dot = host.find(".")
        while dot >= 0:
            out.add(host[dot + 1 :])
            dot = host.find(".", dot + 1)
    return frozenset(out)


def _view(ruleset: RuleSet, facts: FlowFacts) -> _View:
    host_ip = _parse_target(facts.host) if ruleset.needs_host_ip else None
    hosts: tuple[str, ...] = ()
    suffixes: frozenset[str] = frozenset()
    parents: frozenset[str] = frozenset()
    if ruleset.has_domain_conditions:
        if host_ip is None and facts.host:
            hosts = (_norm_host(facts.host),)
        sniffed = facts.sniffed_host
        if sniffed and _parse_target(sniffed) is None:
            name = _norm_host(sniffed)
            if name not in hosts:
                hosts = (*hosts, name)
        if ruleset.has_suffix_conditions:
            suffixes = _dot_suffixes(hosts)
        if ruleset.needs_parents:
            parents = _parent_suffixes(hosts)
    ip: _Ip | None = None
    if ruleset.has_ip_conditions:
        ip = host_ip if host_ip is not None else _parse_target(facts.resolved_ip)
    src = _parse_ip(facts.source_ip) if ruleset.has_source_ip_conditions else None
    return _View(hosts, suffixes, parents, ip, host_ip, src)


def _decide_rules(ruleset: RuleSet, final: str, facts: FlowFacts) -> RouteDecision:
    view = _view(ruleset, facts) if ruleset.needs_view else _EMPTY_VIEW
    for rule in ruleset.rules:
        for check in rule.checks:
            if not check(facts, view):
                break
        else:
            return rule.decision
    return _final_decision(final)


@functools.lru_cache(maxsize=64)
def _final_decision(final: str) -> RouteDecision:
    """The "no rule matched" decision, prebuilt: the final tag hardly ever changes."""
    return RouteDecision("rule", "route", final, None)
