"""The engine resolver (runtime.dns): servers in order, an LRU/TTL cache, diagnostics.

``Resolver`` is built by ``EngineCore`` from ``config.runtime.dns``; outbounds resolve
every hostname through it. ``dns_lookup_result``/``dns_cache_result`` are the results
of the ``diagnostics.dns_lookup``/``diagnostics.dns_cache`` commands.
"""

from spliceway.dns.cache import AnswerCache, CacheEntry
from spliceway.dns.diagnostics import dns_cache_result, dns_lookup_result
from spliceway.dns.resolver import (
    LOOPBACK_ADDRESSES,
    SYSTEM_TTL_SECONDS,
    InvalidHostname,
    ResolveError,
    Resolver,
    normalize_hostname,
)

__all__ = [
    "LOOPBACK_ADDRESSES",
    "SYSTEM_TTL_SECONDS",
    "AnswerCache",
    "CacheEntry",
    "InvalidHostname",
    "ResolveError",
    "Resolver",
    "dns_cache_result",
    "dns_lookup_result",
    "normalize_hostname",
]
