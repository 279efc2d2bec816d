"""The engine resolver (runtime.dns): servers in order, an LRU/TTL cache, diagnostics;
the fake-ip pool (fakeip.py) and the engine's DNS server (server.py, service.py).

The server's parts beside server.py: wire.py (the header screen and the wire cache's
key, judged on bytes before any parse), ratelimit.py (the per-client token bucket, the
log-line throttle), counters.py (its counters and their snapshot document) and tcp.py
(one TCP client's length-prefixed queries, shared with the TUN's DNS hijack).

``Resolver`` is built by ``EngineCore`` from ``config.runtime.dns``; outbounds resolve
every hostname through it. ``dns_lookup_result``/``dns_cache_result`` are the results
of the ``diagnostics.dns_lookup``/``diagnostics.dns_cache`` commands,
``fakeip_lookup_result``/``fakeip_clear_result`` of ``diagnostics.fakeip_lookup`` /
``fakeip.clear``.
"""

from spliceway.dns.cache import AnswerCache, CacheEntry
from spliceway.dns.diagnostics import (
    dns_cache_result,
    dns_lookup_result,
    dns_query_result,
    fakeip_clear_result,
    fakeip_lookup_result,
)
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
    "dns_query_result",
    "fakeip_clear_result",
    "fakeip_lookup_result",
    "normalize_hostname",
]
