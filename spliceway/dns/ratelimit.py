"""The DNS server's rate limits: a token bucket per client (:class:`ClientRateLimit`)
and a throttle for the log lines a client can cause (``_Throttle``).

Both run on the server's loop (or the dispatcher's, for a TUN's ``dns_hijack``); a
reload reconfigures :class:`ClientRateLimit` from any thread.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Final

__all__ = [
    "MAX_RATE_SOURCES",
    "PARSED_QUERY_COST",
    "RATE_BURST_SECONDS",
    "ClientRateLimit",
]

#: What a query that is parsed (resolved, forwarded: some hundreds of microseconds)
#: takes of its client's rate, where one answered from the wire cache or refused by its
#: header (a few microseconds) takes 1.
PARSED_QUERY_COST: Final = 10
#: Source addresses whose rate is followed; the least recently seen is forgotten first.
MAX_RATE_SOURCES: Final = 8192
#: A client's burst: this many seconds of its rate.
RATE_BURST_SECONDS: Final = 2


class _Throttle:
    """True at most once per ``interval`` seconds: for log lines a client can cause."""

    __slots__ = ("_interval", "_next", "skipped")

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._next = 0.0
        #: Calls answered False since the last True.
        self.skipped = 0

    def ready(self) -> bool:
        now = time.monotonic()
        if now < self._next:
            self.skipped += 1
            return False
        self._next = now + self._interval
        return True


class ClientRateLimit:
    """A token bucket per source address, as unbound's ``ip-ratelimit``: ``rate`` queries
    a second from one address, with a burst of :data:`RATE_BURST_SECONDS` of them; None
    lets every query through. At most ``max_sources`` addresses are followed, the least
    recently seen forgotten first (a forgotten one starts again with a full bucket).

    Used from the server's loop only; :meth:`configure` may be called from any thread
    (a reload): the new rate applies from the next query."""

    def __init__(
        self,
        rate: int | None,
        *,
        max_sources: int = MAX_RATE_SOURCES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._max_sources = max_sources
        #: source -> [tokens, when they were counted]; least recently seen first.
        self._buckets: OrderedDict[str, list[float]] = OrderedDict()
        self._limits: tuple[float, float] | None = None
        self.configure(rate)

    @property
    def rate(self) -> int | None:
        """Queries a second from one source, or None (no limit)."""
        limits = self._limits
        return None if limits is None else int(limits[0])

    def configure(self, rate: int | None) -> None:
        """Set the rate (None: no limit)."""
        self._limits = None if rate is None else (float(rate), float(rate * RATE_BURST_SECONDS))

    def allow(self, source: str, cost: float = 1.0) -> bool:
        """Take ``cost`` queries of ``source``'s rate; False when its bucket holds less
        (drop the query; nothing is taken)."""
        limits = self._limits
        if limits is None:
            return True
        rate, burst = limits
        now = self._clock()
        buckets = self._buckets
        bucket = buckets.get(source)
        if bucket is None:
            if len(buckets) >= self._max_sources:
                buckets.popitem(last=False)
            bucket = buckets[source] = [burst, now]
        else:
            buckets.move_to_end(source)
        tokens = min(burst, bucket[0] + (now - bucket[1]) * rate)
        bucket[1] = now
        if tokens < cost:
            bucket[0] = tokens
            return False
        bucket[0] = tokens - cost
        return True

    def __len__(self) -> int:
        return len(self._buckets)
