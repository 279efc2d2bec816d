"""EngineSupervisor: owns the listeners, the policy group actors, the stats sampler
and the routing mode, and installs a reload's new configuration."""

from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pykka

from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.listener import ListenerActor
from spliceway.actors.policy import PolicyGroupActor
from spliceway.actors.stats import StatsSamplerActor
from spliceway.errors import ApiError
from spliceway.routing import policy

if TYPE_CHECKING:
    from spliceway.engine.core import EngineCore, InboundSpec
    from spliceway.engine.reconcile import Plan


class EngineSupervisor(LoopActor):
    """Starts and stops the engine's long-lived actors; serialises mode changes and
    reloads with them (all on the dispatcher thread, where flows decide)."""

    def __init__(self, core: EngineCore, sockets: list[socket.socket]) -> None:
        super().__init__(core.dispatcher)
        self.core = core
        self._sockets = sockets
        #: ListenerActor by listener slot.
        self.listeners: dict[int, pykka.ActorRef[Any]] = {}
        self.sampler: pykka.ActorRef[Any] | None = None

    def on_start(self) -> None:
        """Start the group actors, then one ListenerActor per bound inbound, and the sampler."""
        # Groups first: the first accepted flow may already route through one.
        for view in self.core.policies.views():
            self.core.group_actors[view.tag] = PolicyGroupActor.start(self.core, view)
        for spec, sock in zip(self.core.inbounds, self._sockets, strict=True):
            self._start_listener(spec, sock)
        self._sockets = []
        self._start_sampler()

    def _start_listener(self, spec: InboundSpec, sock: socket.socket) -> bool:
        """Start accepting on ``sock`` as slot ``spec.index``; False (socket closed) if C
        refused it."""
        self.core.inbound_slots[spec.index] = spec
        self.core.listen_sockets[spec.index] = sock
        ref = ListenerActor.start(self.core, spec, sock)
        # on_start ran here, on this thread: a listener C refused is dead already.
        if not ref.is_alive():
            self.core.listen_sockets.pop(spec.index, None)
            return False
        self.listeners[spec.index] = ref
        return True

    def _stop_listener(self, slot: int) -> None:
        ref = self.listeners.pop(slot, None)
        self.core.listen_sockets.pop(slot, None)
        if ref is not None:
            # Told from this thread to an idle actor: handled at once, so C no longer
            # accepts on the slot and its socket is closed when this returns.
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop(block=False)

    def _start_sampler(self) -> None:
        interval = self.core.config.runtime.stats_interval_ms
        self.sampler = StatsSamplerActor.start(self.core, interval)

    def stop_listeners(self) -> None:
        """Stop accepting new connections (first step of shutdown)."""
        for slot in list(self.listeners):
            self._stop_listener(slot)

    def set_mode(self, mode: str, outbound: str | None) -> bool:
        """Switch the routing mode for new flows."""
        self.core.set_mode(mode, outbound)
        return True

    def reconfigure(self, plan: Plan) -> None:
        """Install a prepared reload (see spliceway.engine.reconcile); ApiError with nothing
        changed when a new listener cannot start."""
        core = self.core
        change = plan.listeners
        old = _Tables.of(core)
        # A listener giving its socket to a new slot stops first: the two never accept
        # side by side, and the new one's registration with C reports connections
        # already waiting, so none is stranded.
        for slot in change.shared:
            self._stop_listener(slot)
        # The tables before the new listeners: C accepts on those at once, and must
        # route their first flows by the new table (their inbound rules, the hook).
        self._swap_tables(plan)
        started: list[int] = []
        for spec, sock in change.start:
            if not self._start_listener(spec, sock):
                for slot in started:
                    self._stop_listener(slot)
                old.restore(
                    core, hook_changed=plan.config.api.flow_hook != old.config.api.flow_hook
                )
                for slot, spare in change.shared.items():
                    self._start_listener(core.inbound_slots[slot], spare.dup())
                raise ApiError(
                    "internal",
                    f"inbound {spec.tag!r} could not start accepting (see the log)",
                )
            started.append(spec.index)
        self._swap_actors(plan, old.config, dns_changed=plan.parts.resolver is not old.resolver)
        for slot in change.retire:
            if slot not in change.shared:
                self._stop_listener(slot)

    def _swap_tables(self, plan: Plan) -> None:
        """Install what flows read (undone by ``_Tables.restore``): config, outbounds,
        groups' views, routing state, listeners, the flow hook, the C route table."""
        from spliceway.engine.core import ActiveInbound

        core = self.core
        new, parts = plan.config, plan.parts
        old_config = core.config
        core.learn_principals(new)
        core.config = new
        core.parts = parts
        core.resolver = parts.resolver
        core.outbounds = parts.outbounds
        table = policy.PolicyTable(parts.views)
        core.policies.on_publish = None
        core.policies = table
        core.route_state = parts.route_state
        core.tcp_idle_timeout_ms = int(new.runtime.tcp_idle_timeout_seconds * 1000)
        core.active_inbounds = tuple(
            ActiveInbound(spec, bound) for spec, bound in plan.listeners.active
        )
        if new.api.flow_hook != old_config.api.flow_hook:
            # Before the publish below: the table defers the new hook's inbounds.
            core.replace_flow_hook(new)
        table.on_publish = core.routes.publish
        core.routes.publish()

    def _swap_actors(self, plan: Plan, old: Any, *, dns_changed: bool) -> None:
        """Replace the actors that serve the new tables (cannot fail half-way)."""
        core = self.core
        new, parts = plan.config, plan.parts
        # Groups: a kept one keeps its actor (and probe timer); others start afresh.
        for tag in list(core.group_actors):
            if tag not in parts.kept_groups:
                ref = core.group_actors.pop(tag)
                with contextlib.suppress(pykka.ActorDeadError):
                    ref.stop(block=False)
        for view in parts.views:
            if view.tag not in core.group_actors:
                core.group_actors[view.tag] = PolicyGroupActor.start(core, view)
        if dns_changed:
            core.resolver.on_answer = core.dns_answer
            core.bridge.conn.dns_flush()
        if plan.dns is not None:
            core.dns.install(plan.dns)
        if new.runtime.stats_interval_ms != old.runtime.stats_interval_ms:
            if self.sampler is not None:
                with contextlib.suppress(pykka.ActorDeadError):
                    self.sampler.stop(block=False)
            self._start_sampler()
        if new.runtime.event_ring_capacity != old.runtime.event_ring_capacity:
            core.log.resize(new.runtime.event_ring_capacity)

    def on_stop(self) -> None:
        """Stop the actors this supervisor started."""
        self.stop_listeners()
        if self.sampler is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                self.sampler.stop(block=False)
            self.sampler = None
        for ref in self.core.group_actors.values():
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop(block=False)
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()


@dataclass(frozen=True, slots=True)
class _Tables:
    """What ``_swap_tables`` replaces, kept to put back when a new listener fails."""

    config: Any
    parts: Any
    resolver: Any
    outbounds: Any
    policies: Any
    route_state: Any
    tcp_idle_timeout_ms: int
    active_inbounds: Any

    @classmethod
    def of(cls, core: EngineCore) -> _Tables:
        return cls(
            core.config,
            core.parts,
            core.resolver,
            core.outbounds,
            core.policies,
            core.route_state,
            core.tcp_idle_timeout_ms,
            core.active_inbounds,
        )

    def restore(self, core: EngineCore, *, hook_changed: bool) -> None:
        core.policies.on_publish = None
        core.config = self.config
        core.parts = self.parts
        core.resolver = self.resolver
        core.outbounds = self.outbounds
        core.policies = self.policies
        core.route_state = self.route_state
        core.tcp_idle_timeout_ms = self.tcp_idle_timeout_ms
        core.active_inbounds = self.active_inbounds
        if hook_changed:
            core.replace_flow_hook(self.config)
        self.policies.on_publish = core.routes.publish
        core.routes.publish()
