"""Clash (mihomo) rule lines read into spliceway rules.

:func:`parse_rule_line` reads one line of a Clash ``rules:`` list
(``DOMAIN-SUFFIX,google.com,Proxy``) or of a ``classical`` rule set (no target) the way
mihomo does (``config/config.go`` ``parseRules``, ``rules/parser.go`` ``ParseRule``,
``rules/logic/logic.go``, ``rules/provider/classical_strategy.go``), and gives back a
spliceway rule (a dict as a ``rules[]`` entry is written, without ``action`` and
``outbound``) with the target's name, or :class:`Unsupported` saying why it cannot.

Splitting, as mihomo (1.19.x, ``rules/common/base.go`` ``ParseRulePayload``) does it,
the same for a ``rules:`` line, a classical rule-set line and a logic rule's part: split
on ``,``, every field trimmed of spaces, the type upper-cased. For ``AND``, ``OR``,
``NOT``, ``SUB-RULE``, ``DOMAIN-REGEX`` and ``PROCESS-NAME-REGEX``/``PROCESS-PATH-REGEX``
the last field is the target and everything between is the payload (which may hold
commas); otherwise ``TYPE,payload,target[,params...]`` and ``MATCH,target``; a line
without a target (a rule set's, a logic part) is ``TYPE,payload[,params...]``. Params:
``no-resolve``, ``src`` (``src`` implies ``no-resolve``). A logic payload is a list of
parenthesised parts, ``((DOMAIN,a.com),(NETWORK,UDP))``; ``MATCH`` and ``SUB-RULE`` are
refused inside one, and ``MATCH``, ``RULE-SET`` and ``SUB-RULE`` in a rule set.

What each type becomes: ``DOMAIN`` ``domain``; ``DOMAIN-SUFFIX`` ``domain_suffix``;
``DOMAIN-KEYWORD`` ``domain_keyword`` (lowercased, IDNA as mihomo does);
``DOMAIN-REGEX`` ``domain_regex``; ``DOMAIN-WILDCARD`` a ``domain_regex`` (``*`` any
run of characters, ``?`` one); ``GEOSITE`` ``geosite`` (``!name``: ``invert``);
``GEOIP`` ``geoip`` (``src``: ``source_geoip``); ``SRC-GEOIP`` ``source_geoip``;
``IP-ASN``/``SRC-IP-ASN`` ``ip_asn``/``source_ip_asn``; ``IP-CIDR``/``IP-CIDR6``
``ip_cidr`` (``src``: ``source_ip_cidr``); ``SRC-IP-CIDR`` ``source_ip_cidr``;
``DST-PORT``/``SRC-PORT`` ``port``/``source_port``; ``NETWORK`` ``network``;
``PROCESS-NAME`` ``process_name``; ``RULE-SET`` ``rule_set`` (``src``:
``rule_set_ip_cidr_match_source``); ``no-resolve``: ``no_resolve``; ``AND``/``OR`` a
logical rule (an ``AND`` of plain parts that name distinct conditions is flattened into
one plain rule); ``NOT`` ``invert``; ``MATCH`` a rule with no condition (the importer
makes it ``route.final``). ``IN-PORT``, ``IN-TYPE``, ``IN-NAME`` and ``IN-USER`` need
an :class:`InboundContext` (the importer's inbounds) and become ``inbound_tag`` /
``principal_key``.

:class:`Unsupported`: ``IP-SUFFIX``/``SRC-IP-SUFFIX``, ``DSCP``, ``UID``,
``SUB-RULE``, ``PROCESS-PATH``, the ``*-REGEX``/``*-WILDCARD`` process types, a regex
Python cannot compile, the inbound types without a context, and every line mihomo
itself refuses (the reason says so).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "InboundContext",
    "ParsedRule",
    "Unsupported",
    "parse_rule_line",
    "single_item",
]

#: Types whose last field is the target, everything between the payload.
_SPLIT_TYPES = frozenset(
    {"NOT", "OR", "AND", "SUB-RULE", "DOMAIN-REGEX", "PROCESS-NAME-REGEX", "PROCESS-PATH-REGEX"}
)
_LOGIC_TYPES = frozenset({"AND", "OR", "NOT"})

#: Why spliceway cannot evaluate these types.
_NOT_EVALUATED: dict[str, str] = {
    "IP-SUFFIX": "no spliceway condition matches the low bits of an address",
    "SRC-IP-SUFFIX": "no spliceway condition matches the low bits of an address",
    "DSCP": "spliceway does not read a connection's DSCP field",
    "UID": "spliceway does not match the client process's user id",
    "SUB-RULE": "spliceway has no sub-rule lists (mihomo's sub-rules)",
    "PROCESS-PATH": "spliceway matches a process by name (process_name), not by path",
    "PROCESS-NAME-REGEX": "spliceway matches process names exactly, not by regular expression",
    "PROCESS-PATH-REGEX": "spliceway matches a process by name (process_name), not by path",
    "PROCESS-NAME-WILDCARD": "spliceway matches process names exactly, not by wildcard",
    "PROCESS-PATH-WILDCARD": "spliceway matches a process by name (process_name), not by path",
}

#: mihomo's ``ParseRule`` types (and the newer ``*-WILDCARD`` ones).
KNOWN_TYPES: frozenset[str] = frozenset(
    {
        "DOMAIN",
        "DOMAIN-SUFFIX",
        "DOMAIN-KEYWORD",
        "DOMAIN-REGEX",
        "DOMAIN-WILDCARD",
        "GEOSITE",
        "GEOIP",
        "SRC-GEOIP",
        "IP-ASN",
        "SRC-IP-ASN",
        "IP-CIDR",
        "IP-CIDR6",
        "SRC-IP-CIDR",
        "IP-SUFFIX",
        "SRC-IP-SUFFIX",
        "SRC-PORT",
        "DST-PORT",
        "IN-PORT",
        "DSCP",
        "PROCESS-NAME",
        "PROCESS-PATH",
        "PROCESS-NAME-REGEX",
        "PROCESS-PATH-REGEX",
        "PROCESS-NAME-WILDCARD",
        "PROCESS-PATH-WILDCARD",
        "NETWORK",
        "UID",
        "IN-TYPE",
        "IN-USER",
        "IN-NAME",
        "SUB-RULE",
        "AND",
        "OR",
        "NOT",
        "RULE-SET",
        "MATCH",
    }
)

#: mihomo's inbound types (``IN-TYPE``); ``SOCKS`` stands for both SOCKS versions.
IN_TYPES: frozenset[str] = frozenset(
    {
        "HTTP",
        "HTTPS",
        "SOCKS4",
        "SOCKS5",
        "SHADOWSOCKS",
        "VMESS",
        "VLESS",
        "REDIR",
        "TPROXY",
        "TROJAN",
        "TUNNEL",
        "TUN",
        "TUIC",
        "HYSTERIA2",
        "ANYTLS",
        "INNER",
    }
)


@dataclass(frozen=True, slots=True)
class InboundContext:
    """What inbound-dependent rule types need, from the importer's inbounds.

    ``by_port``: inbound tags listening on each port (``IN-PORT``); ``by_type``:
    inbound tags by mihomo inbound type, upper case (``HTTP``, ``SOCKS5``, ``TUN``...;
    ``IN-TYPE``); ``by_name``: inbound tag by mihomo listener name (``IN-NAME``);
    ``users``: principal key by username (``IN-USER``).
    """

    by_port: Mapping[int, Sequence[str]] = field(default_factory=dict)
    by_type: Mapping[str, Sequence[str]] = field(default_factory=dict)
    by_name: Mapping[str, str] = field(default_factory=dict)
    users: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ParsedRule:
    """A line spliceway evaluates: ``rule`` is a ``rules[]`` entry without ``action``
    and ``outbound`` (``{}`` for ``MATCH``), ``target`` the proxy or group name the
    line names (None for a rule-set line). ``type`` is the Clash type, upper case."""

    type: str
    rule: dict[str, Any]
    target: str | None
    line: str
    #: Notes on a meaning that differs slightly from mihomo's (the importer reports them).
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Unsupported:
    """A line spliceway does not evaluate: its Clash ``type`` and why (``reason``)."""

    type: str
    reason: str
    line: str = ""
    target: str | None = None


class _Refused(Exception):
    """A part of a line cannot be carried over (type, reason)."""

    def __init__(self, type_: str, reason: str) -> None:
        super().__init__(reason)
        self.type = type_
        self.reason = reason


# ---------------------------------------------------------------------------
# Payloads
# ---------------------------------------------------------------------------


def _idna_lower(text: str) -> str:
    """mihomo's ``idna.ToASCII(strings.ToLower(x))`` (the text as is if that fails)."""
    text = text.lower()
    if text.isascii():
        return text
    try:
        return ".".join(
            label if label.isascii() else label.encode("idna").decode("ascii")
            for label in text.split(".")
        )
    except UnicodeError:
        return text


def _domain_value(tp: str, payload: str) -> str:
    value = _idna_lower(payload)
    if value.endswith(".") and len(value) > 1:
        value = value[:-1]
    if not value or value.startswith(".") or ".." in value or any(c.isspace() for c in value):
        raise _Refused(tp, f"{payload!r} is not a domain name spliceway can match")
    return value


def _regex_value(tp: str, pattern: str) -> str:
    try:
        re.compile(pattern, re.IGNORECASE)
    except re.error as ex:
        raise _Refused(
            tp, f"regular expression {pattern!r} does not compile in Python's re: {ex}"
        ) from None
    return pattern


def _wildcard_regex(pattern: str) -> str:
    """mihomo's wildcard (``*`` any run of characters, ``?`` one) as an anchored regex."""
    out = []
    for ch in pattern.lower():
        if ch == "*":
            out.append(".*")
        elif ch == "?":
            out.append(".")
        else:
            out.append(re.escape(ch))
    return "^" + "".join(out) + "$"


def _cidr_value(tp: str, payload: str) -> str:
    # Go's netip.ParsePrefix: an address, '/', a prefix length; no zone.
    address, slash, bits = payload.partition("/")
    if not slash or not bits.isdigit() or "%" in address:
        raise _Refused(tp, f"{payload!r} is not a network (mihomo refuses it too)")
    try:
        net = ipaddress.ip_network(payload, strict=False)
        ipaddress.ip_address(address)
    except ValueError:
        raise _Refused(tp, f"{payload!r} is not a network (mihomo refuses it too)") from None
    return str(net) if str(net.network_address) == address else payload


def _ports(tp: str, payload: str) -> list[str]:
    """mihomo's ``NewUnsignedRanges``: ``80``, ``80/443``, ``1000-2000`` (reversed
    ranges swapped), at most 28 items."""
    text = payload.strip().replace(",", "/")
    if not text or text == "*":
        raise _Refused(tp, f"{payload!r} names no port (mihomo refuses it too)")
    items = text.split("/")
    if len(items) > 28:
        raise _Refused(tp, "more than 28 port ranges (mihomo refuses it too)")
    out: list[str] = []
    for item in items:
        if not item:
            continue
        bounds = item.split("-")
        if len(bounds) > 2:
            raise _Refused(tp, f"{item!r} is not a port range (mihomo refuses it too)")
        values = []
        for b in bounds:
            b = b.strip("[ ]")
            if not b.isascii() or not b.isdigit():
                raise _Refused(tp, f"{item!r} is not a port range (mihomo refuses it too)")
            values.append(int(b))
        if any(v > 65535 for v in values):
            raise _Refused(tp, f"{item!r}: ports are 0..65535")
        lo, hi = min(values), max(values)
        out.append(str(lo) if lo == hi else f"{lo}-{hi}")
    if not out:
        raise _Refused(tp, f"{payload!r} names no port (mihomo refuses it too)")
    return out


def _params(params: Sequence[str]) -> tuple[bool, bool]:
    """``(src, no_resolve)`` as mihomo's ``ParseParams`` reads them."""
    src = "src" in params
    return src, src or "no-resolve" in params


# ---------------------------------------------------------------------------
# One rule (type, payload, params)
# ---------------------------------------------------------------------------


def _in_port(tp: str, payload: str, ctx: InboundContext) -> dict[str, Any]:
    tags: dict[str, None] = {}
    for spec in _ports(tp, payload):
        lo, _, hi = spec.partition("-")
        low, high = int(lo), int(hi or lo)
        for port, names in ctx.by_port.items():
            if low <= port <= high:
                tags.update(dict.fromkeys(names))
    if not tags:
        raise _Refused(tp, f"no imported inbound listens on {payload}")
    return {"inbound_tag": list(tags)}


def _in_type(tp: str, payload: str, ctx: InboundContext) -> dict[str, Any]:
    wanted: list[str] = []
    for item in payload.split("/"):
        kind = item.upper()
        if kind == "SOCKS":
            wanted += ["SOCKS4", "SOCKS5"]
        elif kind in IN_TYPES:
            wanted.append(kind)
        else:
            raise _Refused(tp, f"unknown inbound type {item!r} (mihomo refuses it too)")
    tags: dict[str, None] = {}
    for kind in wanted:
        tags.update(dict.fromkeys(ctx.by_type.get(kind, ())))
    if not tags:
        raise _Refused(tp, f"no imported inbound is of type {payload}")
    return {"inbound_tag": list(tags)}


def _in_name(tp: str, payload: str, ctx: InboundContext) -> dict[str, Any]:
    names = [ctx.by_name[n] for n in payload.split("/") if n in ctx.by_name]
    if not names:
        raise _Refused(tp, f"no imported inbound is named {payload}")
    return {"inbound_tag": list(dict.fromkeys(names))}


def _in_user(tp: str, payload: str, ctx: InboundContext) -> dict[str, Any]:
    keys = [ctx.users[u] for u in payload.split("/") if u in ctx.users]
    if not keys:
        raise _Refused(tp, f"no imported user is named {payload}")
    return {"principal_key": list(dict.fromkeys(keys))}


_IN_TYPES_READERS: dict[str, Callable[[str, str, InboundContext], dict[str, Any]]] = {
    "IN-PORT": _in_port,
    "IN-TYPE": _in_type,
    "IN-NAME": _in_name,
    "IN-USER": _in_user,
}


@dataclass(slots=True)
class _Line:
    """One (type, payload, params) being read, and what reading it noted."""

    tp: str
    payload: str
    src: bool
    no_resolve: bool
    ctx: InboundContext | None
    notes: list[str]

    @property
    def flag(self) -> dict[str, Any]:
        return {"no_resolve": True} if self.no_resolve else {}


def _r_domain(x: _Line) -> dict[str, Any]:
    return {"domain": [_domain_value(x.tp, x.payload)]}


def _r_suffix(x: _Line) -> dict[str, Any]:
    return {"domain_suffix": [_domain_value(x.tp, x.payload)]}


def _r_keyword(x: _Line) -> dict[str, Any]:
    value = _idna_lower(x.payload)
    if not value:
        raise _Refused(x.tp, "an empty keyword matches every name (refused)")
    return {"domain_keyword": [value]}


def _r_regex(x: _Line) -> dict[str, Any]:
    return {"domain_regex": [_regex_value(x.tp, x.payload)]}


def _r_wildcard(x: _Line) -> dict[str, Any]:
    x.notes.append("DOMAIN-WILDCARD: the sniffed host is tried too (mihomo: the target only)")
    return {"domain_regex": [_wildcard_regex(x.payload)]}


def _r_geosite(x: _Line) -> dict[str, Any]:
    name = x.payload.strip().lower()
    invert = name.startswith("!")
    name = name.removeprefix("!")
    list_name = name.split("@", 1)[0].strip()
    if not list_name or any(c.isspace() for c in name):
        raise _Refused(x.tp, f"{x.payload!r} is not a geosite list name (mihomo refuses it too)")
    attrs = [a.strip() for a in name.split("@")[1:] if a.strip()]
    value = "@".join([list_name, *attrs])
    return {"geosite": [value], **({"invert": True} if invert else {})}


def _r_geoip(x: _Line) -> dict[str, Any]:
    code = x.payload.lower()
    if not re.fullmatch(r"[a-z0-9_-]+", code):
        raise _Refused(x.tp, f"{x.payload!r} is not a country code")
    if x.tp == "SRC-GEOIP" or x.src:
        return {"source_geoip": [code]}
    return {"geoip": [code], **x.flag}


def _r_asn(x: _Line) -> dict[str, Any]:
    if not x.payload.isascii() or not x.payload.isdigit():
        raise _Refused(x.tp, f"{x.payload!r} is not an AS number (it never matches in mihomo)")
    if x.tp == "SRC-IP-ASN" or x.src:
        return {"source_ip_asn": [x.payload]}
    return {"ip_asn": [x.payload], **x.flag}


def _r_cidr(x: _Line) -> dict[str, Any]:
    value = _cidr_value(x.tp, x.payload)
    if x.tp == "SRC-IP-CIDR" or x.src:
        return {"source_ip_cidr": [value]}
    return {"ip_cidr": [value], **x.flag}


def _r_port(x: _Line) -> dict[str, Any]:
    return {"port" if x.tp == "DST-PORT" else "source_port": _ports(x.tp, x.payload)}


def _r_network(x: _Line) -> dict[str, Any]:
    network = x.payload.upper()
    if network not in ("TCP", "UDP"):
        raise _Refused(x.tp, f"{x.payload!r}: only TCP or UDP (mihomo refuses it too)")
    return {"network": network.lower()}


def _r_process(x: _Line) -> dict[str, Any]:
    if not x.payload:
        raise _Refused(x.tp, "an empty process name")
    x.notes.append("PROCESS-NAME: spliceway compares process names case-sensitively")
    return {"process_name": [x.payload]}


def _r_inbound(x: _Line) -> dict[str, Any]:
    if x.ctx is None:
        raise _Refused(x.tp, "needs the imported inbounds (an inbound context) to match")
    return _IN_TYPES_READERS[x.tp](x.tp, x.payload, x.ctx)


def _r_rule_set(x: _Line) -> dict[str, Any]:
    if not x.payload:
        raise _Refused(x.tp, "names no rule provider")
    rule: dict[str, Any] = {"rule_set": [x.payload]}
    if x.src:
        rule["rule_set_ip_cidr_match_source"] = True
    elif x.no_resolve:
        rule["no_resolve"] = True
    return rule


def _r_match(x: _Line) -> dict[str, Any]:
    return {}


_READERS: dict[str, Callable[[_Line], dict[str, Any]]] = {
    "DOMAIN": _r_domain,
    "DOMAIN-SUFFIX": _r_suffix,
    "DOMAIN-KEYWORD": _r_keyword,
    "DOMAIN-REGEX": _r_regex,
    "DOMAIN-WILDCARD": _r_wildcard,
    "GEOSITE": _r_geosite,
    "GEOIP": _r_geoip,
    "SRC-GEOIP": _r_geoip,
    "IP-ASN": _r_asn,
    "SRC-IP-ASN": _r_asn,
    "IP-CIDR": _r_cidr,
    "IP-CIDR6": _r_cidr,
    "SRC-IP-CIDR": _r_cidr,
    "DST-PORT": _r_port,
    "SRC-PORT": _r_port,
    "NETWORK": _r_network,
    "PROCESS-NAME": _r_process,
    "IN-PORT": _r_inbound,
    "IN-TYPE": _r_inbound,
    "IN-NAME": _r_inbound,
    "IN-USER": _r_inbound,
    "RULE-SET": _r_rule_set,
    "MATCH": _r_match,
}


def _one(
    tp: str,
    payload: str,
    params: Sequence[str],
    ctx: InboundContext | None,
    notes: list[str],
) -> dict[str, Any]:
    """mihomo's ``ParseRule`` for one (type, payload, params) into a rule dict."""
    if tp in _LOGIC_TYPES and payload:
        return _logic(tp, payload, ctx, notes)
    if tp == "":
        raise _Refused(tp, f"missing subsequent parameters: {payload} (mihomo refuses it too)")
    if tp not in KNOWN_TYPES:
        raise _Refused(tp, f"unsupported rule type {tp!r} (mihomo refuses it too)")
    if payload == "" and tp != "MATCH":
        raise _Refused(tp, f"missing subsequent parameters: {tp} (mihomo refuses it too)")
    if tp in _NOT_EVALUATED:
        raise _Refused(tp, _NOT_EVALUATED[tp])
    src, no_resolve = _params(params)
    return _READERS[tp](_Line(tp, payload, src, no_resolve, ctx, notes))


# ---------------------------------------------------------------------------
# Logic rules (rules/logic/logic.go)
# ---------------------------------------------------------------------------


def _ranges(payload: str, tp: str) -> list[tuple[int, int]]:
    """Parenthesised ranges, by start (mihomo's ``format``)."""
    stack: list[int] = []
    found: list[tuple[int, int]] = []
    for i, ch in enumerate(payload):
        if ch == "(":
            stack.append(i)
        elif ch == ")":
            if not stack:
                raise _Refused(tp, "missing '(' (mihomo refuses it too)")
            found.append((stack.pop(), i))
    if stack:
        raise _Refused(tp, "format error is missing ) (mihomo refuses it too)")
    return sorted(found)


def _sub_payloads(payload: str, tp: str) -> list[str]:
    """The top-level parts of a logic payload (mihomo's ``parsePayload``)."""
    if not payload.startswith("(") or not payload.endswith(")"):
        raise _Refused(tp, "payload format error (mihomo refuses it too)")
    chosen: list[tuple[int, int]] = []
    for start, end in _ranges(payload, tp):
        if start == 0 and end == len(payload) - 1:
            continue  # the outermost parentheses
        if any(s < start and e > end for s, e in chosen):
            continue  # a part of a part
        chosen.append((start, end))
    return [payload[start + 1 : end] for start, end in chosen]


def _logic_part(text: str, ctx: InboundContext | None, notes: list[str]) -> dict[str, Any]:
    """mihomo's ``payloadToRule``: a part without a target."""
    tp, payload, _, params = _split(text, need_target=False)
    if tp in ("MATCH", "SUB-RULE"):
        raise _Refused(tp, f"{tp} is not allowed in a logic rule (mihomo refuses it too)")
    if tp == "":
        raise _Refused("AND", f"[{text}] format is error (mihomo refuses it too)")
    return _one(tp, payload, params, ctx, notes)


def _flatten_and(parts: list[dict[str, Any]]) -> dict[str, Any] | None:
    """An AND of plain parts naming distinct conditions as one plain rule, else None."""
    merged: dict[str, Any] = {}
    flags: dict[str, bool] = {}
    for part in parts:
        if part.get("type") == "logical" or part.get("invert") or not part:
            return None
        for key, value in part.items():
            if key in ("no_resolve", "rule_set_ip_cidr_match_source"):
                continue
            if key in merged:
                return None
            merged[key] = value
        for flag in ("no_resolve", "rule_set_ip_cidr_match_source"):
            flags[flag] = flags.get(flag, False) or bool(part.get(flag))
    # no_resolve covers every address condition of the rule: flatten only when the
    # parts agree (or only one part has address conditions).
    address_parts = [
        p for p in parts if any(k in p for k in ("ip_cidr", "geoip", "ip_asn", "rule_set"))
    ]
    if len({bool(p.get("no_resolve")) for p in address_parts}) > 1:
        return None
    for flag, on in flags.items():
        if on:
            merged[flag] = True
    return merged


def _logic(tp: str, payload: str, ctx: InboundContext | None, notes: list[str]) -> dict[str, Any]:
    parts = [_logic_part(sub, ctx, notes) for sub in _sub_payloads(payload, tp)]
    if tp == "NOT":
        if len(parts) != 1:
            raise _Refused(tp, "not rule must contain one rule (mihomo refuses it too)")
        part = dict(parts[0])
        if not part:
            raise _Refused(tp, "NOT of an empty rule")
        if part.get("invert"):
            part.pop("invert")
        else:
            part["invert"] = True
        return part
    if not parts:
        # mihomo accepts an empty AND (always true) or OR (never): spliceway has no
        # rule without a condition.
        raise _Refused(tp, f"{tp} with no part")
    if tp == "AND":
        flat = _flatten_and(parts)
        if flat is not None:
            return flat
    return {"type": "logical", "mode": tp.lower(), "rules": parts}


# ---------------------------------------------------------------------------
# Lines
# ---------------------------------------------------------------------------


def _split(line: str, *, need_target: bool) -> tuple[str, str, str, list[str]]:
    """``(type, payload, target, params)`` as mihomo's ``ParseRulePayload`` splits it."""
    items = [item.strip(" ") for item in line.split(",")]
    tp = items[0].upper()
    payload = target = ""
    params: list[str] = []
    if len(items) > 1:
        if tp == "MATCH":
            target = items[1]
        elif tp in _SPLIT_TYPES:
            if need_target:
                target = items[-1]
                items = items[:-1]
            payload = ",".join(items[1:])
        else:
            payload = items[1]
            if need_target:
                if len(items) > 2:
                    target = items[2]
                params = items[3:]
            else:
                params = items[2:]
    return tp, payload, target, params


def parse_rule_line(
    line: str,
    *,
    with_target: bool = True,
    context: InboundContext | None = None,
    in_rule_set: bool | None = None,
) -> ParsedRule | Unsupported:
    """Read one Clash rule line (see the module).

    ``with_target``: a ``rules:`` line (``TYPE,payload,target[,params]``); False: a
    line without target. ``in_rule_set`` (default: ``not with_target``): a classical
    rule set's line (``MATCH``/``RULE-SET``/``SUB-RULE`` refused). ``context`` maps
    inbound-dependent types; without it they are :class:`Unsupported`.
    """
    if in_rule_set is None:
        in_rule_set = not with_target
    tp, payload, target, params = _split(line, need_target=with_target)
    try:
        if with_target and target == "":
            raise _Refused(tp, "format invalid: no target (mihomo refuses it too)")
        if in_rule_set and tp in ("MATCH", "RULE-SET", "SUB-RULE"):
            raise _Refused(
                tp, f"unsupported rule type on classical rule-set: {tp} (mihomo refuses it too)"
            )
        notes: list[str] = []
        rule = _one(tp, payload, params, context, notes)
    except _Refused as ex:
        return Unsupported(ex.type, ex.reason, line, target or None)
    if not rule and tp != "MATCH":
        return Unsupported(tp, "no condition", line, target or None)
    return ParsedRule(tp, rule, target or None, line, tuple(dict.fromkeys(notes)))


def single_item(parsed: ParsedRule) -> tuple[str, str, bool] | None:
    """``(key, value, no_resolve)`` when ``parsed`` is one ``domain``,
    ``domain_suffix``, ``domain_keyword``, ``domain_regex`` or target ``ip_cidr`` item
    (a rule set folds those into its sets); None otherwise."""
    rule = parsed.rule
    no_resolve = bool(rule.get("no_resolve"))
    keys = [k for k in rule if k != "no_resolve"]
    if len(keys) != 1:
        return None
    key = keys[0]
    if key not in ("domain", "domain_suffix", "domain_keyword", "domain_regex", "ip_cidr"):
        return None
    value = rule[key]
    if not isinstance(value, list) or len(value) != 1:
        return None
    return key, value[0], no_resolve
