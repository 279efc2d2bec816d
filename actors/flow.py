"""FlowActor: owns one client connection from accept to flow.completed.

It runs the inbound handshake, sniffs, routes, dials, then hands both fds to
the C relay and sleeps until the relay reports the end. It alone writes its
FlowRecord; every revision is published to the flow table as a new dict and
announced as an event. Exactly one ``flow.completed`` is emitted per flow that
got past the handshake, whatever path ends it (blocked, failed, cancelled,
relay completion, engine stop).

Where the flow stands and what its end means is :class:`~spliceway.flows.machine.FlowMachine`'s
(pure, tested without sockets): this actor does the I/O, feeds it the events and records
the verdict it answers. What it is given of the engine is :class:`FlowDeps`
(actors/flow_deps.py); a flow the C connection path runs is recorded by its
:class:`~spliceway.actors.flow_conn.ConnRecording` half, an absolute-URI request by its
:class:`~spliceway.actors.http_forward.HttpForwarding` half.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import socket
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.flow_conn import ConnRecording
from spliceway.actors.flow_deps import FlowDeps as FlowDeps  # where its users import it
from spliceway.actors.http_forward import HttpForwarding
from spliceway.actors.messages import (
    CloseFlow,
    ConnEnded,
    ConnRouted,
    ConnTakeOver,
    RelayFinished,
    StopFlow,
    TrafficSample,
)
from spliceway.actors.policy import MemberFailed
from spliceway.dns.resolver import ResolveError
from spliceway.engine.runtime import FlowEntry, RouteState
from spliceway.events.log import now_ms
from spliceway.flows import log as flowlog
from spliceway.flows import records
from spliceway.flows.hook import ask_about
from spliceway.flows.inbound import Handshake, HandshakeFailed, refuse_quietly
from spliceway.flows.inbound import accept as accept_handshake
from spliceway.flows.machine import (
    Blocked,
    CloseAction,
    Closed,
    Dialed,
    Dialing,
    Event,
    Failed,
    FlowMachine,
    Holder,
    HookDenied,
    RelayEnded,
    Relaying,
    Routed,
    Started,
)
from spliceway.flows.outbounds import DialError
from spliceway.native import conn as connpath
from spliceway.protocols import NEED_MORE, sniff, socks5
from spliceway.routing import hostnorm
from spliceway.routing import rules as routing

if TYPE_CHECKING:
    from spliceway.engine.generation import InboundSpec
    from spliceway.flows.hook import FlowHookClient

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
#: Longest a flow waits for its process lookup (``runtime.process_lookup``); one takes
#: well under a millisecond, unless hundreds queue behind each other.
PROCESS_LOOKUP_TIMEOUT = 1.0
#: What a flow C started keeps for later while its record waits for the process lookup.
_HELD = (ConnRouted, ConnEnded, ConnTakeOver, RelayFinished)
_SNIFF_PEEK = 16 * 1024 + 5
_SNIFF_RETRY = 0.005


def _resolve(future: asyncio.Future[None]) -> None:
    # Level-triggered readiness can fire again before the waiter removes the reader.
    if not future.done():
        future.set_result(None)


def _sniff_may_reroute(route_state: RouteState, decision: routing.RouteDecision) -> bool:
    """Whether a sniffed host could change ``decision`` (a domain rule ranks before it)."""
    if route_state.mode != "rule":
        return False
    ruleset = route_state.ruleset
    bound = decision.matched_rule.index if decision.matched_rule else len(ruleset.rules)
    return ruleset.first_domain_rule < bound


class FlowActor(HttpForwarding, ConnRecording, LoopActor):
    """One TCP flow through the engine."""

    # One per connection: the engine tracks them in ``deps.flow_actors``.
    registered = False

    def __init__(
        self,
        deps: FlowDeps,
        inbound: InboundSpec,
        client: socket.socket,
        peer: tuple[Any, ...],
        flow_id: str,
        *,
        deferred: connpath.Deferred | None = None,
        started: connpath.ConnRecord | None = None,
    ) -> None:
        super().__init__(deps.dispatcher)
        self.deps = deps
        self.inbound = inbound
        self.client: socket.socket | None = client
        self.upstream: socket.socket | None = None
        self.peer = peer
        self.flow_id = flow_id
        self.state: records.FlowState | None = None
        self.handle: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._base: records.Traffic | None = None
        #: Where the flow stands and what its end means (spliceway/flows/machine.py).
        self.machine = FlowMachine()
        #: Set when C handed this connection over mid-way (see connpath.Deferred).
        self._deferred = deferred
        #: Set when the C connection path runs this flow; Python only records it.
        self._started = started
        self._c_flow = started.flow if started is not None else None
        #: While a flow C started waits for its process lookup: C's reports, kept in order.
        self._held: list[Any] | None = None
        deps.flow_actors.add(self)

    # -- lifecycle -----------------------------------------------------------------

    def on_start(self) -> None:
        """Begin the handshake on the dispatcher loop (or record C's flow.started)."""
        started, self._started = self._started, None
        if started is not None:
            if started.source_ip and self.deps.lookup_wanted(started.source_ip):
                self._held = []
                self.deps.process_lookup.holding += 1
                self._task = self.dispatcher.spawn(self._start_c_after_lookup(started))
                return
            self._start_record_c(started)
            return
        self._task = self.dispatcher.spawn(self._establish())

    def on_stop(self) -> None:
        """Release whatever is still held (idempotent)."""
        self._teardown()

    def on_failure(self, *exc_info: Any) -> None:
        """A handler raised: end the flow as failed so nothing leaks."""
        self._fail_internal(exc_info[1])
        self._teardown()

    def _fail_internal(self, ex: BaseException | None) -> None:
        if self.machine.live:
            self._end(Failed(records.Failure("internal", "internal_error", str(ex))))

    def _become_association(self, hs: Handshake) -> None:
        """A UDP ASSOCIATE: its control connection goes to an association actor (whose
        flows are the destinations), and this actor ends without a flow of its own."""
        client, self.client = self.client, None
        assert client is not None
        self.deps.start_association(
            self.inbound,
            client,
            self.peer,
            hs.port,
            hs.principal_key,
            hs.auth_scheme,
            self.flow_id,
        )
        self._finish()

    def _teardown(self) -> None:
        self.deps.flow_actors.discard(self)
        held, self._held = self._held, None
        for message in held or ():
            self._dropped(message)
        task = self._task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()
        for sock in (self.client, self.upstream):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.close()
        self.client = self.upstream = None

    # -- messages ------------------------------------------------------------------

    def on_receive(self, message: Any) -> Any:
        """Handle relay completions, traffic samples and close requests."""
        if self._held is not None and isinstance(message, _HELD):
            self._held.append(message)
            return None
        if isinstance(message, RelayFinished):
            self._on_relay_finished(message.completion)
        elif isinstance(message, TrafficSample):
            self._on_sample(message.counters, message.sampled_at_unix_ms)
        elif isinstance(message, ConnRouted):
            self._on_c_routed(message.record)
        elif isinstance(message, ConnEnded):
            self._on_c_ended(message.record)
        elif isinstance(message, ConnTakeOver):
            self._take_over(message.deferred)
        elif isinstance(message, CloseFlow):
            return self._close(records.MANUAL)
        elif isinstance(message, StopFlow):
            return self._close(None)
        return None

    def _close(self, reason: str | None) -> bool:
        if self.handle is not None:
            holder = Holder.RELAY
        elif self._c_flow is not None:
            # C still holds it (dialling or sniffing): its ENDED record ends the flow.
            holder = Holder.CONN
        elif self._task is not None and not self._task.done():
            holder = Holder.TASK
        else:
            holder = Holder.NOTHING
        action = self.machine.close(reason, holder)
        if action is CloseAction.CLOSE_RELAY:
            assert self.handle is not None
            return self.deps.bridge.request_close(self.handle)
        if action is CloseAction.CLOSE_CONN:
            self.deps.bridge.conn.request_close(self._c_flow)
            return True
        if action is CloseAction.CANCEL_TASK:
            assert self._task is not None
            self._task.cancel()
            return self.machine.started
        return False

    # -- establishment (a task on the dispatcher loop) -----------------------------

    async def _establish(self, steps: Coroutine[Any, Any, None] | None = None) -> None:
        try:
            await (steps if steps is not None else self._establish_steps())
            # An idle relayed flow should hold no finished task or coroutine frame.
            self._task = None
        except asyncio.CancelledError:
            if self.machine.live:
                self._end(Closed(self._dialled()))
            self._finish()
        except Exception as ex:
            logger.exception("flow %s failed unexpectedly", self.flow_id)
            self._fail_internal(ex)
            self._finish()

    async def _establish_steps(self) -> None:
        loop = self.dispatcher.loop
        client = self.client
        assert client is not None
        deferred, self._deferred = self._deferred, None
        replied = False
        if deferred is not None and deferred.stage == connpath.ROUTE:
            # C finished the handshake (and maybe answered and sniffed) but could not
            # route or dial this flow, or left it to the flow hook: carry on from there.
            hs = self._c_handshake(deferred, deferred.host, deferred.raw)
            replied = deferred.replied
            state = self._new_state(hs, deferred.started_unix_ms)
            if replied:
                state.sniffed_host = deferred.sniffed
        else:
            protocol = self.inbound.protocol
            if deferred is not None and protocol == "mixed" and deferred.protocol == "http":
                # C read the first byte already (as _first_byte does: not 5, so HTTP), and
                # on a connection whose earlier requests C forwarded, more HTTP is all the
                # Python path would read there too (a SOCKS5 greeting then is a bad head).
                protocol = "http"
            try:
                hs = await accept_handshake(
                    loop,
                    client,
                    protocol,
                    self.inbound.users,
                    HANDSHAKE_TIMEOUT,
                    initial=deferred.raw if deferred is not None else b"",
                    udp=self.inbound.udp,
                )
            except HandshakeFailed as ex:
                logger.debug("handshake from %s failed: %s", self.peer, ex)
                self._finish()
                return
            if hs.udp:
                self._become_association(hs)
                return
            state = self._new_state(hs)
        if self.deps.lookup_wanted(self.peer[0]):
            # Before flow.started, the hook and the route: a process_name rule needs it.
            # A TUN's client socket is connected to the original destination, which
            # this accepted socket's own address (the TUN's listener) is not.
            if self.inbound.protocol == "tun" and deferred is not None:
                server = (deferred.host, deferred.port)
            else:
                server = client.getsockname()[:2]
            await self._look_up(state, server)
        if hs.forward:
            # Absolute-URI requests: a flow per request, the connection kept between them.
            await self._serve_forward(hs, state)
            return
        await self._tunnel_request(hs, state, replied)

    async def _tunnel_request(
        self, hs: Handshake, state: records.FlowState, replied: bool = False
    ) -> None:
        """A tunnel's flow (SOCKS5, CONNECT, TUN) from its record to the hand-off."""
        hook = self.deps.flow_hook
        if hook is not None and hook.settings.selects("tcp", self.inbound.tag):
            if not await self._ask_hook(hook, state, hs, replied):
                return
        else:
            self._start_record(state)
        await self._route_and_dial(hs, replied)

    async def _ask_hook(
        self, hook: FlowHookClient, state: records.FlowState, hs: Handshake, replied: bool
    ) -> bool:
        """Ask the flow hook about the new flow before it is routed, then start its record;
        False when the hook denied it (the flow is completed, blocked, and finished)."""
        # The record flow.started will carry (revision 1, state opening), before the
        # hook's own fields. The flow is not listed while it waits: a stop or a close
        # ends it quietly, as one still in its handshake.
        allow = await ask_about(hook, state)
        self._start_record(state)
        if allow:
            return True
        if not replied:
            await self._refuse(hs, socks5.REP_NOT_ALLOWED, 403, "denied by the flow hook")
        self._end(HookDenied())
        self._finish()
        return False

    async def _route_and_dial(self, hs: Handshake, replied: bool) -> None:
        """From the started flow's route to the hand-off (``replied``: the client was told
        the tunnel is open, and sniffing is done)."""
        deps = self.deps
        decision, address = await self._decide(hs)
        if (
            not replied
            and self.inbound.sniff
            and not hs.forward
            and _sniff_may_reroute(deps.route_state, decision)
        ):
            # A domain rule ranked before the match could claim this flow by its first
            # bytes, which the client only sends once told the tunnel is open: answer
            # first (as sing-box and mihomo do), then sniff and decide again.
            await self._reply(hs.success_reply())
            replied = True
            await self._sniff(hs)
            # Again with the tables of now: a reload may have replaced them meanwhile.
            decision, address = await self._decide(hs, address)
        chain = (
            deps.policies.resolve(decision.target, hs.host, self.peer[0]) if decision.target else []
        )
        outbound = deps.outbounds.get(chain[-1]) if chain else None
        if decision.action == "block" or outbound is None or outbound.protocol == "block":
            self._set_route(decision, chain, outbound)
            if not replied:
                await self._refuse(hs, socks5.REP_NOT_ALLOWED, 403, "blocked by rule")
            self._end(Blocked())
            self._finish()
            return
        self._set_route(decision, chain, outbound)
        self.machine.handle(Dialing())
        try:
            dialed = await self._dial(outbound, hs, address)
        except DialError as ex:
            if ex.member_down:
                self._report_member_down(chain, ex.message)
            if not replied:
                await self._refuse(hs, ex.socks_reply, ex.http_status, ex.message)
            remote = (
                {"host": hs.host, "port": hs.port} if ex.remote is None else {"host": ex.remote}
            )
            self._end(Failed(records.Failure(ex.stage, ex.code, ex.message, remote)))
            self._finish()
            return
        self.upstream = dialed.sock
        self.machine.handle(Dialed())
        if not replied:
            await self._reply(hs.success_reply())
            if self.inbound.sniff and not hs.forward:
                await self._sniff(hs)
        await self._start_relay(hs, dialed, outbound.chained)

    async def _decide(
        self, hs: Handshake, address: str | None = None
    ) -> tuple[routing.RouteDecision, str | None]:
        """The route for ``hs`` with the tables of now, and the address it was decided on
        when an ip_cidr rule needed the target's (``routing.needs_address``: mihomo's
        rule matching without ``no-resolve``). ``address``: one resolved before.

        The name is resolved with the engine resolver (its first address, what a dial
        tries first); a name that does not resolve meets the rules without an address.
        """
        route_state = self.deps.route_state
        facts = self._facts(hs)
        decision = route_state.decide(facts)
        if not routing.needs_address(route_state.ruleset, route_state.mode, facts, decision):
            return decision, None
        if address is None:
            try:
                found = await self.deps.resolver.resolve(hs.host, routing.RULE_RESOLVE_TIMEOUT)
            except ResolveError as ex:
                logger.debug("flow %s: %s, rules go on without its address", self.flow_id, ex)
                found = []
            if not found:
                return decision, None
            address = found[0]
        # With the tables of now again: a reload may have replaced them while resolving.
        route_state = self.deps.route_state
        facts = dataclasses.replace(self._facts(hs), resolved_ip=address)
        return route_state.decide(facts), address

    async def _dial(self, outbound: Any, hs: Handshake, address: str | None) -> Any:
        """Dial ``hs``'s target through ``outbound``; a direct one connects to ``address``
        alone when the route was decided on it (no other address of the name is tried:
        it might be in a network an ip_cidr rule blocks)."""
        loop = self.dispatcher.loop
        if address is None or outbound.protocol != "direct":
            return await outbound.dial(loop, hs.host, hs.port)
        dialed = await outbound.dial(loop, hostnorm.canonical_host(address), hs.port)
        dialed.remote_host = hs.host
        return dialed

    def _new_state(self, hs: Handshake, started_at: int | None = None) -> records.FlowState:
        """The record of a flow whose handshake completed (at ``started_at``, else now),
        not yet the actor's: :meth:`_start_record` makes it so and announces it. A target
        that is a mapped fake-ip address becomes its domain (``hs.host`` too)."""
        # Every spelling of an address is that address, from here on: routed, dialled and
        # recorded so (spliceway.routing.hostnorm; C's handshakes did the same already).
        hs.host = hostnorm.canonical_host(hs.host)
        fake_ip: str | None = None
        pool = self.deps.fakeip
        if pool is not None:
            # A fake-ip address stands for the domain the client resolved: the flow is
            # that domain's (target.host, domain rules, the dial). The route table hands
            # every such flow to Python (route_publish), so this is the one place.
            domain = pool.domain_of(hs.host)
            if domain is not None:
                fake_ip, hs.host = hs.host, domain
        started = now_ms() if started_at is None else started_at
        state = records.FlowState(
            flow_id=self.flow_id,
            inbound_tag=self.inbound.tag,
            inbound_protocol=self.inbound.protocol,
            source_ip=self.peer[0],
            source_port=self.peer[1],
            started_at_unix_ms=started,
            mode=self.deps.route_state.mode,
            client_protocol=hs.client_protocol,
            target_host=hs.host,
            target_port=hs.port,
            fake_ip=fake_ip,
            principal_key=hs.principal_key,
            auth_scheme=hs.auth_scheme,
            last_activity_at_unix_ms=started,
        )
        t = state.traffic
        t.inbound_rx_bytes = hs.rx_bytes
        t.inbound_tx_bytes = hs.tx_bytes
        return state

    def _start_record(self, state: records.FlowState) -> None:
        """The flow exists from here: flow.started, listed, completed exactly once."""
        self.machine.handle(Started())
        self.state = state
        self.deps.counters.total_started += 1
        # When it started (C's time for a flow C runs), as flow.routed carries C's too.
        self._publish("flow.started", records.lifecycle_payload, occurred=state.started_at_unix_ms)

    async def _refuse(self, hs: Handshake, socks_code: int, http_status: int, message: str) -> None:
        """Tell the client its request failed: the protocol's reply, or for a TUN's
        client (which knows only a TCP connection) a reset when the socket closes."""
        if hs.protocol == "tun":
            if self.client is not None:
                refuse_quietly(self.client)
            return
        await self._reply(hs.failure_reply(socks_code, http_status, message), quiet=True)

    async def _reply(self, data: bytes, *, quiet: bool = False) -> None:
        if not data or self.client is None:
            return
        try:
            await self.dispatcher.loop.sock_sendall(self.client, data)
        except OSError:
            if not quiet:
                raise
            return
        assert self.state is not None
        self.state.traffic.inbound_tx_bytes += len(data)

    async def _sniff(self, hs: Handshake) -> None:
        """Peek at the first client bytes (bounded wait) for a TLS SNI or HTTP Host."""
        assert self.state is not None and self.client is not None
        if hs.early:
            found = sniff.sniff(hs.early)
            if found is not NEED_MORE and found is not None:
                self.state.sniffed_host = found.host
            return
        loop = self.dispatcher.loop
        deadline = time.monotonic() + self.inbound.sniff_timeout_ms / 1000
        fd = self.client.fileno()
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                data = self.client.recv(_SNIFF_PEEK, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                readable = loop.create_future()
                loop.add_reader(fd, _resolve, readable)
                try:
                    await asyncio.wait_for(readable, remaining)
                except TimeoutError:
                    return
                finally:
                    loop.remove_reader(fd)
                continue
            except OSError:
                return
            if not data:
                return
            found = sniff.sniff(data)
            if found is NEED_MORE:
                await asyncio.sleep(_SNIFF_RETRY)
                continue
            if found is not None:
                self.state.sniffed_host = found.host
            return

    def _facts(self, hs: Handshake) -> routing.FlowFacts:
        assert self.state is not None
        return routing.FlowFacts(
            network="tcp",
            host=hs.host,
            port=hs.port,
            sniffed_host=self.state.sniffed_host,
            resolved_ip=None,
            source_ip=self.peer[0],
            source_port=self.peer[1],
            inbound_tag=self.inbound.tag,
            # The authenticated user's, or the one the flow hook gave in its place.
            principal_key=self.state.principal_key,
            process_name=self.state.process_name,
        )

    def _set_route(self, decision: routing.RouteDecision, chain: list[str], outbound: Any) -> None:
        s = self.state
        assert s is not None
        s.mode = decision.mode
        s.route_action = decision.action
        s.route_target = decision.target
        s.matched_rule = decision.matched_rule.to_dict() if decision.matched_rule else None
        if outbound is None:
            self.machine.handle(Routed(outbound=False))
        else:
            self.machine.handle(Routed(outbound=True, chained=outbound.chained))
            s.selection_chain = chain
            s.outbound_tag = outbound.tag
            s.outbound_protocol = outbound.protocol

    def _report_member_down(self, chain: list[str], error: str) -> None:
        """Tell every probing group on the chain that its chosen member failed."""
        deps = self.deps
        for group, member in itertools.pairwise(chain):
            view = deps.policies.get(group)
            actor = deps.group_actors.get(group)
            if view is not None and view.probing and actor is not None:
                actor.tell(MemberFailed(member, error))

    async def _start_relay(self, hs: Handshake, dialed: Any, chained: bool) -> None:
        s = self.state
        assert s is not None and self.client is not None and self.upstream is not None
        loop = self.dispatcher.loop
        t = s.traffic
        t.outbound_tx_bytes += dialed.tx_bytes
        t.outbound_rx_bytes += dialed.rx_bytes
        sealed = dialed.sealed
        if hs.early:
            wire = hs.early if sealed is None else sealed.encryptor.seal(hs.early)
            await loop.sock_sendall(self.upstream, wire)
            t.outbound_tx_bytes += len(wire)
            t.bytes_up += len(hs.early)
        if dialed.leftover:
            await loop.sock_sendall(self.client, dialed.leftover)
            t.inbound_tx_bytes += len(dialed.leftover)
            t.bytes_down += len(dialed.leftover)
        s.resolved_ip = dialed.resolved_ip
        s.remote_host = dialed.remote_host
        s.remote_port = dialed.remote_port
        s.relay_chain = list(dialed.relay_chain)
        self._base = t.copy(sealed=sealed is not None)
        client_fd = self.client.detach()
        upstream_fd = self.upstream.detach()
        self.client = self.upstream = None
        try:
            self.handle = self.deps.bridge.hand_off(
                client_fd, upstream_fd, self.deps.tcp_idle_timeout_ms, self.actor_ref, sealed
            )
        except OSError:
            for fd in (client_fd, upstream_fd):
                with contextlib.suppress(OSError):
                    socket.close(fd)
            raise
        self.machine.handle(Relaying())
        s.state = "active"
        if chained:
            self.deps.counters.chained_sessions += 1
        else:
            self.deps.counters.direct_sessions += 1
        self._publish("flow.routed", records.lifecycle_payload)

    # -- the process behind the flow ---------------------------------------------------

    async def _look_up(self, state: records.FlowState, server: tuple[str | None, int]) -> None:
        """Fill ``state``'s process from its client's socket (``runtime.process_lookup``),
        found off the loop; nothing when none is found in time."""
        lookup = self.deps.process_lookup.lookup_tcp((self.peer[0], self.peer[1]), server)
        try:
            found = await asyncio.wait_for(lookup, PROCESS_LOOKUP_TIMEOUT)
        except TimeoutError:
            logger.debug("process lookup for flow %s timed out", self.flow_id)
            return
        if found is not None:
            state.set_process(found.pid, found.name, found.path)

    # -- after the hand-off ----------------------------------------------------------

    def _apply_counters(self, c: Any) -> bool:
        """Fold relay counters into the record; True if anything moved."""
        s = self.state
        assert s is not None and self._base is not None
        traffic = self._base.with_relay(c)
        if traffic == s.traffic:
            return False
        s.traffic = traffic
        if c.last_activity_unix_ms:
            s.last_activity_at_unix_ms = c.last_activity_unix_ms
        return True

    def _on_sample(self, counters: Any, sampled_at: int) -> None:
        s = self.state
        if s is None or not self.machine.live or self.handle is None:
            return
        before_up, before_down = s.traffic.bytes_up, s.traffic.bytes_down
        previous_at = s.sampled_at_unix_ms or s.started_at_unix_ms
        if not self._apply_counters(counters):
            return
        elapsed_ms = max(sampled_at - previous_at, 1)
        s.upload_bps = (s.traffic.bytes_up - before_up) * 8000 // elapsed_ms
        s.download_bps = (s.traffic.bytes_down - before_down) * 8000 // elapsed_ms
        s.sampled_at_unix_ms = sampled_at
        self._publish("flow.updated", records.updated_payload)

    def _on_relay_finished(self, completion: Any) -> None:
        s = self.state
        if s is None or not self.machine.live:
            return
        self._apply_counters(completion.counters)
        remote: dict[str, object] = {"host": s.remote_host, "port": s.remote_port}
        cause = completion.cause.name
        self._end(RelayEnded(cause, completion.side, completion.errno, remote))
        self._finish()

    def _dialled(self) -> bool:
        """Whether the flow's upstream connection is open here (what the machine cannot
        see: it decides whether a stopped flow was relayed or cancelled)."""
        return self.upstream is not None

    # -- publishing ---------------------------------------------------------------

    def _publish(self, event_type: str, payload_fn: Any, occurred: int | None = None) -> None:
        s = self.state
        assert s is not None
        s.revision += 1
        record = s.render()
        deps = self.deps
        if s.state == "completed":
            deps.flows.remove(self.flow_id)
        else:
            deps.flows.put(
                self.flow_id,
                FlowEntry(
                    self.actor_ref,
                    record,
                    s.inbound_tag,
                    s.principal_key,
                    self.handle,
                    self._base,
                ),
            )
        deps.log.emit(
            event_type,
            payload_fn(s, record),
            principal_key=s.principal_key,
            labels=s.labels,
            occurred_at_unix_ms=occurred,
        )

    def _end(self, event: Event) -> None:
        """Complete the flow by ``event`` (the machine decides its outcome): the record's
        end, flow.completed and the flow log line, exactly once."""
        verdict = self.machine.handle(event)
        s = self.state
        assert s is not None and verdict is not None
        ended = now_ms()
        s.state = "completed"
        s.outcome = verdict.outcome
        s.close_reason = verdict.close_reason
        s.failure = verdict.failure
        s.ended_at_unix_ms = max(ended, s.started_at_unix_ms)
        self.deps.counters.count_completed(s)
        self._publish("flow.completed", records.lifecycle_payload, occurred=s.ended_at_unix_ms)
        flowlog.log_completed(s)

    def _finish(self) -> None:
        self._teardown()
        self.stop_now()
