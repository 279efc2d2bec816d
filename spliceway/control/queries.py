"""The one query table: every read-only resource of the control API by name (docs/http-api.md).

``Engine.query``, the HTTP transport and (later) IPC resolve names here, through
``run_query``. Each entry declares the parameters its query accepts (a path
parameter such as ``flow_id`` counts as one); any other parameter is
``invalid_argument`` naming it, so nothing a caller sends is silently ignored.
Queries read published snapshots; none of them changes state.

``events`` filters the ring: ``types`` (comma-separated allow-list, as the SSE
stream's), ``since`` (only events with a greater sequence) and ``limit`` (at most
this many, 1..EVENTS_LIMIT_MAX, the oldest matching ones first, so a client pages
forward with ``since`` = the last sequence it got). ``oldest_sequence`` and
``latest_sequence`` always describe the ring, not the filtered list.

``logs`` reads the engine's ring of recent log records (spliceway.events.logring) the same
way: ``since``, ``limit`` (1..LOGS_LIMIT_MAX) and ``level``, the lowest level
returned (``trace``, ``debug``, ``info``, ``warn``, ``error``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from spliceway.control.capabilities import capabilities
from spliceway.control.commands import PERMISSIONS
from spliceway.errors import invalid_argument, not_found
from spliceway.events.log import normalize_types, parse_types
from spliceway.events.logring import LEVELS, LOGS_LIMIT_MAX
from spliceway.providers.subscription import origin_of
from spliceway.routing import policy
from spliceway.routing.policy import POLICY_KINDS
from spliceway.support import fdlimit

if TYPE_CHECKING:
    from spliceway.engine.core import EngineCore
    from spliceway.engine.generation import Generation
    from spliceway.engine.providers import ProviderState

FLOWS_LIMIT_DEFAULT = 100
FLOWS_LIMIT_MAX = 10000
#: Upper bound of ``events``'s ``limit`` (fixed, whatever the ring's configured capacity);
#: without ``limit`` every matching event in the ring is returned.
EVENTS_LIMIT_MAX = 10000
RECENT_COMPLETED = 32

Query = Callable[["EngineCore", dict[str, Any]], dict[str, Any]]


def _integer(params: dict[str, Any], name: str, low: int, high: int | None) -> int | None:
    """``params[name]`` as an int in ``low..high`` (None when absent).

    An int, or a string of ASCII digits as a transport delivers it; anything else,
    blank included, is ``invalid_argument`` naming the parameter.
    """
    if name not in params:
        return None
    value = params[name]
    # isascii: str.isdigit() also accepts '²' and fullwidth digits, which int() rejects.
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    in_range = (
        not isinstance(value, bool)
        and isinstance(value, int)
        and low <= value
        and (high is None or value <= high)
    )
    if not in_range:
        bounds = f"{low}..{high}" if high is not None else f">= {low}"
        raise invalid_argument(f"{name} must be an integer {bounds}", name)
    return int(value)


def _health(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "engine_build_id": core.build_id,
        "started_at_unix_ms": core.started_at_unix_ms,
        "healthy": core.running,
    }


def _stats(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    return core.stats_snapshot()


def _recent_completed(core: EngineCore) -> list[dict[str, Any]]:
    done = core.log.latest_of_type("flow.completed", RECENT_COMPLETED)
    return [e["payload"]["record"] for e in done]


def _runtime(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    rt = core.config.runtime
    out: dict[str, Any] = {
        "stats": core.stats_snapshot(),
        "udp_upstream_idle_timeout_seconds": rt.udp_upstream_idle_timeout_seconds,
        # log.set_level's level while it holds, else runtime.log_level.
        "log_level": core.logs.log_level,
        "log_files": list(rt.log_files),
        "pid": os.getpid(),
        "started_at_unix_ms": core.started_at_unix_ms,
        "active_sessions": core.flows.records(),
        "recent_completed_sessions": _recent_completed(core),
        "file_descriptors": fdlimit.snapshot(),
    }
    if core.config_path is not None:
        out["config_path"] = core.config_path
    server = core.dns.server
    if server is not None:
        address, port = server.bound
        out["dns_server"] = {
            "listen_address": address,
            "listen_port": port,
            "counters": server.counters.snapshot(),
        }
    return out


def _flows(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    limit = _integer(params, "limit", 1, FLOWS_LIMIT_MAX)
    if limit is None:
        limit = FLOWS_LIMIT_DEFAULT
    inbound_tag = params.get("inbound_tag")
    principal_key = params.get("principal_key")
    out = []
    for entry in core.flows.entries():
        if inbound_tag is not None and entry.inbound_tag != inbound_tag:
            continue
        if principal_key is not None and entry.principal_key != principal_key:
            continue
        out.append(entry.record)
        if len(out) >= limit:
            break
    return {"active_flows": out}


def _flow(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    flow_id = params.get("flow_id")
    if not isinstance(flow_id, str) or not flow_id:
        raise invalid_argument("flow_id is required", "flow_id")
    entry = core.flows.get(flow_id)
    if entry is None:
        raise not_found(f"flow {flow_id!r} is not active")
    # A FlowRecord is a dict; the query table's answers are typed as plain JSON objects.
    return cast("dict[str, Any]", entry.record)


def _config(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    # One read of the generation: a reload replaces it whole, so the listeners, the
    # outbounds, the groups and the rules below are all of one configuration.
    g = core.generation
    cfg, route, table = g.config, g.route_state, g.policies
    listeners = [
        {
            "tag": a.spec.tag,
            "protocol": a.spec.protocol,
            "listen_address": a.bound[0],
            "listen_port": a.bound[1],
        }
        for a in g.active_inbounds
    ]
    outbounds = [
        {
            "tag": ob.tag,
            "protocol": ob.protocol,
            "server": ob.server,
            "port": ob.port,
            "provider": g.origins.get(ob.tag),
        }
        for ob in g.outbounds.values()
        if ob.tag not in table  # a relay group's outbound is a group
    ]
    # From the compiled rule set a flow decides with, so the text is matched_rule's.
    rules = []
    for index, rule in enumerate(route.ruleset.rules):
        decision = rule.decision
        matched = decision.matched_rule
        rules.append(
            {
                "index": index,
                "condition": matched.condition if matched is not None else "",
                "action": decision.action,
                "outbound": decision.target,
            }
        )
    return {
        "mode": {"kind": route.mode, "outbound": route.mode_outbound},
        "rule_count": len(cfg.rules),
        "rules": rules,
        "final": route.final,
        "listeners": listeners,
        "outbounds": outbounds,
        "outbound_groups": [_group_snapshot(g, v.tag) for v in table.views()],
    }


def _event_types(params: dict[str, Any]) -> frozenset[str] | None:
    """The ``types`` allow-list (None: every type), validated as the SSE stream's."""
    raw = params.get("types")
    if raw is None:
        return None
    if isinstance(raw, list | tuple) and all(isinstance(t, str) for t in raw):
        raw = ",".join(raw)
    if not isinstance(raw, str):
        raise invalid_argument("types must be a comma-separated list of event types", "types")
    return normalize_types(parse_types(raw))


def _events(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    types = _event_types(params)
    since = _integer(params, "since", 0, None)
    limit = _integer(params, "limit", 1, EVENTS_LIMIT_MAX)
    # One snapshot: the bounds and the events are of the same instant.
    return core.log.snapshot(since, types, limit)


def _logs(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    since = _integer(params, "since", 0, None)
    limit = _integer(params, "limit", 1, LOGS_LIMIT_MAX)
    level = params.get("level")
    if level is not None and (not isinstance(level, str) or level not in LEVELS):
        raise invalid_argument(f"level must be one of {', '.join(LEVELS)}", "level")
    return core.logs.snapshot(since, level, limit)


def _tun_status(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    if core.tun is None:
        return {"running": False, "name": None, "addr": None, "tag": None}
    return core.tun.status()


def _group_snapshot(g: Generation, tag: str) -> dict[str, Any]:
    """A group's snapshot with where its members come from: the group's ``providers``, and
    each ``member_health`` item's ``provider`` (null for a member of its own)."""
    snap = g.policies.snapshot(tag)
    group = g.config.find_group(tag)
    snap["providers"] = list(group.providers) if group is not None else []
    for item in snap["member_health"]:
        item["provider"] = g.origins.get(item["member_tag"])
    return snap


def _policies(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    g = core.generation
    table = g.policies
    return {
        "policies": [_group_snapshot(g, v.tag) for v in table.views() if v.kind in POLICY_KINDS]
    }


def _policy(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    g = core.generation
    tag = params.get("policy_tag")
    view = g.policies.get(tag) if isinstance(tag, str) else None
    if view is None or view.kind not in POLICY_KINDS:
        raise not_found(f"policy {tag!r} does not exist")
    return _group_snapshot(g, view.tag)


#: Most skipped proxies a provider's status lists (the count is exact).
SKIPPED_LISTED = 100


def _health_check(core: EngineCore, name: str) -> dict[str, Any] | None:
    """A proxy provider's ``health_check``, its URL resolved as a group's is."""
    spec = core.source_config.providers.proxies.get(name)
    if spec is None:
        return None
    check = spec.health_check
    return {
        "enabled": check.enabled,
        "url": policy.probe_url_for(check.url, core.config.runtime.latency_test_url),
        "interval_seconds": check.interval_seconds,
    }


def _provider_status(core: EngineCore, state: ProviderState, g: Generation) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": state.name,
        "kind": state.kind,
        "source": state.source,
        "url": origin_of(state.url),
        "path": state.path,
        "interval_seconds": state.interval_seconds,
        "via": state.via,
        "updated_at_unix_ms": state.updated_at_ms,
        "checked_at_unix_ms": state.checked_at_ms,
        "next_update_at_unix_ms": state.next_update_at_ms,
        "updating": state.updating,
        "last_error": state.last_error,
        "last_error_at_unix_ms": state.last_error_at_ms,
        "sha256": state.sha256,
    }
    if state.kind == "proxies":
        content = state.content
        report = g.provider_members.get(state.name)
        skipped = list(content.skipped) if content is not None else []
        info = state.userinfo
        out.update(
            {
                "format": content.format if content is not None else state.format,
                "outbounds": len(content.entries) if content is not None else None,
                "members": list(report.tags) if report is not None else [],
                "filtered_out": len(report.filtered_out) if report is not None else 0,
                "renamed": [
                    {"name": name, "tag": tag} for name, tag in (report.renamed if report else ())
                ],
                "skipped": len(skipped) if content is not None else None,
                "skipped_proxies": [
                    {"name": p.name, "type": p.type, "reason": p.reason}
                    for p in skipped[:SKIPPED_LISTED]
                ],
                "subscription_info": info.to_dict() if info is not None else None,
                "health_check": _health_check(core, state.name),
            }
        )
    elif state.kind == "rules":
        rules, skipped_rules = state.rule_count, state.rule_skipped
        # What routing read from the file when it built the running tables (a path
        # provider is not counted at start but there).
        loaded = g.parts.rule_set_status.get(state.name)
        if loaded is not None and loaded.error is None and rules is None:
            rules, skipped_rules = loaded.count, loaded.skipped
        if loaded is not None and loaded.error is not None and state.last_error is None:
            out["last_error"] = loaded.error
        out.update(
            {
                "format": state.format,
                "behavior": state.behavior,
                "rules": rules,
                "skipped": skipped_rules,
            }
        )
    return out


def _providers(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    g = core.generation
    return {"providers": [_provider_status(core, s, g) for s in core.providers.states()]}


def _sinks(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    return {"sinks": core.connector.status()}


def _capabilities(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    # Embedding and IPC callers hold every permission; HTTP and gRPC render
    # capabilities themselves with the caller's own grants (api.app.caller_capabilities).
    api = core.config.api
    return capabilities(
        PERMISSIONS,
        api_enabled=api.control.enabled,
        ipc_enabled=bool(api.ipc.enabled),
        grpc_enabled=api.grpc.enabled,
        clash_enabled=api.clash.enabled,
    )


@dataclass(frozen=True, slots=True)
class QuerySpec:
    """One entry of the table: the function and the parameters it accepts."""

    run: Query
    params: tuple[str, ...] = ()


QUERIES: dict[str, QuerySpec] = {
    "health": QuerySpec(_health),
    "capabilities": QuerySpec(_capabilities),
    "config": QuerySpec(_config),
    "runtime": QuerySpec(_runtime),
    "stats": QuerySpec(_stats),
    "flows": QuerySpec(_flows, ("limit", "inbound_tag", "principal_key")),
    "flow": QuerySpec(_flow, ("flow_id",)),
    "policies": QuerySpec(_policies),
    "policy": QuerySpec(_policy, ("policy_tag",)),
    "providers": QuerySpec(_providers),
    "sinks": QuerySpec(_sinks),
    "tun_status": QuerySpec(_tun_status),
    "events": QuerySpec(_events, ("types", "since", "limit")),
    "logs": QuerySpec(_logs, ("since", "limit", "level")),
}


def reject_unknown(params: dict[str, Any], accepted: tuple[str, ...], where: str) -> None:
    """Raise ``invalid_argument`` (``field_path``: the name) for the first parameter of
    ``params`` not in ``accepted``; the message names it and lists what ``where`` accepts."""
    for key in params:
        if key not in accepted:
            listed = f"it accepts: {', '.join(accepted)}" if accepted else "it accepts none"
            raise invalid_argument(f"unknown parameter {key!r} for {where}; {listed}", str(key))


def check_params(name: str, params: dict[str, Any]) -> QuerySpec:
    """The table entry of query ``name``, after checking that ``params`` names only what
    it declares; raises ``not_found`` for an unknown query, ``invalid_argument`` for an
    undeclared parameter."""
    spec = QUERIES.get(name)
    if spec is None:
        raise not_found(f"unknown query {name!r}")
    reject_unknown(params, spec.params, f"query {name!r}")
    return spec


def run_query(core: EngineCore, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Answer one named query; raises ApiError for unknown names and bad parameters."""
    params = params or {}
    return check_params(name, params).run(core, params)
