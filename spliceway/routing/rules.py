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

``matched_rule.condition`` text: conditions in :data:`spliceway.config.CONDITION_KEYS`
order, each ``key=item|item``, joined by ``,`` — e.g.
``domain_suffix=example.com|example.org,port=443``. Items are written as configured.
"""

from __future__ import annotations

import bisect
import functools
import ipaddress
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from spliceway.config import Rule, parse_port_spec
from spliceway.routing import hostnorm

__all__ = [
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


class _View(NamedTuple):
    """What one decision derives from the facts, once, before trying the rules."""

    hosts: tuple[str, ...]  # normalised domain names: target (if a domain), sniffed host
    suffixes: frozenset[str]  # every dot-suffix of those hosts, themselves included
    ip: _Ip | None  # target IP literal, else resolved_ip
    src: _Ip | None  # source_ip


# One check per condition.
_Check = Callable[[FlowFacts, _View], bool]
_EMPTY_VIEW = _View((), frozenset(), None, None)


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


class _IpSet:
    """CIDR list as sorted, merged integer intervals per IP version."""

    __slots__ = ("_ends", "_starts")

    def __init__(self, cidrs: Sequence[str]) -> None:
        spans: dict[int, list[tuple[int, int]]] = {4: [], 6: []}
        for cidr in cidrs:
            net = ipaddress.ip_network(cidr, strict=False)
            version: int = net.version
            first, last = int(net.network_address), int(net[-1])
            if version == 6 and net.prefixlen >= 96:
                mapped = net.network_address.ipv4_mapped  # type: ignore[union-attr]
                if mapped is not None:  # ::ffff:a.b.c.d/n also covers a.b.c.d as IPv4
                    v4 = int(mapped)
                    spans[4].append((v4, v4 + (last - first)))
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

    def __contains__(self, ip: _Ip) -> bool:
        version, value = ip
        starts = self._starts[version]
        k = bisect.bisect_right(starts, value) - 1
        return k >= 0 and value <= self._ends[version][k]


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


def _domain_check(values: Sequence[str]) -> _Check:
    names = frozenset(_norm_host(v) for v in values)

    def check(facts: FlowFacts, view: _View) -> bool:
        return not names.isdisjoint(view.hosts)

    return check


def _suffix_check(values: Sequence[str]) -> _Check:
    # view.suffixes holds every dot-suffix of the hosts ("a.example.com", "example.com",
    # "com"), so one set intersection answers "equal to s or ends with '.' + s".
    suffixes = frozenset(_norm_host(v) for v in values)

    def check(facts: FlowFacts, view: _View) -> bool:
        return not suffixes.isdisjoint(view.suffixes)

    return check


def _keyword_check(values: Sequence[str]) -> _Check:
    keywords = tuple(dict.fromkeys(v.lower() for v in values))

    def check(facts: FlowFacts, view: _View) -> bool:
        for h in view.hosts:
            for k in keywords:
                if k in h:
                    return True
        return False

    return check


def _regex_check(values: Sequence[str]) -> _Check:
    patterns = tuple(re.compile(v, re.IGNORECASE) for v in values)

    def check(facts: FlowFacts, view: _View) -> bool:
        for h in view.hosts:
            for p in patterns:
                if p.search(h) is not None:
                    return True
        return False

    return check


def _ip_check(values: Sequence[str]) -> _Check:
    nets = _IpSet(values)

    def check(facts: FlowFacts, view: _View) -> bool:
        ip = view.ip
        return ip is not None and ip in nets

    return check


def _source_ip_check(values: Sequence[str]) -> _Check:
    nets = _IpSet(values)

    def check(facts: FlowFacts, view: _View) -> bool:
        src = view.src
        return src is not None and src in nets

    return check


def _port_check(values: Sequence[str]) -> _Check:
    ports = _PortSet(values)

    def check(facts: FlowFacts, view: _View) -> bool:
        return facts.port in ports

    return check


def _source_port_check(values: Sequence[str]) -> _Check:
    ports = _PortSet(values)

    def check(facts: FlowFacts, view: _View) -> bool:
        return facts.source_port is not None and facts.source_port in ports

    return check


def _network_check(value: str) -> _Check:
    def check(facts: FlowFacts, view: _View) -> bool:
        return facts.network == value

    return check


def _attr_check(attr: str) -> Callable[[Sequence[str]], _Check]:
    def build(values: Sequence[str]) -> _Check:
        allowed = frozenset(values)

        def check(facts: FlowFacts, view: _View) -> bool:
            return getattr(facts, attr) in allowed

        return check

    return build


# Cheapest checks first: a rule fails as soon as one condition does.
_BUILDERS: tuple[tuple[str, Callable[..., _Check]], ...] = (
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
    ("domain_regex", _regex_check),
)
_DOMAIN_KEYS = frozenset({"domain", "domain_suffix", "domain_keyword", "domain_regex"})


@dataclass(frozen=True, slots=True)
class _CompiledRule:
    checks: tuple[_Check, ...]
    decision: RouteDecision  # prebuilt for mode "rule"


@dataclass(frozen=True, slots=True)
class RuleSet:
    """Precompiled rules; build with :func:`compile_rules`."""

    rules: tuple[_CompiledRule, ...]
    #: Any rule uses domain, domain_suffix, domain_keyword or domain_regex (so the sniffed
    #: host can change the route).
    has_domain_conditions: bool
    #: Index of the first rule with a domain condition (``len(rules)`` when none): a
    #: sniffed host can change a decision only if this is below the matched index.
    first_domain_rule: int
    has_suffix_conditions: bool
    has_ip_conditions: bool
    #: Index of the first rule with an ip_cidr condition (``len(rules)`` when none): a
    #: domain target's address can change a decision only if this is below the match.
    first_ip_rule: int
    has_source_ip_conditions: bool
    #: Any rule names a ``process_name`` (``runtime.process_lookup: auto`` looks up then).
    has_process_conditions: bool
    #: Whether deciding must parse the target host as an IP literal.
    needs_host_ip: bool
    #: Whether deciding derives anything from the facts before trying rules.
    needs_view: bool


def _condition_text(conditions: dict[str, tuple[str, ...] | str]) -> str:
    """``key=item|item,...``; ``conditions`` is already in CONDITION_KEYS order."""
    return ",".join(
        f"{key}={value if isinstance(value, str) else '|'.join(value)}"
        for key, value in conditions.items()
    )


def compile_rules(rules: Sequence[Rule]) -> RuleSet:
    """Precompile validated configuration rules (``Config.rules``) for :func:`decide`."""
    compiled: list[_CompiledRule] = []
    keys_used: set[str] = set()
    first_domain_rule = first_ip_rule = len(rules)
    for index, rule in enumerate(rules):
        conditions = rule.conditions()
        keys_used.update(conditions)
        if first_ip_rule == len(rules) and "ip_cidr" in conditions:
            first_ip_rule = index
        if first_domain_rule == len(rules) and not _DOMAIN_KEYS.isdisjoint(conditions):
            first_domain_rule = index
        checks = tuple(build(conditions[key]) for key, build in _BUILDERS if key in conditions)
        matched = MatchedRule(index, _condition_text(conditions))
        if rule.action == "block":
            decision = RouteDecision("rule", "block", None, matched)
        else:
            decision = RouteDecision("rule", "route", rule.outbound, matched)
        compiled.append(_CompiledRule(checks, decision))
    has_domain = bool(keys_used & _DOMAIN_KEYS)
    has_ip = "ip_cidr" in keys_used
    has_source_ip = "source_ip_cidr" in keys_used
    return RuleSet(
        rules=tuple(compiled),
        has_domain_conditions=has_domain,
        first_domain_rule=first_domain_rule,
        has_suffix_conditions="domain_suffix" in keys_used,
        has_ip_conditions=has_ip,
        first_ip_rule=first_ip_rule,
        has_source_ip_conditions=has_source_ip,
        has_process_conditions="process_name" in keys_used,
        needs_host_ip=has_domain or has_ip,
        needs_view=has_domain or has_ip or has_source_ip,
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


#: Longest a flow (or ``diagnostics.trace_route``) waits for its target's address when an
#: ip_cidr rule needs it (:func:`needs_address`); a name that does not resolve in time
#: meets the rules without one.
RULE_RESOLVE_TIMEOUT = 5.0


def needs_address(
    ruleset: RuleSet, mode_kind: str, facts: FlowFacts, decision: RouteDecision
) -> bool:
    """Whether ``decision`` (what :func:`decide` gave for ``facts``) may change once the
    target's address is known: mode ``rule``, a domain target without ``resolved_ip``,
    and an ``ip_cidr`` rule ranked before the match (or any, when none matched).

    The caller then resolves the target (its first address, as it would dial it) and
    decides again with ``resolved_ip``; a name that does not resolve keeps ``decision``.
    """
    if mode_kind != "rule" or facts.resolved_ip is not None or not facts.host:
        return False
    if _parse_target(facts.host) is not None:
        return False
    bound = decision.matched_rule.index if decision.matched_rule else len(ruleset.rules)
    return ruleset.first_ip_rule < bound


def _dot_suffixes(hosts: tuple[str, ...]) -> frozenset[str]:
    out: set[str] = set()
    for host in hosts:
        out.add(host)
        dot = host.find(".")
        while dot >= 0:
            out.add(host[dot + 1 :])
            dot = host.find(".", dot + 1)
    return frozenset(out)


def _view(ruleset: RuleSet, facts: FlowFacts) -> _View:
    host_ip = _parse_target(facts.host) if ruleset.needs_host_ip else None
    hosts: tuple[str, ...] = ()
    suffixes: frozenset[str] = frozenset()
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
    ip: _Ip | None = None
    if ruleset.has_ip_conditions:
        ip = host_ip if host_ip is not None else _parse_target(facts.resolved_ip)
    src = _parse_ip(facts.source_ip) if ruleset.has_source_ip_conditions else None
    return _View(hosts, suffixes, ip, src)


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
