"""FlowActor's side of the flows the C connection path runs: it records what C reports.

A connection C accepts, handshakes, routes and dials itself reaches its FlowActor as C's
records (STARTED, ROUTED, ENDED) or, when C leaves the rest to Python mid-way, as a
:class:`~spliceway.native.conn.Deferred` handed over. :class:`ConnRecording` turns
them into the flow's record and events as the Python path would have made them (the
same handshake, route, counts and outcome), waiting for the process lookup first when
one is wanted. It is a mixin of :class:`~spliceway.actors.flow.FlowActor`.
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import TYPE_CHECKING, Any

from spliceway.actors.messages import ConnTakeOver
from spliceway.flows import records
from spliceway.flows.inbound import Handshake
from spliceway.flows.machine import Blocked, Closed, Event, Failed, FlowMachine, Relaying
from spliceway.native import conn as connpath
from spliceway.native.conn import AUTH_SCHEMES

if TYPE_CHECKING:
    from collections.abc import Coroutine

    from spliceway.routing.rules import RouteDecision

#: How a request C forwarded itself ends (actors/http_forward.py records it).
_FORWARD_ENDS = (connpath.END_FORWARDED, connpath.END_FWD_CLIENT, connpath.END_FWD_TIMEOUT)


class ConnRecording:
    """FlowActor's recording of a flow C runs (see the module docstring)."""

    # FlowActor's, used here.
    deps: Any
    inbound: Any
    client: socket.socket | None
    state: records.FlowState | None
    handle: int | None
    dispatcher: Any
    _base: records.Traffic | None
    machine: FlowMachine
    _task: asyncio.Task[None] | None
    _c_flow: Any
    _held: list[Any] | None

    if TYPE_CHECKING:
        # Methods of FlowActor and HttpForwarding this mixin calls: declared for the type
        # checker only, so a change of their signatures fails mypy here.
        async def _establish(self, steps: Coroutine[Any, Any, None] | None = None) -> None: ...
        async def _route_and_dial(self, hs: Handshake, replied: bool) -> None: ...
        async def _look_up(
            self, state: records.FlowState, server: tuple[str | None, int]
        ) -> None: ...
        def _new_state(self, hs: Handshake, started_at: int | None = None) -> records.FlowState: ...
        def _start_record(self, state: records.FlowState) -> None: ...
        def _set_route(self, decision: RouteDecision, chain: list[str], outbound: Any) -> None: ...
        def _report_member_down(self, chain: list[str], error: str) -> None: ...
        def _dialled(self) -> bool: ...
        def _publish(
            self, event_type: str, payload_fn: Any, occurred: int | None = None
        ) -> None: ...
        def _end(self, event: Event) -> None: ...
        def _finish(self) -> None: ...
        def on_receive(self, message: Any) -> Any: ...
        def _on_c_forwarding(self, rec: connpath.ConnRecord, outbound: Any) -> None: ...
        def _on_c_forwarded(self, rec: connpath.ConnRecord) -> None: ...
        def _take_over_forward(self, d: connpath.Deferred, client: socket.socket) -> None: ...

    # -- flows the C connection path runs ---------------------------------------------

    def _c_handshake(
        self, c: connpath.Deferred | connpath.ConnRecord, host: str, early: bytes = b""
    ) -> Handshake:
        """What C's handshake established, as the Python handshake would have."""
        forward = c.protocol == "http_forward"
        return Handshake(
            "http" if forward else c.protocol,
            host,
            c.port,
            self.deps.principal_key(c.principal),
            AUTH_SCHEMES.get(c.auth),
            c.client_rx,
            c.client_tx,
            early=early,
            forward=forward,
        )

    async def _start_c_after_lookup(self, rec: connpath.ConnRecord) -> None:
        """flow.started of a flow C runs, once its process is known; then what C reported
        meanwhile, in order. C relays the flow all along: only its record waits."""
        try:
            state = self._new_state(self._c_handshake(rec, rec.name), rec.at_unix_ms)
            server = (
                (rec.name, rec.port)
                if self.inbound.protocol == "tun"
                else self.deps.listener_address(rec.inbound)
            )
            await self._look_up(state, server)
        except asyncio.CancelledError:
            return  # stopped meanwhile: _teardown dropped what was held
        finally:
            self.deps.process_lookup.holding -= 1
        self._task = None
        self._start_record(state)
        held, self._held = self._held, None
        for message in held or ():
            self.on_receive(message)

    def _start_record_c(self, rec: connpath.ConnRecord) -> None:
        """flow.started from C's STARTED record, with C's timestamp and counts."""
        self._start_record(self._new_state(self._c_handshake(rec, rec.name), rec.at_unix_ms))

    def _c_route(self, rec: connpath.ConnRecord) -> Any:
        """Apply the route C took (looked up in the table it used); its outbound."""
        mirror = self.deps.routes.mirror(rec.epoch)
        decision = mirror.routes.decision(rec.action, rec.rule, rec.target)
        chain = mirror.chains[rec.target] if rec.target >= 0 else []
        outbound = mirror.outbounds.get(chain[-1]) if chain else None
        self._set_route(decision, chain, outbound)
        self._c_seen(rec.client_rx, rec.client_tx, rec.name)
        return outbound

    def _c_seen(self, client_rx: int, client_tx: int, sniffed: str | None) -> None:
        """What C read from and wrote to the client so far, and the host it sniffed."""
        s = self.state
        assert s is not None
        s.traffic.inbound_rx_bytes = client_rx
        s.traffic.inbound_tx_bytes = client_tx
        if sniffed:
            s.sniffed_host = sniffed

    def _on_c_routed(self, rec: connpath.ConnRecord) -> None:
        s = self.state
        if s is None or not self.machine.live:
            return
        outbound = self._c_route(rec)
        if rec.relay_handle == 0:
            self._on_c_forwarding(rec, outbound)
            return
        self._c_flow = None
        # Only a flow C dialled has outbound counts: the Python path, too, counts a
        # proxy's handshake once the dial succeeded (its Dialed carries them).
        t = s.traffic
        t.outbound_rx_bytes = rec.upstream_rx
        t.outbound_tx_bytes = rec.upstream_tx
        t.bytes_up += rec.early
        t.bytes_down += rec.late
        if outbound.protocol == "direct":
            s.resolved_ip = rec.resolved_ip
            s.remote_host, s.remote_port = s.target_host, s.target_port
        else:
            s.remote_host, s.remote_port = outbound.server, outbound.port
        self._base = s.traffic.copy(sealed=False)
        self.handle = rec.relay_handle
        self.machine.handle(Relaying())
        s.state = "active"
        if outbound.chained:
            self.deps.counters.chained_sessions += 1
        else:
            self.deps.counters.direct_sessions += 1
        self._publish("flow.routed", records.lifecycle_payload, occurred=rec.at_unix_ms)
        if self.machine.close_requested:
            # The close reached C after it had handed the flow to the relay.
            self.deps.bridge.request_close(rec.relay_handle)

    def _dropped(self, message: Any) -> None:
        """A connection handed over after the actor stopped is closed, not leaked."""
        if isinstance(message, ConnTakeOver):
            os.close(message.deferred.fd)
            if message.deferred.ufd >= 0:
                os.close(message.deferred.ufd)

    def _take_over(self, d: connpath.Deferred) -> None:
        """C answered and sniffed this flow, then found a route only Python can take (an
        opaque rule, a DNS miss, an outbound it does not dial): carry on from there."""
        self._c_flow = None
        s = self.state
        client = socket.socket(fileno=d.fd)
        if d.stage == connpath.FORWARD:
            self._take_over_forward(d, client)
            return
        if s is None or not self.machine.live:
            client.close()
            return
        self._c_seen(d.client_rx, d.client_tx, d.sniffed)
        if self.machine.close_requested:
            # The close reached C after it had handed the connection over.
            client.close()
            self._end(Closed(self._dialled()))
            self._finish()
            return
        self.client = client
        hs = self._c_handshake(d, d.host, d.raw)
        self._task = self.dispatcher.spawn(self._establish(self._route_and_dial(hs, True)))

    def _on_c_ended(self, rec: connpath.ConnRecord) -> None:
        s = self.state
        if s is None or not self.machine.live:
            return
        # Closed while C sniffed before routing, when the Python path has applied no
        # route yet.
        sniffing_first = rec.end == connpath.END_CLOSED and rec.detail == 1
        if rec.action > 0 and not sniffing_first:
            outbound = self._c_route(rec)
        else:
            outbound = None
            self._c_seen(rec.client_rx, rec.client_tx, rec.name)
        self._c_flow = None
        if rec.end in _FORWARD_ENDS:
            self._on_c_forwarded(rec)
            self._finish()
            return
        if rec.end == connpath.END_BLOCKED:
            self._end(Blocked())
        elif rec.end == connpath.END_CLOSED:
            # Dialled and told the tunnel is open (C was still sniffing): as the
            # Python path, that flow was relayed.
            self._end(Closed(self._dialled() or rec.dialled))
        elif rec.end in (connpath.END_CLIENT, connpath.END_INTERNAL) or outbound is None:
            failure = records.Failure(
                "internal", "internal_error", f"client socket error: {os.strerror(rec.err)}"
            )
            self._end(Failed(failure))
        else:
            ex = connpath.dial_error(rec, outbound, s.target_host, s.target_port, rec.message)
            if ex.member_down:
                self._report_member_down(s.selection_chain, ex.message)
            remote = (
                {"host": s.target_host, "port": s.target_port}
                if ex.remote is None
                else {"host": ex.remote}
            )
            self._end(Failed(records.Failure(ex.stage, ex.code, ex.message, remote)))
        self._finish()
