"""Request-rate and concurrency limits of the control API (docs/security.md, rate limits).

Limits are per engine: token buckets whose burst equals their rate. Over a
limit the caller gets 429 ``rate_limited`` with ``Retry-After`` in whole seconds
(at least 1).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from spliceway.errors import ApiError


@dataclass(frozen=True, slots=True)
class Limits:
    """The limits one control app enforces."""

    queries_per_second: float = 100.0
    commands_per_second: float = 10.0
    sse_streams: int = 5
    #: Failed authentications (a missing or wrong key) per source address and per
    #: engine; past them the answer is 429 instead of 401 (docs/security.md).
    failed_auth_per_source_per_second: float = 5.0
    failed_auth_per_source_burst: float = 20.0
    failed_auth_per_second: float = 50.0
    failed_auth_burst: float = 100.0


class RateLimited(ApiError):
    """``rate_limited`` carrying the ``Retry-After`` seconds for the response."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__("rate_limited", message)
        self.retry_after = max(1, math.ceil(retry_after_s))


class TokenBucket:
    """A thread-safe token bucket; ``take`` returns 0.0 or the wait until a token."""

    def __init__(
        self, rate: float, burst: float | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate
        self.burst = rate if burst is None else burst
        self._clock = clock
        self._tokens = self.burst
        self._stamp = clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Take one token if there is one (0.0); otherwise seconds until one is due."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
            self._stamp = now
            # The epsilon keeps float drift from refusing a token that is due.
            if self._tokens >= 1.0 - 1e-9:
                self._tokens = max(0.0, self._tokens - 1.0)
                return 0.0
            return (1.0 - self._tokens) / self.rate


class Slots:
    """A counted set of concurrent slots (SSE streams); ``acquire`` never waits."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        """Slots currently held."""
        return self._used

    def acquire(self) -> bool:
        """Take a slot if one is free."""
        with self._lock:
            if self._used >= self.capacity:
                return False
            self._used += 1
            return True

    def release(self) -> None:
        """Give a slot back."""
        with self._lock:
            self._used = max(0, self._used - 1)


class FailureLimiter:
    """Failed authentications: a token bucket per source and one for everyone.

    ``failed(source)`` is called for each request whose key is missing or wrong and
    returns 0.0 (answer it as usual: 401) or the seconds until that source may fail
    again (answer 429). A request with a valid key never reaches it, so an attacker
    being limited cannot lock out a caller holding a key, even from the same
    address. At most ``max_sources`` per-source buckets are kept; the least recently
    used goes first (the global bucket still bounds a caller rotating sources).
    """

    def __init__(
        self,
        per_source_rate: float,
        per_source_burst: float,
        global_rate: float,
        global_burst: float,
        max_sources: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._rate = per_source_rate
        self._burst = per_source_burst
        self._global = TokenBucket(global_rate, global_burst, clock)
        self._max_sources = max_sources
        self._clock = clock
        self._sources: OrderedDict[str, TokenBucket] = OrderedDict()
        self._lock = threading.Lock()

    def failed(self, source: str) -> float:
        """Count one failure from ``source``: 0.0, or the wait before it may fail again."""
        with self._lock:
            bucket = self._sources.get(source)
            if bucket is None:
                bucket = self._sources[source] = TokenBucket(self._rate, self._burst, self._clock)
                while len(self._sources) > self._max_sources:
                    self._sources.popitem(last=False)
            else:
                self._sources.move_to_end(source)
        wait = bucket.take()
        if wait:
            return wait
        return self._global.take()
