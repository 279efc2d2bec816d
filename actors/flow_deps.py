"""FlowDeps: what a flow's actor may use of the engine, and nothing more.

Built once per start by the composition root (:mod:`spliceway.app.compose`) and handed
to every :class:`~spliceway.actors.flow.FlowActor` and UDP association actor; it is
importable from :mod:`spliceway.actors.flow` as well, where its users import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spliceway.actors.dispatcher import Dispatcher
    from spliceway.dns.fakeip import FakeIpPool
    from spliceway.dns.resolver import Resolver
    from spliceway.engine.generation import Generation
    from spliceway.engine.route_publish import RoutePublisher
    from spliceway.engine.runtime import Counters, FlowTable, RouteState
    from spliceway.events.log import EventLog
    from spliceway.flows.hook import FlowHookClient
    from spliceway.routing.policy import PolicyTable
    from spliceway.routing.process_lookup import ProcessLookup


@dataclass(frozen=True, slots=True)
class FlowDeps:
    """What a FlowActor (and a UDP association's actor) may use of the engine, and nothing
    more: built once per start by the composition root (spliceway.app.compose).

    What a reload or ``mode.set`` replaces is read through ``generation`` (the engine's
    current :class:`~spliceway.engine.generation.Generation`); a flow reads it on the
    dispatcher thread, where every generation is published, so two reads between
    awaits see the same one.
    """

    bridge: Any
    counters: Counters
    dispatcher: Dispatcher
    #: Every FlowActor alive.
    flow_actors: set[Any]
    flows: FlowTable
    group_actors: dict[str, Any]
    log: EventLog
    #: The principal_key C's principal id stands for.
    principal_key: Callable[[int], str | None]
    process_lookup: ProcessLookup
    routes: RoutePublisher
    #: The engine's current generation.
    generation: Callable[[], Generation]
    #: The flow hook's client now (a reload replaces it), None without a hook.
    hook: Callable[[], FlowHookClient | None]
    #: The fake-ip pool now (``runtime.dns.answer.type: fake_ip``), else None.
    fake_ip_pool: Callable[[], FakeIpPool | None]
    #: A flow id for a flow Python starts on a connection that already had one (the
    #: next request on a kept-alive http connection): the deferred flows' sequence.
    new_flow_id: Callable[[int], str]
    #: Hand a UDP ASSOCIATE's control connection to its association actor.
    start_association: Callable[..., None]

    def lookup_wanted(self, peer_ip: str) -> bool:
        """Whether the process behind a flow from ``peer_ip`` is to be looked up now
        (``runtime.process_lookup`` and the rules of now; a client on this host)."""
        g = self.generation()
        return self.process_lookup.wanted(
            peer_ip,
            g.config.runtime.process_lookup,
            g.route_state.ruleset.has_process_conditions,
        )

    def listener_address(self, index: int) -> tuple[str | None, int]:
        """The address listener slot ``index`` is bound to; ``(None, 0)`` once it is gone."""
        for active in self.generation().active_inbounds:
            if active.spec.index == index:
                return active.bound
        return None, 0

    @property
    def route_state(self) -> RouteState:
        """The routing inputs now (mode, final, rules)."""
        return self.generation().route_state

    @property
    def outbounds(self) -> dict[str, Any]:
        """The outbounds now, by tag."""
        return self.generation().outbounds

    @property
    def policies(self) -> PolicyTable:
        """The policy table now."""
        return self.generation().policies

    @property
    def tcp_idle_timeout_ms(self) -> int:
        """``runtime.tcp_idle_timeout_seconds`` now, in milliseconds."""
        return self.generation().tcp_idle_timeout_ms

    @property
    def flow_hook(self) -> FlowHookClient | None:
        """The flow hook's client now (a reload replaces it), None without a hook."""
        return self.hook()

    @property
    def resolver(self) -> Resolver:
        """The engine resolver now (``runtime.dns``; a reload replaces it)."""
        return self.generation().resolver

    @property
    def fakeip(self) -> FakeIpPool | None:
        """The fake-ip pool now (``runtime.dns.answer.type: fake_ip``), else None."""
        return self.fake_ip_pool()
