"""GeoIP (MaxMind ``.mmdb``) and GeoSite (v2fly ``geosite.dat``) databases for rules.

Reads files only when asked (:meth:`GeoIp.open`, :meth:`GeoSite.open`), memoised by the
file's identity (path, ``mtime_ns``, size), so a reload that did not change a file
reuses what was read. A missing or corrupt file raises :class:`GeoDataError` naming it.

GeoIP: a MaxMind-format database read with ``maxminddb``. A record's codes are, as
mihomo reads them: a MaxMind record's ``country.iso_code`` (else, spliceway's addition,
``registered_country.iso_code``); a ``sing-geoip`` database's string; a
``Meta-geoip0`` database's string or list of strings; all lowercased. A record's AS
number is its ``autonomous_system_number`` (GeoLite2-ASN, DB-IP) or an ipinfo ``asn``
(``"AS13335"``). :meth:`GeoIp.networks` walks the whole database once (on first use),
groups the networks by code and by AS number, and gives a code's networks merged into
the fewest CIDRs, which rules match with a bisect (Python) or the C route table.

GeoSite: the protobuf ``GeoSiteList`` of v2fly's ``app/router/routercommon/common.proto``
(the same as mihomo's ``component/geodata/router/config.proto``): lists by
``country_code`` (case-insensitive), each a list of ``Domain`` entries typed ``Plain``
(a keyword), ``Regex``, ``Domain`` (the name and every name below it) and ``Full`` (the
name exactly), with attributes. ``name@attr`` keeps the entries that carry ``attr``
(several ``@`` must all hold), as mihomo's ``LoadGeoSiteMatcher``.
:meth:`GeoSite.domains` gives a list as a :class:`~spliceway.routing.ruleset.RuleSetData`.
"""

from __future__ import annotations

import ipaddress
import os
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import maxminddb
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from spliceway.routing.ruleset import MAX_REASONS, Cidr, RuleSetData, range_to_cidrs

__all__ = [
    "GeoDataError",
    "GeoDatabases",
    "GeoIp",
    "GeoRecord",
    "GeoSite",
    "open_databases",
    "range_to_cidrs",
]


class GeoDataError(ValueError):
    """A geodata file that is missing or cannot be read (the message names it)."""


@dataclass(frozen=True, slots=True)
class GeoRecord:
    """What a GeoIP database says about one address."""

    countries: tuple[str, ...]
    asn: int | None


@dataclass(frozen=True, slots=True)
class GeoDatabases:
    """The databases rules read: ``geoip`` (``geoip``, ``source_geoip``), ``asn``
    (``ip_asn``, ``source_ip_asn``; often the same object as ``geoip``), ``geosite``."""

    geoip: GeoIp | None = None
    asn: GeoIp | None = None
    geosite: GeoSite | None = None


def _identity(path: str) -> tuple[str, int, int, int]:
    try:
        st = os.stat(path)
    except OSError as ex:
        raise GeoDataError(f"{path}: cannot read the file ({ex.strerror})") from None
    return os.path.realpath(path), st.st_mtime_ns, st.st_size, st.st_ino


_CACHE_LOCK = threading.Lock()
_GEOIP_CACHE: dict[str, tuple[tuple[str, int, int, int], GeoIp]] = {}
_GEOSITE_CACHE: dict[str, tuple[tuple[str, int, int, int], GeoSite]] = {}


# ---------------------------------------------------------------------------
# CIDR helpers
# ---------------------------------------------------------------------------


def _merge(version: int, nets: list[int]) -> tuple[Cidr, ...]:
    """Packed networks (``first << 8 | prefix``) merged into the fewest CIDRs."""
    width = 32 if version == 4 else 128
    spans: list[list[int]] = []
    for packed in sorted(nets):
        first, prefix = packed >> 8, packed & 0xFF
        last = first + (1 << (width - prefix)) - 1
        if spans and first <= spans[-1][1] + 1:
            spans[-1][1] = max(spans[-1][1], last)
        else:
            spans.append([first, last])
    out: list[Cidr] = []
    for first, last in spans:
        out.extend(range_to_cidrs(version, first, last))
    return tuple(out)


# ---------------------------------------------------------------------------
# GeoIP
# ---------------------------------------------------------------------------


def _record_codes(record: Any, kind: str) -> tuple[str, ...]:
    if kind == "sing" or (kind == "meta" and isinstance(record, str)):
        return (record.lower(),) if isinstance(record, str) and record else ()
    if kind == "meta":
        if isinstance(record, list):
            return tuple(c.lower() for c in record if isinstance(c, str) and c)
        return ()
    if not isinstance(record, dict):
        return ()
    for key in ("country", "registered_country"):
        sub = record.get(key)
        if isinstance(sub, dict):
            code = sub.get("iso_code")
            if isinstance(code, str) and code:
                return (code.lower(),)
    return ()


def _record_asn(record: Any) -> int | None:
    if not isinstance(record, dict):
        return None
    number = record.get("autonomous_system_number")
    if isinstance(number, int) and not isinstance(number, bool):
        return number
    text = record.get("asn")  # ipinfo: "AS13335"
    if isinstance(text, str) and text[:2].upper() == "AS" and text[2:].isdigit():
        return int(text[2:])
    return None


class GeoIp:
    """One MaxMind-format database (open with :meth:`open`)."""

    def __init__(self, path: str, reader: Any) -> None:
        self.path = path
        self._reader = reader
        meta = reader.metadata()
        self.database_type: str = str(meta.database_type)
        self.ip_version: int = int(meta.ip_version)
        self._kind = {"sing-geoip": "sing", "Meta-geoip0": "meta"}.get(
            self.database_type, "maxmind"
        )
        self._lock = threading.Lock()
        self._by_code: dict[str, dict[int, list[int]]] | None = None
        self._by_asn: dict[int, dict[int, list[int]]] | None = None
        self._merged: dict[tuple[str, Any], tuple[Cidr, ...]] = {}

    @classmethod
    def open(cls, path: str) -> GeoIp:
        """The database at ``path`` (the same object while the file is unchanged)."""
        key = _identity(path)
        with _CACHE_LOCK:
            cached = _GEOIP_CACHE.get(key[0])
            if cached is not None and cached[0] == key:
                return cached[1]
        # The pure-Python reader over mmap: libmaxminddb's C reader (MODE_MMAP_EXT)
        # corrupts its heap on a damaged file, taking the process down.
        try:
            reader = maxminddb.open_database(path, maxminddb.MODE_MMAP)
            db = cls(path, reader)
        except Exception as ex:  # a damaged file fails in many ways: all mean "not one"
            raise GeoDataError(f"{path}: not a MaxMind database ({ex})") from None
        with _CACHE_LOCK:
            _GEOIP_CACHE[key[0]] = (key, db)
        return db

    def lookup(self, ip: str) -> GeoRecord:
        """The codes and AS number the database gives ``ip`` (empty when none)."""
        address = ipaddress.ip_address(ip)
        if address.version == 6 and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        if address.version == 6 and self.ip_version == 4:
            return GeoRecord((), None)
        try:
            record = self._reader.get(address)
        except Exception:  # a damaged record: the address has no data
            return GeoRecord((), None)
        return GeoRecord(_record_codes(record, self._kind), _record_asn(record))

    def _walk(self) -> None:
        """Group every network of the database by code and by AS number (once)."""
        by_pointer: dict[int, dict[int, list[int]]] = {}
        try:
            for version, packed, pointer in self._leaves():
                groups = by_pointer.get(pointer)
                if groups is None:
                    groups = by_pointer[pointer] = {4: [], 6: []}
                groups[version].append(packed)
            by_code: dict[str, dict[int, list[int]]] = {}
            by_asn: dict[int, dict[int, list[int]]] = {}
            # Records are shared by many networks (a country database has a few hundred):
            # each is decoded once.
            for pointer, groups in by_pointer.items():
                record = self._reader._resolve_data_pointer(pointer)
                for code in _record_codes(record, self._kind):
                    target = by_code.setdefault(code, {4: [], 6: []})
                    target[4].extend(groups[4])
                    target[6].extend(groups[6])
                asn = _record_asn(record)
                if asn is not None:
                    target = by_asn.setdefault(asn, {4: [], 6: []})
                    target[4].extend(groups[4])
                    target[6].extend(groups[6])
        except Exception as ex:  # a damaged tree or record: any failure while walking
            raise GeoDataError(f"{self.path}: corrupt MaxMind database ({ex})") from None
        self._by_code, self._by_asn = by_code, by_asn

    def _leaves(self) -> Iterator[tuple[int, int, int]]:
        """``(version, first address << 8 | prefix, data pointer)`` of every network
        that has data, walking the search tree once (maxminddb's own iterator decodes
        every leaf's record again and builds an object per network: seconds per
        100,000). IPv4 comes from the IPv4 subtree of an IPv6 database, once (its
        aliases at ``::ffff:0:0/96`` and ``2002::/16`` are skipped)."""
        reader = self._reader
        count: int = reader._metadata.node_count
        size: int = reader._record_size
        buf = reader._buffer
        from_bytes = int.from_bytes
        budget = [count + 1]  # a valid tree visits each node once; a damaged one may loop

        def children(node: int) -> tuple[int, int]:
            if size == 24:
                o = node * 6
                return from_bytes(buf[o : o + 3], "big"), from_bytes(buf[o + 3 : o + 6], "big")
            if size == 28:
                o = node * 7
                middle = buf[o + 3]
                left = ((middle & 0xF0) << 20) | from_bytes(buf[o : o + 3], "big")
                right = ((middle & 0x0F) << 24) | from_bytes(buf[o + 4 : o + 7], "big")
                return left, right
            o = node * 8
            return from_bytes(buf[o : o + 4], "big"), from_bytes(buf[o + 4 : o + 8], "big")

        def walk(start: int, width: int, version: int, skip: int) -> Iterator[tuple[int, int, int]]:
            if start > count:  # the whole space has one record
                yield version, 0, start
                return
            stack = [(start, 0, 0)] if start < count else []
            pop, push = stack.pop, stack.append
            while stack:
                node, depth, acc = pop()
                budget[0] -= 1
                if budget[0] < 0 or depth >= width:
                    raise GeoDataError("the search tree loops or is too deep")
                left, right = children(node)
                depth += 1
                acc <<= 1
                for child, value in ((left, acc), (right, acc | 1)):
                    if child < count:
                        if child != skip:
                            push((child, depth, value))
                    elif child > count:
                        yield version, ((value << (width - depth)) << 8) | depth, child

        if self.ip_version == 6:
            ipv4 = reader._ipv4_start
            yield from walk(ipv4, 32, 4, -1)
            yield from walk(0, 128, 6, ipv4 if ipv4 < count else -1)
        else:
            yield from walk(0, 32, 4, -1)

    def _networks(self, kind: str, key: Any) -> tuple[Cidr, ...]:
        with self._lock:
            cached = self._merged.get((kind, key))
            if cached is not None:
                return cached
            if self._by_code is None:
                self._walk()
            table = self._by_code if kind == "code" else self._by_asn
            groups = (table or {}).get(key, {})
            merged = _merge(4, groups.get(4, [])) + _merge(6, groups.get(6, []))
            self._merged[(kind, key)] = merged
            return merged

    def networks(self, code: str) -> tuple[Cidr, ...]:
        """The networks of country ``code`` (case-insensitive), merged, IPv4 first."""
        return self._networks("code", code.lower())

    def asn_networks(self, asn: int) -> tuple[Cidr, ...]:
        """The networks of AS number ``asn``, merged, IPv4 first."""
        return self._networks("asn", int(asn))

    def codes(self) -> frozenset[str]:
        """Every code the database has (walks it once)."""
        with self._lock:
            if self._by_code is None:
                self._walk()
            return frozenset(self._by_code or ())


# ---------------------------------------------------------------------------
# GeoSite
# ---------------------------------------------------------------------------


def _geosite_classes() -> tuple[Any, Any]:
    """``GeoSiteList`` and ``Domain`` message classes, built from the schema below (the
    v2fly ``common.proto`` messages, field numbers as there)."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="spliceway_geosite.proto", package="spliceway.geosite", syntax="proto3"
    )
    F = descriptor_pb2.FieldDescriptorProto
    domain = proto.message_type.add(name="Domain")
    kind = domain.enum_type.add(name="Type")
    for number, name in enumerate(("Plain", "Regex", "Domain", "Full")):
        kind.value.add(name=name, number=number)
    attribute = domain.nested_type.add(name="Attribute")
    attribute.field.add(name="key", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    attribute.oneof_decl.add(name="typed_value")
    attribute.field.add(
        name="bool_value", number=2, type=F.TYPE_BOOL, label=F.LABEL_OPTIONAL, oneof_index=0
    )
    attribute.field.add(
        name="int_value", number=3, type=F.TYPE_INT64, label=F.LABEL_OPTIONAL, oneof_index=0
    )
    domain.field.add(
        name="type",
        number=1,
        type=F.TYPE_ENUM,
        type_name=".spliceway.geosite.Domain.Type",
        label=F.LABEL_OPTIONAL,
    )
    domain.field.add(name="value", number=2, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    domain.field.add(
        name="attribute",
        number=3,
        type=F.TYPE_MESSAGE,
        type_name=".spliceway.geosite.Domain.Attribute",
        label=F.LABEL_REPEATED,
    )
    site = proto.message_type.add(name="GeoSite")
    site.field.add(name="country_code", number=1, type=F.TYPE_STRING, label=F.LABEL_OPTIONAL)
    site.field.add(
        name="domain",
        number=2,
        type=F.TYPE_MESSAGE,
        type_name=".spliceway.geosite.Domain",
        label=F.LABEL_REPEATED,
    )
    site_list = proto.message_type.add(name="GeoSiteList")
    site_list.field.add(
        name="entry",
        number=1,
        type=F.TYPE_MESSAGE,
        type_name=".spliceway.geosite.GeoSite",
        label=F.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return (
        message_factory.GetMessageClass(
            pool.FindMessageTypeByName("spliceway.geosite.GeoSiteList")
        ),
        message_factory.GetMessageClass(pool.FindMessageTypeByName("spliceway.geosite.Domain")),
    )


#: ``GeoSiteList`` and ``Domain`` messages (tests build ``geosite.dat`` files with them).
GeoSiteListMessage, DomainMessage = _geosite_classes()

_PLAIN, _REGEX, _DOMAIN, _FULL = 0, 1, 2, 3


def _name_value(value: str) -> str | None:
    value = value.strip().lower()
    if value.endswith("."):
        value = value[:-1]
    if not value or any(c.isspace() for c in value):
        return None
    if not value.isascii():
        try:
            value = value.encode("idna").decode("ascii")
        except UnicodeError:
            return None
    return value


class GeoSite:
    """One ``geosite.dat`` (open with :meth:`open`)."""

    def __init__(self, path: str, entries: dict[str, Any]) -> None:
        self.path = path
        self._entries = entries
        self._lock = threading.Lock()
        self._cache: dict[str, RuleSetData] = {}

    @classmethod
    def open(cls, path: str) -> GeoSite:
        """The database at ``path`` (the same object while the file is unchanged)."""
        key = _identity(path)
        with _CACHE_LOCK:
            cached = _GEOSITE_CACHE.get(key[0])
            if cached is not None and cached[0] == key:
                return cached[1]
        try:
            with open(path, "rb") as f:
                body = f.read()
        except OSError as ex:
            raise GeoDataError(f"{path}: cannot read the file ({ex.strerror})") from None
        message = GeoSiteListMessage()
        try:
            message.ParseFromString(body)
        except (DecodeError, RecursionError, ValueError) as ex:
            raise GeoDataError(f"{path}: not a geosite.dat (protobuf: {ex})") from None
        entries = {e.country_code.lower(): e for e in message.entry if e.country_code}
        if not entries:
            raise GeoDataError(f"{path}: not a geosite.dat (no list in it)")
        db = cls(path, entries)
        with _CACHE_LOCK:
            _GEOSITE_CACHE[key[0]] = (key, db)
        return db

    def names(self) -> frozenset[str]:
        """Every list name (lowercase)."""
        return frozenset(self._entries)

    def domains(self, name: str) -> RuleSetData:
        """List ``name`` (``google``, ``google@cn``: see the module) as domain entries.

        Raises KeyError when the database has no such list.
        """
        key = name.strip().lower()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                return cached
        list_name, *attrs = key.split("@")
        wanted = [a.strip() for a in attrs if a.strip()]
        entry = self._entries.get(list_name.strip())
        if entry is None:
            raise KeyError(name)
        exact: set[str] = set()
        suffix: set[str] = set()
        keyword: dict[str, None] = {}
        regex: dict[str, None] = {}
        count = skipped = 0
        reasons: list[str] = []
        for domain in entry.domain:
            if wanted:
                have = {a.key.lower() for a in domain.attribute}
                if not all(a in have for a in wanted):
                    continue
            kind, value = domain.type, domain.value
            reason = None
            if kind == _REGEX:
                try:
                    re.compile(value, re.IGNORECASE)
                except re.error as ex:
                    reason = f"regex {value!r}: {ex}"
                else:
                    regex[value] = None
            elif kind == _PLAIN:
                if value:
                    keyword[value.lower()] = None
                else:
                    reason = "empty keyword"
            else:
                text = _name_value(value)
                if text is None:
                    reason = f"{value!r} is not a domain"
                elif kind == _FULL:
                    exact.add(text)
                else:
                    suffix.add(text)
            if reason is None:
                count += 1
            else:
                skipped += 1
                if len(reasons) < MAX_REASONS:
                    reasons.append(reason)
        data = RuleSetData(
            behavior="domain",
            exact=frozenset(exact - suffix),
            suffix=frozenset(suffix),
            keyword=tuple(keyword),
            regex=tuple(regex),
            count=count,
            skipped=skipped,
            skip_reasons=tuple(reasons),
        )
        with self._lock:
            self._cache[key] = data
        return data


def open_databases(
    geoip_path: str | None, asn_path: str | None, geosite_path: str | None
) -> GeoDatabases:
    """Open the configured databases (``runtime.geodata``; ``asn_path`` None: the ASN
    numbers come from ``geoip_path``). Raises :class:`GeoDataError` for a file that is
    missing or not such a database."""
    geoip = GeoIp.open(geoip_path) if geoip_path else None
    asn = GeoIp.open(asn_path) if asn_path else geoip
    geosite = GeoSite.open(geosite_path) if geosite_path else None
    return GeoDatabases(geoip=geoip, asn=asn, geosite=geosite)
