"""StatsSamplerActor: once per interval, reads relay counters and emits samples.

For every active flow whose counters moved it tells the flow's actor a
``TrafficSample`` (the flow itself then emits flow.updated with a new
revision), and it emits one ``stats.sampled`` with the engine totals.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import pykka

from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.messages import TrafficSample
from spliceway.actors.udp import SampleUdp
from spliceway.events.log import now_ms

if TYPE_CHECKING:
    from spliceway.engine.core import EngineCore

logger = logging.getLogger(__name__)


class StatsSamplerActor(LoopActor):
    """Periodic sampler of relay counters and engine stats."""

    def __init__(self, core: EngineCore, interval_ms: int) -> None:
        super().__init__(core.dispatcher)
        self.core = core
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
            self.core.log.emit("stats.sampled", self.core.stats_snapshot())
        except Exception:
            logger.exception("stats sampling failed")
        self._schedule()

    def sample_udp(self) -> None:
        """Ask each UDP association to sample its flows (one C call each)."""
        message = SampleUdp(now_ms())
        for ref in list(self.core.udp_assocs.values()):
            with contextlib.suppress(pykka.ActorDeadError):
                ref.tell(message)

    def sample_flows(self) -> int:
        """Tell each flow whose counters moved since the last tick; returns how many."""
        entries = [e for e in self.core.flows.entries() if e.handle is not None]
        if not entries:
            self._seen.clear()
            return 0
        handles = [e.handle for e in entries if e.handle is not None]
        counters = self.core.bridge.counters(handles)
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
