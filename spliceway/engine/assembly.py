"""The engine's routing parts built from a configuration: resolver, outbounds, groups, rules.

At start they are built from nothing; on ``config.apply`` they are built again
from the new configuration and the running parts, reusing every part whose
definition did not change: the same outbound object (and what it holds), the
same resolver (and its cache), and for a group its current view, so a selector
keeps its selection and a url_test group its probe results. Nothing here has
side effects; the reconciler installs the result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from spliceway.config import BUILTIN_DIRECT, Config
from spliceway.dns import Resolver
from spliceway.engine.runtime import RouteState
from spliceway.flows.outbounds import (
    DirectOutbound,
    NoMemberOutbound,
    Outbound,
    build_outbound,
    build_relay,
)
from spliceway.routing import policy
from spliceway.routing import rules as routing


@dataclass(frozen=True, slots=True)
class RoutingParts:
    """What routes a flow, as one generation of the configuration defines it."""

    resolver: Resolver
    #: Config entry of every outbound and relay group, by tag (what reuse compares).
    outbound_specs: Mapping[str, Any]
    outbounds: dict[str, Outbound]
    #: Config entry of every group, by tag, with the probe URL it resolves to.
    group_specs: Mapping[str, tuple[Any, str]]
    views: list[policy.GroupView]
    #: Groups whose view (selection, probe state) carried over from the running engine.
    kept_groups: frozenset[str]
    route_state: RouteState


def build_routing(
    config: Config,
    previous: RoutingParts | None = None,
    previous_config: Config | None = None,
    live_views: policy.PolicyTable | None = None,
    live_route: RouteState | None = None,
    on_answer: Callable[[str, list[str], float], None] | None = None,
) -> RoutingParts:
    """The routing parts of ``config``, reusing the unchanged ones of ``previous``.

    ``live_views`` and ``live_route`` are the running engine's current group views
    and routing state (a selection or ``mode.set`` made since the last apply).
    ``on_answer`` is a new resolver's answer callback (``Resolver``'s).
    """
    dns_kept = (
        previous is not None
        and previous_config is not None
        and previous_config.runtime.dns == config.runtime.dns
    )
    resolver = (
        previous.resolver
        if dns_kept and previous
        else Resolver(config.runtime.dns, on_answer=on_answer)
    )

    def reusable(tag: str, spec: Any) -> Outbound | None:
        if not dns_kept or previous is None or previous.outbound_specs.get(tag) != spec:
            return None
        return previous.outbounds.get(tag)

    specs: dict[str, Any] = {}
    outbounds: dict[str, Outbound] = {
        BUILTIN_DIRECT: (
            previous.outbounds[BUILTIN_DIRECT]
            if dns_kept and previous
            else DirectOutbound(BUILTIN_DIRECT, resolver=resolver)
        )
    }
    for spec in config.outbounds:
        specs[spec.tag] = spec
        outbounds[spec.tag] = reusable(spec.tag, spec) or build_outbound(spec, resolver)
    for group in config.outbound_groups:
        if not group.outbounds:  # its proxy providers gave it no member (yet)
            outbounds[group.tag] = NoMemberOutbound(group.tag)
    # A relay group is a leaf outbound whose hops are other outbounds.
    for group in config.outbound_groups:
        if group.kind != "relay" or not group.outbounds:
            continue
        specs[group.tag] = group
        hops = [outbounds[m] for m in group.outbounds]
        old = reusable(group.tag, group)
        same_hops = old is not None and all(
            previous is not None and previous.outbounds.get(m) is outbounds[m]
            for m in group.outbounds
        )
        outbounds[group.tag] = (
            old if old is not None and same_hops else build_relay(group.tag, hops)
        )

    latency_url = config.runtime.latency_test_url
    group_specs: dict[str, tuple[Any, str]] = {}
    views: list[policy.GroupView] = []
    kept: set[str] = set()
    for group in config.outbound_groups:
        url = policy.probe_url_for(getattr(group, "url", None), latency_url)
        group_specs[group.tag] = (group, url)
        live = live_views.get(group.tag) if live_views is not None else None
        if previous is not None and previous.group_specs.get(group.tag) == (group, url) and live:
            views.append(live)
            kept.add(group.tag)
        else:
            before = previous.group_specs.get(group.tag) if previous is not None else None
            views.append(policy.next_view(before, group, url, live))

    return RoutingParts(
        resolver=resolver,
        outbound_specs=specs,
        outbounds=outbounds,
        group_specs=group_specs,
        views=views,
        kept_groups=frozenset(kept),
        route_state=_route_state(config, previous_config, live_route, outbounds, group_specs),
    )


def _route_state(
    config: Config,
    previous_config: Config | None,
    live: RouteState | None,
    outbounds: Mapping[str, Any],
    groups: Mapping[str, Any],
) -> RouteState:
    """The new routing state. A mode set at runtime (``mode.set``) outlives an apply
    whose ``mode`` section did not change, as a selection outlives one that keeps its
    group, unless its outbound is gone."""
    mode: str = config.mode.kind
    mode_outbound = config.mode.outbound
    if live is not None and previous_config is not None and previous_config.mode == config.mode:
        gone = live.mode_outbound is not None and not (
            live.mode_outbound in outbounds or live.mode_outbound in groups
        )
        if not gone:
            mode, mode_outbound = live.mode, live.mode_outbound
    return RouteState(
        mode=mode,
        mode_outbound=mode_outbound,
        final=config.route.final,
        ruleset=routing.compile_rules(config.rules),
    )
