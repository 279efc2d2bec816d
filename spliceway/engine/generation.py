"""One generation of the engine's replaceable state, built whole and published by one assignment.

Everything ``config.apply`` (or a SIGHUP) replaces and flows read when they decide lives
in one frozen :class:`Generation`: the configuration, its routing parts (resolver,
outbounds, group views), the policy table, the routing state, the TCP idle timeout and
the listening inbounds. :func:`build_generation` is the one function that makes one;
the core publishes it with ``core.generation = g`` and a rollback assigns the previous
one again. A reader takes ``g = core.generation`` once and reads everything from ``g``,
so no thread ever sees two generations mixed (the pattern of
:class:`~spliceway.routing.policy.PolicyTable`, one level up).

``mode.set`` makes a new generation too (:meth:`Generation.with_route_state`): the
same tables under a new routing state, with a serial of its own.

What a generation holds is replaced, never mutated, with one exception owned by its
own object: the policy table's group views, which group actors republish one by one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from spliceway.flows.inbound import Users
from spliceway.routing import policy

if TYPE_CHECKING:
    from spliceway.config import Config
    from spliceway.dns import Resolver
    from spliceway.engine.assembly import RoutingParts
    from spliceway.engine.runtime import RouteState
    from spliceway.flows.outbounds import Outbound


@dataclass(frozen=True, slots=True)
class InboundSpec:
    """What a listener and its flows need to know about their inbound.

    ``index`` is the listener's slot in the C connection path (flow ids carry it). A
    reload gives a changed inbound a new slot, so records of the old listener's last
    flows still name the spec they were accepted under.
    """

    index: int
    tag: str
    protocol: str
    sniff: bool
    sniff_timeout_ms: int
    users: Users
    #: The configuration entry (what a reload compares).
    source: Any = None
    #: Whether its SOCKS5 clients may open UDP associations (the inbound's ``udp``).
    udp: bool = True

    @classmethod
    def of(cls, index: int, inbound: Any) -> InboundSpec:
        """The spec of configuration entry ``inbound`` in slot ``index``."""
        return cls(
            index=index,
            tag=inbound.tag,
            protocol=inbound.protocol,
            sniff=inbound.sniff,
            sniff_timeout_ms=inbound.sniff_timeout_ms,
            users=Users(inbound.users),
            source=inbound,
            udp=inbound.udp,
        )


@dataclass(frozen=True, slots=True)
class ActiveInbound:
    """A listening inbound: its spec and the address its socket is bound to."""

    spec: InboundSpec
    bound: tuple[str, int]


@dataclass(frozen=True, slots=True)
class Generation:
    """The engine's replaceable state at one moment (see the module docstring)."""

    #: Increases with every generation the engine builds; a rollback's previous
    #: generation keeps its own. Route tables record it (``Mirror.generation``).
    serial: int
    config: Config
    parts: RoutingParts
    policies: policy.PolicyTable
    route_state: RouteState
    #: ``runtime.tcp_idle_timeout_seconds`` in milliseconds (what C and flows take).
    tcp_idle_timeout_ms: int
    #: Listening inbounds in config order.
    active_inbounds: tuple[ActiveInbound, ...]
    #: The proxy provider each outbound merged from one came from, by tag (the others
    #: are the configuration's own).
    origins: Mapping[str, str] = field(default_factory=dict)
    #: What each proxy provider gave the configuration (``providers.materialise``'s
    #: ``ProviderMembers``), by name.
    provider_members: Mapping[str, Any] = field(default_factory=dict)

    @property
    def resolver(self) -> Resolver:
        """The resolver of ``runtime.dns`` (kept across generations while it is unchanged)."""
        return self.parts.resolver

    @property
    def outbounds(self) -> dict[str, Outbound]:
        """Every leaf outbound by tag (relay groups among them)."""
        return self.parts.outbounds

    def with_route_state(self, serial: int, route_state: RouteState) -> Generation:
        """This generation under another routing state (``mode.set``)."""
        return replace(self, serial=serial, route_state=route_state)

    def with_active_inbounds(self, active: tuple[ActiveInbound, ...]) -> Generation:
        """This generation with the listeners a start bound (the same serial: the start's
        first generation, completed)."""
        return replace(self, active_inbounds=active)


def build_generation(
    serial: int,
    config: Config,
    parts: RoutingParts,
    active_inbounds: tuple[ActiveInbound, ...],
    on_publish: Callable[[], None] | None,
    origins: Mapping[str, str] | None = None,
    provider_members: Mapping[str, Any] | None = None,
) -> Generation:
    """The generation of ``config`` built from its routing ``parts``: the one way to make one.

    ``on_publish`` is the policy table's publish callback (the engine recompiles the C
    route table after every group change). ``origins``: the proxy provider of each
    outbound merged from one; ``provider_members``: what each proxy provider gave.
    """
    return Generation(
        serial=serial,
        config=config,
        parts=parts,
        policies=policy.PolicyTable(parts.views, on_publish=on_publish),
        route_state=parts.route_state,
        tcp_idle_timeout_ms=int(config.runtime.tcp_idle_timeout_seconds * 1000),
        active_inbounds=active_inbounds,
        origins=origins or {},
        provider_members=provider_members or {},
    )
