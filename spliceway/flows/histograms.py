"""Per-outbound histograms of completed flows (``GET /metrics``): duration and size.

The engine counts every completed flow once, on the thread that completes it, into
plain buckets; the metrics collector reads a consistent copy at scrape time. No
``prometheus_client`` object sits on the data path, and an embedded engine without a
control API pays one bisect and a lock per flow.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

#: Upper bounds of ``flow_duration_seconds``: from a refused connect (milliseconds) to
#: long-lived tunnels (an hour), roughly x2.5 apart.
DURATION_BUCKETS_S: tuple[float, ...] = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    300.0,
    900.0,
    3600.0,
)

#: Upper bounds of ``flow_size_bytes`` (payload up plus down): 0 first, so flows that
#: moved nothing (a failed dial, a refused UDP destination) stand out, then x4 steps from
#: 1 KiB to 4 GiB.
SIZE_BUCKETS_BYTES: tuple[float, ...] = (0.0, *(float(1024 * 4**i) for i in range(12)))


@dataclass(frozen=True, slots=True)
class Series:
    """One label value's histogram: cumulative counts per upper bound (``+Inf`` last),
    and the sum of the observed values."""

    buckets: tuple[tuple[float, int], ...]
    total: float

    @property
    def count(self) -> int:
        """How many values were observed (the ``+Inf`` bucket)."""
        return self.buckets[-1][1]


class Histogram:
    """Bucket counts by one label (the outbound's tag), thread-safe."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        # Per label: a count per bound plus the overflow (+Inf), and the sum.
        self._counts: dict[str, list[int]] = {}
        self._sums: dict[str, float] = {}
        self._lock = threading.Lock()

    def observe(self, label: str, value: float) -> None:
        """Count ``value`` under ``label``: in the first bucket whose bound is >= it."""
        # bisect_left: a value equal to a bound belongs to that bound (le is inclusive).
        index = bisect_left(self.bounds, value)
        with self._lock:
            counts = self._counts.get(label)
            if counts is None:
                counts = self._counts[label] = [0] * (len(self.bounds) + 1)
                self._sums[label] = 0.0
            counts[index] += 1
            self._sums[label] += value

    def snapshot(self) -> dict[str, Series]:
        """Every label's histogram as Prometheus exposes it (cumulative buckets)."""
        with self._lock:
            copied = {label: (list(c), self._sums[label]) for label, c in self._counts.items()}
        out: dict[str, Series] = {}
        for label, (counts, total) in copied.items():
            running = 0
            buckets = []
            for bound, n in zip((*self.bounds, float("inf")), counts, strict=True):
                running += n
                buckets.append((bound, running))
            out[label] = Series(tuple(buckets), total)
        return out
