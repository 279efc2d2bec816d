"""The JSON Schemas of the control API's resources and command results
(the components of ``spliceway.api.openapi``'s document).

The wire shapes the engine emits (FlowRecord, the event envelope, stats, sink status)
are not written here: they are generated from their models in ``spliceway.shapes``,
which also generate the catalogue tables of docs/events.md. What is written here is
in the same style: small helpers that keep shapes closed (``additionalProperties:
false``) wherever the contract fixes them.
"""

from __future__ import annotations

from typing import Any, get_args

from spliceway.control.capabilities import API_ID
from spliceway.dns.server import COUNTER_NAMES as DNS_SERVER_COUNTERS
from spliceway.errors import HTTP_STATUS
from spliceway.events.log import SCHEMA_ID as EVENT_SCHEMA_ID
from spliceway.events.logring import MESSAGE_MAX_CHARS
from spliceway.routing.policy import TRIGGERS
from spliceway.shapes.event import Envelope
from spliceway.shapes.flow import FLOW_RECORD_CONDITIONS, FlowRecord, MatchedRule, ModeKind
from spliceway.shapes.schema import COMPONENTS, component, nullable, object_schema
from spliceway.shapes.sink import SinkStatus
from spliceway.shapes.stats import Stats

Schema = dict[str, Any]

_SCHEMAS = COMPONENTS

# ---------------------------------------------------------------------------
# Schema helpers
# ---------------------------------------------------------------------------


def ref(name: str) -> Schema:
    """A reference to ``components.schemas.<name>``."""
    return {"$ref": f"{_SCHEMAS}{name}"}


def obj(
    required: dict[str, Schema],
    optional: dict[str, Schema] | None = None,
    *,
    description: str | None = None,
    closed: bool = True,
) -> Schema:
    """An object with ``required`` and ``optional`` properties, closed unless told otherwise."""
    properties = {**required, **(optional or {})}
    out: Schema = {"type": "object"}
    if description is not None:
        out["description"] = description
    out["properties"] = properties
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    return out


def array(items: Schema, **extra: Any) -> Schema:
    """An array of ``items``."""
    return {"type": "array", "items": items, **extra}


def enum(values: Any) -> Schema:
    """A string out of ``values`` (kept in the given order, or sorted for sets)."""
    ordered = sorted(values) if isinstance(values, set | frozenset) else list(values)
    return {"type": "string", "enum": ordered}


def const(value: Any) -> Schema:
    """Exactly ``value``."""
    return {"const": value}


def string(**extra: Any) -> Schema:
    """A string."""
    return {"type": "string", **extra}


def integer(minimum: int | None = 0, maximum: int | None = None, **extra: Any) -> Schema:
    """An integer, non-negative by default."""
    out: Schema = {"type": "integer"}
    if minimum is not None:
        out["minimum"] = minimum
    if maximum is not None:
        out["maximum"] = maximum
    return {**out, **extra}


BOOL: Schema = {"type": "boolean"}
STR: Schema = string()
NON_EMPTY: Schema = string(minLength=1)
COUNT: Schema = integer()
UNIX_MS: Schema = integer(description="UNIX time in milliseconds")
PORT: Schema = integer(0, 65535)
LATENCY_MS: Schema = {"type": "number", "minimum": 0}
STRINGS: Schema = array(STR)
OPEN_OBJECT: Schema = {"type": "object"}

# ---------------------------------------------------------------------------
# Resource schemas
# ---------------------------------------------------------------------------


def _support() -> Schema:
    return obj(
        {
            "supported": BOOL,
            "level": enum(["supported", "unsupported", "not_built", "not_applicable"]),
            "notes": STRINGS,
        }
    )


def _limitation() -> Schema:
    return obj({"code": STR, "message": STR})


def _capabilities() -> Schema:
    direction = obj({"tcp": ref("Support"), "udp": ref("Support")})
    protocol = obj(
        {
            "protocol": STR,
            "feature": STR,
            "compiled": BOOL,
            "status": enum(["stable", "not_built"]),
            "compatibility_baseline": STR,
            "inbound": direction,
            "outbound": direction,
            "transports": STRINGS,
            "mux": ref("Support"),
            "limitations": array(ref("Limitation")),
        }
    )
    toggle = obj({"kind": STR, "enabled": BOOL})
    return obj(
        {
            "api_id": const(API_ID),
            "schema_id": const(EVENT_SCHEMA_ID),
            "engine_version": STR,
            "adapters": array(toggle),
            "sinks": array(toggle),
            "features": STRINGS,
            "protocols": array(protocol),
            "build_features": STRINGS,
            "permissions": array(ref("Permission"), uniqueItems=True),
            "contracts": array(
                obj({"name": STR, "id": STR, "min_version": COUNT, "max_version": COUNT})
            ),
            "error_codes": array(
                obj({"code": enum(HTTP_STATUS), "http_status": integer(400, 599)})
            ),
            "commands": array(
                obj(
                    {
                        "method": ref("CommandMethod"),
                        "permission": ref("Permission"),
                        "available": BOOL,
                    },
                    {"missing": string(description="What this build lacks for the command.")},
                )
            ),
            "global_limitations": array(ref("Limitation")),
        },
        description="What this build can do.",
    )


def _group_fields() -> dict[str, Schema]:
    chains = array(STRINGS)
    member = obj(
        {
            "member_tag": STR,
            "healthy": BOOL,
            "latency_ms": nullable(LATENCY_MS),
            "last_checked_unix_ms": nullable(UNIX_MS),
            "last_error": nullable(STR),
            "effective_chains": chains,
        }
    )
    return {
        "tag": STR,
        "kind": enum(["selector", "url_test", "fallback", "relay", "load_balance"]),
        "outbounds": STRINGS,
        "selected": nullable(STR),
        "fixed": nullable(
            string(
                description="The pinned member of a url_test or fallback group "
                "(`policies.select`, mihomo's `fixed`); null when none, and for other kinds."
            )
        ),
        "latency_ms": nullable(LATENCY_MS),
        "last_checked_unix_ms": nullable(UNIX_MS),
        "effective_chains": chains,
        "providers": array(
            STR,
            description="The proxy providers whose outbounds are members after the group's "
            "own (`outbounds` lists them all; empty when the providers have none yet).",
        ),
        "url_test_members": array(member),
        "member_health": array(
            obj(
                {
                    "member_tag": STR,
                    "healthy": nullable(BOOL),
                    "latency_ms": nullable(LATENCY_MS),
                    "last_checked_unix_ms": nullable(UNIX_MS),
                    "last_error": nullable(STR),
                    "checked_by": nullable(STR),
                    "provider": nullable(
                        string(
                            description="The proxy provider the member came from (one of "
                            "the group's `providers`); null for a member of its own "
                            "`outbounds`."
                        )
                    ),
                },
                description="What the engine knows of one member now: the newest check of "
                "it by any probing group (`checked_by`) or by `diagnostics.probe_outbound` "
                "(`checked_by` null), whichever group lists it; all null until something "
                "has checked it.",
            ),
            description="Every member, in order, with its engine-wide latest health "
            "(`url_test_members` keeps this group's own view, which its selection follows).",
        ),
    }


_PROVIDER_KIND = enum(["proxies", "rules", "geodata"])


def _provider() -> Schema:
    skipped = obj(
        {"name": STR, "type": STR, "reason": STR},
        description="A proxy of the body spliceway cannot carry (empty `name` or `type` "
        "when the body gave none).",
    )
    return obj(
        {
            "name": STR,
            "kind": _PROVIDER_KIND,
            "source": enum(["url", "path"]),
            "url": nullable(
                string(description="`scheme://host[:port]` of the URL (the rest may hold a token).")
            ),
            "path": string(
                description="The file the content is read from: its `path`, or the cached copy."
            ),
            "interval_seconds": nullable(integer(1)),
            "via": nullable(STR),
            "updated_at_unix_ms": nullable(UNIX_MS),
            "checked_at_unix_ms": nullable(UNIX_MS),
            "next_update_at_unix_ms": nullable(UNIX_MS),
            "updating": BOOL,
            "last_error": nullable(STR),
            "last_error_at_unix_ms": nullable(UNIX_MS),
            "sha256": nullable(STR),
        },
        {
            "format": nullable(STR),
            "behavior": nullable(STR),
            "outbounds": nullable(COUNT),
            "members": STRINGS,
            "filtered_out": COUNT,
            "renamed": array(obj({"name": STR, "tag": STR})),
            "rules": nullable(COUNT),
            "skipped": nullable(COUNT),
            "skipped_proxies": array(skipped),
            "health_check": nullable(
                obj(
                    {"enabled": BOOL, "url": STR, "interval_seconds": integer(1)},
                    description="A proxy provider's `health_check`, its URL resolved.",
                )
            ),
            "subscription_info": nullable(
                obj(
                    {"upload": COUNT, "download": COUNT, "total": COUNT, "expire": COUNT},
                    description="The last `subscription-userinfo` header: bytes used and "
                    "allowed, expiry in UNIX seconds (0: not given).",
                )
            ),
        },
        description="One provider (or geodata file) and what the engine holds of it.",
    )


def _config_summary() -> Schema:
    return obj(
        {
            "mode": obj({"kind": ref("ModeKind"), "outbound": nullable(STR)}),
            "rule_count": COUNT,
            "rules": array(
                obj(
                    {
                        "index": COUNT,
                        "condition": STR,
                        "action": enum(["route", "block"]),
                        "outbound": nullable(STR),
                    },
                    description="One routing rule, in order: `index` and `condition` as a "
                    "flow's `route.matched_rule` names it; `outbound` is null for `block`.",
                ),
                description="The rules in force (mode `rule` tries them in order).",
            ),
            "final": string(description="`route.final`: where flows no rule matches go."),
            "listeners": array(
                obj(
                    {
                        "tag": STR,
                        "protocol": STR,
                        "listen_address": STR,
                        "listen_port": PORT,
                    }
                )
            ),
            "outbounds": array(
                obj(
                    {
                        "tag": STR,
                        "protocol": STR,
                        "server": nullable(STR),
                        "port": nullable(PORT),
                        "provider": nullable(
                            string(
                                description="The proxy provider it came from; null for the "
                                "configuration's own."
                            )
                        ),
                    }
                )
            ),
            "outbound_groups": array(ref("PolicySnapshot")),
        },
        description="The running configuration, summarised.",
    )


def _runtime() -> Schema:
    return obj(
        {
            "stats": ref("Stats"),
            "udp_upstream_idle_timeout_seconds": integer(1),
            "log_level": enum(["trace", "debug", "info", "warn", "error"]),
            "log_files": STRINGS,
            "pid": integer(1),
            "started_at_unix_ms": UNIX_MS,
            "active_sessions": array(ref("FlowRecord")),
            "recent_completed_sessions": array(ref("FlowRecord")),
            "file_descriptors": obj(
                {
                    "soft_limit": integer(-1),
                    "hard_limit": integer(-1),
                    "accept_failures": COUNT,
                    "accept_outages": COUNT,
                    "listeners_out_of_descriptors": STRINGS,
                },
                {"open": COUNT},
                description="The process's `RLIMIT_NOFILE` (-1: unlimited; the engine "
                "raises the soft limit to the hard one at start), the descriptors open now "
                "(absent when they cannot be counted), and accepts that failed for want of "
                "descriptors since start: how many, in how many outages, and the listeners "
                "in one now (docs/running.md).",
            ),
        },
        {
            "config_path": string(description="Present when the engine was started from a file."),
            "dns_server": obj(
                {
                    "listen_address": STR,
                    "listen_port": PORT,
                    "counters": obj(dict.fromkeys(DNS_SERVER_COUNTERS, COUNT)),
                },
                description="Present while the DNS server (`runtime.dns.listen`) runs: the "
                "address it bound (UDP and TCP) and what it did since it started "
                "(docs/dns.md).",
            ),
        },
        description="The runtime snapshot.",
    )


def flow_record() -> Schema:
    """``FlowRecord``, from its model; ``result`` exactly when completed."""
    return component(FlowRecord, extra=FLOW_RECORD_CONDITIONS)


def stats() -> Schema:
    """``Stats``, from its model."""
    return component(Stats)


def sink() -> Schema:
    """``Sink``, from its model."""
    return component(SinkStatus)


def event_envelope() -> Schema:
    """``EventEnvelope``: the envelope model, with each flow and policy type's payload."""
    lifecycle = ["flow.started", "flow.routed", "flow.updated", "flow.completed"]
    envelope = component(Envelope)
    envelope["allOf"] = [
        {
            "if": {"properties": {"event_type": enum(lifecycle)}, "required": ["event_type"]},
            "then": {
                "properties": {
                    "payload": {
                        "type": "object",
                        "required": ["flow_id", "record"],
                        "properties": {"flow_id": NON_EMPTY, "record": ref("FlowRecord")},
                    }
                }
            },
        },
        {
            "if": {"properties": {"event_type": const("flow.completed")}},
            "then": {
                "properties": {
                    "payload": {
                        "properties": {"record": {"properties": {"state": const("completed")}}}
                    }
                }
            },
        },
        {
            "if": {"properties": {"event_type": const("flow.snapshot")}},
            "then": {
                "properties": {
                    "payload": obj({"watermark": COUNT, "records": array(ref("FlowRecord"))})
                }
            },
        },
        {
            "if": {"properties": {"event_type": const("policy.selected")}},
            "then": {
                "properties": {
                    "payload": obj(
                        {
                            "policy_tag": STR,
                            "policy_kind": const("selector"),
                            "selected": STR,
                            "previous": nullable(STR),
                        }
                    )
                }
            },
        },
        {
            "if": {"properties": {"event_type": const("policy.probe.completed")}},
            "then": {"properties": {"payload": _probe_completed()}},
        },
    ]
    return envelope


def _probe_completed() -> Schema:
    member = obj(
        {
            "target_tag": STR,
            "healthy": BOOL,
            "latency_ms": nullable(LATENCY_MS),
            "error": nullable(STR),
        }
    )
    return obj(
        {
            "policy_tag": STR,
            "trigger": enum(list(TRIGGERS)),
            "url": STR,
            "started_at_unix_ms": UNIX_MS,
            "completed_at_unix_ms": UNIX_MS,
            "duration_ms": COUNT,
            "selected": nullable(STR),
            "members": array(member),
        },
        description="A finished probe round of a url_test, fallback or load_balance group.",
    )


def _log_ring() -> Schema:
    record = obj(
        {
            "sequence": integer(1),
            "time_unix_ms": UNIX_MS,
            "level": enum(["debug", "info", "warn", "error"]),
            "logger": string(description="The logger's name: `spliceway` or below it."),
            "message": string(
                description=f"The formatted message, with its traceback if any; at most "
                f"{MESSAGE_MAX_CHARS} characters."
            ),
            "thread": STR,
        },
        description="One log record.",
    )
    return obj(
        {
            "records": array(record),
            "oldest_sequence": integer(1),
            "latest_sequence": COUNT,
            "capacity": integer(1),
        },
        description=(
            "The newest log records of the `spliceway` loggers at or above "
            "`runtime.log_level`, as the host's logging configuration lets them through, "
            "since the engine started. `oldest_sequence`, `latest_sequence` and `capacity` "
            "describe the ring itself, not the filtered list."
        ),
    )


def _tun_status() -> Schema:
    stopped = obj(
        {
            "running": const(False),
            "name": {"type": "null"},
            "addr": {"type": "null"},
            "tag": {"type": "null"},
        },
        description="No TUN inbound is running.",
    )
    egress = obj(
        {"availability": enum(["unknown", "available", "unavailable"])},
        {"interface": STR, "reason": STR},
    )
    running = obj(
        {
            "running": const(True),
            "name": STR,
            "addr": STR,
            "tag": STR,
            "addresses": STRINGS,
            "mtu": integer(1),
            "healthy": BOOL,
            "last_error": nullable(STR),
            "auto_route": BOOL,
            "include_cidrs": STRINGS,
            "exclude_cidrs": STRINGS,
            "dual_stack": BOOL,
            "strict_route": BOOL,
            "dns_hijack": BOOL,
            "ipv4_egress": egress,
            "ipv6_egress": egress,
            "network_generation": COUNT,
            "address_family_policy": STR,
            "ipv6_to_ipv4_fallbacks": COUNT,
            "managed_by_config": BOOL,
        },
        description="A running TUN inbound; egress_interface* fields name the egress device.",
    )
    running["patternProperties"] = {"^egress_interface": {}}
    return {"oneOf": [stopped, running], "description": "The TUN inbound."}


# ---------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------


def _apply_result() -> Schema:
    return obj(
        {
            "applied": BOOL,
            "persistence": enum(["source_file", "runtime_only"]),
            "reconciled": BOOL,
            "application_components": STRINGS,
            "changed_components": STRINGS,
        }
    )


_LOG_LEVEL = enum(["trace", "debug", "info", "warn", "error"])


def _dns_query_result() -> Schema:
    record = obj(
        {"name": STR, "type": COUNT, "ttl": COUNT, "data": STR},
        description="One record: owner name (with its final dot), numeric type, TTL and "
        "the data in zone-file text.",
    )
    return obj(
        {
            "rcode": COUNT,
            "question": obj({"name": STR, "type": COUNT, "class": COUNT}),
            "flags": obj({"tc": BOOL, "rd": BOOL, "ra": BOOL, "ad": BOOL, "cd": BOOL}),
            "answer": array(record),
            "authority": array(record),
            "additional": array(record),
        },
        {"error": STR},
    )


def command_results() -> dict[str, Schema]:
    """The result schema of each command, by method."""
    accepted = obj({"accepted": BOOL})
    return {
        "flows.close": obj({"flow_id": NON_EMPTY, "closed": BOOL}),
        "mode.set": accepted,
        "config.validate": obj({"valid": BOOL}),
        "diagnostics.trace_route": obj(
            {
                "target": STR,
                "resolved_ip": nullable(STR),
                "port": PORT,
                "protocol": enum(["tcp", "udp"]),
                "inbound_tag": nullable(STR),
                "effective_mode": ref("ModeKind"),
                "route_action": {
                    "oneOf": [obj({"route": STR}), obj({"block": const(True)})],
                },
                "matched_rule": nullable(ref("MatchedRule")),
            }
        ),
        "diagnostics.probe_target": obj(
            {
                "target_tag": STR,
                "server": nullable(STR),
                "port": nullable(PORT),
                "reachable": BOOL,
                "latency_ms": nullable(LATENCY_MS),
            },
            {"error": STR},
        ),
        "diagnostics.dns_lookup": obj(
            {"hostname": STR, "resolved_addresses": STRINGS, "count": COUNT}, {"error": STR}
        ),
        "diagnostics.dns_cache": {
            "oneOf": [
                obj(
                    {
                        "enabled": BOOL,
                        "domain": STR,
                        "hit": BOOL,
                        "addresses": STRINGS,
                        "ttl_seconds": nullable(COUNT),
                    },
                    description="With params.domain: that domain's cache entry.",
                ),
                obj(
                    {
                        "enabled": BOOL,
                        "entries": array(
                            obj({"domain": STR, "addresses": STRINGS, "ttl_seconds": COUNT})
                        ),
                        "count": COUNT,
                    },
                    description="Without params.domain: the cache's entries.",
                ),
            ]
        },
        "policies.select": obj(
            {"policy_tag": STR, "selected": STR},
            {"fixed": string(description="The pinned member (url_test and fallback groups).")},
        ),
        "policies.unfix": obj(
            {
                "policy_tag": STR,
                "selected": nullable(STR),
                "fixed": {"type": "null"},
                "previous_fixed": nullable(STR),
            }
        ),
        "policies.probe": obj({"policy_tag": STR, "probe_triggered": BOOL}),
        "config.apply": _apply_result(),
        "config.apply_runtime": _apply_result(),
        "tun.start": accepted,
        "tun.stop": accepted,
        "diagnostics.probe_outbound": obj(
            {
                "target_tag": STR,
                "url": STR,
                "via": const("through_proxy"),
                "reachable": BOOL,
                "latency_ms": nullable(LATENCY_MS),
                "status": nullable(integer(100, 999)),
                "timed_out": BOOL,
            },
            {"error": STR},
        ),
        "diagnostics.dns_query": _dns_query_result(),
        "dns.cache_flush": obj({"flushed": COUNT}),
        "providers.update": obj(
            {
                "results": array(
                    obj(
                        {
                            "name": STR,
                            "kind": _PROVIDER_KIND,
                            "outcome": enum(["updated", "unchanged", "failed"]),
                            "error": nullable(STR),
                            "updated_at_unix_ms": nullable(UNIX_MS),
                        },
                        {
                            "outbounds": nullable(COUNT),
                            "rules": nullable(COUNT),
                            "skipped": nullable(COUNT),
                        },
                        description="One provider's refresh: `updated` (new content, in "
                        "use), `unchanged`, or `failed` (`error`; the last good copy, of "
                        "`updated_at_unix_ms`, stays).",
                    )
                )
            }
        ),
        "log.set_level": obj({"level": _LOG_LEVEL, "previous": _LOG_LEVEL}),
        "diagnostics.fakeip_lookup": {
            "oneOf": [
                obj(
                    {"enabled": BOOL, "domain": STR, "fake_ip": nullable(STR)},
                    description="Forward (params.domain).",
                ),
                obj(
                    {"enabled": BOOL, "ip": STR, "domain": nullable(STR)},
                    description="Reverse (params.ip).",
                ),
            ]
        },
        "fakeip.clear": obj({"cleared": COUNT}),
    }


def resource_schemas() -> dict[str, Schema]:
    """The resource components, in the document's order (after the enumerations)."""
    policy = obj(
        _group_fields(),
        {
            "interval_seconds": integer(1),
            "tolerance_ms": COUNT,
            "strategy": enum(["round_robin", "consistent_hashing", "sticky_sessions"]),
            "url": STR,
        },
        description="A group's live state.",
    )
    return {
        "MatchedRule": object_schema(MatchedRule),
        "Support": _support(),
        "Limitation": _limitation(),
        "Health": obj(
            {"engine_build_id": STR, "started_at_unix_ms": UNIX_MS, "healthy": BOOL},
            description="Liveness.",
        ),
        "Capabilities": _capabilities(),
        "ConfigSummary": _config_summary(),
        "Stats": stats(),
        "Runtime": _runtime(),
        "FlowRecord": flow_record(),
        "FlowList": obj({"active_flows": array(ref("FlowRecord"))}),
        "PolicySnapshot": policy,
        "PolicyList": obj({"policies": array(ref("PolicySnapshot"))}),
        "Provider": _provider(),
        "ProviderList": obj({"providers": array(ref("Provider"))}),
        "Sink": sink(),
        "SinkList": obj({"sinks": array(ref("Sink"))}),
        "TunStatus": _tun_status(),
        "EventEnvelope": event_envelope(),
        "EventRing": obj(
            {
                "events": array(ref("EventEnvelope")),
                "oldest_sequence": integer(1),
                "latest_sequence": COUNT,
                "capacity": integer(1),
            },
            description="The event ring.",
        ),
        "LogRing": _log_ring(),
    }


#: ``ModeKind``: the routing modes (the flow model's ``route.mode``).
MODE_KIND: Schema = enum(get_args(ModeKind))
