"""A UDP flow's record and events, shared by the actors that own UDP flows (SOCKS5 UDP
associations in ``actors/udp.py``, the TUN's sessions in ``actors/tun_udp.py``).

Each actor keeps its own per-destination state; these functions are the part that is
the same for every UDP flow: how it is routed, how the record ends and is counted, and
how it is listed and announced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spliceway.dns.resolver import ResolveError
from spliceway.engine.runtime import FlowEntry
from spliceway.events.log import now_ms
from spliceway.flows import log as flowlog
from spliceway.flows import records
from spliceway.flows.outbounds import NoMemberOutbound
from spliceway.routing import rules as routing

if TYPE_CHECKING:
    from spliceway.actors.flow import FlowDeps
    from spliceway.dns.resolver import Resolver
    from spliceway.flows.hook import FlowHookClient

#: Outbound protocols that relay UDP in this build.
UDP_PROTOCOLS = frozenset({"direct", "socks5", "shadowsocks"})

#: How a flow is refused: its outcome and, for a failure, why.
Refusal = tuple[str, records.Failure | None]


#: How long a refused (blocked or failed) destination's datagrams are dropped before its
#: next datagram is routed again as a new flow: a failure (DNS, a proxy down) is
#: retried, a client sending on never turns one refusal into an endless silent drop,
#: and a client retrying fast makes one refused flow per hold, not one per datagram.
REFUSAL_HOLD_S = 5.0


def hook_for(deps: FlowDeps, s: records.FlowState) -> FlowHookClient | None:
    """The flow hook a new UDP flow must ask before its route, if one selects it."""
    hook = deps.flow_hook
    if hook is not None and hook.settings.selects("udp", s.inbound_tag):
        return hook
    return None


def _facts(s: records.FlowState, resolved_ip: str | None = None) -> routing.FlowFacts:
    return routing.FlowFacts(
        network="udp",
        host=s.target_host,
        port=s.target_port,
        resolved_ip=resolved_ip,
        source_ip=s.source_ip,
        source_port=s.source_port,
        inbound_tag=s.inbound_tag,
        principal_key=s.principal_key,
    )


def needs_address(deps: FlowDeps, s: records.FlowState) -> bool:
    """Whether the flow's route may depend on its domain target's address (an ip_cidr
    rule ranks before the match: ``routing.needs_address``), to resolve before
    :func:`start`."""
    state = deps.route_state
    facts = _facts(s)
    return routing.needs_address(state.ruleset, state.mode, facts, state.decide(facts))


async def rule_address(resolver: Resolver, host: str) -> str | None:
    """The address ``host``'s ip_cidr rules meet (its first), None when it has none."""
    try:
        found = await resolver.resolve(host, routing.RULE_RESOLVE_TIMEOUT)
    except ResolveError:
        return None
    return found[0] if found else None


def start(
    deps: FlowDeps,
    actor_ref: Any,
    s: records.FlowState,
    at_unix_ms: int,
    *,
    allowed: bool = True,
    resolved_ip: str | None = None,
) -> tuple[Any, Refusal | None]:
    """Publish (and count) flow.started, then decide the route of the flow's record as
    it stands: the outbound to relay through, or how to refuse the flow (``allowed``
    False: the flow hook denied it). ``resolved_ip``: the domain target's address, when
    :func:`needs_address` asked for it (a direct flow then goes to it alone)."""
    deps.counters.total_started += 1
    publish(deps, actor_ref, s, "flow.started", occurred=at_unix_ms)
    if not allowed:
        return None, (records.BLOCKED, records.HOOK_DENIED)
    return route(deps, s, _facts(s, resolved_ip))


def no_association(outbound: Any) -> records.Failure:
    """Why a flow failed when its proxy outbound gave no upstream association."""
    return records.Failure(
        "connect", "connect_failed", f"no UDP association through {outbound.tag!r}"
    )


def routed(
    deps: FlowDeps,
    actor_ref: Any,
    s: records.FlowState,
    *,
    resolved_ip: str | None = None,
    proxy: Any = None,
) -> None:
    """The flow relays from now on: directly to its target (at ``resolved_ip``), or
    through the ``proxy`` outbound; counted, and announced by flow.routed."""
    s.state = "active"
    if proxy is None:
        s.resolved_ip = resolved_ip
        s.remote_host, s.remote_port = s.target_host, s.target_port
        deps.counters.direct_sessions += 1
    else:
        s.remote_host, s.remote_port = proxy.server, proxy.port
        s.relay_chain = [proxy.tag]
        deps.counters.chained_sessions += 1
    publish(deps, actor_ref, s, "flow.routed")


def route(
    deps: FlowDeps, s: records.FlowState, facts: routing.FlowFacts
) -> tuple[Any, Refusal | None]:
    """Decide a UDP flow's route and write it into its record: the outbound to relay
    through, or how to refuse the flow (blocked, or failed for an outbound that does not
    relay UDP)."""
    decision = deps.route_state.decide(facts)
    chain = (
        deps.policies.resolve(decision.target, facts.host, facts.source_ip or "")
        if decision.target
        else []
    )
    outbound = deps.outbounds.get(chain[-1]) if chain else None
    s.mode = decision.mode
    s.route_action = decision.action
    s.route_target = decision.target
    s.matched_rule = decision.matched_rule.to_dict() if decision.matched_rule else None
    if outbound is not None:
        s.selection_chain = chain
        s.outbound_tag = outbound.tag
        s.outbound_protocol = outbound.protocol
    if decision.action == "block" or outbound is None or outbound.protocol == "block":
        return None, (records.BLOCKED, None)
    if isinstance(outbound, NoMemberOutbound):
        return None, (records.FAILED, records.Failure("route", "no_member", outbound.message))
    if outbound.protocol not in UDP_PROTOCOLS:
        failure = records.Failure(
            "route",
            "udp_unsupported",
            f"outbound {outbound.tag!r} ({outbound.protocol}) does not relay UDP in this build",
        )
        return None, (records.FAILED, failure)
    return outbound, None


def complete(
    deps: FlowDeps,
    actor_ref: Any,
    s: records.FlowState,
    outcome: str | None,
    failure: records.Failure | None,
    *,
    chained: bool,
) -> None:
    """End the record (``outcome`` None: relayed, through a proxy when ``chained``),
    count it in the engine's totals, publish ``flow.completed`` and write the flow's
    ``spliceway.flow`` line (docs/running.md: one per flow, UDP as TCP)."""
    s.state = "completed"
    s.outcome = outcome or (records.CHAINED_RELAYED if chained else records.DIRECT_RELAYED)
    s.failure = failure
    if failure is not None and outcome == records.FAILED:
        s.close_reason = records.UPSTREAM_ERROR
    s.ended_at_unix_ms = max(now_ms(), s.started_at_unix_ms)
    deps.counters.count_completed(s)
    publish(deps, actor_ref, s, "flow.completed", occurred=s.ended_at_unix_ms)
    flowlog.log_completed(s)


def publish(
    deps: FlowDeps,
    actor_ref: Any,
    s: records.FlowState,
    event_type: str,
    occurred: int | None = None,
) -> None:
    """A lifecycle event with the record's next revision; listed while open."""
    s.revision += 1
    record = s.render()
    if s.state == "completed":
        deps.flows.remove(s.flow_id)
    else:
        deps.flows.put(s.flow_id, FlowEntry(actor_ref, record, s.inbound_tag, s.principal_key))
    deps.log.emit(
        event_type,
        records.lifecycle_payload(s, record),
        principal_key=s.principal_key,
        occurred_at_unix_ms=occurred,
    )


def publish_updated(deps: FlowDeps, actor_ref: Any, s: records.FlowState) -> None:
    """``flow.updated`` with the record's next revision (counts moved)."""
    s.revision += 1
    record = s.render()
    deps.flows.put(s.flow_id, FlowEntry(actor_ref, record, s.inbound_tag, s.principal_key))
    deps.log.emit("flow.updated", records.updated_payload(s, record), principal_key=s.principal_key)
