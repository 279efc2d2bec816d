"""State shared between the engine's actors and its query surface.

Ownership rules (actors own state; nothing else mutates it):
- ``FlowTable`` entries are written only by the FlowActor they describe; other
  threads read the published record dict, which is never mutated after it is
  published (each revision publishes a new dict).
- ``Counters`` are incremented only on the dispatcher thread (flow actors).
- ``RouteState`` is immutable; ``mode.set`` swaps in a new one atomically.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from spliceway.events.catalogue import UDP_COUNTERS
from spliceway.flows.histograms import DURATION_BUCKETS_S, SIZE_BUCKETS_BYTES, Histogram
from spliceway.flows.records import BLOCKED, FAILED
from spliceway.routing import rules as routing
from spliceway.shapes.flow import FlowRecord

if TYPE_CHECKING:
    import pykka

    from spliceway.flows.records import FlowState, Traffic


@dataclass(frozen=True, slots=True)
class RouteState:
    """The routing inputs a flow reads when it decides."""

    mode: str
    mode_outbound: str | None
    final: str
    ruleset: routing.RuleSet

    def decide(self, facts: routing.FlowFacts) -> routing.RouteDecision:
        """The route for ``facts`` under this state."""
        return routing.decide(self.ruleset, self.mode, self.mode_outbound, self.final, facts)


@dataclass(slots=True)
class FlowEntry:
    """One active flow as other threads see it."""

    actor: pykka.ActorRef[Any]
    record: FlowRecord
    inbound_tag: str
    principal_key: str | None
    handle: int | None = None
    #: Traffic at hand-off; live totals are ``base.with_relay(relay counters)``.
    base: Traffic | None = None


class FlowTable:
    """Active flows by id. Writers are the flows themselves; readers copy."""

    def __init__(self) -> None:
        self._flows: dict[str, FlowEntry] = {}
        self._lock = threading.Lock()

    def put(self, flow_id: str, entry: FlowEntry) -> None:
        """Add or replace a flow's entry."""
        with self._lock:
            self._flows[flow_id] = entry

    def remove(self, flow_id: str) -> None:
        """Drop a flow's entry (it completed)."""
        with self._lock:
            self._flows.pop(flow_id, None)

    def get(self, flow_id: str) -> FlowEntry | None:
        """The entry of one flow, if active."""
        return self._flows.get(flow_id)

    def entries(self) -> list[FlowEntry]:
        """A copy of all active entries."""
        with self._lock:
            return list(self._flows.values())

    def records(self) -> list[dict[str, Any]]:
        """The latest published record of every active flow."""
        with self._lock:
            # Snapshots and the query table deal in plain JSON objects.
            return [cast("dict[str, Any]", e.record) for e in self._flows.values()]

    def __len__(self) -> int:
        return len(self._flows)


@dataclass(slots=True)
class Counters:
    """Cumulative flow counters of the stats resource (TCP part)."""

    total_started: int = 0
    completed_sessions: int = 0
    failed_sessions: int = 0
    blocked_sessions: int = 0
    direct_sessions: int = 0
    chained_sessions: int = 0
    #: Bytes of flows that already completed; active flows are added live.
    completed_bytes_up: int = 0
    completed_bytes_down: int = 0
    udp: dict[str, int] = field(default_factory=lambda: dict.fromkeys(UDP_COUNTERS, 0))
    #: Proxy replies Python dropped because no destination of their upstream sent to
    #: their source (``GET /metrics``; C counts its own datagram drops).
    udp_unmatched_replies: int = 0
    #: Completed flows by ``(network, outcome)`` (``GET /metrics``).
    outcomes: dict[tuple[str, str], int] = field(default_factory=dict)
    #: ``[bytes_up, bytes_down]`` of completed flows by outbound tag; a flow that never
    #: had an outbound (blocked by a rule's action, denied by the hook, failed or
    #: cancelled before its route) is in the totals above only.
    outbound_bytes: dict[str, list[int]] = field(default_factory=dict)
    #: Completed flows' durations (seconds) and sizes (payload bytes up plus down), by
    #: outbound tag, for the same flows as ``outbound_bytes`` (``GET /metrics``).
    durations: Histogram = field(default_factory=lambda: Histogram(DURATION_BUCKETS_S))
    sizes: Histogram = field(default_factory=lambda: Histogram(SIZE_BUCKETS_BYTES))

    def count_completed(self, s: FlowState) -> None:
        """Count one flow that just completed (its outcome is set)."""
        up, down = s.traffic.bytes_up, s.traffic.bytes_down
        self.completed_sessions += 1
        self.completed_bytes_up += up
        self.completed_bytes_down += down
        if s.outcome == FAILED:
            self.failed_sessions += 1
        elif s.outcome == BLOCKED:
            self.blocked_sessions += 1
        key = (s.network, s.outcome or "")
        self.outcomes[key] = self.outcomes.get(key, 0) + 1
        tag = s.outbound_tag
        if not tag:
            # Not "" as a label: a series no outbound stands for (issue 25).
            return
        totals = self.outbound_bytes.get(tag)
        if totals is None:
            self.outbound_bytes[tag] = [up, down]
        else:
            totals[0] += up
            totals[1] += down
        if s.ended_at_unix_ms is not None:
            self.durations.observe(tag, (s.ended_at_unix_ms - s.started_at_unix_ms) / 1000)
        self.sizes.observe(tag, up + down)
