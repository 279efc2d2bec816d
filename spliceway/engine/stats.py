"""The engine core's live counters, as the stats resource and the metrics read them.

:class:`StatsViews` is a mixin of :class:`~spliceway.engine.core.EngineCore`: the stats
resource (``stats_snapshot``), every active flow's bytes read now (``live_traffic``, from
C's counters for relayed flows), and the UDP upstream and datagram-drop counters, C's
and Python's summed. The state it reads is the core's, declared below for the type
checker.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from spliceway.engine.components import BridgePort
from spliceway.engine.runtime import Counters, FlowEntry, FlowTable

__all__ = ["UDP_DROP_REASONS", "StatsViews"]

#: The reasons :meth:`EngineCore.udp_datagram_drops` counts.
UDP_DROP_REASONS = (
    "foreign",
    "fragment",
    "malformed",
    "no_dest",
    "pending",
    "blocked",
    "python",
    "unsolicited",
    "unmatched_reply",
)


class StatsViews:
    """The core's live counters (a mixin of ``EngineCore``, whose state it reads)."""

    # The core's state these views read (set by EngineCore.__init__/start).
    counters: Counters
    flows: FlowTable
    bridge: BridgePort

    def stats_snapshot(self) -> dict[str, Any]:
        """The stats resource (docs/http-api.md), live."""
        c = self.counters
        live_up, live_down = self.live_totals()
        up = c.completed_bytes_up + live_up
        down = c.completed_bytes_down + live_down
        return {
            "active_sessions": len(self.flows),
            "total_started": c.total_started,
            "completed_sessions": c.completed_sessions,
            "failed_sessions": c.failed_sessions,
            "blocked_sessions": c.blocked_sessions,
            "direct_sessions": c.direct_sessions,
            "chained_sessions": c.chained_sessions,
            "bytes_up": up,
            "bytes_down": down,
            "udp_upstream": self.udp_upstream_counters(),
        }

    def live_totals(self) -> tuple[int, int]:
        """``(bytes_up, bytes_down)`` summed over every active flow, read now (the sampler
        reads this every ``runtime.stats_interval_ms`` with thousands of flows open)."""
        up = down = 0
        for _entry, flow_up, flow_down in self._live_bytes():
            up += flow_up
            down += flow_down
        return up, down

    def live_traffic(self) -> list[tuple[FlowEntry, int, int]]:
        """``(entry, bytes_up, bytes_down)`` of every active flow that has moved or may move
        bytes, read now (relayed flows from C's counters)."""
        return list(self._live_bytes())

    def _live_bytes(self) -> Iterator[tuple[FlowEntry, int, int]]:
        entries = self.flows.entries()
        relayed = [e for e in entries if e.handle is not None and e.base is not None]
        counters = self.bridge.counters([e.handle for e in relayed if e.handle is not None])
        for entry, relay in zip(relayed, counters, strict=True):
            if relay is not None and entry.base is not None:
                # Payload bytes only: no Traffic object per flow.
                yield (entry, *entry.base.payload_with_relay(relay))
        for entry in entries:
            if entry.handle is None:
                traffic_now = entry.record["traffic"]
                yield entry, traffic_now["bytes_up"], traffic_now["bytes_down"]

    def udp_upstream_counters(self) -> dict[str, int]:
        """``stats.udp_upstream``: C's upstreams (direct) plus Python's (proxies)."""
        out = dict(self.counters.udp)
        relay = getattr(self, "udp", None)
        if relay is not None:
            for name, value in relay.stats().udp_upstream().items():
                out[name] = out.get(name, 0) + value
        return out

    def udp_datagram_drops(self) -> dict[str, int]:
        """Datagrams of SOCKS5 UDP associations dropped, by reason: C's (``foreign``: not
        from the client's address; ``fragment``: FRAG not 0; ``malformed``; ``no_dest``:
        the destination table full; ``pending``: over the bound while a verdict is
        awaited; ``blocked``: a refused destination; ``python``: Python's queue full;
        ``unsolicited``: an upstream reply from an address nothing was sent to) and
        Python's (``unmatched_reply``: a proxy's reply no destination sent for)."""
        out = dict.fromkeys(UDP_DROP_REASONS, 0)
        relay = getattr(self, "udp", None)
        if relay is not None:
            stats = relay.stats()
            for reason in UDP_DROP_REASONS[:-1]:
                out[reason] = getattr(stats, f"dropped_{reason}")
        out["unmatched_reply"] = self.counters.udp_unmatched_replies
        return out
