"""The event catalogue: every event type, when it is emitted and what its payload holds.

This is the one definition of the event types: ``spliceway.config.EVENT_TYPES``
(what a sink's ``events`` filter and the ``types`` parameters accept) is the set of
its keys, and ``docs/events.md`` is rendered from it by ``spliceway.tools.docgen``.

Payload fields are named by key path: ``target.host`` is the ``host`` key of the
``target`` object, ``members[].healthy`` the ``healthy`` key of every item of the
``members`` list. A field of type ``FlowRecord`` holds a flow record, whose fields
are :data:`FLOW_RECORD_FIELDS`. The unit tests start an engine, drive real flows
through it and check that every payload it emits has exactly the fields listed
here (the required ones always, the optional ones when they apply).

The envelope, flow record and stats tables are not written here: they are generated
from the wire-shape models (``spliceway.shapes``), which also give the OpenAPI
document its components, so the three cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from spliceway.shapes.event import Envelope
from spliceway.shapes.flow import FlowRecord
from spliceway.shapes.schema import catalogue_rows
from spliceway.shapes.stats import UDP_COUNTERS, Stats

__all__ = [
    "CLOSE_REASONS",
    "ENGINE_WARNING_CODES",
    "ENVELOPE_FIELDS",
    "EVENT_CATALOGUE",
    "FAILURE_CODES",
    "FAILURE_STAGES",
    "FLOW_RECORD_FIELDS",
    "OUTCOMES",
    "UDP_COUNTERS",
    "EventType",
    "PayloadField",
]


@dataclass(frozen=True, slots=True)
class PayloadField:
    """One key of an event payload (or of the envelope, or of a flow record)."""

    #: Key path: ``a.b`` for key ``b`` of object ``a``, ``a[].b`` for key ``b`` of each item.
    name: str
    #: JSON type in words (``integer``, ``string or null``, ``FlowRecord``...).
    type: str
    #: What the value means.
    description: str
    #: False when the key is present only in some cases (the description says which).
    required: bool = True


@dataclass(frozen=True, slots=True)
class EventType:
    """One event type of the catalogue."""

    name: str
    #: What makes the engine emit it.
    when: str
    #: How often it comes.
    frequency: str
    #: Whether this build emits it (some types are reserved for subsystems not built yet).
    emitted: bool
    #: The payload's keys; empty for a type this build does not emit.
    fields: tuple[PayloadField, ...] = ()


def _f(name: str, type_: str, description: str, *, required: bool = True) -> PayloadField:
    return PayloadField(name, type_, description, required)


def _rows(shape: type) -> tuple[PayloadField, ...]:
    """The rows of a wire shape's table, generated from its model (spliceway.shapes)."""
    rows = catalogue_rows(shape)
    return tuple(PayloadField(r.name, r.type, r.description, r.required) for r in rows)


UNIX_MS = "integer (UNIX ms)"

#: The envelope every event travels in (``schema_id`` ``service.event.v1``).
ENVELOPE_FIELDS: tuple[PayloadField, ...] = _rows(Envelope)

#: Outcomes of a completed flow (``result.outcome``).
OUTCOMES: dict[str, str] = {
    "direct_relayed": "Relayed to the target by a `direct` outbound.",
    "chained_relayed": "Relayed through an upstream proxy (socks5, http, shadowsocks or a "
    "relay chain).",
    "blocked": "Refused by a `block` rule, a `block` outbound or a group that chose one, or "
    "denied by the flow hook (`result.failure.code` `hook_denied`).",
    "failed": "The upstream could not be reached, or failed while relaying (see `result.failure`).",
    "cancelled": "Closed by the `flows.close` command (close reason `manual`), or ended by "
    "an engine stop before its upstream connection was made (while it was routed or dialled).",
    "engine_crashed": "The engine stopped without completing the flow (killed, or crashed): "
    "at its next start, before any new flow, the engine completes every flow a sink's "
    "outbox shows started and not completed, with this outcome, `result.failure` "
    "`internal`/`engine_crashed`, the newest record a sink was given (the bytes last "
    "reported) and the last moment the flow was seen as its end, so every flow has one "
    "final record even across a crash (see Sinks below; needs `api.outbox_path`).",
}

#: ``result.close_reason`` values.
CLOSE_REASONS: dict[str, str] = {
    "manual": "Closed by the `flows.close` command.",
    "idle_timeout": "No byte moved for `runtime.tcp_idle_timeout_seconds`.",
    "upstream_error": "The upstream failed (the outcome is `failed`).",
}

#: ``result.failure.stage`` values.
FAILURE_STAGES: dict[str, str] = {
    "resolve": "Resolving the target or proxy name with `runtime.dns`.",
    "connect": "Connecting to the target or proxy, or the proxy refusing the target.",
    "handshake": "The upstream proxy's protocol exchange.",
    "relay": "After the relay started: the upstream connection broke.",
    "internal": "An unexpected error inside the engine.",
    "hook": "The flow hook (`api.flow_hook`), asked before routing.",
    "route": "Routing: the flow's group has no member (`no_member`), or its outbound does "
    "not relay UDP (`udp_unsupported`).",
}

#: ``result.failure.code`` values.
FAILURE_CODES: dict[str, str] = {
    "dns_failed": "The name has no address, or every DNS server failed.",
    "connect_timeout": "`connect_timeout_ms` ran out (or a proxy reported a timeout).",
    "connection_refused": "The peer refused the connection (or a proxy reported so).",
    "network_unreachable": "No route to the network (or a proxy reported so).",
    "host_unreachable": "No route to the host (or a proxy reported so).",
    "connect_failed": "Any other connection error.",
    "auth_failed": "An upstream proxy refused the configured credentials.",
    "upstream_rejected": "An upstream proxy refused the target (another SOCKS5 reply, or "
    "an HTTP status other than 2xx to CONNECT).",
    "upstream_not_allowed": 'An upstream SOCKS5 proxy answered "not allowed by ruleset".',
    "protocol_error": "An upstream proxy answered something that is not its protocol.",
    "upstream_reset": "The upstream connection was reset while relaying.",
    "upstream_error": "The upstream connection failed while relaying.",
    "internal_error": "An unexpected error inside the engine.",
    "engine_crashed": "The engine was killed or crashed while the flow was open; it was "
    "completed at the next start (outcome `engine_crashed`).",
    "hook_denied": "The flow hook denied the flow (outcome `blocked`; its route stays `pending`).",
    "no_member": "The flow was routed to a group with no member: every member comes from proxy "
    "providers that have given it none yet (never fetched, offline, empty or filtered out). "
    "The flow fails rather than going anywhere else; SOCKS5 clients get reply 1, HTTP "
    "clients status 503.",
    "udp_unsupported": "The UDP flow's outbound does not relay UDP in this build.",
}

#: Codes of ``engine.warning`` this build emits.
ENGINE_WARNING_CODES: dict[str, str] = {
    "reload_failed": "`spliceway run` received SIGHUP and could not apply its configuration "
    "file (invalid, or a listener or sink failed and was rolled back): the running "
    "configuration is kept; the message says why.",
    "ipc_hook_unreachable": "The flow hook (`api.flow_hook`) could not be reached, did not "
    "answer within `timeout_ms`, or answered something unreadable: flows are allowed as if "
    "there were no hook (fail-open). Once per outage; the next comes only after the hook "
    "has answered in time again.",
    "fakeip_table_damaged": "The fake-ip table (`runtime.dns.answer.persist_path`) could not be "
    "read back whole at start or reload: unreadable or damaged (it is moved aside to "
    "`<path>.damaged` and the table starts empty), or some mappings lay outside the "
    "configured range (they are dropped).",
    "policy_no_healthy_member": "A `url_test` or `fallback` group has no healthy member left "
    "(every member's last probe or dial failed); the message names the group, each member's "
    "last error and the member its flows still use. Once per outage of the group: the next "
    "comes only after a member was healthy again (logged at info).",
    "fd_exhausted": "A listener (an inbound, the DNS server, the control API, IPC or gRPC) "
    "could not accept a connection because the process or the system is out of file "
    "descriptors (`EMFILE`/`ENFILE`): it pauses accepting and retries with a growing delay, "
    "while every connection already open is served. The message names the listener and the "
    "limits (`runtime` reports the soft and hard `RLIMIT_NOFILE`). Once per outage of each "
    "listener: the next comes only after it has accepted again.",
}

_COUNT = "integer"

#: The fields of a flow record (the ``record`` of flow events, ``GET /api/v1/flows``).
FLOW_RECORD_FIELDS: tuple[PayloadField, ...] = _rows(FlowRecord)

_FLOW_ID = _f("flow_id", "string", "The flow's identifier (also `record.flow_id`).")
_RECORD = _f("record", "FlowRecord", "The flow's record at this revision.")

#: The fields of flow.started and flow.routed (flow.completed adds some).
_LIFECYCLE: tuple[PayloadField, ...] = (
    _FLOW_ID,
    _f("network", "string", "`tcp`."),
    _f("inbound", "object", "`{tag, protocol}`, as in the record."),
    _f("auth", "object", "How the client authenticated."),
    _f(
        "auth.scheme",
        "string or null",
        "`userpass` (SOCKS5), `basic` (HTTP) or `null` when the inbound has no users.",
    ),
    _f(
        "auth.principal_key",
        "string or null",
        "The flow's principal: the authenticated user's key, or the one the flow hook gave.",
    ),
    _f("auth.attributes", "object", "Always empty in this build."),
    _f("target", "object", "`{host, port}` the client asked for."),
    _f("target.host", "string", "Host name or IP address."),
    _f("target.port", "integer", "Port."),
    _f("route", "object", "`{mode, target}`, as in the record."),
    _f("route.mode", "string", "`rule`, `global` or `direct`."),
    _f("route.target", "string or null", "The outbound or group routing named."),
    _f(
        "policy",
        "string or null",
        "The group routing named when the route went through one (first tag of "
        "`record.route.selection_chain`), else `null`.",
    ),
    _f("outbound", "object or null", "`{tag, protocol}` of the outbound used, once routed."),
    _f("traffic", "object", "Byte counts so far."),
    _f("traffic.bytes_up", _COUNT, "As `record.traffic.bytes_up`."),
    _f("traffic.bytes_down", _COUNT, "As `record.traffic.bytes_down`."),
    _f("traffic.packets_up", "null", "Always `null` for TCP."),
    _f("traffic.packets_down", "null", "Always `null` for TCP."),
    _f("timing", "object", "Start, end and duration."),
    _f("timing.started_at_unix_ms", UNIX_MS, "When the handshake completed."),
    _f("timing.ended_at_unix_ms", "integer or null", "When it ended; `null` until then."),
    _f("timing.duration_ms", "integer or null", "End minus start; `null` until then."),
    _f("outcome", "string or null", "The outcome once completed, else `null`."),
    _RECORD,
)

_AFTER_TRAFFIC = [f.name for f in _LIFECYCLE].index("traffic.packets_down") + 1

#: flow.completed: the same fields, plus the boundary counters and the close reason.
_COMPLETED: tuple[PayloadField, ...] = (
    *_LIFECYCLE[:_AFTER_TRAFFIC],
    _f("traffic.inbound_rx_bytes", _COUNT, "As in the record."),
    _f("traffic.inbound_tx_bytes", _COUNT, "As in the record."),
    _f("traffic.outbound_rx_bytes", _COUNT, "As in the record."),
    _f("traffic.outbound_tx_bytes", _COUNT, "As in the record."),
    *_LIFECYCLE[_AFTER_TRAFFIC:],
    _f(
        "close_reason",
        "string",
        "As `record.result.close_reason`, when there is one.",
        required=False,
    ),
)


_STATS: tuple[PayloadField, ...] = _rows(Stats)

#: The fields of both provider events that say which provider and why it was refreshed.
_PROVIDER: tuple[PayloadField, ...] = (
    _f("name", "string", "The provider's name (`geoip` or `geosite` for geodata)."),
    _f("kind", "string", "`proxies`, `rules` or `geodata`."),
    _f("source", "string", "`url` (fetched) or `path` (read from its file)."),
    _f(
        "url",
        "string or null",
        "`scheme://host[:port]` of the URL (the rest may hold a secret token); `null` for "
        "a `path` provider.",
    ),
    _f(
        "trigger",
        "string",
        "`startup` (fetched at start: no cached copy), `scheduled` (its interval) or "
        "`manual` (`providers.update`).",
    ),
)

_EVENTS: tuple[EventType, ...] = (
    EventType(
        "engine.started",
        "The engine started: every inbound is bound; the actors are starting. Always the "
        "first event of an engine start (sequence 1).",
        "Once per start.",
        True,
        (
            _f("build_id", "string", "`spliceway-<version>`."),
            _f("started_at_unix_ms", UNIX_MS, "When the engine started."),
        ),
    ),
    EventType(
        "engine.stopped",
        "The engine stopped: listeners are closed and every open flow has emitted its "
        "`flow.completed`.",
        "Once per stop; the last event. It is the last frame of every open SSE stream, "
        "whatever the stream's `types`.",
        True,
        (
            _f("stopped_at_unix_ms", UNIX_MS, "When the engine stopped."),
            _f(
                "reason",
                "string",
                "Why: `signal` when `spliceway run` received SIGINT or SIGTERM; absent when "
                "a host application stopped the engine without giving one.",
                required=False,
            ),
        ),
    ),
    EventType(
        "engine.warning",
        "The engine met something an operator should know but kept running.",
        "Rare; the codes this build uses are listed below.",
        True,
        (
            _f("code", "string", "Stable code of the warning."),
            _f("message", "string", "What happened, in words."),
        ),
    ),
    EventType(
        "config.changed",
        "A new configuration is running: `config.apply`, `config.apply_runtime` or a SIGHUP "
        "reload completed, with listeners, outbounds, groups, rules, DNS and sinks "
        "reconciled, or a provider's new content was applied the same way. A failed apply "
        "(rolled back) emits nothing.",
        "Once per successful apply.",
        True,
        (
            _f("changed_at_unix_ms", UNIX_MS, "When the reload completed."),
            _f(
                "trigger",
                "string",
                "What applied it: `config.apply`, `config.apply_runtime`, `sighup`, or "
                "`provider` (a proxy provider's outbounds, a rule set or a geodata file "
                "changed: the same document applied again with the new content, followed "
                "by `provider.updated`).",
            ),
            _f(
                "persistence",
                "string",
                "`source_file` (the running configuration is the file's) or `runtime_only` "
                "(the file differs; a restart goes back to it). A `provider` apply repeats "
                "the previous apply's value (the document did not change).",
            ),
            _f(
                "changed_components",
                "list of string",
                "The components whose configuration differed, of `proxy_listeners`, "
                "`outbounds`, `policy_groups`, `routing`, `dns`, `flow_hook`, "
                "`event_dispatcher`, `runtime` (empty when the document equals the running "
                "one).",
            ),
        ),
    ),
    EventType(
        "flow.started",
        "A client completed the inbound handshake (and authentication): the flow exists. "
        "A connection whose handshake fails emits nothing.",
        "Once per flow.",
        True,
        _LIFECYCLE,
    ),
    EventType(
        "flow.snapshot",
        "A subscriber's live phase begins: an SSE stream, or `engine.subscribe(..., "
        "snapshot=True)`, whose filter includes a flow type.",
        "Once per such subscription, first of its live phase. Never stored in the ring, "
        "never in `GET /api/v1/events`, never sent to sinks.",
        True,
        (
            _f(
                "watermark",
                "integer",
                "The latest sequence when the snapshot was taken (also the envelope's "
                "`sequence` and the SSE `id`): the records include everything up to it.",
            ),
            _f("records", "list of FlowRecord", "Every open flow."),
        ),
    ),
    EventType(
        "flow.routed",
        "The upstream connection is established and the relay took the flow over "
        "(`state` becomes `active`).",
        "Once per relayed flow; blocked and failed flows never get one.",
        True,
        _LIFECYCLE,
    ),
    EventType(
        "flow.updated",
        "A sample found that a relayed flow moved bytes.",
        "At most once per flow every `runtime.stats_interval_ms`, and only while bytes move.",
        True,
        (
            _FLOW_ID,
            _f("network", "string", "`tcp`."),
            _f("inbound_tag", "string", "The inbound's tag."),
            _f("outbound_tag", "string or null", "The outbound's tag."),
            _f("bytes_up", _COUNT, "As `record.traffic.bytes_up`."),
            _f("bytes_down", _COUNT, "As `record.traffic.bytes_down`."),
            _f("inbound_rx_bytes", _COUNT, "As in the record."),
            _f("inbound_tx_bytes", _COUNT, "As in the record."),
            _f("outbound_rx_bytes", _COUNT, "As in the record."),
            _f("outbound_tx_bytes", _COUNT, "As in the record."),
            _f("throughput_up_bps", _COUNT, "As `record.throughput.upload_bps`."),
            _f("throughput_down_bps", _COUNT, "As `record.throughput.download_bps`."),
            _f("snapshot_at_unix_ms", "integer or null", "When the sample was taken."),
            _RECORD,
        ),
    ),
    EventType(
        "flow.completed",
        "The flow ended, whatever ended it: relayed to the end, blocked, failed, closed by "
        "`flows.close`, idle timeout, engine stop; or the engine was killed while the flow "
        "was open, and its next start completes it (outcome `engine_crashed`, needs "
        "`api.outbox_path`; see Sinks).",
        "Exactly once per flow that emitted `flow.started` (across a crash, once per sink "
        "that was given the flow's start).",
        True,
        _COMPLETED,
    ),
    EventType(
        "policy.selected",
        "The `policies.select` command changed a selector group's member or pinned a "
        "member of a url_test or fallback group, or `policies.unfix` dropped a pin.",
        "Once per successful `policies.select`, and per `policies.unfix` that dropped a pin.",
        True,
        (
            _f("policy_tag", "string", "The group's tag."),
            _f("policy_kind", "string", "`selector`, `url_test` or `fallback`."),
            _f(
                "selected",
                "string",
                "The member the group gives new flows now (for a pin: the pinned member "
                "if it is healthy, else the group's own choice).",
            ),
            _f("previous", "string or null", "The member the group gave new flows before."),
            _f(
                "action",
                "string",
                "`select` (a selector's member), `fix` (a url_test or fallback group "
                "pinned, mihomo's `fixed`) or `unfix` (its pin dropped).",
            ),
            _f("fixed", "string or null", "The group's pin now; null for a selector."),
        ),
    ),
    EventType(
        "policy.probe.completed",
        "A probe round of a `url_test`, `fallback` or `load_balance` group finished.",
        "At start, every `interval_seconds`, on `policies.probe`, and when a flow fails to "
        "dial a member (at most one round per group at a time).",
        True,
        (
            _f("policy_tag", "string", "The group's tag."),
            _f(
                "trigger",
                "string",
                "What started the round: `startup`, `scheduled`, `manual` (`policies.probe`) "
                "or `dial_failure`.",
            ),
            _f("url", "string", "The URL probed."),
            _f("started_at_unix_ms", UNIX_MS, "When the round started."),
            _f("completed_at_unix_ms", UNIX_MS, "When it finished."),
            _f("duration_ms", "integer", "Finish minus start."),
            _f("selected", "string or null", "The member the group uses after the round."),
            _f("members", "list of object", "One item per member, in configuration order."),
            _f("members[].target_tag", "string", "The member's tag."),
            _f("members[].healthy", "boolean", "Whether the probe got an answer."),
            _f("members[].latency_ms", "number or null", "Time to the first byte, if healthy."),
            _f("members[].error", "string or null", "Why the probe failed, if it did."),
        ),
    ),
    EventType(
        "provider.updated",
        "A provider's new content is in use: a proxy provider's outbounds (its groups' "
        "members changed with a `config.changed` of trigger `provider` just before), a "
        "rule provider's rule set, or a geodata file (`runtime.geodata`). A refresh that "
        "finds the content unchanged emits nothing.",
        "When a refresh (scheduled every `interval_seconds`, at start for a provider "
        "without a cached copy, or `providers.update`) brings new content.",
        True,
        (
            *_PROVIDER,
            _f("updated_at_unix_ms", UNIX_MS, "When the new content was fetched or read."),
            _f("sha256", "string", "SHA-256 of the body, hex."),
            _f(
                "outbounds",
                _COUNT,
                "Proxies of the body carried as outbounds (before the provider's filters); "
                "`kind` `proxies` only.",
                required=False,
            ),
            _f(
                "rules",
                _COUNT,
                "Entries of the rule set; `kind` `rules` only.",
                required=False,
            ),
            _f(
                "skipped",
                _COUNT,
                "Proxies (or rule-set entries) of the body that spliceway cannot carry, "
                "skipped; the `providers` query lists them with the reasons. `kind` "
                "`proxies` and `rules` only.",
                required=False,
            ),
        ),
    ),
    EventType(
        "provider.failed",
        "A provider's refresh failed: the origin could not be reached or answered an "
        "error, stalled, sent a body over `size_limit_bytes`, or a body that is not the "
        "provider's content (garbage, an HTML page, a document without proxies, two "
        "proxies of one name...). The last good copy stays in use.",
        "Per failed refresh.",
        True,
        (
            *_PROVIDER,
            _f("error", "string", "What failed, in words."),
            _f(
                "kept_copy_at_unix_ms",
                "integer or null",
                "When the copy still in use was fetched or read; `null` when the provider "
                "has none (its groups have no member from it).",
            ),
        ),
    ),
    EventType(
        "stats.sampled",
        "The sampler ran.",
        "Every `runtime.stats_interval_ms`.",
        True,
        _STATS,
    ),
    EventType(
        "ipc.connected",
        "A client connected to the local control socket (docs/ipc.md).",
        "Once per IPC connection.",
        True,
        (
            _f("active", "integer", "Open IPC connections, this one included."),
            _f("pipe", "string", "The client's socket address (empty for an unnamed socket)."),
        ),
    ),
    EventType(
        "ipc.disconnected",
        "An IPC client's connection ended (not emitted while the engine stops, so "
        "`engine.stopped` stays the last event).",
        "Once per IPC connection.",
        True,
        (
            _f("active", "integer", "Open IPC connections after this one closed."),
            _f("pipe", "string", "The client's socket address (empty for an unnamed socket)."),
            _f(
                "error",
                "string",
                "Why it ended abnormally (a failed read or write, a subscription that fell "
                "too far behind); absent on a normal close.",
                required=False,
            ),
        ),
    ),
)

#: Every event type by name, in documentation order.
EVENT_CATALOGUE: dict[str, EventType] = {e.name: e for e in _EVENTS}
