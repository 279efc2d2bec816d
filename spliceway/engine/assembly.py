"""The engine's routing parts built from a configuration: resolver, outbounds, groups, rules.

Rules come with what they read: every rule provider's set, parsed from its content file
(``provider_content_path``: its ``path``, or the last good fetched copy), and the
GeoIP/ASN/GeoSite databases the rules use (``runtime.geodata``). Both are memoised by
file identity (path, inode, ``mtime_ns``, size), so a reload that changed no file does
not parse 300,000 lines again; and a set by its content too
(:func:`~spliceway.routing.ruleset.parse_rule_set`), so the reload after a provider's
refresh gets the set the refresh's check parsed. The C sets the rules name are built here
as well (:func:`prepare_c_sets`), on the thread building the parts, not on the dispatcher
that installs them. A rule provider whose file is missing (never fetched) or
unreadable gives an empty set with a warning (:attr:`RoutingParts.rule_set_status`); a
rule naming a database whose file is missing or corrupt refuses the configuration.

At start they are built from nothing; on ``config.apply`` they are built again
from the new configuration and the running parts, reusing every part whose
definition did not change: the same outbound object (and what it holds), the
same resolver (and its cache), and for a group its current view, so a selector
keeps its selection and a url_test group its probe results. Nothing here has
side effects; the reconciler installs the result.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from spliceway.config import BUILTIN_DIRECT, Config, Rule, SubRule
from spliceway.config.provider_paths import provider_content_path
from spliceway.config.validators import GEOIP_BUILTIN_CODES
from spliceway.dns import Resolver
from spliceway.engine.runtime import RouteState
from spliceway.errors import ApiError
from spliceway.flows.outbounds import (
    DirectOutbound,
    NoMemberOutbound,
    Outbound,
    build_outbound,
    build_relay,
)
from spliceway.native.route import prepare_sets
from spliceway.routing import policy
from spliceway.routing import rules as routing
from spliceway.routing.geodata import GeoDatabases, GeoDataError, GeoIp, GeoSite
from spliceway.routing.ruleset import RuleSetData, RuleSetError, empty_rule_set, parse_rule_set

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RuleSetStatus:
    """How a rule provider's set was loaded: from ``path``; ``error`` None when it
    parsed (``count`` entries, ``skipped`` bad ones), else why the set is empty."""

    path: str
    count: int = 0
    skipped: int = 0
    skip_reasons: tuple[str, ...] = ()
    error: str | None = None


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
    #: Every rule provider's set by name (empty when its file is missing or bad); also
    #: ``route_state.ruleset.rule_sets``, which the C route table compiles.
    rule_sets: Mapping[str, RuleSetData] = field(default_factory=dict)
    #: How each set was loaded (a warning's text in ``error``), by provider name.
    rule_set_status: Mapping[str, RuleSetStatus] = field(default_factory=dict)
    #: The databases the rules use (``route_state.ruleset.geo`` too).
    geo: GeoDatabases = field(default_factory=GeoDatabases)


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

    rule_sets, status = load_rule_sets(config)
    geo = load_geodata(config, rule_sets)
    ruleset = routing.compile_rules(config.rules, rule_sets=rule_sets, geo=geo)
    for what in ruleset.missing:
        logger.warning("rules name %s, which is not loaded: it matches nothing", what)
    prepare_c_sets(config.rules, ruleset)
    return RoutingParts(
        resolver=resolver,
        outbound_specs=specs,
        outbounds=outbounds,
        group_specs=group_specs,
        views=views,
        kept_groups=frozenset(kept),
        route_state=_route_state(
            config, previous_config, live_route, outbounds, group_specs, ruleset
        ),
        rule_sets=rule_sets,
        rule_set_status=status,
        geo=geo,
    )


def prepare_c_sets(rules: tuple[Rule, ...], ruleset: routing.RuleSet) -> None:
    """Build the C sets ``rules`` name here, on the thread building the parts (a
    provider's refresh, ``config.apply``), so the C route table compiled when the parts
    are installed, on the dispatcher thread, finds them built: a set of 300,000 names
    takes ~0.2 s, which the dispatcher would not spend draining C's flow records. A
    failure is left to that compile, which reports it (nothing is lost here)."""
    try:
        prepare_sets(rules, ruleset)
    except Exception:
        logger.debug("building the C route sets ahead failed", exc_info=True)


# Parsed sets by (path, behavior, format), with the file identity they were read at.
_SET_CACHE: dict[tuple[str, str, str], tuple[tuple[int, int, int], RuleSetData]] = {}
_SET_LOCK = threading.Lock()


def _file_identity(path: str) -> tuple[int, int, int]:
    st = os.stat(path)
    return st.st_ino, st.st_mtime_ns, st.st_size


def load_rule_set(path: str, behavior: str, fmt: str, size_limit: int) -> RuleSetData:
    """The set in ``path`` (memoised by file identity). Raises OSError, RuleSetError."""
    key = (path, behavior, fmt)
    identity = _file_identity(path)
    with _SET_LOCK:
        cached = _SET_CACHE.get(key)
    if cached is not None and cached[0] == identity:
        return cached[1]
    if identity[2] > size_limit:
        raise RuleSetError(f"{identity[2]} bytes, over size_limit_bytes ({size_limit})")
    with open(path, "rb") as f:
        body = f.read(size_limit + 1)
    data = parse_rule_set(body, behavior, fmt)  # type: ignore[arg-type]
    with _SET_LOCK:
        _SET_CACHE[key] = (identity, data)
    return data


def load_rule_sets(
    config: Config,
) -> tuple[dict[str, RuleSetData], dict[str, RuleSetStatus]]:
    """Every ``providers.rules`` set, from its content file; a missing or bad file gives
    an empty set and a status whose ``error`` says why (logged as a warning)."""
    sets: dict[str, RuleSetData] = {}
    status: dict[str, RuleSetStatus] = {}
    for name, spec in config.providers.rules.items():
        path = provider_content_path(config, "rules", name)
        try:
            data = load_rule_set(path, spec.behavior, spec.format, spec.size_limit_bytes)
        except FileNotFoundError:
            error = "no content yet (never fetched)" if spec.url else "file not found"
        except OSError as ex:
            error = f"cannot read the file ({ex.strerror})"
        except RuleSetError as ex:
            error = str(ex)
        else:
            sets[name] = data
            status[name] = RuleSetStatus(path, data.count, data.skipped, data.skip_reasons)
            continue
        logger.warning("rule provider %r: %s: %s; its set is empty", name, path, error)
        sets[name] = empty_rule_set(spec.behavior)
        status[name] = RuleSetStatus(path, error=error)
    live = {s.path for s in status.values()}
    with _SET_LOCK:
        for key in [k for k in _SET_CACHE if k[0] not in live]:
            del _SET_CACHE[key]  # a provider gone (or moved): free its set
    return sets, status


def _rule_parts(rules: tuple[Rule, ...] | tuple[SubRule, ...]) -> Iterator[Rule | SubRule]:
    for rule in rules:
        yield rule
        if rule.rules:
            yield from _rule_parts(rule.rules)


def _geo_needs(config: Config, rule_sets: Mapping[str, RuleSetData]) -> dict[str, str]:
    """The databases the rules need, each with the field path of a rule that needs it."""
    needs: dict[str, str] = {}
    classical = [p for data in rule_sets.values() for p in data.classical]
    for where, parts in (("rules", config.rules), ("rule set", tuple(classical))):
        for rule in _rule_parts(parts):
            codes = [*(rule.geoip or ()), *(rule.source_geoip or ())]
            if any(c.lower() not in GEOIP_BUILTIN_CODES for c in codes):
                needs.setdefault("geoip", where)
            if rule.ip_asn or rule.source_ip_asn:
                needs.setdefault("asn", where)
            if rule.geosite:
                needs.setdefault("geosite", where)
    return needs


def load_geodata(config: Config, rule_sets: Mapping[str, RuleSetData]) -> GeoDatabases:
    """The databases the rules use, opened (memoised by file identity).

    A database the configuration's own rules need but whose file is missing or corrupt
    raises ApiError ``invalid_argument`` naming the field; one only a rule set's
    classical line needs is left out with a warning (that line then matches nothing).
    """
    geodata = config.runtime.geodata
    needs = _geo_needs(config, rule_sets)
    paths = {
        "geoip": ("runtime.geodata.geoip_path", geodata.geoip_path),
        "asn": (
            "runtime.geodata.asn_path" if geodata.asn_path else "runtime.geodata.geoip_path",
            geodata.asn_path or geodata.geoip_path,
        ),
        "geosite": ("runtime.geodata.geosite_path", geodata.geosite_path),
    }
    opened: dict[str, Any] = {}
    for kind, where in needs.items():
        field_path, path = paths[kind]
        try:
            if path is None:
                raise GeoDataError(f"{field_path} is not set")
            opened[kind] = GeoSite.open(path) if kind == "geosite" else GeoIp.open(path)
        except GeoDataError as ex:
            if where == "rules":
                raise ApiError(
                    "invalid_argument", f"{ex} (rules need it)", field_path=field_path
                ) from None
            logger.warning("a rule set needs %s: %s; such lines match nothing", kind, ex)
    return GeoDatabases(
        geoip=opened.get("geoip"), asn=opened.get("asn"), geosite=opened.get("geosite")
    )


def _route_state(
    config: Config,
    previous_config: Config | None,
    live: RouteState | None,
    outbounds: Mapping[str, Any],
    groups: Mapping[str, Any],
    ruleset: routing.RuleSet,
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
        ruleset=ruleset,
    )
