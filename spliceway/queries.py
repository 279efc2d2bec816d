"""The one query table: every read-only resource of interface.md 4.1 by name.

``Engine.query`` and (later) the HTTP and IPC transports resolve names here.
Queries read published snapshots; none of them changes state.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from spliceway.commands import PERMISSIONS
from spliceway.errors import invalid_argument, not_found
from spliceway.policy import POLICY_KINDS

if TYPE_CHECKING:
    from spliceway.engine_core import EngineCore

FLOWS_LIMIT_DEFAULT = 100
FLOWS_LIMIT_MAX = 10000
RECENT_COMPLETED = 32

Query = Callable[["EngineCore", dict[str, Any]], dict[str, Any]]


def _health(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    return {
        "engine_build_id": core.build_id,
        "started_at_unix_ms": core.started_at_unix_ms,
        "healthy": core.running,
    }


def _stats(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    return core.stats_snapshot()


def _recent_completed(core: EngineCore) -> list[dict[str, Any]]:
    events = core.log.snapshot()["events"]
    done = [e["payload"]["record"] for e in events if e["event_type"] == "flow.completed"]
    return done[-RECENT_COMPLETED:]


def _runtime(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    rt = core.config.runtime
    out: dict[str, Any] = {
        "stats": core.stats_snapshot(),
        "udp_upstream_idle_timeout_seconds": rt.udp_upstream_idle_timeout_seconds,
        "log_level": rt.log_level,
        "log_files": list(rt.log_files),
        "pid": os.getpid(),
        "started_at_unix_ms": core.started_at_unix_ms,
        "active_sessions": core.flows.records(),
        "recent_completed_sessions": _recent_completed(core),
    }
    if core.config_path is not None:
        out["config_path"] = core.config_path
    return out


def _flows(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    limit = params.get("limit", FLOWS_LIMIT_DEFAULT)
    # isascii: str.isdigit() also accepts '²' and fullwidth digits, which int() rejects.
    if isinstance(limit, str) and limit.isascii() and limit.isdigit():
        limit = int(limit)
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= FLOWS_LIMIT_MAX:
        raise invalid_argument(f"limit must be an integer 1..{FLOWS_LIMIT_MAX}", "limit")
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
    return entry.record


def _config(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    cfg = core.config
    route = core.route_state
    listeners = [
        {"tag": ib.tag, "protocol": ib.protocol, "listen_address": addr, "listen_port": port}
        for ib, (addr, port) in zip(cfg.inbounds, core.bound, strict=True)
    ]
    outbounds = [
        {"tag": ob.tag, "protocol": ob.protocol, "server": ob.server, "port": ob.port}
        for ob in core.outbounds.values()
        if ob.tag not in core.policies  # a relay group's outbound is a group
    ]
    return {
        "mode": {"kind": route.mode, "outbound": route.mode_outbound},
        "rule_count": len(cfg.rules),
        "listeners": listeners,
        "outbounds": outbounds,
        "outbound_groups": [core.policies.snapshot(v.tag) for v in core.policies.views()],
    }


def _events(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    return core.log.snapshot()


def _tun_status(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    return {"running": False, "name": None, "addr": None, "tag": None}


def _policies(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    table = core.policies
    return {"policies": [table.snapshot(v.tag) for v in table.views() if v.kind in POLICY_KINDS]}


def _policy(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    tag = params.get("policy_tag")
    view = core.policies.get(tag) if isinstance(tag, str) else None
    if view is None or view.kind not in POLICY_KINDS:
        raise not_found(f"policy {tag!r} does not exist")
    return core.policies.snapshot(view.tag)


def _sinks(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    return {"sinks": core.connector.status()}


def _capabilities(core: EngineCore, params: dict[str, Any]) -> dict[str, Any]:
    # Embedding and IPC callers hold every permission (decisions 4); HTTP renders
    # capabilities itself with the caller's own grants.
    from spliceway.capabilities import capabilities

    return capabilities(PERMISSIONS, api_enabled=core.config.api.control.enabled)


QUERIES: dict[str, Query] = {
    "health": _health,
    "capabilities": _capabilities,
    "config": _config,
    "runtime": _runtime,
    "stats": _stats,
    "flows": _flows,
    "flow": _flow,
    "policies": _policies,
    "policy": _policy,
    "sinks": _sinks,
    "tun_status": _tun_status,
    "events": _events,
}


def run_query(core: EngineCore, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Answer one named query; raises ApiError for unknown names and bad parameters."""
    query = QUERIES.get(name)
    if query is None:
        raise not_found(f"unknown query {name!r}")
    return query(core, params or {})
