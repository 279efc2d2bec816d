"""The one command table: every command's permission, parameters and handler.

HTTP (``POST /api/v1/commands``), IPC, gRPC and ``Engine.execute`` all call
``execute``; semantics cannot drift between transports. Parameters are
validated by pydantic models (unknown keys rejected) and errors carry a
``field_path`` such as ``params.flow_id``. A command whose subsystem is not
built yet stays in the table with ``missing`` set: it answers ``unsupported``
naming what is missing, and capabilities list it as such.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import pykka
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spliceway import config as config_module
from spliceway import dns
from spliceway.control import diagnostics
from spliceway.control.messages import (
    CloseFlow,
    ProbeNow,
    SelectMember,
    UnfixMember,
    UpdateProviders,
)
from spliceway.errors import ApiError, invalid_argument, not_found
from spliceway.routing import hostnorm, policy
from spliceway.routing import rules as routing

if TYPE_CHECKING:
    from spliceway.engine.core import EngineCore

PERMISSIONS = ("read", "control", "config", "admin")

logger = logging.getLogger(__name__)

#: The transport the running command arrived over (``http``, ``ipc``, ``grpc``,
#: ``embedded``), set by ``execute`` for the handler's duration. Only the log line of an
#: applied configuration reads it, so the handlers' signatures stay transport-free.
_TRANSPORT: ContextVar[str | None] = ContextVar("spliceway_command_transport", default=None)


def grants(permissions: Iterable[str], needed: str) -> bool:
    """Whether ``permissions`` allow what ``needed`` guards (admin allows everything)."""
    held = set(permissions)
    return needed in held or "admin" in held


_ASK_TIMEOUT = 10.0


class _Params(BaseModel):
    # strict: JSON ``true`` is not port 1 and ``"80"`` is not 80; a controller's
    # type mistake is reported, not coerced.
    # Field docstrings are the parameters' descriptions (OpenAPI, docs/commands.md).
    model_config = ConfigDict(
        extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True
    )


class NoParams(_Params):
    """Commands that take ``{}``."""


class FlowsCloseParams(_Params):
    """``flows.close``."""

    flow_id: str
    """Identifier of an open flow (its record's `flow_id`, e.g. from `GET /api/v1/flows`)."""


class ModeSetParams(_Params):
    """``mode.set``."""

    mode: Literal["rule", "global", "direct"]
    """Routing mode for flows that start from now on; open flows keep their route."""
    outbound: str | None = None
    """Outbound or group tag every flow takes in mode `global` (required then); must be
    absent or null for the other modes."""


class ConfigParams(_Params):
    """``config.validate`` / ``config.apply`` / ``config.apply_runtime``."""

    config: dict[str, Any]
    """A whole configuration document, as a configuration file holds it."""


class TraceRouteParams(_Params):
    """``diagnostics.trace_route``."""

    target: str = Field(min_length=1)
    """Host name or IP address, as a client would ask for it."""
    port: int = Field(ge=0, le=65535)
    """Target port."""
    protocol: Literal["tcp", "udp"] = "tcp"
    """Network the `network` rule condition sees."""
    inbound_tag: str | None = None
    """Route as if the flow arrived on this inbound; null: on none, so rules naming an
    inbound do not match."""


class ProvidersUpdateParams(_Params):
    """``providers.update``."""

    name: str | None = Field(default=None, min_length=1)
    """A provider's name (under `providers.proxies` or `providers.rules`; `geoip` or
    `geosite` for the files of `runtime.geodata`); null: every provider, and the geodata
    files that have a URL."""
    kind: Literal["proxies", "rules", "geodata"] | None = None
    """Only the provider of this kind (a proxy and a rule provider may share a name);
    null: any kind."""


class PolicySelectParams(_Params):
    """``policies.select``."""

    policy_tag: str
    """Tag of a `selector` group."""
    target_tag: str
    """The member to select: one of the group's `outbounds`."""


class PolicyTagParams(_Params):
    """``policies.probe``."""

    policy_tag: str
    """Tag of a `url_test` group."""


class PolicyUnfixParams(_Params):
    """``policies.unfix``."""

    policy_tag: str
    """Tag of a `url_test` or `fallback` group."""


class TargetTagParams(_Params):
    """``diagnostics.probe_target``."""

    target_tag: str
    """Tag of an outbound (groups and relays have no fixed server; the result says so)."""


class ProbeOutboundParams(_Params):
    """``diagnostics.probe_outbound``."""

    target_tag: str
    """Tag of an outbound or group (a group is probed through its current choice)."""
    url: str | None = None
    """`http://` or `https://` URL to probe; `runtime.latency_test_url` wins when it is
    configured (a url given then is still checked). The result's `url` is the URL probed."""
    timeout_ms: int = Field(default=5000, ge=1, le=32767)
    """Budget of the whole probe (dial, TLS, request, status line), in milliseconds."""
    expected_status: str | None = None
    """Statuses that count as success, in mihomo's syntax: `200`, `200/204`, `200-299`,
    ranges separated by `/` or `,`; `*`, empty or null: any status."""


class HostnameParams(_Params):
    """``diagnostics.dns_lookup``."""

    hostname: str = Field(min_length=1)
    """Name to resolve through `runtime.dns` (cached answers are used, new ones cached)."""


class DnsQueryParams(_Params):
    """``diagnostics.dns_query``."""

    name: str = Field(min_length=1)
    """Name to query (a trailing dot does not matter)."""
    type: str = "A"
    """Record type, any dnspython rdtype name (`A`, `AAAA`, `MX`, `TXT`, `HTTPS`, ...)."""


class LogLevelParams(_Params):
    """``log.set_level``."""

    level: Literal["trace", "debug", "info", "warn", "error"]
    """The lowest level logged and kept in the log ring from now on."""


class DnsCacheParams(_Params):
    """``diagnostics.dns_cache``."""

    domain: str | None = None
    """One name to look up in the cache (case-insensitive); null lists the cache."""
    limit: int = Field(default=256, ge=1)
    """Most entries listed, the most recently used first (without `domain`)."""


class FakeIpParams(_Params):
    """``diagnostics.fakeip_lookup`` / ``fakeip.clear``."""

    domain: str | None = None
    """A domain name: look up its fake address (or clear its mapping). Case and a
    trailing dot do not matter."""
    ip: str | None = None
    """A fake address: look up its domain (or clear its mapping)."""


#: The document's statement of the handler's rule that a lookup names exactly one of
#: ``domain`` and ``ip`` (a null counts as absent): without it ``{}`` was valid by the
#: OpenAPI document and answered 400.
_EXACTLY_ONE_OF_DOMAIN_IP: dict[str, Any] = {
    "oneOf": [
        {"required": ["domain"], "properties": {"domain": {"type": "string", "minLength": 1}}},
        {"required": ["ip"], "properties": {"ip": {"type": "string"}}},
    ]
}


class FakeIpLookupParams(FakeIpParams):
    """``diagnostics.fakeip_lookup``: exactly one of ``domain`` and ``ip``."""

    model_config = ConfigDict(json_schema_extra=_EXACTLY_ONE_OF_DOMAIN_IP)


class TunStartParams(_Params):
    """``tun.start``: the settings of ``runtime.tun``."""

    addr: str
    """Address of the TUN device, an IP or IP/prefix."""
    tag: str
    """Inbound tag of flows arriving through the device."""
    name: str | None = None
    """Device name; null lets the system choose."""
    mask: str = "255.255.255.0"
    """IPv4 netmask of `addr`."""
    mtu: int | None = None
    """Device MTU in bytes; null uses `runtime.network.mtu`."""
    secondary_addr: str | None = None
    """A second device address; null for none."""
    include_cidrs: list[str] = []
    """Networks routed into the device; empty routes everything."""
    exclude_cidrs: list[str] = []
    """Networks kept out of the device."""
    auto_route: bool = True
    """Install the routes to the device."""
    dual_stack: bool = True
    """Capture IPv6 as well as IPv4."""
    strict_route: bool = True
    """Keep traffic from leaking around the device."""
    dns_hijack: bool = True
    """Answer DNS queries sent through the device."""


Handler = Callable[["EngineCore", Any], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Command:
    """One entry of the command table."""

    method: str
    permission: str
    params: type[_Params]
    handler: Handler | None = None
    #: Why the command is not available in this build (None when it is).
    missing: str | None = None
    #: What the command does, in one line (docs/commands.md).
    summary: str = ""
    #: ``(code, when)`` for each error the command itself can answer. Every command can
    #: also answer ``invalid_argument`` for bad params and ``permission_denied``; one with
    #: ``missing`` set answers ``unsupported`` once its params are valid.
    errors: tuple[tuple[str, str], ...] = ()
    #: Example params for the documentation.
    example: dict[str, Any] = field(default_factory=dict, compare=False)


def _flows_close(core: EngineCore, p: FlowsCloseParams) -> dict[str, Any]:
    entry = core.flows.get(p.flow_id)
    if entry is None:
        raise not_found(f"flow {p.flow_id!r} is not active")
    try:
        closed = entry.actor.ask(CloseFlow(p.flow_id), timeout=_ASK_TIMEOUT)
    except pykka.ActorDeadError:
        closed = False
    if not closed:
        raise not_found(f"flow {p.flow_id!r} already ended")
    return {"flow_id": p.flow_id, "closed": True}


def _mode_set(core: EngineCore, p: ModeSetParams) -> dict[str, Any]:
    outbound = p.outbound
    if p.mode == "global":
        if not outbound:
            raise invalid_argument("mode global needs an outbound", "params.outbound")
        g = core.generation
        if outbound not in g.outbounds and outbound not in g.policies:
            raise invalid_argument(f"unknown outbound {outbound!r}", "params.outbound")
    elif outbound is not None:
        raise invalid_argument(
            f"outbound applies only to mode global, not {p.mode}", "params.outbound"
        )
    assert core.supervisor is not None
    core.supervisor.proxy().set_mode(p.mode, outbound).get(timeout=_ASK_TIMEOUT)
    return {"accepted": True}


def _config_validate(core: EngineCore, p: ConfigParams) -> dict[str, Any]:
    config_module.parse_config(p.config)
    return {"valid": True}


def _config_apply(core: EngineCore, p: ConfigParams) -> dict[str, Any]:
    result = core.reconciler.apply(p.config, persist=True, trigger="config.apply")
    return _logged(result)


def _config_apply_runtime(core: EngineCore, p: ConfigParams) -> dict[str, Any]:
    result = core.reconciler.apply(p.config, persist=False, trigger="config.apply_runtime")
    return _logged(result, "config.apply_runtime")


def _logged(result: dict[str, Any], method: str = "config.apply") -> dict[str, Any]:
    """One INFO line per configuration a command applied (a refused one raised before
    this): an operator reading the log sees when, how and what changed without the event
    stream. SIGHUP reloads are logged by ``spliceway run`` itself (spliceway/cli/main.py)."""
    changed = ",".join(result["changed_components"]) or "-"
    logger.info(
        "configuration applied: method=%s transport=%s persistence=%s changed=%s",
        method,
        _TRANSPORT.get() or "-",
        result["persistence"],
        changed,
    )
    return result


def _trace_route(core: EngineCore, p: TraceRouteParams) -> dict[str, Any]:
    # The rules and the resolver of one generation, as a flow decides.
    g = core.generation
    state = g.route_state
    # As a flow's target is: every spelling of an address is that address.
    host = hostnorm.canonical_host(p.target)
    # A fake-ip address is routed by its domain, as a flow to it would be.
    pool = core.dns.pool
    host = (pool.peek_domain(host) if pool is not None else None) or host
    facts = routing.FlowFacts(
        network=p.protocol,
        host=host,
        port=p.port,
        sniffed_host=None,
        resolved_ip=None,
        source_ip=None,
        source_port=None,
        inbound_tag=p.inbound_tag,
        principal_key=None,
        process_name=None,
    )
    decision = state.decide(facts)
    resolved_ip = None
    if routing.needs_address(state.ruleset, state.mode, facts, decision):
        # What a flow does (actors/flow.py): an ip_cidr rule ranked before the match meets
        # the name's first address; a name that does not resolve meets the rules without.
        try:
            found = g.resolver.lookup(host, routing.RULE_RESOLVE_TIMEOUT)
        except dns.ResolveError:  # InvalidHostname included
            found = []
        if found:
            resolved_ip = found[0]
            decision = state.decide(dataclasses.replace(facts, resolved_ip=resolved_ip))
    return {
        "target": p.target,
        "resolved_ip": resolved_ip,
        "port": p.port,
        "protocol": p.protocol,
        "inbound_tag": p.inbound_tag,
        "effective_mode": state.mode,
        "route_action": {"route": decision.target}
        if decision.action == "route"
        else {"block": True},
        "matched_rule": decision.matched_rule.to_dict() if decision.matched_rule else None,
    }


def _probe_target(core: EngineCore, p: TargetTagParams) -> dict[str, Any]:
    return diagnostics.probe_target(core, p.target_tag)


def _probe_outbound(core: EngineCore, p: ProbeOutboundParams) -> dict[str, Any]:
    return diagnostics.probe_outbound(
        core, p.target_tag, p.url, timeout_ms=p.timeout_ms, expected_status=p.expected_status
    )


def _group_actor(core: EngineCore, tag: str, kinds: Iterable[str]) -> pykka.ActorRef[Any]:
    """The actor of policy ``tag`` if it is one of ``kinds``, else not_found."""
    view = core.policies.get(tag)
    actor = core.group_actors.get(tag)
    if view is None or actor is None or view.kind not in kinds:
        raise not_found(f"no {' or '.join(sorted(kinds))} policy {tag!r}")
    return actor


def _policies_select(core: EngineCore, p: PolicySelectParams) -> dict[str, Any]:
    actor = _group_actor(core, p.policy_tag, policy.POLICY_KINDS)
    try:
        result: dict[str, Any] = cast(
            "dict[str, Any]", actor.ask(SelectMember(p.target_tag), timeout=_ASK_TIMEOUT)
        )
    except pykka.ActorDeadError as ex:
        raise ApiError("conflict", "the engine is stopping") from ex
    return result


def _policies_unfix(core: EngineCore, p: PolicyUnfixParams) -> dict[str, Any]:
    actor = _group_actor(core, p.policy_tag, policy.POLICY_KINDS)
    try:
        result: dict[str, Any] = cast(
            "dict[str, Any]", actor.ask(UnfixMember(), timeout=_ASK_TIMEOUT)
        )
    except pykka.ActorDeadError as ex:
        raise ApiError("conflict", "the engine is stopping") from ex
    return result


def _policies_probe(core: EngineCore, p: PolicyTagParams) -> dict[str, Any]:
    actor = _group_actor(core, p.policy_tag, ("url_test",))
    try:
        started = actor.ask(ProbeNow("manual"), timeout=_ASK_TIMEOUT)
    except pykka.ActorDeadError as ex:
        raise ApiError("conflict", "the engine is stopping") from ex
    return {"policy_tag": p.policy_tag, "probe_triggered": bool(started)}


def _dns_lookup(core: EngineCore, p: HostnameParams) -> dict[str, Any]:
    return dns.dns_lookup_result(core.resolver, p.hostname)


def _dns_query(core: EngineCore, p: DnsQueryParams) -> dict[str, Any]:
    return dns.dns_query_result(core.resolver, p.name, p.type)


#: How long ``providers.update`` waits for its round (downloads run at once, each within
#: its own deadline; then the checks and one reload).
_PROVIDERS_TIMEOUT = 150.0


def _providers_update(core: EngineCore, p: ProvidersUpdateParams) -> dict[str, Any]:
    kinds = (p.kind,) if p.kind is not None else ("proxies", "rules", "geodata")
    known = [s for s in core.providers.states() if s.kind in kinds]
    if p.name is not None and not any(s.name == p.name for s in known):
        what = f"{p.kind} provider" if p.kind else "provider"
        raise not_found(f"no {what} is named {p.name!r}")
    refresher = core.provider_refresher
    if refresher is None:
        raise ApiError("conflict", "the engine is not running (it is stopping)")
    try:
        results = refresher.ask(UpdateProviders(p.name, kinds), timeout=_PROVIDERS_TIMEOUT)
    except pykka.ActorDeadError as ex:
        raise ApiError("conflict", "the engine is stopping") from ex
    except pykka.Timeout as ex:
        raise ApiError(
            "internal",
            f"the refresh did not end within {_PROVIDERS_TIMEOUT:g} s; it goes on, and "
            "its events say how it ends",
        ) from ex
    return {"results": results}


def _dns_cache_flush(core: EngineCore, p: NoParams) -> dict[str, Any]:
    flushed = core.resolver.cache_flush()
    # C's connection path keeps copies of the resolver's answers (EngineCore.dns_answer):
    # a flush that left them would keep dialing the old addresses.
    core.bridge.conn.dns_flush()
    return {"flushed": flushed}


def _log_set_level(core: EngineCore, p: LogLevelParams) -> dict[str, Any]:
    previous = core.logs.log_level
    core.logs.set_log_level(p.level)
    logger.info("log level set to %s (was %s)", p.level, previous)
    return {"level": p.level, "previous": previous}


def _dns_cache(core: EngineCore, p: DnsCacheParams) -> dict[str, Any]:
    return dns.dns_cache_result(core.resolver, p.domain, p.limit)


def _fakeip_lookup(core: EngineCore, p: FakeIpLookupParams) -> dict[str, Any]:
    return dns.fakeip_lookup_result(core.dns.pool, p.domain, p.ip)


def _fakeip_clear(core: EngineCore, p: FakeIpParams) -> dict[str, Any]:
    return dns.fakeip_clear_result(core.dns.pool, p.domain, p.ip)


def _tun_service(core: EngineCore) -> Any:
    tun = core.tun
    if tun is None or not core.running:
        raise ApiError("conflict", "the engine is not running")
    if core.config.runtime.tun is not None:
        raise ApiError(
            "conflict",
            "the TUN is managed by configuration (runtime.tun): change it with config.apply",
        )
    return tun


def _tun_start(core: EngineCore, p: TunStartParams) -> dict[str, Any]:
    tun = _tun_service(core)
    # Only what the caller set: the service fills defaults (mtu from runtime.network).
    tun.start(p.model_dump(exclude_unset=True), managed_by_config=False, field_prefix="params.")
    return {"accepted": True}


def _tun_stop(core: EngineCore, p: NoParams) -> dict[str, Any]:
    return {"accepted": bool(_tun_service(core).stop())}


_TUN_ERRORS = (
    (
        "conflict",
        "A TUN is already running (`tun.start`), the TUN is managed by configuration "
        "(`runtime.tun`), or the engine is stopping.",
    ),
    (
        "insufficient_os_privilege",
        "The engine lacks CAP_NET_ADMIN (creating a TUN device and its routes needs it).",
    ),
    ("unsupported", "This system has no TUN driver (`/dev/net/tun`)."),
    (
        "internal",
        "The kernel refused the device, a route or a rule (the message says which); "
        "nothing is left behind.",
    ),
)
_APPLY_ERRORS = (
    (
        "invalid_argument",
        "The document is invalid (`cause`, `details[]` with field paths inside it), or an "
        "environment variable it names is unset. Nothing changed.",
    ),
    (
        "conflict",
        "It changes `api.control`, `api.ipc`, `api.grpc` or an open outbox's `api.outbox_path`: "
        "a control plane cannot replace itself; restart instead. Nothing changed.",
    ),
    (
        "unsupported",
        "This build has no `config.apply` (`capabilities` says why). Nothing changed. A part "
        "the machine cannot provide (`runtime.tun` without `/dev/net/tun` or "
        "`CAP_NET_ADMIN`) fails as `internal`, rolled back.",
    ),
    (
        "internal",
        "A listener could not bind or start, a sink could not open its outbox, or the file "
        "could not be written: the previous configuration runs again and the source file "
        "is unchanged (it is replaced only once the new configuration runs); the message "
        "says so, or that an install not confirmed within 30 s may still have happened.",
    ),
)

COMMANDS: dict[str, Command] = {
    c.method: c
    for c in (
        Command(
            "flows.close",
            "control",
            FlowsCloseParams,
            _flows_close,
            summary="Close one open flow: it completes with outcome `cancelled`, close reason "
            "`manual`.",
            errors=(
                (
                    "not_found",
                    "No open flow has this `flow_id`, or it ended before it could be closed.",
                ),
            ),
            example={"flow_id": "3f2a9c1e-0-17"},
        ),
        Command(
            "mode.set",
            "admin",
            ModeSetParams,
            _mode_set,
            summary="Switch the routing mode for new flows (open flows keep their route; the "
            "file is not changed, a restart goes back to it).",
            errors=(
                (
                    "invalid_argument",
                    "`params.outbound`: missing for mode `global`, naming no outbound or "
                    "group, or given for another mode.",
                ),
            ),
            example={"mode": "global", "outbound": "direct"},
        ),
        Command(
            "config.validate",
            "config",
            ConfigParams,
            _config_validate,
            summary="Check a configuration document without applying it (environment "
            "variables are not checked).",
            errors=(
                (
                    "invalid_argument",
                    "The document is invalid: `cause` sums up, `details[]` lists every "
                    "problem with its `field_path` inside the document (e.g. "
                    "`inbounds[0].listen.port`).",
                ),
            ),
            example={"config": {"route": {"final": "direct"}}},
        ),
        Command(
            "diagnostics.trace_route",
            "admin",
            TraceRouteParams,
            _trace_route,
            summary="Show how a flow to `target:port` would be routed now, without opening "
            "one (rules on the source, principal, process or sniffed host do not match; a "
            "mapped fake-ip address is routed by its domain; any spelling of an address is "
            "that address; a name an `ip_cidr` rule ranked before the match needs is resolved "
            "as a flow's would be, and `resolved_ip` is the address the rules met, else null).",
            example={"target": "example.com", "port": 443},
        ),
        Command(
            "policies.select",
            "control",
            PolicySelectParams,
            _policies_select,
            summary="Choose the member a `selector` group gives new flows, or pin a member of "
            "a `url_test` or `fallback` group (mihomo's `fixed`: flows take it while it is "
            "healthy); emits `policy.selected`. Lasts until the engine stops.",
            errors=(
                (
                    "not_found",
                    "No selector, url_test, fallback or load_balance group has this `policy_tag`.",
                ),
                (
                    "invalid_argument",
                    "`params.policy_tag`: the group is a `load_balance` group.",
                ),
                ("invalid_argument", "`params.target_tag`: not a member of the group."),
            ),
            example={"policy_tag": "proxy", "target_tag": "auto"},
        ),
        Command(
            "policies.unfix",
            "control",
            PolicyUnfixParams,
            _policies_unfix,
            summary="Drop the pin of a `url_test` or `fallback` group (`fixed` becomes null): "
            "it chooses by its own rule again; emits `policy.selected` (`action: unfix`) "
            "when a pin was dropped.",
            errors=(
                (
                    "not_found",
                    "No selector, url_test, fallback or load_balance group has this `policy_tag`.",
                ),
                (
                    "invalid_argument",
                    "`params.policy_tag`: the group is not a `url_test` or `fallback` group.",
                ),
            ),
            example={"policy_tag": "auto"},
        ),
        Command(
            "policies.probe",
            "control",
            PolicyTagParams,
            _policies_probe,
            summary="Start a probe round of a `url_test` group now (`probe_triggered` is "
            "false when one is already running); it ends with `policy.probe.completed`.",
            errors=(("not_found", "No `url_test` group has this `policy_tag`."),),
            example={"policy_tag": "auto"},
        ),
        Command(
            "config.apply",
            "config",
            ConfigParams,
            _config_apply,
            summary="Replace the whole running configuration, save it to the source file "
            "(atomically) and return once listeners, outbounds, groups, rules, DNS and sinks "
            "are reconciled; emits `config.changed`. Open flows keep their path.",
            errors=_APPLY_ERRORS,
            example={"config": {"route": {"final": "direct"}}},
        ),
        Command(
            "config.apply_runtime",
            "config",
            ConfigParams,
            _config_apply_runtime,
            summary="As `config.apply`, without writing the source file (a restart goes "
            "back to it); emits `config.changed`.",
            errors=_APPLY_ERRORS,
            example={"config": {"route": {"final": "direct"}}},
        ),
        Command(
            "tun.start",
            "admin",
            TunStartParams,
            _tun_start,
            summary="Create a TUN device and capture this host's traffic into it (routes "
            "and rules per `auto_route`, `strict_route`, `dns_hijack`); every captured TCP "
            "and UDP connection becomes a flow of inbound `tag` (protocol `tun`). Check "
            "`tun_status` afterwards.",
            errors=_TUN_ERRORS,
            example={"addr": "172.19.0.1/30", "tag": "tun-in"},
        ),
        Command(
            "tun.stop",
            "admin",
            NoParams,
            _tun_stop,
            summary="Remove the TUN device and every route, rule and address it added; "
            "`accepted: false` when no TUN was running.",
            errors=(
                ("conflict", "The TUN is managed by configuration (`runtime.tun`)."),
                (
                    "internal",
                    "Some route or rule could not be removed (named; the next start removes it).",
                ),
            ),
        ),
        Command(
            "diagnostics.probe_target",
            "admin",
            TargetTagParams,
            _probe_target,
            summary="Try one TCP connection from the engine host to an outbound's "
            "`server:port` (no proxy protocol, 2 s); unreachable is a result, not an error.",
            errors=(("not_found", "No outbound or group has this `target_tag`."),),
            example={"target_tag": "hop-a"},
        ),
        Command(
            "diagnostics.probe_outbound",
            "admin",
            ProbeOutboundParams,
            _probe_outbound,
            summary="Time one `HEAD` request through an outbound or group (dial start to the "
            "first byte of the answer, within `timeout_ms`) and read its status; a failed "
            "probe, or a status outside `expected_status`, is a result with `error`, not an "
            "error. The result is recorded as the target's latest health.",
            errors=(
                ("not_found", "No outbound or group has this `target_tag`."),
                (
                    "invalid_argument",
                    "`params.url`: not an `http://` or `https://` URL with a host; "
                    "`params.expected_status`: not a status range list.",
                ),
            ),
            example={"target_tag": "proxy", "timeout_ms": 5000, "expected_status": "204"},
        ),
        Command(
            "diagnostics.dns_lookup",
            "admin",
            HostnameParams,
            _dns_lookup,
            summary="Resolve a name with the engine's resolver; a name that does not resolve "
            "is a result with `error`.",
            errors=(("invalid_argument", "`params.hostname`: not a valid host name."),),
            example={"hostname": "example.com"},
        ),
        Command(
            "diagnostics.dns_query",
            "admin",
            DnsQueryParams,
            _dns_query,
            summary="Ask the engine's DNS servers (`runtime.dns.servers`, in order, without the "
            "cache) for one record type of a name and return the answer message's sections; "
            "when every server failed the result has `error` (rcode 2, SERVFAIL).",
            errors=(
                ("invalid_argument", "`params.name`: not a valid name; `params.type`: unknown."),
            ),
            example={"name": "example.com", "type": "AAAA"},
        ),
        Command(
            "dns.cache_flush",
            "control",
            NoParams,
            _dns_cache_flush,
            summary="Empty the resolver's answer cache (and the C connection path's copy); "
            "`flushed` is the number of entries removed. Fake-ip mappings stay "
            "(`fakeip.clear`).",
        ),
        Command(
            "providers.update",
            "config",
            ProvidersUpdateParams,
            _providers_update,
            summary="Refresh providers now and wait for the result: fetch each URL provider "
            "(through its `via`), re-read each `path` provider, and with no `name` also "
            "download the `runtime.geodata` files that have a URL. Good new content is "
            "cached and applied as a live reload (`config.changed` with trigger `provider`, "
            "then `provider.updated`); a failure keeps the last good copy (`provider.failed`). "
            "One result per provider: `outcome` `updated`, `unchanged` or `failed`.",
            errors=(
                ("not_found", "No provider (of `params.kind`) is named `params.name`."),
                (
                    "internal",
                    "The refresh did not end within 150 s (it goes on; its events tell).",
                ),
            ),
            example={"name": "subscription"},
        ),
        Command(
            "log.set_level",
            "config",
            LogLevelParams,
            _log_set_level,
            summary="Set the lowest level the `spliceway` loggers log and the log ring keeps, "
            "from now until the engine stops or a configuration changes "
            "`runtime.log_level`; the `runtime` query shows it as `log_level`.",
            example={"level": "debug"},
        ),
        Command(
            "diagnostics.dns_cache",
            "admin",
            DnsCacheParams,
            _dns_cache,
            summary="List the resolver's cache, or show one name's entry.",
            errors=(("invalid_argument", "`params.domain`: an empty string."),),
            example={"domain": "example.com"},
        ),
        Command(
            "diagnostics.fakeip_lookup",
            "read",
            FakeIpLookupParams,
            _fakeip_lookup,
            summary="Find the fake address of a name, or the name of a fake address "
            "(`runtime.dns.answer.type: fake_ip`); never allocates one. `enabled: false` "
            "when fake-ip answers are not configured; null when there is no mapping.",
            errors=(
                (
                    "invalid_argument",
                    "Neither or both of `params.domain` and `params.ip`, or `params.ip` is "
                    "not an IP address.",
                ),
            ),
            example={"domain": "example.com"},
        ),
        Command(
            "fakeip.clear",
            "admin",
            FakeIpParams,
            _fakeip_clear,
            summary="Forget fake-ip mappings: the one of `domain`, of `ip`, or every one with "
            "`{}`; `persist_path` is rewritten before the answer. Clients holding an old "
            "address must resolve again (this is not a DNS cache flush).",
            errors=(
                (
                    "invalid_argument",
                    "Both `params.domain` and `params.ip`, or `params.ip` is not an IP address.",
                ),
                (
                    "internal",
                    "The mappings were removed but `persist_path` could not be written.",
                ),
            ),
            example={"domain": "example.com"},
        ),
    )
}


def _validation_error(ex: ValidationError) -> ApiError:
    first = ex.errors()[0]
    path = ".".join(str(part) for part in ("params", *first["loc"]))
    return invalid_argument(f"{path}: {first['msg']}", path)


def execute(
    core: EngineCore,
    method: object,
    params: object,
    permissions: Iterable[str] = PERMISSIONS,
    *,
    transport: str | None = None,
) -> dict[str, Any]:
    """Validate and run one command; raises ApiError on every failure. ``transport``
    (``http``, ``ipc``, ``grpc``, ``embedded``) names where it came from in the log."""
    if not isinstance(method, str) or method not in COMMANDS:
        raise invalid_argument(f"unknown command method {method!r}", "method")
    command = COMMANDS[method]
    if not isinstance(params, dict):
        raise invalid_argument("params must be an object", "params")
    if not grants(permissions, command.permission):
        raise ApiError("permission_denied", f"{method} needs the {command.permission} permission")
    try:
        parsed = command.params.model_validate(params)
    except ValidationError as ex:
        raise _validation_error(ex) from ex
    if command.handler is None:
        raise ApiError("unsupported", f"{method} needs {command.missing}")
    if not core.running:
        # A control connection opened before the stop may still send commands.
        raise ApiError("conflict", "the engine is not running (it is stopping)")
    token = _TRANSPORT.set(transport)
    try:
        return command.handler(core, parsed)
    finally:
        _TRANSPORT.reset(token)
