"""StatsSamplerActor: once per interval, reads relay counters and emits samples.

For every active flow whose counters moved it tells the flow's actor a
``TrafficSample`` (the flow itself then emits flow.updated with a new
revision), and it emits one ``stats.sampled`` with the engine totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pykka

from spliceway.actors.dispatcher import Dispatcher, LoopActor
from spliceway.actors.messages import TrafficSample
from spliceway.actors.udp import SampleUdp
from spliceway.events.log import now_ms

if TYPE_CHECKING:
    from spliceway.actors.bridge import RelayBridge
    from spliceway.engine.runtime import FlowTable
    from spliceway.events.log import EventLog

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SamplerPorts:
    """What the stats sampler uses of the engine."""

    dispatcher: Dispatcher
    bridge: RelayBridge
    flows: FlowTable
    log: EventLog
    #: UDP associations' actors (the TUN's among them), by the engine's key.
    udp_assocs: Mapping[Any, pykka.ActorRef[Any]]
    #: The stats resource, live.
    stats_snapshot: Callable[[], dict[str, Any]]


class StatsSamplerActor(LoopActor):
    """Periodic sampler of relay counters and engine stats."""

    def __init__(self, ports: SamplerPorts, interval_ms: int) -> None:
        super().__init__(ports.dispatcher)
        self.ports = ports
        self.interval = interval_ms / 1000
        self._timer: asyncio.TimerHandle | None = None
        self._seen: dict[int, tuple[int, int, int, int]] = {}

    def on_start(self) -> None:
        """Schedule the first tick."""
        self._schedule()

    def on_stop(self) -> None:
        """Cancel the pending tick."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        self._timer = self.dispatcher.loop.call_later(self.interval, self._tick)

    def _tick(self) -> None:
        if self.actor_stopped.is_set():
            return
        try:
            self.sample_flows()
            self.sample_udp()
            self.ports.log.emit("stats.sampled", self.ports.stats_snapshot())
        except Exception:
            logger.exception("stats sampling failed")
        self._schedule()

    def sample_udp(self) -> None:
        """Ask each UDP association to sample its flows (one C call each)."""
        message = SampleUdp(now_ms())
        for ref in list(self.ports.udp_assocs.values()):
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(message)

    def sample_flows(self) -> int:
        """Tell each flow whose counters moved since the last tick; returns how many."""
        entries = [e for e in self.ports.flows.entries() if e.handle is not None]
        if not entries:
            self._seen.clear()
            return 0
        handles = [e.handle for e in entries if e.handle is not None]
        counters = self.ports.bridge.counters(handles)
        at = now_ms()
        seen: dict[int, tuple[int, int, int, int]] = {}
        told = 0
        for entry, handle, c in zip(entries, handles, counters, strict=True):
            if c is None:
                continue
            key = (c.client_rx, c.client_tx, c.upstream_rx, c.upstream_tx)
            seen[handle] = key
            if self._seen.get(handle) == key:
                continue
            try:
                entry.actor.tell(TrafficSample(c, at))
                told += 1
            except pykka.ActorDeadError:
                continue
        self._seen = seen
        return told
