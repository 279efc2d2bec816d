"""The one command table: every command's permission, parameters and handler.

HTTP (``POST /api/v1/commands``), IPC, gRPC and ``Engine.execute`` all call
``execute``; semantics cannot drift between transports. Parameters are
validated by pydantic models (unknown keys rejected) and errors carry a
``field_path`` such as ``params.flow_id``. A command whose subsystem is not
built yet stays in the table with ``missing`` set: it answers ``unsupported``
naming what is missing, and capabilities list it as such.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pykka
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spliceway import config as config_module
from spliceway import diagnostics, dns, policy, routing
from spliceway.actors.messages import CloseFlow
from spliceway.actors.policy import ProbeNow, SelectMember
from spliceway.errors import ApiError, invalid_argument, not_found

if TYPE_CHECKING:
    from spliceway.engine_core import EngineCore

PERMISSIONS = ("read", "control", "config", "admin")


def grants(permissions: Iterable[str], needed: str) -> bool:
    """Whether ``permissions`` allow what ``needed`` guards (admin allows everything)."""
    held = set(permissions)
    return needed in held or "admin" in held


_ASK_TIMEOUT = 10.0


class _Params(BaseModel):
    # strict: JSON ``true`` is not port 1 and ``"80"`` is not 80; a controller's
    # type mistake is reported, not coerced.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class NoParams(_Params):
    """Commands that take ``{}``."""


class FlowsCloseParams(_Params):
    """``flows.close``."""

    flow_id: str


class ModeSetParams(_Params):
    """``mode.set``."""

    mode: Literal["rule", "global", "direct"]
    outbound: str | None = None


class ConfigParams(_Params):
    """``config.validate`` / ``config.apply`` / ``config.apply_runtime``."""

    config: dict[str, Any]


class TraceRouteParams(_Params):
    """``diagnostics.trace_route``."""

    target: str = Field(min_length=1)
    port: int = Field(ge=0, le=65535)
    protocol: Literal["tcp", "udp"] = "tcp"
    inbound_tag: str | None = None


class PolicySelectParams(_Params):
    """``policies.select``."""

    policy_tag: str
    target_tag: str


class PolicyTagParams(_Params):
    """``policies.probe``."""

    policy_tag: str


class TargetTagParams(_Params):
    """``diagnostics.probe_target``."""

    target_tag: str


class ProbeOutboundParams(_Params):
    """``diagnostics.probe_outbound``."""

    target_tag: str
    url: str | None = None


class HostnameParams(_Params):
    """``diagnostics.dns_lookup``."""

    hostname: str = Field(min_length=1)


class DnsCacheParams(_Params):
    """``diagnostics.dns_cache``."""

    domain: str | None = None
    limit: int = Field(default=256, ge=1)


class FakeIpParams(_Params):
    """``diagnostics.fakeip_lookup`` / ``fakeip.clear``."""

    domain: str | None = None
    ip: str | None = None


class TunStartParams(_Params):
    """``tun.start`` (interface.md 4.4)."""

    addr: str
    tag: str
    name: str | None = None
    mask: str = "255.255.255.0"
    mtu: int | None = None
    secondary_addr: str | None = None
    include_cidrs: list[str] = []
    exclude_cidrs: list[str] = []
    auto_route: bool = True
    dual_stack: bool = True
    strict_route: bool = True
    dns_hijack: bool = True


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


def _flows_close(core: EngineCore, p: FlowsCloseParams) -> dict[str, Any]:
    entry = core.flows.get(p.flow_id)
    if entry is None:
        raise not_found(f"flow {p.flow_id!r} is not active")
    try:
        closed = entry.actor.ask(CloseFlow(), timeout=_ASK_TIMEOUT)
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
        if outbound not in core.outbounds and outbound not in core.policies:
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


def _trace_route(core: EngineCore, p: TraceRouteParams) -> dict[str, Any]:
    state = core.route_state
    facts = routing.FlowFacts(
        network=p.protocol,
        host=p.target,
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
    return {
        "target": p.target,
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
    return diagnostics.probe_outbound(core, p.target_tag, p.url)


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
        result: dict[str, Any] = actor.ask(SelectMember(p.target_tag), timeout=_ASK_TIMEOUT)
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


def _dns_cache(core: EngineCore, p: DnsCacheParams) -> dict[str, Any]:
    return dns.dns_cache_result(core.resolver, p.domain, p.limit)


_FAKE_IP = "fake-ip answers (runtime.dns.answer fake_ip, not built yet)"
_TUN = "the TUN inbound (not built yet)"
_RELOAD = "hot reload of a full configuration (not built yet)"

COMMANDS: dict[str, Command] = {
    c.method: c
    for c in (
        Command("flows.close", "control", FlowsCloseParams, _flows_close),
        Command("mode.set", "admin", ModeSetParams, _mode_set),
        Command("config.validate", "config", ConfigParams, _config_validate),
        Command("diagnostics.trace_route", "admin", TraceRouteParams, _trace_route),
        Command("policies.select", "control", PolicySelectParams, _policies_select),
        Command("policies.probe", "control", PolicyTagParams, _policies_probe),
        Command("config.apply", "config", ConfigParams, missing=_RELOAD),
        Command("config.apply_runtime", "config", ConfigParams, missing=_RELOAD),
        Command("tun.start", "admin", TunStartParams, missing=_TUN),
        Command("tun.stop", "admin", NoParams, missing=_TUN),
        Command("diagnostics.probe_target", "admin", TargetTagParams, _probe_target),
        Command("diagnostics.probe_outbound", "admin", ProbeOutboundParams, _probe_outbound),
        Command("diagnostics.dns_lookup", "admin", HostnameParams, _dns_lookup),
        Command("diagnostics.dns_cache", "admin", DnsCacheParams, _dns_cache),
        Command("diagnostics.fakeip_lookup", "read", FakeIpParams, missing=_FAKE_IP),
        Command("fakeip.clear", "admin", FakeIpParams, missing=_FAKE_IP),
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
) -> dict[str, Any]:
    """Validate and run one command; raises ApiError on every failure."""
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
    return command.handler(core, parsed)
