"""Result documents of the ``diagnostics.dns_lookup``, ``diagnostics.dns_cache``,
``diagnostics.fakeip_lookup`` and ``fakeip.clear`` commands.

Pure functions of a :class:`~spliceway.dns.resolver.Resolver` or a
:class:`~spliceway.dns.fakeip.FakeIpPool`: the command table validates nothing beyond
what is here and returns these dicts as the results.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from spliceway.dns.fakeip import FakeIpPool, domain_key
from spliceway.dns.resolver import InvalidHostname, ResolveError, Resolver, normalize_hostname
from spliceway.errors import ApiError, invalid_argument

__all__ = [
    "dns_cache_result",
    "dns_lookup_result",
    "dns_query_result",
    "fakeip_clear_result",
    "fakeip_lookup_result",
]

#: The header flags a ``diagnostics.dns_query`` result reports, as mihomo's ``/dns/query``.
_FLAGS = {"tc": dns.flags.TC, "rd": dns.flags.RD, "ra": dns.flags.RA, "ad": dns.flags.AD,
          "cd": dns.flags.CD}  # fmt: skip


def dns_lookup_result(resolver: Resolver, hostname: Any) -> dict[str, Any]:
    """``{hostname, resolved_addresses, count}`` for ``diagnostics.dns_lookup``.

    A name that does not resolve (NXDOMAIN, no A/AAAA records, every server failed)
    is a normal result: empty ``resolved_addresses``, ``count`` 0 and an ``error``
    string. A malformed hostname raises ``ApiError("invalid_argument")`` on
    ``params.hostname``. Blocks the calling thread (HTTP worker threads call it).
    """
    if not isinstance(hostname, str):
        raise invalid_argument("hostname must be a string", field_path="params.hostname")
    result: dict[str, Any] = {"hostname": hostname}
    try:
        addresses = resolver.lookup(hostname)
    except InvalidHostname as ex:
        raise invalid_argument(str(ex), field_path="params.hostname") from ex
    except ResolveError as ex:
        return result | {"resolved_addresses": [], "count": 0, "error": str(ex)}
    result |= {"resolved_addresses": addresses, "count": len(addresses)}
    if not addresses:
        result["error"] = f"{hostname} has no address (NXDOMAIN or no A/AAAA records)"
    return result


def _records(section: list[dns.rrset.RRset]) -> list[dict[str, Any]]:
    return [
        {
            "name": rrset.name.to_text(),
            "type": int(rrset.rdtype),
            "ttl": rrset.ttl,
            "data": rdata.to_text(),
        }
        for rrset in section
        for rdata in rrset
    ]


def dns_query_result(resolver: Resolver, name: str, rdtype: str = "A") -> dict[str, Any]:
    """``diagnostics.dns_query``: the sections of the first server's answer message,
    ``{rcode, question: {name, type, class}, flags: {tc, rd, ra, ad, cd}, answer,
    authority, additional}`` with records as ``{name, type, ttl, data}`` (names with
    their final dot, types and classes as numbers, ``data`` in zone-file text).

    NXDOMAIN is an answer (rcode 3, empty sections but the authority's SOA). When every
    server failed the result has rcode 2 (SERVFAIL), empty sections and ``error``.
    ``invalid_argument`` for a malformed ``params.name`` or an unknown ``params.type``.
    Blocks the calling thread (up to 5 s).
    """
    try:
        message = resolver.query(name, rdtype)
    except InvalidHostname as ex:
        raise invalid_argument(str(ex), field_path="params.name") from ex
    except ResolveError as ex:
        return _failed_query(name, rdtype, str(ex))
    except ValueError as ex:
        raise invalid_argument(str(ex), field_path="params.type") from ex
    return {
        "rcode": int(message.rcode()),
        "question": _question(name, rdtype),
        "flags": {k: bool(message.flags & v) for k, v in _FLAGS.items()},
        "answer": _records(message.answer),
        "authority": _records(message.authority),
        "additional": _records(message.additional),
    }


def _question(name: str, rdtype: str) -> dict[str, Any]:
    # What was asked (validated by the query): a server need not echo its question.
    return {
        "name": dns.name.from_text(name).to_text(),
        "type": int(dns.rdatatype.from_text(rdtype)),
        "class": int(dns.rdataclass.IN),
    }


def _failed_query(name: str, rdtype: str, error: str) -> dict[str, Any]:
    return {
        "rcode": int(dns.rcode.SERVFAIL),
        "question": _question(name, rdtype),
        "flags": dict.fromkeys(_FLAGS, False),
        "answer": [],
        "authority": [],
        "additional": [],
        "error": error,
    }


def dns_cache_result(resolver: Resolver, domain: Any = None, limit: Any = 256) -> dict[str, Any]:
    """The resolver cache for ``diagnostics.dns_cache``.

    With ``domain``: ``{enabled, domain, hit, addresses, ttl_seconds}``; a miss is
    ``hit: false``, no addresses and ``ttl_seconds: null``. Without:
    ``{enabled, entries: [{domain, addresses, ttl_seconds}], count}`` where ``entries``
    holds at most ``limit`` entries, most recently used first, and ``count`` is the
    total number of live cache entries (so ``count > len(entries)`` means truncated).
    ``ttl_seconds`` is the remaining lifetime in whole seconds, rounded up.
    ``enabled: false`` means ``runtime.dns.cache`` is not configured (always a miss,
    no entries). ``domain`` is echoed as given and matched case-insensitively.
    """
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
        raise invalid_argument("limit must be a non-negative integer", field_path="params.limit")
    enabled = resolver.cache_enabled
    if domain is not None:
        if not isinstance(domain, str) or not domain:
            raise invalid_argument("domain must be a non-empty string", field_path="params.domain")
        entry = resolver.cache_entry(domain)
        return {
            "enabled": enabled,
            "domain": domain,
            "hit": entry is not None,
            "addresses": [] if entry is None else list(entry.addresses),
            "ttl_seconds": None if entry is None else entry.ttl_seconds,
        }
    entries = resolver.cache_entries(limit)
    return {
        "enabled": enabled,
        "entries": [
            {"domain": e.domain, "addresses": list(e.addresses), "ttl_seconds": e.ttl_seconds}
            for e in entries
        ],
        "count": resolver.cache_count(),
    }


def _fakeip_params(domain: Any, ip: Any) -> tuple[str | None, str | None]:
    """``(domain key, ip)`` checked: a non-empty domain, an IP address, not both."""
    if domain is not None and ip is not None:
        raise invalid_argument("give domain or ip, not both", field_path="params.ip")
    key = None
    if domain is not None:
        if not isinstance(domain, str) or not domain.strip("."):
            raise invalid_argument("domain must be a non-empty string", field_path="params.domain")
        try:
            key = normalize_hostname(domain)
        except InvalidHostname:
            key = domain_key(domain)  # no such mapping can exist: a miss, not an error
    if ip is not None:
        try:
            ipaddress.ip_address(ip[1:-1] if ip[:1] == "[" and ip[-1:] == "]" else ip)
        except ValueError as ex:
            raise invalid_argument(f"{ip!r} is not an IP address", field_path="params.ip") from ex
    return key, ip


def fakeip_lookup_result(pool: FakeIpPool | None, domain: Any, ip: Any) -> dict[str, Any]:
    """``diagnostics.fakeip_lookup`` (interface 4.2 rule 12): ``{enabled, domain, fake_ip}``
    for a domain, ``{enabled, ip, domain}`` for an address; null when not mapped. Never
    allocates and does not count as use. ``enabled: false`` without fake-ip answers.
    ``invalid_argument`` for neither or both parameters, or an ``ip`` that is no address.
    """
    if domain is None and ip is None:
        raise invalid_argument("give domain or ip", field_path="params")
    key, ip = _fakeip_params(domain, ip)
    enabled = pool is not None
    if key is not None:
        fake = pool.peek_ip(key) if pool is not None else None
        return {"enabled": enabled, "domain": domain, "fake_ip": fake}
    assert ip is not None
    found = pool.peek_domain(ip) if pool is not None else None
    return {"enabled": enabled, "ip": ip, "domain": found}


def fakeip_clear_result(pool: FakeIpPool | None, domain: Any, ip: Any) -> dict[str, Any]:
    """``fakeip.clear`` (interface 4.2 rule 13, decisions 2): ``{cleared: n}``, the number
    of mappings removed (the one of ``domain``, of ``ip``, or all with neither), written to
    ``persist_path`` before answering. 0 without fake-ip answers. ``invalid_argument``
    for both parameters; ``internal`` when the file cannot be written (the mappings are
    gone from memory all the same, and the next write retries)."""
    key, ip = _fakeip_params(domain, ip)
    if pool is None:
        return {"cleared": 0}
    try:
        cleared = pool.clear(domain=key, ip=ip)
    except OSError as ex:
        raise ApiError(
            "internal",
            f"the mappings were removed, but the fake-ip table {pool.persist_path} could not be "
            f"written: {ex.strerror or ex}",
        ) from ex
    return {"cleared": cleared}
