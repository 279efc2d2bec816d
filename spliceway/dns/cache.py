"""The resolver's answer cache: LRU-bounded, TTL-clamped, thread-safe.

Keys are domain names compared case-insensitively and without a trailing dot, so
``Example.COM.`` and ``example.com`` share one entry. Only positive answers are
stored (the resolver does not cache negatives). Expiry is lazy: an expired entry
is dropped when it is read or when the whole cache is listed, never by a timer,
so the cache costs no thread. Time comes from an injectable monotonic ``clock``
so tests can move it without sleeping.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["AnswerCache", "CacheEntry", "cache_key"]


def cache_key(domain: str) -> str:
    """The key a domain is cached under: lower case, no trailing dot."""
    return domain.rstrip(".").lower()


@dataclass(frozen=True, slots=True)
class CacheEntry:
    """A live cache entry as the diagnostics report it."""

    domain: str
    addresses: tuple[str, ...]
    #: Remaining lifetime in whole seconds, rounded up (a live entry never shows 0).
    ttl_seconds: int


class AnswerCache:
    """Positive answers by domain, at most ``max_entries``, least recently used evicted.

    ``min_ttl``/``max_ttl`` clamp every TTL passed to :meth:`put` (``None`` leaves that
    side unbounded); an entry whose clamped TTL is 0 is not stored.
    """

    def __init__(
        self,
        max_entries: int,
        min_ttl: float | None = None,
        max_ttl: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.min_ttl = min_ttl
        self.max_ttl = max_ttl
        self._clock = clock
        # domain -> (addresses, expires_at); order is least to most recently used.
        self._entries: OrderedDict[str, tuple[tuple[str, ...], float]] = OrderedDict()
        # Readers come from HTTP worker threads and the dispatcher loop at once;
        # every critical section is a few dict operations, so one lock is enough.
        self._lock = threading.Lock()

    def clamp_ttl(self, ttl: float) -> float:
        """``ttl`` bounded by ``min_ttl`` and ``max_ttl``."""
        if self.min_ttl is not None:
            ttl = max(ttl, self.min_ttl)
        if self.max_ttl is not None:
            ttl = min(ttl, self.max_ttl)
        return max(ttl, 0.0)

    def put(self, domain: str, addresses: Sequence[str], ttl: float) -> None:
        """Store a positive answer for ``ttl`` seconds (clamped); empty answers are ignored."""
        ttl = self.clamp_ttl(ttl)
        key = cache_key(domain)
        with self._lock:
            if not addresses or ttl <= 0:
                # Nothing worth keeping; a stale entry must not outlive a fresher answer.
                self._entries.pop(key, None)
                return
            self._entries[key] = (tuple(addresses), self._clock() + ttl)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def get(self, domain: str) -> tuple[str, ...] | None:
        """The cached addresses of ``domain`` (marking it recently used), or None."""
        key = cache_key(domain)
        with self._lock:
            item = self._live(key, self._clock())
            if item is None:
                return None
            self._entries.move_to_end(key)
            return item[0]

    def peek(self, domain: str) -> CacheEntry | None:
        """The live entry of ``domain`` without touching its LRU position, or None."""
        key = cache_key(domain)
        with self._lock:
            now = self._clock()
            item = self._live(key, now)
            return None if item is None else _entry(key, item, now)

    def entries(self, limit: int | None = None) -> list[CacheEntry]:
        """Live entries, most recently used first, at most ``limit`` of them."""
        with self._lock:
            now = self._clock()
            self._purge(now)
            out: list[CacheEntry] = []
            for key in reversed(self._entries):
                if limit is not None and len(out) >= limit:
                    break
                out.append(_entry(key, self._entries[key], now))
            return out

    def clear(self) -> int:
        """Drop every entry; the number of live (unexpired) ones dropped."""
        with self._lock:
            self._purge(self._clock())
            count = len(self._entries)
            self._entries.clear()
            return count

    def __len__(self) -> int:
        """The number of live (unexpired) entries."""
        with self._lock:
            self._purge(self._clock())
            return len(self._entries)

    def _live(self, key: str, now: float) -> tuple[tuple[str, ...], float] | None:
        item = self._entries.get(key)
        if item is not None and item[1] <= now:
            del self._entries[key]
            return None
        return item

    def _purge(self, now: float) -> None:
        for key in [k for k, (_, expires) in self._entries.items() if expires <= now]:
            del self._entries[key]


def _entry(key: str, item: tuple[tuple[str, ...], float], now: float) -> CacheEntry:
    return CacheEntry(key, item[0], max(1, math.ceil(item[1] - now)))
