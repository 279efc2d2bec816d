"""``GET /metrics``: the engine's state in the Prometheus exposition formats.

One ``prometheus_client`` custom collector reads the engine's own snapshots when a scrape
arrives (the stats counters, the flow table with C's live byte counters, the policy
views, the sinks' status, the event ring): there is no second set of counters to keep
in step, and nothing is counted on the data path for metrics' sake. Text format 0.0.4
by default, OpenMetrics when the scraper's ``Accept`` asks for it (the library's content
negotiation). The metric names and labels are documented in the README's Metrics section.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import falcon
from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from spliceway import __version__
from spliceway.control import queries
from spliceway.control.capabilities import API_ID
from spliceway.flows.histograms import Histogram

if TYPE_CHECKING:
    from spliceway.events.log import EventLog
    from spliceway.routing.policy import PolicyTable

__all__ = ["EngineCollector", "MetricsResource", "MetricsSource", "metrics_registry"]

NS = "spliceway"
_UDP_GAUGES = frozenset({"active_associations"})


class MetricsSource(Protocol):
    """What ``GET /metrics`` reads of a running engine, and nothing more
    (``spliceway.engine.core.EngineCore`` is one). The engine's own types stay ``Any``
    here: the transports sit above the engine and import nothing of it."""

    @property
    def build_id(self) -> str:
        """This build's id."""
        ...

    @property
    def started_at_unix_ms(self) -> int:
        """When the engine started."""
        ...

    @property
    def running(self) -> bool:
        """True between start and stop."""
        ...

    @property
    def counters(self) -> Any:
        """The engine's cumulative counters (``engine.runtime.Counters``)."""
        ...

    @property
    def flows(self) -> Any:
        """The active flows (``engine.runtime.FlowTable``)."""
        ...

    @property
    def policies(self) -> PolicyTable:
        """The policy groups' current views."""
        ...

    @property
    def connector(self) -> Any:
        """The event sinks (``status()`` per sink)."""
        ...

    @property
    def log(self) -> EventLog:
        """The event ring."""
        ...

    @property
    def bridge(self) -> Any:
        """The relay bridge (its ``relay``'s counters)."""
        ...

    def live_traffic(self) -> list[tuple[Any, int, int]]:
        """Each active relayed flow's entry with its live up and down byte counts."""
        ...

    def udp_datagram_drops(self) -> dict[str, int]:
        """Dropped UDP datagrams by reason."""
        ...

    def udp_upstream_counters(self) -> dict[str, int]:
        """The UDP upstream counters."""
        ...


class EngineCollector(Collector):
    """Reads one engine's snapshots into metric families at each scrape."""

    def __init__(self, core: MetricsSource, sse_streams: Callable[[], int]) -> None:
        self._core = core
        self._sse_streams = sse_streams

    def collect(self) -> Iterator[Metric]:
        """Every family, from the engine's state now."""
        yield from self._engine()
        yield from self._flows()
        yield from self._udp()
        yield from self._policies()
        yield from self._sinks()
        yield from self._events()
        yield from self._relay()

    def describe(self) -> list[Metric]:
        # Nothing to describe up front: registering must not read the engine.
        return []

    def _engine(self) -> Iterator[Metric]:
        core = self._core
        info = InfoMetricFamily(f"{NS}_build", "The engine's build.")
        info.add_metric([], {"version": __version__, "build_id": core.build_id, "api_id": API_ID})
        yield info
        started = GaugeMetricFamily(
            f"{NS}_start_time_seconds", "When the engine started, Unix time in seconds."
        )
        started.add_metric([], core.started_at_unix_ms / 1000)
        yield started
        up = GaugeMetricFamily(f"{NS}_up", "1 while the engine is running.")
        up.add_metric([], 1.0 if core.running else 0.0)
        yield up

    def _flows(self) -> Iterator[Metric]:
        core = self._core
        c = core.counters
        started = CounterMetricFamily(f"{NS}_flows_started", "Flows accepted since start.")
        started.add_metric([], c.total_started)
        yield started
        completed = CounterMetricFamily(
            f"{NS}_flows_completed",
            "Flows completed since start, by network and outcome.",
            labels=["network", "outcome"],
        )
        for (network, outcome), n in sorted(dict(c.outcomes).items()):
            completed.add_metric([network, outcome], n)
        yield completed
        live = core.live_traffic()
        active = GaugeMetricFamily(
            f"{NS}_flows_active",
            "Flows open now, by inbound and network.",
            labels=["inbound", "network"],
        )
        by_inbound = Counter(
            (entry.inbound_tag, entry.record["network"]) for entry in core.flows.entries()
        )
        for (inbound, network), n in sorted(by_inbound.items()):
            active.add_metric([inbound, network], n)
        yield active
        totals = {tag: list(pair) for tag, pair in dict(c.outbound_bytes).items()}
        for entry, up, down in live:
            outbound: Mapping[str, Any] = (entry.record.get("path") or {}).get("outbound") or {}
            tag = outbound.get("tag")
            if not tag:
                # Not routed yet (or never will be): no outbound to count it under, as
                # Counters.count_completed leaves such flows out once they complete.
                continue
            pair = totals.setdefault(tag, [0, 0])
            pair[0] += up
            pair[1] += down
        traffic = CounterMetricFamily(
            f"{NS}_flow_bytes",
            "Bytes of flows since start (completed and open), by outbound and direction "
            "(up: client to remote).",
            labels=["outbound", "direction"],
        )
        for tag, (up, down) in sorted(totals.items()):
            traffic.add_metric([tag, "up"], up)
            traffic.add_metric([tag, "down"], down)
        yield traffic
        yield _histogram(
            f"{NS}_flow_duration_seconds",
            "Durations of completed flows that had an outbound, by outbound.",
            c.durations,
        )
        yield _histogram(
            f"{NS}_flow_size_bytes",
            "Payload bytes (up plus down) of completed flows that had an outbound, by outbound.",
            c.sizes,
        )

    def _udp(self) -> Iterator[Metric]:
        drops = CounterMetricFamily(
            f"{NS}_udp_datagrams_dropped",
            "Datagrams of SOCKS5 UDP associations dropped, by reason.",
            labels=["reason"],
        )
        for reason, value in self._core.udp_datagram_drops().items():
            drops.add_metric([reason], value)
        yield drops
        counters = self._core.udp_upstream_counters()
        for name, value in sorted(counters.items()):
            help_text = f"UDP upstream associations: {name.replace('_', ' ')}."
            if name in _UDP_GAUGES:
                gauge = GaugeMetricFamily(f"{NS}_udp_upstream_{name}", help_text)
                gauge.add_metric([], value)
                yield gauge
            else:
                counter = CounterMetricFamily(f"{NS}_udp_upstream_{name}", help_text)
                counter.add_metric([], value)
                yield counter

    def _policies(self) -> Iterator[Metric]:
        selected = GaugeMetricFamily(
            f"{NS}_policy_selected",
            "1 for the member each policy group selects now.",
            labels=["policy", "kind", "member"],
        )
        healthy = GaugeMetricFamily(
            f"{NS}_policy_member_healthy",
            "1 when a probed member's last probe succeeded, else 0.",
            labels=["policy", "member"],
        )
        latency = GaugeMetricFamily(
            f"{NS}_policy_member_latency_seconds",
            "A probed member's last measured latency (absent until one succeeds).",
            labels=["policy", "member"],
        )
        checked = GaugeMetricFamily(
            f"{NS}_policy_member_last_checked_timestamp_seconds",
            "When a probed member was last probed, Unix time in seconds.",
            labels=["policy", "member"],
        )
        for view in self._core.policies.views():
            if view.selected is not None:
                selected.add_metric([view.tag, view.kind, view.selected], 1)
            if not view.probing:
                continue
            for member in view.members:
                health = view.health[member]
                healthy.add_metric([view.tag, member], 1 if health.healthy else 0)
                if health.latency_ms is not None:
                    latency.add_metric([view.tag, member], health.latency_ms / 1000)
                if health.last_checked_unix_ms is not None:
                    checked.add_metric([view.tag, member], health.last_checked_unix_ms / 1000)
        yield from (selected, healthy, latency, checked)

    def _sinks(self) -> Iterator[Metric]:
        labels = ["sink", "type"]
        pending = GaugeMetricFamily(
            f"{NS}_sink_pending_events", "Events accepted and not yet delivered.", labels=labels
        )
        families = {
            "total_delivered": CounterMetricFamily(
                f"{NS}_sink_delivered_events", "Events delivered (acknowledged).", labels=labels
            ),
            "total_failed": CounterMetricFamily(
                f"{NS}_sink_failed_attempts", "Delivery attempts that failed.", labels=labels
            ),
            "total_dead_lettered": CounterMetricFamily(
                f"{NS}_sink_dead_lettered_events", "Events kept as dead letters.", labels=labels
            ),
            "total_discarded": CounterMetricFamily(
                f"{NS}_sink_discarded_events", "Events given up and dropped.", labels=labels
            ),
            "replay_gaps": CounterMetricFamily(
                f"{NS}_sink_replay_gaps",
                "Events the ring evicted before this sink's outbox could take them.",
                labels=labels,
            ),
        }
        blocked = GaugeMetricFamily(
            f"{NS}_sink_write_blocked",
            "1 while the outbox's free-space reserve stops new events being written.",
            labels=labels,
        )
        last_success = GaugeMetricFamily(
            f"{NS}_sink_last_success_timestamp_seconds",
            "When the sink last delivered, Unix time in seconds.",
            labels=labels,
        )
        for item in self._core.connector.status():
            key = [item["name"], item["type"]]
            pending.add_metric(key, item["pending"])
            for field, family in families.items():
                family.add_metric(key, item[field])
            storage = item.get("outbox_storage")
            if storage is not None:
                blocked.add_metric(key, 1 if storage["write_blocked"] else 0)
            if item["last_success_at_unix_ms"] is not None:
                last_success.add_metric(key, item["last_success_at_unix_ms"] / 1000)
        yield pending
        yield from families.values()
        yield from (blocked, last_success)

    def _events(self) -> Iterator[Metric]:
        log = self._core.log
        emitted = CounterMetricFamily(
            f"{NS}_events_emitted", "Events emitted since start, by type.", labels=["type"]
        )
        for event_type, n in sorted(log.type_counts().items()):
            emitted.add_metric([event_type], n)
        yield emitted
        fill = GaugeMetricFamily(f"{NS}_event_ring_events", "Events the ring holds now.")
        fill.add_metric([], log.fill())
        yield fill
        capacity = GaugeMetricFamily(f"{NS}_event_ring_capacity", "Events the ring can hold.")
        capacity.add_metric([], log.capacity)
        yield capacity
        streams = GaugeMetricFamily(
            f"{NS}_sse_streams_open", "Server-sent event streams open on this control API."
        )
        streams.add_metric([], self._sse_streams())
        yield streams

    def _relay(self) -> Iterator[Metric]:
        relay = self._core.bridge.relay
        loops = GaugeMetricFamily(f"{NS}_relay_loops", "C relay threads.")
        loops.add_metric([], relay.loops)
        yield loops
        active = GaugeMetricFamily(f"{NS}_relay_active_flows", "Flows the C relay moves now.")
        active.add_metric([], relay.active_count())
        yield active


def _histogram(name: str, documentation: str, histogram: Histogram) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, documentation, labels=["outbound"])
    for tag, series in sorted(histogram.snapshot().items()):
        buckets = [(floatToGoString(bound), n) for bound, n in series.buckets]
        family.add_metric([tag], buckets, series.total)
    return family


def metrics_registry(core: MetricsSource, sse_streams: Callable[[], int]) -> CollectorRegistry:
    """A registry of its own per app (never the process-wide default one): an embedding
    host may run several engines, or its own metrics. It also holds the process
    collector (``process_resident_memory_bytes``, ``process_open_fds``,
    ``process_cpu_seconds_total``...), read from ``/proc`` at each scrape; an engine
    shares its process with its host, so those are the host's figures too."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(core, sse_streams))
    ProcessCollector(registry=registry)
    return registry


class MetricsResource:
    """``GET /metrics`` (permission ``read``, checked by the gate like every query)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        """One scrape, in the format the ``Accept`` header asks for."""
        queries.reject_unknown(dict(req.params), (), "GET /metrics")
        encoder, content_type = choose_encoder(req.get_header("Accept") or "")
        resp.data = encoder(self._registry)
        resp.content_type = content_type
        resp.set_header("Cache-Control", "no-store")
