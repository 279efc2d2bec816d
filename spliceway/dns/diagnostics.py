"""Result documents of the ``diagnostics.dns_lookup`` and ``diagnostics.dns_cache`` commands.

Pure functions of a :class:`~spliceway.dns.resolver.Resolver`: the command table
validates nothing beyond what is here and returns these dicts as the results.
"""

from __future__ import annotations

from typing import Any

from spliceway.dns.resolver import InvalidHostname, ResolveError, Resolver
from spliceway.errors import invalid_argument

__all__ = ["dns_cache_result", "dns_lookup_result"]


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
