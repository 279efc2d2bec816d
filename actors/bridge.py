"""The bridge between FlowActors and the C relay: hand-off and completion delivery.

The relay reports completions through an eventfd that stays readable while any
are pending. The dispatcher loop watches it, drains the completions and tells
each flow's actor ``RelayFinished``. There is deliberately no reaper thread:
a second Python thread woken a thousand times a second takes the GIL every
time the dispatcher releases it for a syscall, which measured as ~100 us stalls
per hand-off. Hand-off and delivery both run on the dispatcher thread, so a flow
that completes before ``hand_off`` returns is still routed to its actor.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pykka

from spliceway.actors.messages import ConnEnded, ConnRouted, ConnTakeOver, RelayFinished
from spliceway.native import conn as connpath
from spliceway.native.conn import ConnPath, ConnRecord, Deferred
from spliceway.native.relay import Completion, Counters, Relay
from spliceway.support import socket_mark as mark
from spliceway.support.fdlimit import AcceptBackoff

if TYPE_CHECKING:
    from spliceway.actors.dispatcher import Dispatcher
    from spliceway.flows.outbounds import SealedSession

logger = logging.getLogger(__name__)


def relay_loops() -> int:
    """How many C relay loops the engine runs: one per usable CPU but one.

    The Python dispatcher (handshakes, routing, events) needs a core of its own,
    and on a small host the upstreams (an ss-server, another proxy) share the
    CPUs too: with as many busy relay loops as CPUs, they starve, and measured
    shadowsocks goodput over 8 connections fell to 0.85x of ss-local on 2 CPUs
    (1.10x with one loop).
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)


#: Starts the FlowActor of a flow C began (a STARTED record).
FlowStarter = Callable[[ConnRecord], "pykka.ActorRef[Any]"]
#: Takes over a connection C deferred.
DeferredTaker = Callable[[Deferred], None]


class RelayBridge:
    """Owns the relay and the C connection path; turns their reports into actor messages.

    Each has its own eventfd and drain, so a relay completion costs no C-path call.
    A completion can be drained before the ROUTED record of its flow (C hands the
    flow to the relay, then publishes the record): it waits in ``_orphans`` until
    the record names its handle.
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        start_flow: FlowStarter | None = None,
        take_deferred: DeferredTaker | None = None,
        slots: Mapping[int, Any] | None = None,
        accept_warn: Callable[[str], None] | None = None,
    ) -> None:
        """``start_flow`` starts the actor of a flow C began; ``take_deferred`` takes a
        connection C handed back before its handshake (closed without one). The C
        listeners' accept outages are reported through an :class:`AcceptBackoff` per
        slot: ``slots`` names the inbound in each slot (an object with ``tag``, as
        ``EngineCore.inbound_slots``), ``accept_warn`` emits the ``engine.warning``."""
        self.relay = Relay(loops=relay_loops())
        self.conn = ConnPath(self.relay)
        # C dials upstreams itself: it gets the TUN's socket mark now and on every
        # change, so its connections leave by the physical egress (spliceway.support.socket_mark;
        # the subscription holds the bound method weakly).
        self._unsubscribe_mark = mark.subscribe(self.conn.set_mark)
        self._dispatcher = dispatcher
        self._actors: dict[int, pykka.ActorRef[Any]] = {}
        #: C flow number -> actor, from STARTED until ROUTED or ENDED.
        self._flows: dict[int, pykka.ActorRef[Any]] = {}
        self._orphans: dict[int, Completion] = {}
        self._start_flow = start_flow
        self._take_deferred = take_deferred
        self._attached = False
        #: Listener slot -> the backoff that reports its accept outages.
        self._backoffs: dict[int, AcceptBackoff] = {}
        self._slot_specs: Mapping[int, Any] = slots if slots is not None else {}
        #: Listener slot -> the number of its last outage that ended (RESUMED).
        self._resumed: dict[int, int] = {}
        self._accept_warn: Callable[[str], None] = (
            accept_warn if accept_warn is not None else lambda message: None
        )

    def attach(self) -> None:
        """Start watching the relay and the C path (call on the dispatcher thread)."""
        self._dispatcher.loop.add_reader(self.relay.fileno(), self._on_relay_ready)
        self._dispatcher.loop.add_reader(self.conn.fileno(), self._on_conn_ready)
        self._attached = True

    def hand_off(
        self,
        client_fd: int,
        upstream_fd: int,
        idle_timeout_ms: int,
        actor: pykka.ActorRef[Any],
        sealed: SealedSession | None = None,
    ) -> int:
        """Give both fds to the relay (dispatcher thread); on success the relay owns them.

        With ``sealed`` the upstream speaks shadowsocks: the caller has sent its salt
        and sealed header, and the relay's AEAD path continues that session.
        """
        if sealed is None:
            handle = self.relay.add(client_fd, upstream_fd, idle_timeout_ms)
        else:
            handle = self.relay.add_aead(
                client_fd,
                upstream_fd,
                idle_timeout_ms,
                cipher=sealed.cipher,
                master_key=sealed.master_key,
                enc_subkey=sealed.encryptor.subkey,
                enc_nonce=sealed.encryptor.nonce_counter,
            )
        self._actors[handle] = actor
        return handle

    def counters(self, handles: list[int]) -> list[Counters | None]:
        """Live counters for many flows in one C call."""
        return self.relay.counters_many(handles)

    def request_close(self, handle: int) -> bool:
        """Ask the relay to close a flow; False if it already finished."""
        return self.relay.request_close(handle)

    def _on_relay_ready(self) -> None:
        for completion in self.relay.drain():
            self._deliver(completion)

    def _on_conn_ready(self) -> None:
        # Deferrals first, records second, then handle both: C publishes a flow's
        # STARTED before it hands that flow over, so this order sees every STARTED a
        # take-over refers to (the other order could take a deferral queued after
        # the drain, whose STARTED is still in the ring).
        deferrals = self.conn.take_deferred()
        for record in self.conn.drain():
            self._on_record(record)
        for deferred in deferrals:
            if deferred.flow:
                self._take_over(deferred)
            elif self._take_deferred is None:
                os.close(deferred.fd)
            else:
                self._take_deferred(deferred)

    def _take_over(self, deferred: Deferred) -> None:
        # Its STARTED record was drained first (C published it before deferring).
        actor = self._flows.pop(deferred.flow, None)
        try:
            if actor is not None:
                actor.tell(ConnTakeOver(deferred))
                return
        except pykka.ActorDeadError:
            pass
        logger.warning("C handed over flow %d, whose actor is gone", deferred.flow)
        os.close(deferred.fd)

    def forget_listener(self, slot: int) -> None:
        """Listener ``slot`` stopped: an outage it was in ends with it (no RESUMED comes)."""
        self._backoffs.pop(slot, None)
        self._resumed.pop(slot, None)

    def _on_listener_record(self, record: ConnRecord) -> None:
        # C paused accepting itself; the backoff only reports (once per outage) and counts.
        backoff = self._backoffs.get(record.inbound)
        if backoff is None:
            spec = self._slot_specs.get(record.inbound)
            name = f"inbound {spec.tag!r}" if spec is not None else f"listener {record.inbound}"
            backoff = self._backoffs[record.inbound] = AcceptBackoff(name, self._accept_warn)
        if record.kind == connpath.ACCEPT_FAILED:
            backoff.failed(record.err)
            # Another loop's ring may hold the outage's end, drained first: it is over.
            if self._resumed.get(record.inbound, 0) >= record.flow:
                backoff.accepted()
        else:
            self._resumed[record.inbound] = record.flow
            backoff.accepted(record.detail)

    def _on_record(self, record: ConnRecord) -> None:
        if record.kind >= connpath.ACCEPT_FAILED:
            self._on_listener_record(record)
            return
        if record.kind == connpath.STARTED:
            assert self._start_flow is not None
            self._flows[record.flow] = self._start_flow(record)
            return
        actor = self._flows.pop(record.flow, None)
        if actor is None:
            logger.warning("C record for unknown flow %d", record.flow)
            return
        try:
            if record.kind == connpath.ROUTED and record.relay_handle == 0:
                # A request C forwards itself: no relay, C still holds it; its ENDED
                # record (or a hand-over) follows, to the same actor.
                self._flows[record.flow] = actor
                actor.tell(ConnRouted(record))
            elif record.kind == connpath.ROUTED:
                self._actors[record.relay_handle] = actor
                actor.tell(ConnRouted(record))
                orphan = self._orphans.pop(record.relay_handle, None)
                if orphan is not None:
                    self._deliver(orphan)
            else:
                actor.tell(ConnEnded(record))
        except pykka.ActorDeadError:
            logger.warning("flow actor of C flow %d died before its record", record.flow)

    def _deliver(self, completion: Completion) -> None:
        actor = self._actors.pop(completion.handle, None)
        if actor is None:
            self._orphans[completion.handle] = completion
            return
        try:
            actor.tell(RelayFinished(completion))
        except pykka.ActorDeadError:
            logger.warning("flow actor of handle %#x died before its completion", completion.handle)

    def shutdown(self) -> None:
        """Stop the C path and the relay (any thread): what C held ends with ENDED
        records, open relayed flows complete with SHUTDOWN; all still delivered."""
        self._unsubscribe_mark()
        self.conn.close()
        self.relay.close()

    def detach(self) -> None:
        """Deliver what is left and stop watching (dispatcher thread, after shutdown)."""
        if self._attached:
            # Records first: completions of flows C routed find their actors.
            self._on_conn_ready()
            self._on_relay_ready()
            # A shut-down relay keeps its eventfd readable; stop watching it.
            self._dispatcher.loop.remove_reader(self.relay.fileno())
            self._dispatcher.loop.remove_reader(self.conn.fileno())
            self._attached = False
            for handle in self._orphans:
                logger.warning("relay completion for unknown handle %#x", handle)
            self._orphans.clear()
