"""Compile routing rules into the C route table (``csrc/route.h``) and keep its Python mirror.

:func:`compile_route_table` turns validated configuration rules (``Config.rules``), a mode,
the final tag and the route targets into a sealed ``sw_table`` built through
``spliceway._relay``, plus a :class:`CompiledRoutes` that owns it and maps every result
the C side can give back to exactly the :class:`spliceway.routing.rules.RouteDecision`
:func:`spliceway.routing.rules.decide` returns for the same flow (the rule decisions are the
ones :func:`spliceway.routing.rules.compile_rules` prebuilt).

What the engine supplies, because only it knows them: the index of each inbound tag
(config order), the id of each principal key, and for each route target tag what the C
path does with it (:class:`TargetSpec`). Targets are indexed in the mapping's order.

One configured rule may become several C rules. A rule is multiplied out into its
disjunctive normal form (its *terms*): a ``rule_set`` condition is one set condition
(``sw_table_cond_sets``: every named set's shared C set, :mod:`spliceway.native.route_sets`,
ORed) or one of the sets' classical lines that no set item can express (each a term of its
own); a logical ``or`` adds the terms of its parts, an ``and`` multiplies them; ``invert``
on a rule of one term is the C rule's own flag (``SW_RULE_INVERT``), anywhere else the
negation is pushed down to the conditions (De Morgan; a negated set condition is
``SW_SETCOND_INVERT``, a negated plain condition a set of its items inverted). Each term is
one C rule with the rule's action and target; the terms after the first carry
``SW_RULE_GROUPED`` (an unknown term is overruled by a later one that holds), and
:attr:`CompiledRoutes.rule_of` maps every C rule back to its configured rule, whose
decision C's answer stands for. Within a term, a condition kind met twice (two parts of an
``and``) is intersected for a single-valued fact (network, inbound, principal) and
otherwise becomes a set condition of its own. ``geoip`` / ``ip_asn`` (and ``source_``)
are set conditions over one set per code (the database's networks), ``geosite`` over one
per list. Every C rule carries ``SW_RULE_RESOLVES`` or ``SW_RULE_NO_RESOLVE`` as
:func:`spliceway.routing.rules.rule_resolves` says for its configured rule, so C's first
resolving rule is routing's ``first_ip_rule`` (rules before it see only an IP-literal
target's address). A rule that would multiply past :data:`MAX_TERMS` C rules (or copy
more than :data:`MAX_COPIED_ITEMS` condition items) is compiled as its own conditions
plus an opaque one (only opaque, when inverted or logical): C defers on reaching it.

What C cannot check is compiled as opaque (``sw_table_cond_opaque``), so reaching such a
term defers to Python: ``domain_regex``, a domain item whose lowercased text holds a NUL
(a C string cannot carry it; that condition of the term is then left to Python), a
negated ``inbound_tag`` / ``principal_key`` (no id stands for "none of them, or none at
all"), logical rules nested deeper than eight. A set's regexes make the set unknown to C
for a flow with a name (``SW_SET_F_DOMAIN_OPAQUE``). ``process_name`` is a process
condition (``sw_table_cond_process``, or a set's ``SW_SET_F_PROCESS``): only a client on
this host has a process, which only Python finds, so reaching such a rule defers for a
source on this host (loopback or one of ``local_addresses``) and fails for any other, as
``routing.decide`` fails it for a flow without a ``process_name``; with ``process_mode``
``off`` it never holds. Inbound tags and principal keys missing from the mappings are
dropped: a query can only name mapped ones (:meth:`CompiledRoutes.decide` answers None for
a flow whose tag or key is not mapped); a condition left with no item gets the "none"
value, which never matches.

The sets are built once per rule set content (cached by
:class:`~spliceway.routing.ruleset.RuleSetData`), so recompiling for a new selection or
mode costs the rules, not their sets; :func:`prepare_sets` builds them ahead (off the
thread that installs a configuration).
"""

from __future__ import annotations

import ipaddress
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from spliceway._relay import ffi, lib
from spliceway.config import BUILTIN_DIRECT, Rule, SubRule, parse_port_spec
from spliceway.native.relay import check
from spliceway.native.route_sets import (
    CompiledSet,
    build_set,
    geoip_sets,
    geosite_sets,
    rule_set_parts,
)
from spliceway.routing import hostnorm
from spliceway.routing import rules as routing

__all__ = [
    "NO_INBOUND",
    "NO_PRINCIPAL",
    "OUT_BLOCK",
    "OUT_DEFER",
    "OUT_DIRECT",
    "OUT_HTTP",
    "OUT_SOCKS5",
    "PROCESS_MODES",
    "CompiledRoutes",
    "TargetSpec",
    "compile_route_table",
    "prepare_sets",
]

#: ``sw_out_kind``: what a route target is to the C connection path.
OUT_DEFER: int = lib.SW_OUT_DEFER
OUT_DIRECT: int = lib.SW_OUT_DIRECT
OUT_BLOCK: int = lib.SW_OUT_BLOCK
OUT_SOCKS5: int = lib.SW_OUT_SOCKS5
OUT_HTTP: int = lib.SW_OUT_HTTP

#: Query values meaning "no inbound" / "no principal": conditions on them never match.
NO_INBOUND: int = 0xFFFFFFFF
NO_PRINCIPAL: int = lib.SW_NO_PRINCIPAL

_MODES = {"rule": lib.SW_MODE_RULE, "global": lib.SW_MODE_GLOBAL, "direct": lib.SW_MODE_DIRECT}
_DOMAIN_KINDS = {
    "domain": lib.SW_DOMAIN_EXACT,
    "domain_suffix": lib.SW_DOMAIN_SUFFIX,
    "domain_keyword": lib.SW_DOMAIN_KEYWORD,
}
_OPAQUE_KEYS = ("domain_regex",)
#: ``runtime.process_lookup`` -> ``sw_process_mode``.
PROCESS_MODES: dict[str, int] = {
    "off": lib.SW_PROCESS_OFF,
    "auto": lib.SW_PROCESS_RULES,
    "always": lib.SW_PROCESS_ALL,
}
_NETWORKS = {"tcp": lib.SW_NET_TCP, "udp": lib.SW_NET_UDP}


class TargetSpec(NamedTuple):
    """One route target as the C path sees it (``sw_table_target``).

    ``kind`` is one of the ``OUT_*`` constants; ``server``/``port``/``user``/``password``
    matter for socks5 and http (``user`` None: no credentials).
    """

    kind: int
    server: str | None = None
    port: int = 0
    user: str | None = None
    password: str | None = None
    connect_timeout_ms: int = 0
    #: The leaf outbound's tag, which C's failure messages name (as Python's do).
    outbound_tag: str | None = None


def _cstr(text: str | None, what: str) -> Any:
    """``text`` as a NUL-terminated C string argument (NULL for None)."""
    if text is None:
        return ffi.NULL
    data = text.encode("utf-8", "surrogatepass")
    if b"\0" in data:
        raise ValueError(f"{what} {text!r} contains a NUL character")
    return data


def _parse_source(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``text`` as routing._parse_ip reads it (brackets allowed), or None."""
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


class CompiledRoutes:
    """A sealed C route table and its Python mirror.

    ``epoch`` and ``targets`` (tags by index) are as compiled. A configured rule may
    become several C rules (a rule set's classical lines, logical rules multiplied out):
    ``rule_of[c]`` is the configured rule C rule ``c`` came from, and
    ``rule_decisions[c]`` what :func:`routing.decide` returns when that rule matches in
    mode ``rule``. ``first_domain_rule`` is :attr:`routing.RuleSet.first_domain_rule`
    (a configured rule's index; ``sw_table_first_domain_rule`` counts C rules, and every
    opaque one).

    The table is freed when this object is collected, by :meth:`close`, or becomes the
    caller's with :meth:`detach`.
    """

    __slots__ = (
        "_final_decision",
        "_mode_decision",
        "_ruleset",
        "_table",
        "epoch",
        "first_domain_rule",
        "inbounds",
        "mode_kind",
        "principals",
        "rule_decisions",
        "rule_of",
        "targets",
    )

    def __init__(
        self,
        table: Any,
        *,
        epoch: int,
        targets: tuple[str, ...],
        mode_kind: str,
        mode_decision: routing.RouteDecision | None,
        final_decision: routing.RouteDecision,
        ruleset: routing.RuleSet,
        inbounds: Mapping[str, int | Sequence[int]],
        principals: Mapping[str, int],
        rule_of: Sequence[int] | None = None,
    ) -> None:
        self._table = table
        self.epoch = epoch
        self.targets = targets
        self.mode_kind = mode_kind
        self._mode_decision = mode_decision
        self._final_decision = final_decision
        # Weakly: the engine keeps the mirrors of many tables (a flow's record names the
        # table that routed it), and a strong reference would keep every rule set a
        # refresh replaced (tens of MB for a big one) alive with them. A mirror needs only
        # the decisions below.
        self._ruleset = weakref.ref(ruleset)
        self.rule_of: tuple[int, ...] = (
            tuple(range(len(ruleset.rules))) if rule_of is None else tuple(rule_of)
        )
        self.rule_decisions: tuple[routing.RouteDecision, ...] = tuple(
            ruleset.rules[i].decision for i in self.rule_of
        )
        self.first_domain_rule = ruleset.first_domain_rule
        self.inbounds = dict(inbounds)
        self.principals = dict(principals)

    @property
    def ruleset(self) -> routing.RuleSet | None:
        """The rules this table was compiled from, while the engine still uses them (the
        generation that holds them, a flow deciding with them); None after."""
        return self._ruleset()

    @property
    def table(self) -> Any:
        """The ``sw_table *`` (still owned by this object)."""
        if self._table is None:
            raise RuntimeError("route table already detached or closed")
        return self._table

    def detach(self) -> Any:
        """Hand the table over: returns the raw ``sw_table *``, which the caller frees."""
        table = self.table
        self._table = None
        ffi.gc(table, None)  # drops the finaliser; `table` stays a plain pointer
        return table

    def close(self) -> None:
        """Free the table now (idempotent; nothing after :meth:`detach`)."""
        table, self._table = self._table, None
        if table is not None:
            ffi.gc(table, None)
            lib.sw_table_free(table)

    def decision(self, action: int, rule: int, target: int) -> routing.RouteDecision | None:
        """The RouteDecision for a ``sw_route_result`` of this table; None for a deferral.

        Raises ValueError for a result this table cannot have given.
        """
        if action == lib.SW_ROUTE_DEFER:
            return None
        if self._mode_decision is not None:
            decision = self._mode_decision
        elif rule < 0:
            decision = self._final_decision
        elif rule < len(self.rule_decisions):
            decision = self.rule_decisions[rule]
        else:
            raise ValueError(f"rule {rule} out of range")
        if decision.action == "block":
            fits = action == lib.SW_ROUTE_BLOCK
        else:
            tag = self.targets[target] if 0 <= target < len(self.targets) else None
            fits = action == lib.SW_ROUTE_ROUTE and tag == decision.target
        if not fits:
            raise ValueError(f"result ({action}, {rule}, {target}) does not fit epoch {self.epoch}")
        return decision

    def decide(self, facts: routing.FlowFacts) -> routing.RouteDecision | None:
        """Route ``facts`` through the C table; None when C defers or cannot express the facts."""
        result = self.query(facts)
        return None if result is None else self.decision(*result)

    def query(self, facts: routing.FlowFacts) -> tuple[int, int, int] | None:
        """``sw_table_decide`` on ``facts``: ``(action, rule, target)``, or None for facts C
        cannot express.

        Those are: a ``resolved_ip`` that is not an address (C's query carries one only
        as bytes), a ``process_name`` (C never knows one), an inbound tag or principal key
        missing from the mappings, a port outside 0..65535, and a source address and port
        of which only one is known or the address does not parse.
        """
        if facts.process_name is not None:
            return None
        query = ffi.new("sw_route_query *")
        if facts.resolved_ip is not None:
            resolved = hostnorm.target_address(facts.resolved_ip)
            if resolved is None:
                return None
            ip = ipaddress.ip_address(resolved.partition("%")[0])
            query.resolved_family = ip.version
            ffi.memmove(query.resolved_ip, ip.packed, len(ip.packed))
        keep: list[Any] = []
        if not 0 <= facts.port <= 0xFFFF:
            return None
        query.port = facts.port
        host = facts.host.encode("utf-8", "surrogatepass")
        keep.append(ffi.from_buffer(host))
        query.host, query.host_len = keep[-1], len(host)
        if facts.sniffed_host:
            sniffed = facts.sniffed_host.encode("utf-8", "surrogatepass")
            keep.append(ffi.from_buffer(sniffed))
            query.sniffed, query.sniffed_len = keep[-1], len(sniffed)
        if (facts.source_ip is None) != (facts.source_port is None):
            return None
        if facts.source_ip is not None and facts.source_port is not None:
            src = _parse_source(facts.source_ip)
            if src is None or not 0 <= facts.source_port <= 0xFFFF:
                return None
            query.source_family = src.version
            packed = src.packed
            ffi.memmove(query.source_ip, packed, len(packed))
            query.source_port = facts.source_port
        query.network = _NETWORKS.get(facts.network, 0)
        if facts.inbound_tag is None:
            query.inbound = NO_INBOUND
        elif facts.inbound_tag in self.inbounds:
            query.inbound = _ids(self.inbounds[facts.inbound_tag])[0]
        else:
            return None
        if facts.principal_key is None:
            query.principal = NO_PRINCIPAL
        elif facts.principal_key in self.principals:
            query.principal = self.principals[facts.principal_key]
        else:
            return None
        out = ffi.new("sw_route_result *")
        check(lib.sw_table_decide(self.table, query, out), "sw_table_decide")
        return out.action, out.rule, out.target


def _values(value: tuple[str, ...] | str) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else value


def _ids(value: int | Sequence[int]) -> Sequence[int]:
    """The ids a tag stands for: one, or several (a TUN's listener per family)."""
    return (value,) if isinstance(value, int) else value


# ---------------------------------------------------------------------------
# Rules -> C rules
# ---------------------------------------------------------------------------

#: One condition of a C rule: ``("plain", key, items)`` a condition C has a kind for,
#: ``("sets", sets, flags)`` a set condition (``sw_table_cond_sets``), ``("opaque",)``
#: one only Python checks.
_Atom = tuple[Any, ...]
#: A C rule: every atom holds.
_Term = tuple[_Atom, ...]
#: Terms any of which holds (a rule's disjunctive normal form).
_Dnf = list[_Term]

_OPAQUE: _Atom = ("opaque",)
#: A set condition over no set: never holds.
_NEVER: _Atom = ("sets", (), 0)
_PLAIN_KEYS = frozenset({
    "domain", "domain_suffix", "domain_keyword", "ip_cidr", "source_ip_cidr", "port",
    "source_port", "network", "inbound_tag", "principal_key", "process_name",
})  # fmt: skip
_GEOIP_KEYS = frozenset({"geoip", "source_geoip", "ip_asn", "source_ip_asn"})
#: Conditions over one value of the flow: two of them hold when the intersection does.
_SINGLE_VALUED = frozenset({"network", "inbound_tag", "principal_key"})
#: Most C rules one configured rule becomes (logical rules multiply out, a rule set's
#: classical lines each add one); past it the rule is compiled as opaque (deferred).
MAX_TERMS = 1024
#: Most condition items the copies of a rule's other conditions may add up to (each C
#: rule of a rule carries its own copy).
MAX_COPIED_ITEMS = 200_000
#: Deepest nesting of logical rules (and rule-set lines) compiled into C.
_MAX_DEPTH = 8


class _TooBig(Exception):
    """A rule multiplies out past MAX_TERMS / MAX_COPIED_ITEMS."""


def _weight(term: _Term) -> int:
    return sum(len(a[2]) for a in term if a[0] == "plain")


def _product(dnfs: Sequence[_Dnf]) -> _Dnf:
    """AND of the DNFs, multiplied out."""
    out: _Dnf = [()]
    for dnf in dnfs:
        if len(out) * len(dnf) > MAX_TERMS:
            raise _TooBig
        out = [a + b for a in out for b in dnf]
    if sum(map(_weight, out)) > MAX_COPIED_ITEMS:
        raise _TooBig
    return out


def _norm_name(text: str) -> str:
    """routing._norm_host: str.lower, one trailing dot dropped."""
    text = text.lower()
    return text[:-1] if text.endswith(".") else text


def _cidrs(items: Iterable[str]) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for text in items:
        net = ipaddress.ip_network(text, strict=False)
        out.append((net.version, int(net.network_address), net.prefixlen))
    return out


def _item_set(key: str, items: Sequence[str]) -> CompiledSet | None:
    """A set of one plain condition's items (None for a kind sets do not have)."""
    if key == "domain":
        return build_set(exact=[_norm_name(v) for v in items])
    if key == "domain_suffix":
        return build_set(suffix=[_norm_name(v) for v in items])
    if key == "domain_keyword":
        return build_set(keyword=[v.lower() for v in items])
    if key == "ip_cidr":
        return build_set(cidr=_cidrs(items))
    if key == "source_ip_cidr":
        return build_set(source_cidr=_cidrs(items))
    if key == "port":
        return build_set(ports=items)
    if key == "source_port":
        return build_set(source_ports=items)
    if key == "network":
        return build_set(networks=items)
    if key == "process_name":
        return build_set(process=True)
    return None


def _negate_atom(atom: _Atom) -> _Atom:
    if atom[0] == "sets":
        return ("sets", atom[1], atom[2] ^ lib.SW_SETCOND_INVERT)
    if atom[0] == "plain":
        found = _item_set(atom[1], atom[2])
        if found is not None:
            return ("sets", (found,), lib.SW_SETCOND_INVERT)
    # inbound_tag / principal_key: "none" matches the negation, which no id expresses.
    return _OPAQUE


class _RuleCompiler:
    """Turns configured rules into C rules (terms), with the sets they name."""

    def __init__(self, ruleset: routing.RuleSet) -> None:
        self.rule_sets = ruleset.rule_sets
        self.geo = ruleset.geo

    def compile(self, rule: Rule) -> tuple[_Dnf, bool]:
        """The C rules (terms) of ``rule``, and whether they carry SW_RULE_INVERT (an
        inverted rule of one term: C negates the whole rule, exactly; otherwise the
        negation is pushed down to the conditions, De Morgan's way)."""
        try:
            inner = self._dnf(rule, 0, neg=False, own_invert=False)
            if rule.invert:
                if len(inner) == 1:
                    return inner, True
                inner = self._dnf(rule, 0, neg=True, own_invert=False)
        except _TooBig:
            # Its own conditions still have to hold (unless inverted): only the rest is
            # left to Python.
            if rule.invert or rule.is_logical:
                return [(_OPAQUE,)], False
            return [(*self._atoms(rule), _OPAQUE)], False
        if not inner:
            return [(_NEVER,)], False
        # A term C may defer on goes last: a term that holds decides first.
        inner.sort(key=lambda t: any(a is _OPAQUE for a in t))
        return inner, False

    def _dnf(self, rule: Rule | SubRule, depth: int, *, neg: bool, own_invert: bool = True) -> _Dnf:
        """The DNF of ``rule`` (of its negation with ``neg``; ``own_invert``: counting the
        rule's own ``invert``), negations pushed down to the conditions."""
        if depth > _MAX_DEPTH:
            return [(_OPAQUE,)]
        flip = neg != (rule.invert and own_invert)
        if rule.is_logical:
            parts = [self._dnf(p, depth + 1, neg=flip) for p in rule.rules or ()]
            if not parts:
                return [()] if flip else []  # no parts never holds
            # NOT(and) is the OR of the negated parts, NOT(or) their AND.
            if (rule.mode == "and") != flip:
                return _product(parts)
            out = [t for p in parts for t in p]
            if len(out) > MAX_TERMS:
                raise _TooBig
            return out
        atoms = self._atoms(rule)
        if not flip:
            out = [tuple(atoms)]
            if rule.rule_set is not None:
                out = _product([out, self._rule_sets(rule, depth, neg=False)])
            return out
        # NOT(a and b and sets) = NOT a or NOT b or NOT sets.
        out = [(_negate_atom(a),) for a in atoms]
        if rule.rule_set is not None:
            out += self._rule_sets(rule, depth, neg=True)
        if len(out) > MAX_TERMS:
            raise _TooBig
        return out

    def _atoms(self, rule: Rule | SubRule) -> list[_Atom]:
        """The atoms of a plain rule's conditions but ``rule_set``."""
        atoms: list[_Atom] = []
        for key, value in rule.conditions().items():
            items = _values(value)
            if key in _PLAIN_KEYS:
                # A C string cannot carry a NUL: that condition is left to Python.
                nul = key.startswith("domain") and any("\0" in v.lower() for v in items)
                atoms.append(_OPAQUE if nul else ("plain", key, items))
            elif key == "domain_regex":
                atoms.append(_OPAQUE)
            elif key == "geosite":
                atoms.append(("sets", tuple(geosite_sets(items, self.geo)), 0))
            elif key in _GEOIP_KEYS:
                atoms.append(("sets", tuple(geoip_sets(key, items, self.geo)), 0))
            elif key != "rule_set":  # pragma: no cover - a CONDITION_KEYS entry unknown here
                raise ValueError(f"unknown rule condition {key!r}")
        return atoms

    def _rule_sets(self, rule: Rule | SubRule, depth: int, *, neg: bool) -> _Dnf:
        """``rule_set`` (negated with ``neg``): its sets in one set condition, or one of
        their other parts (negated: none of the sets, and no part)."""
        sets: list[CompiledSet] = []
        parts: list[SubRule] = []
        for name in rule.rule_set or ():
            data = self.rule_sets.get(name)
            if data is None:
                continue  # matches nothing, as routing's
            found = rule_set_parts(
                data, match_source=rule.rule_set_ip_cidr_match_source, geo=self.geo
            )
            sets += [found.main, *found.extra]
            parts += found.rules
        flags = lib.SW_SETCOND_INVERT if neg else 0
        head: _Dnf = [(("sets", tuple(sets), flags),)]
        if neg:
            return _product([head, *(self._dnf(p, depth + 1, neg=True) for p in parts)])
        out = head
        for part in parts:
            out += self._dnf(part, depth + 1, neg=False)
            if len(out) > MAX_TERMS:
                raise _TooBig
        return out


def _cond_domains(table: Any, index: int, key: str, items: Sequence[str]) -> None:
    """Rule ``index``'s ``key`` domains (none holds a NUL: see _RuleCompiler._atoms)."""
    # routing lowercases with str.lower (Unicode-aware): C gets the result and
    # only drops the trailing dot (domain, domain_suffix) and lowercases ASCII.
    for v in items:
        data = v.lower().encode("utf-8", "surrogatepass")
        check(lib.sw_table_cond_domain(table, index, _DOMAIN_KINDS[key], data), "cond_domain")


def _cond_ids(
    table: Any,
    index: int,
    key: str,
    items: Sequence[str],
    mapping: Mapping[str, int | Sequence[int]],
    none: int,
    add: Any,
) -> None:
    """Rule ``index``'s inbound_tag / principal_key condition: the ids of the listed
    names, or ``none`` (matches nothing) when no name has one."""
    ids = sorted({i for v in items if v in mapping for i in _ids(mapping[v])}) or [none]
    for i in ids:
        check(add(table, index, i), f"sw_table_cond_{key}")


def _cond_sets(table: Any, index: int, sets: Sequence[CompiledSet], flags: int) -> None:
    ptrs = ffi.new("sw_set *[]", [s.ptr for s in sets] or [ffi.NULL])
    check(lib.sw_table_cond_sets(table, index, flags, ptrs, len(sets)), "sw_table_cond_sets")


def _group(
    term: _Term,
) -> tuple[dict[str, list[str]], list[tuple[Sequence[CompiledSet], int]], bool]:
    """A term's atoms as one C rule's conditions: ``(plain, setconds, opaque)``. A kind met
    twice (two parts of an AND) is one condition of the intersection for a single-valued
    fact, else a set condition of its own (a C rule ORs the items of one kind)."""
    plain: dict[str, list[str]] = {}
    setconds: list[tuple[Sequence[CompiledSet], int]] = []
    opaque = False
    for atom in term:
        if atom[0] == "opaque":
            opaque = True
        elif atom[0] == "sets":
            setconds.append((atom[1], atom[2]))
        else:
            key, items = atom[1], atom[2]
            if key not in plain:
                plain[key] = list(items)
            elif key in _SINGLE_VALUED:
                plain[key] = [v for v in plain[key] if v in items]
            elif key != "process_name":  # a second one fails as the first
                found = _item_set(key, items)
                assert found is not None
                setconds.append(((found,), 0))
    if plain.get("network") == []:  # an empty intersection: never holds
        del plain["network"]
        setconds.append(((), 0))
    return plain, setconds, opaque


def _emit_plain(
    table: Any,
    index: int,
    key: str,
    items: Sequence[str],
    inbounds: Mapping[str, int | Sequence[int]],
    principals: Mapping[str, int],
) -> None:
    """One plain condition of C rule ``index``."""
    if key in _DOMAIN_KINDS:
        _cond_domains(table, index, key, items)
    elif key == "process_name":
        check(lib.sw_table_cond_process(table, index), "sw_table_cond_process")
    elif key in ("ip_cidr", "source_ip_cidr"):
        field = lib.SW_COND_DST if key == "ip_cidr" else lib.SW_COND_SRC
        for v in items:
            net = ipaddress.ip_network(v, strict=False)
            addr = ffi.new("uint8_t[]", net.network_address.packed)
            rc = lib.sw_table_cond_cidr(table, index, field, net.version, addr, net.prefixlen)
            check(rc, "sw_table_cond_cidr")
    elif key in ("port", "source_port"):
        field = lib.SW_COND_DST if key == "port" else lib.SW_COND_SRC
        for v in items:
            lo, hi = parse_port_spec(str(v))
            check(lib.sw_table_cond_port(table, index, field, lo, hi), "sw_table_cond_port")
    elif key == "network":
        for v in items:
            check(lib.sw_table_cond_network(table, index, _NETWORKS[v]), "cond_network")
    elif key == "inbound_tag":
        _cond_ids(table, index, key, items, inbounds, NO_INBOUND, lib.sw_table_cond_inbound)
    else:  # principal_key
        _cond_ids(table, index, key, items, principals, NO_PRINCIPAL, lib.sw_table_cond_principal)


def _emit_term(
    table: Any,
    index: int,
    term: _Term,
    inbounds: Mapping[str, int | Sequence[int]],
    principals: Mapping[str, int],
) -> None:
    """C rule ``index``'s conditions: the term's atoms (see _group)."""
    plain, setconds, opaque = _group(term)
    for key, items in plain.items():
        _emit_plain(table, index, key, items, inbounds, principals)
    for sets, flags in setconds:
        _cond_sets(table, index, sets, flags)
    if opaque:
        check(lib.sw_table_cond_opaque(table, index), "sw_table_cond_opaque")


def _check_ids(what: str, ids: Mapping[str, int | Sequence[int]], none: int) -> None:
    """ValueError when an id is out of range (``none`` and above are not ids)."""
    bad = sorted(k for k, v in ids.items() if not all(0 <= i < none for i in _ids(v)))
    if bad:
        raise ValueError(f"{what} ids out of range for {', '.join(map(repr, bad))}")


def _write_targets(table: Any, specs: Iterable[TargetSpec]) -> None:
    """The table's targets, index = position in ``specs``."""
    for i, spec in enumerate(specs):
        rc = lib.sw_table_target(
            table,
            i,
            spec.kind,
            _cstr(spec.server, "server"),
            spec.port,
            _cstr(spec.user, "user"),
            _cstr(spec.password, "password"),
            spec.connect_timeout_ms,
        )
        check(rc, "sw_table_target")
        if spec.outbound_tag is not None:
            rc = lib.sw_table_target_tag(table, i, _cstr(spec.outbound_tag, "outbound tag"))
            check(rc, "sw_table_target_tag")


def _mode_decision(mode_kind: str, mode_outbound: str | None) -> routing.RouteDecision | None:
    """The decision every flow gets in a ``global`` or ``direct`` mode (None: ``rule``)."""
    if mode_kind == "rule":
        return None
    if mode_kind == "global":
        return routing.RouteDecision("global", "route", mode_outbound, None)
    return routing.RouteDecision("direct", "route", BUILTIN_DIRECT, None)


def prepare_sets(rules: Sequence[Rule], ruleset: routing.RuleSet) -> None:
    """Build (and cache) every C set ``rules`` name with ``ruleset``'s rule sets and
    databases, so that :func:`compile_route_table` later only finds them. A set of
    300,000 names takes about 0.2 s, most of it in C with the GIL released: call this where
    a configuration is prepared, off the thread that installs it."""
    compiler = _RuleCompiler(ruleset)
    for rule in rules:
        compiler.compile(rule)


def compile_route_table(
    rules: Sequence[Rule],
    *,
    mode_kind: str,
    mode_outbound: str | None,
    final: str,
    targets: Mapping[str, TargetSpec] | Sequence[tuple[str, TargetSpec]],
    inbounds: Mapping[str, int | Sequence[int]],
    principals: Mapping[str, int],
    epoch: int,
    ruleset: routing.RuleSet | None = None,
    deferred_inbounds: Sequence[int] = (),
    deferred_cidrs: Sequence[str] = (),
    process_lookup: str = "auto",
    local_addresses: Sequence[str] = (),
) -> CompiledRoutes:
    """Build and seal the C table for ``rules`` under a mode; return it with its mirror.

    ``mode_kind``/``mode_outbound``/``final`` are what :func:`routing.decide` takes;
    ``targets`` gives every tag a rule, ``final`` or the mode can route to (``direct`` in
    mode ``direct``) its :class:`TargetSpec` (or a plain tuple of its fields), as a
    mapping or a list of ``(tag, spec)``; index = position. ``inbounds`` maps inbound
    tags to indexes, ``principals`` principal keys to ids (both below 2**32 - 1, the
    "none" value); ``epoch`` is stored in the table; ``ruleset`` is
    ``routing.compile_rules(rules)`` if the caller has it already.
    ``deferred_inbounds`` are listener slots whose flows C hands to Python after the
    handshake, before routing (the flow hook's inbounds); the decisions are unchanged.
    ``deferred_cidrs`` are networks (fake-ip ranges) whose IP-literal targets C hands to
    Python likewise, which routes them by the domain the address stands for.
    ``process_lookup`` is ``runtime.process_lookup`` (``always``: C hands Python every
    flow from a client on this host likewise, to find its process before routing) and
    ``local_addresses`` this host's addresses (loopback is always local).

    Raises ValueError for a bad mode, a missing or repeated target tag, an id out of
    range, or a target string with a NUL; RelayError if C refuses (e.g. ENOMEM).
    """
    if mode_kind not in _MODES:
        raise ValueError(f"unknown mode {mode_kind!r}")
    if mode_kind == "global" and not mode_outbound:
        raise ValueError("global mode needs an outbound")
    pairs = list(targets.items()) if isinstance(targets, Mapping) else list(targets)
    specs = {tag: TargetSpec(*spec) for tag, spec in pairs}
    if len(specs) != len(pairs):
        raise ValueError("a route target tag is listed twice")
    _check_ids("inbound", inbounds, NO_INBOUND)
    _check_ids("principal", principals, NO_PRINCIPAL)
    tags = tuple(specs)
    index = {tag: i for i, tag in enumerate(tags)}
    mode_tag = {"rule": None, "global": mode_outbound, "direct": BUILTIN_DIRECT}[mode_kind]
    needed = [final, *(r.outbound for r in rules if r.action == "route"), mode_tag]
    missing = sorted({t for t in needed if t is not None and t not in index})
    if missing:
        raise ValueError(f"no route target for {', '.join(map(repr, missing))}")
    if ruleset is None:
        ruleset = routing.compile_rules(rules)
    if len(ruleset.rules) != len(rules):
        raise ValueError("ruleset does not belong to these rules")

    # Multiplied out first: the table is created with its C rule count.
    compiler = _RuleCompiler(ruleset)
    compiled = [compiler.compile(rule) for rule in rules]
    rule_of = [i for i, (terms, _) in enumerate(compiled) for _ in terms]
    resolving = [routing.rule_resolves(rule, ruleset.rule_sets) for rule in rules]

    out = ffi.new("sw_table **")
    check(lib.sw_table_new(len(rule_of), len(tags), epoch, out), "sw_table_new")
    table = ffi.gc(out[0], lib.sw_table_free)
    _write_targets(table, specs.values())
    mode_target = -1 if mode_tag is None else index[mode_tag]
    rc = lib.sw_table_set_mode(table, _MODES[mode_kind], mode_target, index[final])
    check(rc, "sw_table_set_mode")
    c = 0
    for i, (rule, (terms, invert)) in enumerate(zip(rules, compiled, strict=True)):
        target = index[rule.outbound] if rule.action == "route" and rule.outbound else -1
        action = lib.SW_ROUTE_BLOCK if rule.action == "block" else lib.SW_ROUTE_ROUTE
        # Python says which rules resolve (a set's networks may not: no-resolve lines).
        flags = lib.SW_RULE_RESOLVES if resolving[i] else lib.SW_RULE_NO_RESOLVE
        if invert:
            flags |= lib.SW_RULE_INVERT
        for k, term in enumerate(terms):
            check(lib.sw_table_rule(table, c, action, target), "sw_table_rule")
            grouped = lib.SW_RULE_GROUPED if k else 0
            check(lib.sw_table_rule_flags(table, c, flags | grouped), "sw_table_rule_flags")
            _emit_term(table, c, term, inbounds, principals)
            c += 1
    for slot in deferred_inbounds:
        check(lib.sw_table_defer_inbound(table, slot), "sw_table_defer_inbound")
    for cidr in deferred_cidrs:
        net = ipaddress.ip_network(cidr, strict=False)
        addr = ffi.new("uint8_t[]", net.network_address.packed)
        rc = lib.sw_table_defer_cidr(table, net.version, addr, net.prefixlen)
        check(rc, "sw_table_defer_cidr")
    check(lib.sw_table_set_process(table, PROCESS_MODES[process_lookup]), "sw_table_set_process")
    for text in local_addresses:
        ip = ipaddress.ip_address(text)
        rc = lib.sw_table_local_addr(table, ip.version, ffi.new("uint8_t[]", ip.packed))
        check(rc, "sw_table_local_addr")
    check(lib.sw_table_seal(table), "sw_table_seal")

    return CompiledRoutes(
        table,
        epoch=epoch,
        targets=tags,
        mode_kind=mode_kind,
        mode_decision=_mode_decision(mode_kind, mode_outbound),
        final_decision=routing.RouteDecision("rule", "route", final, None),
        ruleset=ruleset,
        inbounds=inbounds,
        principals=principals,
        rule_of=rule_of,
    )
