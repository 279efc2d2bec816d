"""Shared C sets (``sw_set``, ``csrc/route.h``): rule sets, GeoIP countries and GeoSite lists
compiled once and shared by every route table that names them.

A set is an OR over items of any kind (names, keywords, networks, ports, networks of a
flow, and flags for what only Python checks), built through a bulk API: one cffi call per
kind with a packed buffer (NUL-terminated names one after the other, or packed addresses
and prefix lengths), so 300,000 names cost one call, not 300,000. The C side holds the
GIL-free part (hashing and sorting): cffi releases the GIL around each call, so a big set
built on a publishing thread does not stall the rest of the engine.

:class:`CompiledSet` owns one reference to a sealed ``sw_set``; a route table takes its own
(``sw_table_cond_sets``), so a set lives while a table or a :class:`CompiledSet` holds it.
:func:`rule_set_parts`, :func:`geoip_set` and :func:`geosite_set` keep what they built in
weak caches keyed by the source object (a :class:`~spliceway.routing.ruleset.RuleSetData`,
a :class:`~spliceway.routing.geodata.GeoIp`): every table compiled while a provider's
content stays the same reuses its set, and a refreshed provider (a new ``RuleSetData``)
gets a new one while the old one goes with the last table using it.

What a set from a :class:`RuleSetData` holds, as :func:`spliceway.routing.rules.decide`
reads it: its exact / suffix / subdomain / wildcard names and keywords; its regexes as a
flag (a flow with a domain name is then unknown to C and deferred to Python, unless
another item matches); its networks (the target's address, or the client's for
``rule_set_ip_cidr_match_source``); and each classical line that is one condition C has an
item for (``domain*``, ``ip_cidr``, ``source_ip_cidr``, ports, ``network``,
``process_name`` as a flag). Other classical lines (several conditions, logical lines, an
``inbound_tag``...) are returned as parts for the table compiler, which gives each its own
C rule; lines naming ``geoip`` / ``ip_asn`` / ``geosite`` become further sets.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from spliceway._relay import ffi, lib
from spliceway.config import SubRule, parse_port_spec
from spliceway.config.validators import GEOIP_BUILTIN_CODES
from spliceway.native.relay import check
from spliceway.routing.rules import PRIVATE_CIDRS
from spliceway.routing.ruleset import Cidr, RuleSetData, parse_cidr

if TYPE_CHECKING:
    from spliceway.routing.geodata import GeoDatabases, GeoIp

__all__ = [
    "CompiledSet",
    "RuleSetParts",
    "SetInfo",
    "build_set",
    "geoip_set",
    "geosite_set",
    "rule_set_parts",
]

#: ``sw_set_item``: how a name item matches.
EXACT: int = lib.SW_SET_EXACT
SUFFIX: int = lib.SW_SET_SUFFIX
SUBDOMAIN: int = lib.SW_SET_SUBDOMAIN
WILDCARD: int = lib.SW_SET_WILDCARD
KEYWORD: int = lib.SW_SET_KEYWORD
_DST: int = lib.SW_COND_DST
_SRC: int = lib.SW_COND_SRC
_NETWORKS = {"tcp": lib.SW_NET_TCP, "udp": lib.SW_NET_UDP}


class SetInfo(NamedTuple):
    """``sw_set_info``: what a sealed set holds and the heap bytes it takes."""

    bytes: int
    names: int
    keywords: int
    wildcards: int
    nets4: int
    nets6: int
    ports: int
    flags: int


class CompiledSet:
    """One sealed ``sw_set`` (this object owns one reference; tables take their own)."""

    __slots__ = ("__weakref__", "_ptr")

    def __init__(self, ptr: Any) -> None:
        self._ptr = ptr

    @property
    def ptr(self) -> Any:
        """The ``sw_set *`` (still owned by this object)."""
        return self._ptr

    def info(self) -> SetInfo:
        """What the set holds (``sw_set_info_get``)."""
        out = ffi.new("sw_set_info *")
        check(lib.sw_set_info_get(self._ptr, out), "sw_set_info_get")
        return SetInfo(
            out.bytes, out.names, out.keywords, out.wildcards, out.nets4, out.nets6, out.ports,
            out.flags,
        )  # fmt: skip

    def has_name(self, host: str) -> bool:
        """Whether a name item (exact, suffix, subdomain, wildcard, keyword) matches ``host``
        (one trailing dot ignored, ASCII case-insensitive)."""
        data = host.encode("utf-8", "surrogatepass")
        rc = lib.sw_set_has_name(self._ptr, data, len(data))
        check(rc, "sw_set_has_name")
        return rc == 1

    def has_address(self, address: str, *, source: bool = False) -> bool:
        """Whether a network of the target (or, with ``source``, client) field holds
        ``address`` (an IPv4-mapped IPv6 address is read as IPv4)."""
        version, value, _ = parse_cidr(address)
        packed = value.to_bytes(4 if version == 4 else 16, "big")
        rc = lib.sw_set_has_addr(self._ptr, _SRC if source else _DST, version, packed)
        check(rc, "sw_set_has_addr")
        return rc == 1


def _pack(items: Iterable[str]) -> tuple[bytes, bool]:
    """NUL-terminated UTF-8 strings one after the other, and whether every item fitted
    (an item holding a NUL cannot be written: it is left out)."""
    seq = list(items)
    if not seq:
        return b"", True
    text = "\0".join(seq)
    whole = text.count("\0") == len(seq) - 1
    if not whole:
        text = "\0".join(s for s in seq if "\0" not in s)
        if not text and all("\0" in s for s in seq):
            return b"", False
    return (text + "\0").encode("utf-8", "surrogatepass"), whole


def _add_names(ptr: Any, kind: int, items: Iterable[str]) -> bool:
    buf, whole = _pack(items)
    if buf:
        check(lib.sw_set_domains(ptr, kind, buf, len(buf)), "sw_set_domains")
    return whole


def _add_cidrs(ptr: Any, field: int, cidrs: Iterable[Cidr]) -> None:
    by_version: dict[int, tuple[list[bytes], list[int]]] = {4: ([], []), 6: ([], [])}
    for version, value, prefix in cidrs:
        addrs, prefixes = by_version[version]
        addrs.append(value.to_bytes(4 if version == 4 else 16, "big"))
        prefixes.append(prefix)
    for version, (addrs, prefixes) in by_version.items():
        if addrs:
            rc = lib.sw_set_cidrs(
                ptr, field, version, b"".join(addrs), bytes(prefixes), len(prefixes)
            )
            check(rc, "sw_set_cidrs")


def build_set(
    *,
    exact: Iterable[str] = (),
    suffix: Iterable[str] = (),
    subdomain: Iterable[str] = (),
    wildcard: Iterable[str] = (),
    keyword: Iterable[str] = (),
    domain_opaque: bool = False,
    cidr: Iterable[Cidr] = (),
    source_cidr: Iterable[Cidr] = (),
    ports: Iterable[str] = (),
    source_ports: Iterable[str] = (),
    networks: Iterable[str] = (),
    process: bool = False,
    opaque: bool = False,
) -> CompiledSet:
    """A sealed set of these items (names already normalised: lowercase, no trailing dot;
    C only lowercases ASCII). ``domain_opaque``: an item only Python checks on a name (a
    regex), ``process``: a ``process_name`` item, ``opaque``: an item only Python checks.
    A name with a NUL cannot be written and makes the set ``domain_opaque``."""
    out = ffi.new("sw_set **")
    check(lib.sw_set_new(out), "sw_set_new")
    ptr = ffi.gc(out[0], lib.sw_set_free)
    whole = True
    for kind, items in (
        (EXACT, exact), (SUFFIX, suffix), (SUBDOMAIN, subdomain), (WILDCARD, wildcard),
        (KEYWORD, keyword),
    ):  # fmt: skip
        whole = _add_names(ptr, kind, items) and whole
    _add_cidrs(ptr, _DST, cidr)
    _add_cidrs(ptr, _SRC, source_cidr)
    for field, specs in ((_DST, ports), (_SRC, source_ports)):
        for spec in specs:
            lo, hi = parse_port_spec(str(spec))
            check(lib.sw_set_port(ptr, field, lo, hi), "sw_set_port")
    for network in networks:
        check(lib.sw_set_network(ptr, _NETWORKS[network]), "sw_set_network")
    flags = 0
    if domain_opaque or not whole:
        flags |= lib.SW_SET_F_DOMAIN_OPAQUE
    if process:
        flags |= lib.SW_SET_F_PROCESS
    if opaque:
        flags |= lib.SW_SET_F_OPAQUE
    if flags:
        check(lib.sw_set_flags(ptr, flags), "sw_set_flags")
    check(lib.sw_set_seal(ptr), "sw_set_seal")
    return CompiledSet(ptr)


def _compiles(patterns: Iterable[str]) -> bool:
    """Whether any regex compiles (routing skips the ones that do not)."""
    for text in patterns:
        try:
            re.compile(text, re.IGNORECASE)
        except re.error:
            continue
        return True
    return False


# ---------------------------------------------------------------------------
# Rule sets: one set per (RuleSetData, match source), plus the parts C rules carry
# ---------------------------------------------------------------------------


class RuleSetParts(NamedTuple):
    """What a rule set compiles to for one rule.

    The set matches when ``main`` or one of ``extra`` (GeoIP / GeoSite sets its classical
    lines name) does, or one of ``rules`` (classical lines no set item can express, each
    compiled as a rule part of its own).
    """

    main: CompiledSet
    extra: tuple[CompiledSet, ...]
    rules: tuple[SubRule, ...]


class _Folded(NamedTuple):
    main: CompiledSet
    #: Classical lines that are one geo condition: (key, values).
    geo: tuple[tuple[str, tuple[str, ...]], ...]
    rules: tuple[SubRule, ...]


#: Conditions a classical line may have alone and still be a set item.
_ITEM_KEYS = frozenset({
    "domain", "domain_suffix", "domain_keyword", "domain_regex", "ip_cidr", "source_ip_cidr",
    "port", "source_port", "network", "process_name",
})  # fmt: skip
_GEO_KEYS = frozenset({"geoip", "source_geoip", "ip_asn", "source_ip_asn", "geosite"})


def _values(value: tuple[str, ...] | str) -> tuple[str, ...]:
    return (value,) if isinstance(value, str) else value


def _norm_name(text: str) -> str:
    """routing._norm_host: str.lower, one trailing dot dropped."""
    text = text.lower()
    return text[:-1] if text.endswith(".") else text


def _cidr_of(text: str) -> Cidr:
    """A configuration network (``10.0.0.0/8``, validated already) as a Cidr."""
    import ipaddress

    net = ipaddress.ip_network(text, strict=False)
    return net.version, int(net.network_address), net.prefixlen


def _fold(data: RuleSetData, match_source: bool) -> _Folded:
    items: dict[str, list[Any]] = {k: [] for k in _ITEM_KEYS}
    geo: list[tuple[str, tuple[str, ...]]] = []
    rules: list[SubRule] = []
    for part in data.classical:
        conditions = part.conditions()
        if part.is_logical or part.invert or len(conditions) != 1:
            rules.append(part)
            continue
        ((key, value),) = conditions.items()
        if key in _ITEM_KEYS:
            items[key].extend(_values(value))
        elif key in _GEO_KEYS:
            geo.append((key, _values(value)))
        else:
            rules.append(part)
    regexes = [*data.regex, *items["domain_regex"]]
    cidrs = list(data.cidr)
    main = build_set(
        exact=[*data.exact, *(_norm_name(v) for v in items["domain"])],
        suffix=[*data.suffix, *(_norm_name(v) for v in items["domain_suffix"])],
        subdomain=data.subdomain,
        wildcard=data.wildcard,
        keyword=[*(k.lower() for k in data.keyword), *(k.lower() for k in items["domain_keyword"])],
        domain_opaque=_compiles(regexes),
        # The set's own networks look at the client with match_source; a classical line's
        # ip_cidr is a rule part of its own, which always looks at the target.
        cidr=[*([] if match_source else cidrs), *(_cidr_of(v) for v in items["ip_cidr"])],
        source_cidr=[
            *(cidrs if match_source else []),
            *(_cidr_of(v) for v in items["source_ip_cidr"]),
        ],
        ports=items["port"],
        source_ports=items["source_port"],
        networks=items["network"],
        process=bool(items["process_name"]),
    )
    return _Folded(main, tuple(geo), tuple(rules))


_lock = threading.Lock()
#: (RuleSetData) -> {match_source: _Folded}.
_RULE_SETS: weakref.WeakKeyDictionary[RuleSetData, dict[bool, _Folded]] = (
    weakref.WeakKeyDictionary()
)
#: (GeoIp) -> {(kind, key, source): CompiledSet}.
_GEOIP: weakref.WeakKeyDictionary[GeoIp, dict[tuple[str, Any, bool], CompiledSet]] = (
    weakref.WeakKeyDictionary()
)
_PRIVATE: dict[bool, CompiledSet] = {}


def _folded(data: RuleSetData, match_source: bool) -> _Folded:
    with _lock:
        per = _RULE_SETS.get(data)
        if per is not None and match_source in per:
            return per[match_source]
    # Built outside the lock (a big set takes a while); two builders race harmlessly.
    folded = _fold(data, match_source)
    with _lock:
        per = _RULE_SETS.setdefault(data, {})
        return per.setdefault(match_source, folded)


def rule_set_parts(
    data: RuleSetData, *, match_source: bool, geo: GeoDatabases | None
) -> RuleSetParts:
    """The sets and rule parts of rule set ``data`` for a rule (``match_source``:
    ``rule_set_ip_cidr_match_source``); ``geo`` serves its lines naming GeoIP/GeoSite."""
    folded = _folded(data, match_source)
    extra: list[CompiledSet] = []
    for key, values in folded.geo:
        if key == "geosite":
            extra.extend(geosite_sets(values, geo))
        else:
            extra.extend(geoip_sets(key, values, geo))
    return RuleSetParts(folded.main, tuple(extra), folded.rules)


def geosite_set(data: RuleSetData) -> CompiledSet:
    """The set of a GeoSite list (a domain :class:`RuleSetData`: cached like a rule set)."""
    return _folded(data, False).main


def geosite_sets(names: Sequence[str], geo: GeoDatabases | None) -> list[CompiledSet]:
    """A ``geosite`` condition's sets: one per list the database has (missing ones match
    nothing, as routing's)."""
    site = geo.geosite if geo is not None else None
    out = []
    for name in names:
        if site is None:
            continue
        try:
            out.append(geosite_set(site.domains(name)))
        except KeyError:
            continue
    return out


def _private_set(source: bool) -> CompiledSet:
    with _lock:
        found = _PRIVATE.get(source)
    if found is None:
        cidrs = [parse_cidr(c) for c in PRIVATE_CIDRS]
        found = build_set(source_cidr=cidrs) if source else build_set(cidr=cidrs)
        with _lock:
            found = _PRIVATE.setdefault(source, found)
    return found


def geoip_set(db: GeoIp, kind: str, key: Any, *, source: bool) -> CompiledSet:
    """The set of one country code (``kind`` ``code``) or AS number (``asn``) of ``db``,
    its networks on the target's (or, with ``source``, the client's) address."""
    cache_key = (kind, key, source)
    with _lock:
        per = _GEOIP.get(db)
        if per is not None and cache_key in per:
            return per[cache_key]
    cidrs = db.asn_networks(int(key)) if kind == "asn" else db.networks(str(key))
    built = build_set(source_cidr=cidrs) if source else build_set(cidr=cidrs)
    with _lock:
        per = _GEOIP.setdefault(db, {})
        return per.setdefault(cache_key, built)


def geoip_sets(key: str, values: Sequence[str], geo: GeoDatabases | None) -> list[CompiledSet]:
    """A ``geoip`` / ``source_geoip`` / ``ip_asn`` / ``source_ip_asn`` condition's sets:
    one per code or number (``private``/``lan`` the built-in ranges); a missing database
    matches nothing, as routing's."""
    asn = key in ("ip_asn", "source_ip_asn")
    source = key.startswith("source_")
    db = None if geo is None else (geo.asn if asn else geo.geoip)
    out = []
    for value in values:
        if not asn and value.lower() in GEOIP_BUILTIN_CODES:
            out.append(_private_set(source))
        elif db is not None:
            out.append(geoip_set(db, "asn" if asn else "code", value, source=source))
    return out
