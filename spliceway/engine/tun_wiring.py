"""The engine core's TUN wiring: what the TUN service is given, and its teardown.

:class:`TunWiring` is a mixin of :class:`~spliceway.engine.core.EngineCore`: the parts
(:class:`~spliceway.tun.service.TunParts`) through which the TUN inbound registers its
listener slot, starts its actors on the dispatcher, answers hijacked DNS and ends its
flows; the sweep of what a crashed engine's TUN left behind (first in ``start``); and
the TUN's stop. The state it reads is the core's, declared below for the type checker.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import pykka

from spliceway.dns.server import DnsResponder
from spliceway.dns.service import DnsService
from spliceway.engine.components import ActorPort, LoopPort, TunPort
from spliceway.engine.generation import Generation, InboundSpec
from spliceway.engine.runtime import FlowTable
from spliceway.events.log import EventLog
from spliceway.flows.inbound import Users
from spliceway.support.fdlimit import warning_emitter
from spliceway.support.loop import Dispatcher
from spliceway.tun.routing import sweep_if_recorded
from spliceway.tun.service import TunParts

__all__ = ["TunWiring"]

logger = logging.getLogger(__name__)

#: A TUN inbound's sniffing budget (tun.start has no setting): an inbound's default.
_TUN_SNIFF_TIMEOUT_MS = 300


class TunWiring:
    """The core's TUN wiring (a mixin of ``EngineCore``, whose state it reads)."""

    # The core's state this mixin reads and writes (set by EngineCore.__init__/start).
    generation: Generation
    log: EventLog
    dns: DnsService
    dispatcher: LoopPort
    flows: FlowTable
    inbound_slots: dict[int, InboundSpec]
    udp_assocs: dict[Any, pykka.ActorRef[Any]]
    tun: TunPort | None
    republish: Callable[[], None]
    _actors: ActorPort | None
    _tun_responder: DnsResponder | None

    @staticmethod
    def _sweep_tun_leftovers() -> None:
        try:
            swept = sweep_if_recorded()
        except Exception as ex:  # no privilege, no netlink: the TUN's own start says so
            logger.warning("could not remove a crashed engine's TUN routes and rules: %s", ex)
            return
        if swept is not None and swept.removed:
            logger.warning(
                "removed what a crashed engine's TUN (pid %s) left behind: %s",
                swept.previous_owner,
                "; ".join(swept.removed),
            )

    def _tun_parts(self) -> TunParts:
        # The TUN service starts after the actors (start builds them first), on the
        # support.loop Dispatcher the composition root built.
        assert self._actors is not None
        assert isinstance(self.dispatcher, Dispatcher)

        def register(slot: int, tag: str) -> InboundSpec:
            spec = InboundSpec(slot, tag, "tun", True, _TUN_SNIFF_TIMEOUT_MS, Users(None))
            self.inbound_slots[slot] = spec
            return spec

        return TunParts(
            dispatcher=self.dispatcher,
            start_actor=self._actors.start_tun,
            register=register,
            republish=self.republish,
            inbound_tags=lambda: {ib.tag for ib in self.generation.config.inbounds},
            idle_timeout_ms=lambda: self.generation.tcp_idle_timeout_ms,
            network_mtu=lambda: self.generation.config.runtime.network.mtu,
            end_flows=self._end_flows_of,
            udp_idle_timeout_s=lambda: (
                self.generation.config.runtime.udp_upstream_idle_timeout_seconds
            ),
            dns_responder=self._dns_responder,
            start_udp=self._start_tun_udp,
            warn_fd_exhausted=warning_emitter(self.log),
        )

    def _dns_responder(self) -> DnsResponder:
        """The DNS server's responder (one set of counters), else one of the TUN's own."""
        server = self.dns.server
        if server is not None:
            return server.responder
        if self._tun_responder is None:
            self._tun_responder = DnsResponder(
                lambda: self.generation.resolver, lambda: self.dns.pool
            )
        return self._tun_responder

    def _start_tun_udp(
        self, spec: InboundSpec, stack: Any, dns: DnsResponder | None
    ) -> pykka.ActorRef[Any]:
        """The actor of a TUN's UDP sessions (on the dispatcher, from the TunActor); the
        stats sampler ticks it like a SOCKS5 association."""
        assert self._actors is not None
        ref = self._actors.start_tun_udp(spec, stack, dns)
        self.udp_assocs[("tun", spec.tag)] = ref
        return ref

    def _end_flows_of(self, tag: str) -> None:
        self.udp_assocs.pop(("tun", tag), None)
        actors = self._actors
        assert actors is not None
        for entry in self.flows.entries():
            if entry.inbound_tag == tag:
                with contextlib.suppress(pykka.ActorDeadError):
                    actors.stop_flow(entry.actor)

    def _stop_tun(self) -> None:
        """Take a running TUN down (engine stop, or a start undone); never raises."""
        if self.tun is None:
            return
        try:
            self.tun.stop()
        except Exception:
            logger.exception("stopping the TUN failed")
