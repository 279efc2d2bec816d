"""The configuration document: pydantic models, cross-checks, loading, the embedded default.

Reference: docs/configuration.md. Errors are ``invalid_argument`` with ``cause`` and one
``details[]`` item per problem.

Validation runs in two passes over the same document and reports every problem found:

1. the schema (pydantic v2 models, ``extra="forbid"`` everywhere, strict scalar types:
   ``"7890"`` is not a port, ``"yes"`` is not a boolean);
2. cross-checks that need the whole document (tag uniqueness, references, group cycles,
   ``global`` without an outbound, ...). They read the raw document defensively, so a
   dangling reference is reported even when an unrelated part fails the schema.

Each problem is a :class:`~spliceway.errors.Detail` whose ``field_path`` looks like
``inbounds[0].listen.port`` (``None`` only when the document itself is not an object).

Decisions this module makes where the spec leaves room:

- ``api.control.api_key_env`` defaults to ``"SPLICEWAY_API_KEY"`` as in the example (1.1:
  "everything else takes the value shown in the example"). An explicit ``null`` means
  no token; the embedded default sets ``null``. So a configuration that omits the key
  fails closed at start (the variable must be set) instead of silently opening an
  unauthenticated control API. :meth:`ControlApi.read_api_key` does that check.
- Rule conditions other than ``network`` take a list or a single string
  (``"domain_suffix": "example.com"``); a single string is normalised to a one-item
  list and :meth:`Config.to_dict` always writes lists. An empty list is an error (it
  could never match). ``network`` is a single ``"tcp"``/``"udp"`` string.
  ``port``/``source_port`` items are strings ``"443"``/``"8000-8100"``; integers are
  accepted and normalised to strings. ``domain``/``domain_suffix`` items must not start
  with ``.``; ``domain_regex`` is compiled case-insensitively (routing does the same).
- ``url_test``/``fallback``/``load_balance`` ``url`` is optional: ``null`` means
  "``runtime.latency_test_url``, else the engine's built-in probe URL". When given it must
  be an ASCII ``http://`` URL with a host (probes send HEAD without TLS).
  ``interval_seconds`` defaults to 300 for all three; load_balance probes too, because it
  spreads over healthy members only.
- Relay hops are socks5, http or shadowsocks outbounds (not groups: a chain's hops must
  be fixed to be shown and dialled), and a shadowsocks hop can only be the last.
- Shadowsocks ``method`` defaults to ``chacha20-ietf-poly1305``; ``password`` is required
  (a shared secret has no sensible default).
- ``users`` absent or ``null`` means no authentication; present it must be non-empty.
  Usernames are unique per inbound, 1..255 UTF-8 bytes, and contain no ``:`` on
  ``http``/``mixed`` inbounds (Basic auth could not carry it).
- ``listen.address`` is an IP literal or ``localhost``. Two listeners (inbounds and the
  control API) with the same non-zero address and port are an error.
- ``runtime.dns.servers`` items: ``system``, ``udp://IP[:PORT]``, ``tcp://IP[:PORT]``
  (IPv6 in brackets, port default 53); see :func:`parse_dns_server`.
- ``runtime.dns.cache`` defaults to ``{"max_entries": 4096}`` (enabled, as in the example);
  ``null`` disables the cache.
- ``runtime.tun.mtu`` ``null`` means "use ``runtime.network.mtu``".
- Sink ``events`` items must be known event types or ``"*"`` (a typo would silently
  filter everything out otherwise).
- A group may not list the same member twice; a selector ``default`` of ``null`` or
  absent becomes its first member.
- Tag ``direct`` is reserved for the built-in direct outbound: an outbound may use it only
  with protocol ``direct``; a group may not.
"""

from __future__ import annotations

import functools
import ipaddress
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import SplitResult, urlsplit

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    PrivateAttr,
    Strict,
    ValidationError,
    model_serializer,
    model_validator,
)

from spliceway.connector.signing import SIGNATURE_HEADERS, secret_key
from spliceway.errors import ApiError, Detail
from spliceway.events.catalogue import EVENT_CATALOGUE
from spliceway.flows.hook import HookSettings
from spliceway.routing.policy import parse_probe_url

__all__ = [
    "CONDITION_KEYS",
    "DEFAULT_API_KEY_ENV",
    "EVENT_TYPES",
    "Api",
    "ApiKeySpec",
    "BlockOutbound",
    "Config",
    "ControlApi",
    "ControlListen",
    "DirectOutbound",
    "Dispatcher",
    "DnsCache",
    "DnsSettings",
    "FakeIpAnswer",
    "FallbackGroup",
    "FlowHook",
    "GrpcApi",
    "HttpOutbound",
    "Inbound",
    "InboundUser",
    "IpcApi",
    "JsonlSink",
    "Listen",
    "LoadBalanceGroup",
    "Mode",
    "NatsSink",
    "NetworkSettings",
    "RealAnswer",
    "RelayGroup",
    "Route",
    "Rule",
    "Runtime",
    "SelectorGroup",
    "ShadowsocksOutbound",
    "Socks5Outbound",
    "TunSettings",
    "UrlTestGroup",
    "WebhookSink",
    "check_environment",
    "check_environment_details",
    "config_schema",
    "control_environment_problems",
    "default_config",
    "default_ipc_path",
    "environment_problems",
    "load_config_file",
    "one_sink_environment_problems",
    "parse_config",
    "parse_dns_server",
    "resolve_ipc",
    "sink_environment_problems",
    "validate_document",
]

DEFAULT_API_KEY_ENV = "SPLICEWAY_API_KEY"

#: Rule condition keys in the order used for ``matched_rule.condition`` text.
CONDITION_KEYS: tuple[str, ...] = (
    "domain",
    "domain_suffix",
    "domain_keyword",
    "domain_regex",
    "ip_cidr",
    "source_ip_cidr",
    "port",
    "source_port",
    "network",
    "inbound_tag",
    "principal_key",
    "process_name",
)

#: Every event type (valid in a sink's ``events`` filter, with ``"*"``): the catalogue's names.
EVENT_TYPES: frozenset[str] = frozenset(EVENT_CATALOGUE)

BUILTIN_DIRECT = "direct"

# ---------------------------------------------------------------------------
# Field validators (each raises ValueError with the message shown to the user)
# ---------------------------------------------------------------------------

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PORT_SPEC = re.compile(r"(\d{1,5})(?:-(\d{1,5}))?")
_DNS_SERVER = re.compile(r"(udp|tcp)://(\[[^\]]+\]|[^:/\[\]]+)(?::(\d{1,5}))?")


def _check_ip_address(value: str) -> str:
    if value == "localhost":
        return value
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an IP address (or 'localhost')") from None
    return value


def _check_cidr(value: str) -> str:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        raise ValueError(f"{value!r} is not a valid CIDR (e.g. '10.0.0.0/8')") from None
    return value


def _check_interface_address(value: str) -> str:
    try:
        ipaddress.ip_interface(value)
    except ValueError:
        raise ValueError(f"{value!r} is not an interface address (IP or IP/prefix)") from None
    return value


def _check_netmask(value: str) -> str:
    try:
        ipaddress.IPv4Network(f"0.0.0.0/{value}")
    except ValueError:
        raise ValueError(f"{value!r} is not an IPv4 netmask") from None
    return value


def _check_domain(value: str) -> str:
    if not value or value.startswith(".") or any(c.isspace() for c in value) or ".." in value:
        raise ValueError(f"{value!r} is not a domain name (no leading dot, no spaces)")
    return value


def _check_keyword(value: str) -> str:
    if not value:
        raise ValueError("must not be empty")
    return value


def _check_regex(value: str) -> str:
    try:
        re.compile(value, re.IGNORECASE)
    except re.error as exc:
        raise ValueError(f"invalid regular expression: {exc}") from None
    return value


def parse_port_spec(value: str) -> tuple[int, int]:
    """Parse ``"443"`` or ``"8000-8100"`` into an inclusive ``(low, high)`` range."""
    m = _PORT_SPEC.fullmatch(value)
    if m is None:
        raise ValueError(f"{value!r} is not a port ('443') or port range ('8000-8100')")
    low = int(m.group(1))
    high = int(m.group(2)) if m.group(2) is not None else low
    if high > 65535:
        raise ValueError(f"{value!r}: ports are 0..65535")
    if low > high:
        raise ValueError(f"{value!r}: range start is above its end")
    return low, high


def _check_port_spec(value: str) -> str:
    parse_port_spec(value)
    return value


def _port_to_str(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    return value


def _url_with_host(value: str, schemes: tuple[str, ...]) -> SplitResult:
    """``value`` split, when it is a URL of one of ``schemes`` with a host (and a valid
    port, if any); ValueError saying what is wrong otherwise."""
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises ValueError on a bad port
    except ValueError:
        raise ValueError(f"{value!r} is not a valid URL") from None
    if parts.scheme not in schemes or not parts.hostname:
        kinds = " or ".join(f"{scheme}://" for scheme in schemes)
        article = "an" if schemes[0][0] in "aehiou" else "a"
        raise ValueError(f"must be {article} {kinds} URL with a host (got {value!r})")
    return parts


def _check_webhook_url(value: str) -> str:
    _url_with_host(value, ("http", "https"))
    return value


def _check_nats_url(value: str) -> str:
    parts = _url_with_host(value, ("nats", "tls"))
    if parts.username is not None or parts.password is not None:
        raise ValueError("must not carry credentials: name them with credentials_env")
    return value


#: A publish subject: dot-separated tokens, no wildcards, no whitespace (NATS subjects).
_NATS_SUBJECT = re.compile(r"[^.*>\s]+(?:\.[^.*>\s]+)*")


def _check_nats_subject(value: str) -> str:
    if not _NATS_SUBJECT.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a NATS publish subject (dot-separated tokens, no spaces, "
            "no wildcards * or >)"
        )
    return value


def _check_env_name(value: str) -> str:
    if not _ENV_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not an environment variable name")
    return value


def _check_credential(value: str) -> str:
    if not 1 <= len(value.encode("utf-8")) <= 255:
        raise ValueError("must be 1..255 bytes long (UTF-8)")
    return value


def _check_event_type(value: str) -> str:
    if value != "*" and value not in EVENT_TYPES:
        raise ValueError(f"unknown event type {value!r}")
    return value


def parse_dns_server(value: str) -> tuple[str, str | None, int | None]:
    """Parse a ``runtime.dns.servers`` item into ``(kind, ip, port)``.

    ``"system"`` gives ``("system", None, None)``; ``"udp://1.1.1.1"`` gives
    ``("udp", "1.1.1.1", 53)``; ``"tcp://[::1]:5353"`` gives ``("tcp", "::1", 5353)``.
    """
    if value == "system":
        return "system", None, None
    m = _DNS_SERVER.fullmatch(value)
    if m is None:
        raise ValueError(f"{value!r} is not 'system', 'udp://IP[:PORT]' or 'tcp://IP[:PORT]'")
    host = m.group(2)
    bracketed = host.startswith("[")
    host = host.strip("[]")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: {host!r} is not an IP address") from None
    if (ip.version == 6) != bracketed:
        raise ValueError(f"{value!r}: IPv6 addresses go in brackets, IPv4 ones do not")
    port = int(m.group(3)) if m.group(3) is not None else 53
    if not 1 <= port <= 65535:
        raise ValueError(f"{value!r}: port must be 1..65535")
    return m.group(1), host, port


def _check_dns_server(value: str) -> str:
    parse_dns_server(value)
    return value


def _one_or_many(value: Any) -> Any:
    """Accept a single string (or integer) where a list is expected."""
    if isinstance(value, str | int) and not isinstance(value, bool):
        return (value,)
    return value


def _float_out(value: float) -> float | int:
    return int(value) if float(value).is_integer() else value


# ---------------------------------------------------------------------------
# Annotated scalar types
# ---------------------------------------------------------------------------

SStr = Annotated[str, Strict()]
SBool = Annotated[bool, Strict()]
Tag = Annotated[str, Strict(), Field(min_length=1)]
NonEmptyStr = Annotated[str, Strict(), Field(min_length=1)]
PosInt = Annotated[int, Strict(), Field(ge=1)]
NonNegInt = Annotated[int, Strict(), Field(ge=0)]
ListenPort = Annotated[int, Strict(), Field(ge=0, le=65535)]
RemotePort = Annotated[int, Strict(), Field(ge=1, le=65535)]
Timeout = Annotated[int, Strict(), Field(ge=1)]
IpAddr = Annotated[str, Strict(), AfterValidator(_check_ip_address)]
Cidr = Annotated[str, Strict(), AfterValidator(_check_cidr)]


def _check_probe_url(value: str) -> str:
    try:
        parse_probe_url(value)
    except ValueError as ex:
        raise ValueError(f"{ex} (got {value!r})") from None
    return value


#: A URL probed with HEAD through an outbound: plain ``http://`` only.
ProbeUrl = Annotated[str, Strict(), AfterValidator(_check_probe_url)]
EnvName = Annotated[str, Strict(), AfterValidator(_check_env_name)]
Credential = Annotated[str, Strict(), AfterValidator(_check_credential)]
Percent = Annotated[
    float, Strict(), Field(ge=0, le=100), PlainSerializer(_float_out, return_type=float | int)
]


def _cond_list(item: Any) -> Any:
    return Annotated[tuple[item, ...], BeforeValidator(_one_or_many), Field(min_length=1)]


DomainList = _cond_list(Annotated[str, Strict(), AfterValidator(_check_domain)])
KeywordList = _cond_list(Annotated[str, Strict(), AfterValidator(_check_keyword)])
RegexList = _cond_list(Annotated[str, Strict(), AfterValidator(_check_regex)])
CidrList = _cond_list(Cidr)
PortList = _cond_list(
    Annotated[str, BeforeValidator(_port_to_str), Strict(), AfterValidator(_check_port_spec)]
)
NameList = _cond_list(NonEmptyStr)


class _Model(BaseModel):
    # Field docstrings are the descriptions of the JSON Schema (``spliceway config-schema``)
    # and of docs/configuration.md.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def _schema_optional(*names: str) -> Callable[[dict[str, Any]], None]:
    """JSON Schema hook: ``names`` are filled in by a before-validator, so they may be omitted."""

    def hook(schema: dict[str, Any]) -> None:
        schema["required"] = [n for n in schema.get("required", ()) if n not in names]

    return hook


def _rule_schema(schema: dict[str, Any]) -> None:
    """JSON Schema hook of ``Rule``: list conditions also take a single item (see ``_one_or_many``),
    and port items may be integers."""
    for key in CONDITION_KEYS:
        prop = schema["properties"][key]
        many = next((s for s in prop.get("anyOf", ()) if s.get("type") == "array"), None)
        if many is None:
            continue  # network: a single string
        item = many["items"]
        if key in ("port", "source_port"):
            item = {"anyOf": [item, {"type": "integer", "minimum": 0, "maximum": 65535}]}
        prop["anyOf"] = [item, {"type": "array", "items": item, "minItems": 1}, {"type": "null"}]


def _fill_from(data: Any, key: str, source: str, *, first: bool = False) -> Any:
    """Before-validator helper: default ``key`` to ``data[source]`` (or its first item)."""
    if not isinstance(data, dict) or data.get(key) is not None:
        return data
    value = data.get(source)
    if first:
        value = value[0] if isinstance(value, list | tuple) and value else None
    if isinstance(value, str):
        return {**data, key: value}
    return data


# ---------------------------------------------------------------------------
# mode, inbounds
# ---------------------------------------------------------------------------


class Mode(_Model):
    """``mode``: ``rule`` (rules then final), ``global`` (all to ``outbound``), ``direct``."""

    kind: Literal["rule", "global", "direct"] = "rule"
    """How new flows are routed: `rule` tries `rules` in order, then `route.final`; `global`
    sends every flow to `mode.outbound`; `direct` sends every flow to the built-in `direct`
    outbound. The `mode.set` command changes it while the engine runs (not written back to
    the file).
    """
    outbound: Tag | None = None
    """Outbound or group tag every flow takes when `kind` is `global` (required then); not used
    by the other kinds.
    """


class Listen(_Model):
    """A listen address whose port is required (inbounds, ``runtime.dns.listen``)."""

    address: IpAddr = "127.0.0.1"
    """IP address to bind (`0.0.0.0` or `::` for every interface), or `localhost`."""
    port: ListenPort
    """TCP port to bind; `0` lets the operating system choose a free one (`GET /api/v1/config`
    shows the port it chose).
    """


class ControlListen(_Model):
    """``api.control.listen`` (defaults 127.0.0.1:9090)."""

    address: IpAddr = "127.0.0.1"
    """IP address the control API binds (`0.0.0.0` or `::` for every interface), or
    `localhost`. Keep it on loopback unless a key is configured.
    """
    port: ListenPort = 9090
    """TCP port of the control API; `0` lets the operating system choose."""


class InboundUser(_Model):
    """One user of an authenticating inbound; ``principal_key`` defaults to the username."""

    model_config = ConfigDict(json_schema_extra=_schema_optional("principal_key"))

    username: Credential
    """User name the client sends (SOCKS5 username/password or HTTP `Proxy-Authorization:
    Basic`), 1 to 255 UTF-8 bytes, unique on its inbound, no `:` on `http` and `mixed`
    inbounds.
    """
    password: Credential
    """Password of this user, 1 to 255 UTF-8 bytes."""
    principal_key: NonEmptyStr
    """Identity recorded for this user's flows (the events' `principal_key`, the `flows` query
    filter) and matched by rules' `principal_key`. Defaults to `username`.
    """

    @model_validator(mode="before")
    @classmethod
    def _default_principal(cls, data: Any) -> Any:
        return _fill_from(data, "principal_key", "username")


class Inbound(_Model):
    """An inbound listener (``socks5``, ``http`` or ``mixed``)."""

    tag: Tag
    """Name of this inbound, unique among inbounds; flow records, the `flows` query filter and
    rules' `inbound_tag` refer to it.
    """
    protocol: Literal["socks5", "http", "mixed"]
    """What clients speak: `socks5` (CONNECT), `http` (CONNECT and absolute-URI forwarding) or
    `mixed` (both on one port, told apart by the first byte).
    """
    listen: Listen
    """Where to accept connections."""
    udp: SBool = True
    """Offer SOCKS5 UDP ASSOCIATE (RFC 1928 section 7) on a `socks5` or `mixed` inbound: each
    destination of an association is a `udp` flow, relayed in C. `false` answers UDP ASSOCIATE
    with reply 07 (command not supported). An `http` inbound has no UDP either way.
    """
    sniff: SBool = True
    """Peek at the client's first bytes for a TLS SNI or HTTP Host, so domain rules can match a
    flow that names an IP address. Turn it off for server-first protocols (SSH, SMTP), which
    would otherwise wait `sniff_timeout_ms`.
    """
    sniff_timeout_ms: NonNegInt = 300
    """Longest wait for the client's first bytes when sniffing, in milliseconds; `0` does not
    wait (only bytes that came with the request are examined).
    """
    users: Annotated[tuple[InboundUser, ...], Field(min_length=1)] | None = None
    """Accepted credentials; `null` (or absent) accepts every client without authentication.
    When given it must not be empty.
    """


# ---------------------------------------------------------------------------
# outbounds
# ---------------------------------------------------------------------------


class DirectOutbound(_Model):
    """Connect to the target itself."""

    tag: Tag
    """Name of this outbound, unique among outbounds and groups. `direct` names the built-in
    direct outbound, which exists even when not listed.
    """
    protocol: Literal["direct"]
    """`direct`: connect to the target itself."""
    connect_timeout_ms: Timeout = 5000
    """Budget for resolving the target and connecting to it, in milliseconds; when it runs out
    the flow fails with code `connect_timeout`.
    """


class BlockOutbound(_Model):
    """Refuse the flow."""

    tag: Tag
    """Name of this outbound, unique among outbounds and groups."""
    protocol: Literal["block"]
    """`block`: refuse every flow routed here (outcome `blocked`)."""


class Socks5Outbound(_Model):
    """An upstream SOCKS5 proxy (optional RFC 1929 credentials, both or neither)."""

    tag: Tag
    """Name of this outbound, unique among outbounds and groups."""
    protocol: Literal["socks5"]
    """`socks5`: reach targets through a SOCKS5 proxy (CONNECT)."""
    server: NonEmptyStr
    """Host name or IP address of the proxy, resolved with `runtime.dns`."""
    port: RemotePort
    """TCP port of the proxy."""
    username: Credential | None = None
    """RFC 1929 user name (1 to 255 UTF-8 bytes); set `username` and `password` together or
    neither (`null`: no authentication).
    """
    password: Credential | None = None
    """RFC 1929 password (1 to 255 UTF-8 bytes); required when `username` is set."""
    connect_timeout_ms: Timeout = 5000
    """Budget for reaching the proxy and completing its handshake, in milliseconds."""


class HttpOutbound(_Model):
    """An upstream HTTP proxy used with CONNECT (optional Basic credentials)."""

    tag: Tag
    """Name of this outbound, unique among outbounds and groups."""
    protocol: Literal["http"]
    """`http`: reach targets through an HTTP proxy with CONNECT (plain HTTP to the proxy, no
    TLS).
    """
    server: NonEmptyStr
    """Host name or IP address of the proxy, resolved with `runtime.dns`."""
    port: RemotePort
    """TCP port of the proxy."""
    username: NonEmptyStr | None = None
    """User name sent as `Proxy-Authorization: Basic`; set `username` and `password` together
    or neither (`null`: no authentication).
    """
    password: SStr | None = None
    """Password for Basic authentication (may be empty); required when `username` is set."""
    connect_timeout_ms: Timeout = 5000
    """Budget for reaching the proxy and getting its answer to CONNECT, in milliseconds."""


class ShadowsocksOutbound(_Model):
    """An upstream Shadowsocks (AEAD) server."""

    tag: Tag
    """Name of this outbound, unique among outbounds and groups."""
    protocol: Literal["shadowsocks"]
    """`shadowsocks`: reach targets through a Shadowsocks AEAD server."""
    server: NonEmptyStr
    """Host name or IP address of the server, resolved with `runtime.dns`."""
    port: RemotePort
    """TCP port of the server."""
    method: Literal["aes-128-gcm", "aes-256-gcm", "chacha20-ietf-poly1305"] = (
        "chacha20-ietf-poly1305"
    )
    """AEAD cipher; must match the server's."""
    password: NonEmptyStr
    """Shared secret the session keys are derived from; must match the server's."""
    connect_timeout_ms: Timeout = 5000
    """Budget for reaching the server and opening the session, in milliseconds."""


AnyOutbound = DirectOutbound | BlockOutbound | Socks5Outbound | HttpOutbound | ShadowsocksOutbound
Outbound = Annotated[AnyOutbound, Field(discriminator="protocol")]


# ---------------------------------------------------------------------------
# groups
# ---------------------------------------------------------------------------

Members = Annotated[tuple[Tag, ...], Field(min_length=1)]


class SelectorGroup(_Model):
    """Manually selected member; ``default`` is the initial selection (first member)."""

    model_config = ConfigDict(json_schema_extra=_schema_optional("default"))

    tag: Tag
    """Name of this group, unique among outbounds and groups."""
    kind: Literal["selector"]
    """`selector`: flows take the member chosen by hand (command `policies.select`)."""
    outbounds: Members
    """Members: outbound or group tags, each at most once."""
    default: Tag
    """Member selected at start; defaults to the first member. A selection made with
    `policies.select` lasts until the engine stops.
    """

    @model_validator(mode="before")
    @classmethod
    def _default_first(cls, data: Any) -> Any:
        return _fill_from(data, "default", "outbounds", first=True)


class UrlTestGroup(_Model):
    """Lowest-latency healthy member, re-probed every ``interval_seconds``."""

    tag: Tag
    """Name of this group, unique among outbounds and groups."""
    kind: Literal["url_test"]
    """`url_test`: flows take the healthy member with the lowest probe latency."""
    outbounds: Members
    """Members: outbound or group tags, each at most once, probed in every round."""
    url: ProbeUrl | None = None
    """Plain `http://` URL probed with `HEAD` through each member. `null` uses
    `runtime.latency_test_url`, else `http://www.gstatic.com/generate_204`.
    """
    interval_seconds: PosInt = 300
    """Seconds between scheduled probe rounds (rounds also run at start, on `policies.probe`
    and when a flow fails to dial a member).
    """
    tolerance_ms: NonNegInt = 50
    """Keep the current member while it is healthy and at most this many milliseconds slower
    than the fastest, so small jitter does not move traffic.
    """


class FallbackGroup(_Model):
    """First healthy member in order."""

    tag: Tag
    """Name of this group, unique among outbounds and groups."""
    kind: Literal["fallback"]
    """`fallback`: flows take the first healthy member in list order."""
    outbounds: Members
    """Members in order of preference: outbound or group tags, each at most once."""
    url: ProbeUrl | None = None
    """Plain `http://` URL probed with `HEAD` through each member. `null` uses
    `runtime.latency_test_url`, else `http://www.gstatic.com/generate_204`.
    """
    interval_seconds: PosInt = 300
    """Seconds between scheduled probe rounds (rounds also run at start and when a flow fails
    to dial a member).
    """


class RelayGroup(_Model):
    """A chain: members are dialled through one another in order."""

    tag: Tag
    """Name of this group, unique among outbounds and groups."""
    kind: Literal["relay"]
    """`relay`: a chain; each flow is dialled through every member in turn."""
    outbounds: Members
    """Hops in dialling order: `socks5`, `http` or `shadowsocks` outbounds (not groups); a
    `shadowsocks` hop can only be the last.
    """


class LoadBalanceGroup(_Model):
    """Spread flows over the healthy members."""

    tag: Tag
    """Name of this group, unique among outbounds and groups."""
    kind: Literal["load_balance"]
    """`load_balance`: flows are spread over the healthy members (over all members when none is
    healthy).
    """
    outbounds: Members
    """Members: outbound or group tags, each at most once."""
    strategy: Literal["round_robin", "consistent_hashing", "sticky_sessions"] = "round_robin"
    """How a member is picked: `round_robin` (in turn), `consistent_hashing` (by target host:
    one host keeps its member) or `sticky_sessions` (by source IP: one client keeps its
    member).
    """
    url: ProbeUrl | None = None
    """Plain `http://` URL probed with `HEAD` through each member. `null` uses
    `runtime.latency_test_url`, else `http://www.gstatic.com/generate_204`.
    """
    interval_seconds: PosInt = 300
    """Seconds between scheduled probe rounds (rounds also run at start and when a flow fails
    to dial a member).
    """


AnyGroup = SelectorGroup | UrlTestGroup | FallbackGroup | RelayGroup | LoadBalanceGroup
OutboundGroup = Annotated[AnyGroup, Field(discriminator="kind")]


# ---------------------------------------------------------------------------
# rules, route
# ---------------------------------------------------------------------------


class Rule(_Model):
    """One routing rule: all named conditions must match (a list matches when any item does)."""

    model_config = ConfigDict(json_schema_extra=_rule_schema)

    domain: DomainList | None = None
    """Target host names matched exactly (case-insensitive, trailing dot ignored); the sniffed
    host is tried too. A single string or a list.
    """
    domain_suffix: DomainList | None = None
    """Domain suffixes: `example.com` matches `example.com` and `www.example.com`, never
    `badexample.com`. The sniffed host is tried too. A single string or a list.
    """
    domain_keyword: KeywordList | None = None
    """Substrings of the target (or sniffed) host name. A single string or a list."""
    domain_regex: RegexList | None = None
    """Regular expressions searched in the target (or sniffed) host name, case-insensitive
    (Python `re` syntax). A single string or a list.
    """
    ip_cidr: CidrList | None = None
    """Networks (`10.0.0.0/8`, `2001:db8::/32`) containing the target's address: the address
    the client asked for, in any spelling (`2130706433` and `127.1` are 127.0.0.1), else,
    for a flow to a domain, the first address the engine resolver gives for it once
    matching reaches this rule (docs/routing.md). A single string or a list.
    """
    source_ip_cidr: CidrList | None = None
    """Networks containing the client's address. A single string or a list."""
    port: PortList | None = None
    """Target ports: `"443"` or an inclusive range `"8000-8100"` (integers are accepted too). A
    single item or a list.
    """
    source_port: PortList | None = None
    """Client source ports, written like `port`. A single item or a list."""
    network: Literal["tcp", "udp"] | None = None
    """`tcp` or `udp`: SOCKS5 UDP associations' destinations and the TUN's UDP sessions are
    `udp` flows."""
    inbound_tag: NameList | None = None
    """Tags of the inbounds the flow arrived on. A single string or a list."""
    principal_key: NameList | None = None
    """Principal keys of authenticated users (see `inbounds[].users`); a flow without a user
    never matches. A single string or a list.
    """
    process_name: NameList | None = None
    """Names of the client's process: the base name of its executable (`curl`, `firefox`),
    compared exactly. Only a flow whose client runs on this host has one, found while
    `runtime.process_lookup` is `auto` or `always`; with `off` such a rule never matches.
    A single string or a list.
    """
    action: Literal["route", "block"] = "route"
    """`route` sends a matching flow to `outbound`; `block` refuses it (outcome `blocked`)."""
    outbound: Tag | None = None
    """Outbound or group tag for a matching flow; required when `action` is `route`, not
    allowed when it is `block`.
    """

    def conditions(self) -> dict[str, tuple[str, ...] | str]:
        """The conditions this rule names, in :data:`CONDITION_KEYS` order."""
        out: dict[str, tuple[str, ...] | str] = {}
        for key in CONDITION_KEYS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {
            k: v
            for k, v in data.items()
            if v is not None or (k not in CONDITION_KEYS and k != "outbound")
        }


class Route(_Model):
    """``route``: ``final`` is used when no rule matches."""

    final: Tag = BUILTIN_DIRECT
    """Outbound or group tag for flows that no rule matches (mode `rule`)."""


# ---------------------------------------------------------------------------
# runtime
# ---------------------------------------------------------------------------


class NetworkSettings(_Model):
    """``runtime.network``."""

    mtu: Annotated[int, Strict(), Field(ge=68, le=65535)] = 1500
    """Link MTU in bytes for the TUN device when `runtime.tun.mtu` (or `tun.start`'s `mtu`)
    is null."""


class DnsCache(_Model):
    """``runtime.dns.cache`` (present = cache enabled)."""

    max_entries: PosInt = 4096
    """Most names kept; the least recently used name is evicted first."""
    min_ttl_seconds: NonNegInt | None = None
    """Keep answers at least this many seconds whatever their TTL; `null` keeps the TTL as
    received.
    """
    max_ttl_seconds: NonNegInt | None = None
    """Keep answers at most this many seconds whatever their TTL; `null` keeps the TTL as
    received. Must not be below `min_ttl_seconds`.
    """


class RealAnswer(_Model):
    """Answer with real addresses."""

    type: Literal["real"]
    """`real`: names resolve to their real addresses."""


class FakeIpAnswer(_Model):
    """Answer with synthetic addresses from ``fake_ip_range``."""

    type: Literal["fake_ip"]
    """`fake_ip`: the DNS server (`listen`) answers A (or AAAA, for an IPv6 range) with a
    synthetic address of the name, TTL 1 s; a connection through the proxy to that address is
    routed by the name (`target.host` is the name, domain rules match). Outbounds still resolve
    real addresses. See docs/dns.md.
    """
    fake_ip_range: Cidr = "198.18.0.0/15"
    """Network (IPv4 or IPv6) the synthetic addresses are taken from, in order; its network
    address, first host (kept for a TUN gateway) and broadcast address are never handed out.
    When every address is taken, the least recently used name gives its address up.
    """
    persist_path: NonEmptyStr | None = None
    """File keeping the name-to-address table across restarts (written atomically within 1 s
    of a change, and at stop); `null` keeps it in memory only. A damaged file is set aside as
    `<path>.damaged` and reported (`engine.warning` `fakeip_table_damaged`); the table starts
    empty.
    """


class DnsSettings(_Model):
    """``runtime.dns``."""

    servers: Annotated[
        tuple[Annotated[str, Strict(), AfterValidator(_check_dns_server)], ...],
        Field(min_length=1),
    ] = ("system",)
    """Servers asked in order: `system` (the C library's resolver: /etc/hosts, resolv.conf),
    `udp://IP[:PORT]` or `tcp://IP[:PORT]` (IPv6 in brackets, port 53 by default). A timeout
    or server error moves on to the next; a definitive "no such name" does not. Every
    outbound resolves through them.
    """
    cache: DnsCache | None = Field(default_factory=DnsCache)
    """Answer cache (positive answers only); `null` turns it off."""
    answer: Annotated[RealAnswer | FakeIpAnswer, Field(discriminator="type")] = Field(
        default_factory=lambda: RealAnswer(type="real")
    )
    """What kind of addresses names resolve to."""
    listen: Listen | None = None
    """Address (UDP and TCP, one port) of a DNS server for clients, answering through this
    resolver and cache, or with fake-ip addresses; `null`: no server. See docs/dns.md.
    """
    client_rate_limit: PosInt | None = 1000
    """Queries a second the DNS server (`listen`) answers from one client address, with a
    burst of twice as many; a query it must parse (not a cached answer) counts 10. More
    are dropped and counted (`rate_limited`), as unbound's `ip-ratelimit`. Raise it for a
    forwarder that sends every client's queries from one address; `null`: no limit. See
    docs/dns.md.
    """


class TunSettings(_Model):
    """``runtime.tun``: a TUN inbound, set like the ``tun.start`` parameters."""

    addr: Annotated[str, Strict(), AfterValidator(_check_interface_address)]
    """Address of the TUN device, an IP or IP/prefix."""
    tag: Tag
    """Inbound tag of flows arriving through the TUN device."""
    name: NonEmptyStr | None = None
    """Device name; `null` lets the system choose."""
    mask: Annotated[str, Strict(), AfterValidator(_check_netmask)] = "255.255.255.0"
    """IPv4 netmask of `addr`."""
    mtu: Annotated[int, Strict(), Field(ge=68, le=65535)] | None = None
    """Device MTU in bytes; `null` uses `runtime.network.mtu`."""
    secondary_addr: Annotated[str, Strict(), AfterValidator(_check_interface_address)] | None = None
    """A second device address (e.g. IPv6 next to IPv4); `null` for none."""
    include_cidrs: tuple[Cidr, ...] = ()
    """Networks routed into the device; empty routes everything."""
    exclude_cidrs: tuple[Cidr, ...] = ()
    """Networks kept out of the device."""
    auto_route: SBool = True
    """Install the routes to the device."""
    dual_stack: SBool = True
    """Capture IPv6 as well as IPv4."""
    strict_route: SBool = True
    """Keep traffic from leaking around the device."""
    dns_hijack: SBool = True
    """Answer DNS queries sent through the device."""


class Runtime(_Model):
    """``runtime``."""

    log_level: Literal["trace", "debug", "info", "warn", "error"] = "info"
    """Lowest level logged: `trace` (same as `debug` in this build), `debug`, `info`, `warn` or
    `error`.
    """
    log_files: tuple[NonEmptyStr, ...] = ()
    """Files the log is appended to, in addition to standard error."""
    udp_upstream_idle_timeout_seconds: PosInt = 300
    """Seconds a UDP destination (a UDP flow) may be idle before it completes, and an
    upstream association with no destination left before it closes.
    """
    udp_busy_poll_us: Annotated[int, Strict(), Field(ge=0, le=1000)] = 50
    """Microseconds the C UDP relay keeps polling after a batch of datagrams before it
    sleeps: request/response traffic then costs no thread wake-ups (measured: UDP echo one
    datagram at a time went from 0.51x to 1.5x of direct), for at most this much CPU
    spinning after each batch. `0` never spins. Applied at start (a reload keeps the
    running value).
    """
    tcp_idle_timeout_seconds: PosInt = 600
    """A relayed TCP flow that moves no byte in either direction for this many seconds is
    closed (close reason `idle_timeout`).
    """
    process_lookup: Literal["auto", "always", "off"] = "auto"
    """Finding the process behind a flow whose client runs on this host (its address is a
    loopback address or one of this host's interface addresses): `auto` only while a rule
    names a `process_name`, `always` for every such flow, `off` never. A found process fills
    the record's `source.process_id`, `process_name` (the executable's base name) and
    `process_path`; a flow from another host has none, and no `process_name` rule matches
    it. The lookup (netlink `sock_diag`, then `/proc`) runs off the event loop, before
    routing for a flow that reaches a `process_name` rule and, with `always`, for every
    such flow (which then takes the Python connection path, not the C one). Under `auto`
    a flow decided by an earlier rule is relayed at once, and its record carries the
    process when the lookup ended before the client closed its socket.
    """
    latency_test_url: ProbeUrl | None = None
    """Plain `http://` URL for probing groups that set no `url` of their own, and for
    `diagnostics.probe_outbound` (where it wins over the command's `url`). `null`:
    `http://www.gstatic.com/generate_204`.
    """
    network: NetworkSettings = Field(default_factory=NetworkSettings)
    """Network settings."""
    stats_interval_ms: Annotated[int, Strict(), Field(ge=100)] = 1000
    """Sampling period in milliseconds: each sample emits `stats.sampled`, and `flow.updated`
    for every flow whose byte counts moved.
    """
    event_ring_capacity: PosInt = 8192
    """Events kept in memory (the ring behind `GET /api/v1/events`, stream resume and the
    sinks' intake); the oldest is dropped when it is full.
    """
    dns: DnsSettings = Field(default_factory=DnsSettings)
    """The engine's resolver."""
    tun: TunSettings | None = None
    """A TUN inbound started with the engine and managed by configuration (`tun.start` and
    `tun.stop` then answer `conflict`); `null`: none (the commands may start one).
    See docs/tun.md."""


# ---------------------------------------------------------------------------
# api
# ---------------------------------------------------------------------------

Permission = Literal["read", "control", "config", "admin"]


class ApiKeySpec(_Model):
    """Extension ``api.control.keys[]``: a scoped key read from ``key_env``."""

    name: Tag
    """Name of this key, unique among `keys`."""
    key_env: EnvName
    """Environment variable holding the key; while the control API is enabled, the engine
    refuses to start when it is unset or empty.
    """
    permissions: Annotated[tuple[Permission, ...], Field(min_length=1)]
    """What the key may do: `read` (every query and the event stream), `control`, `config` and
    `admin` (everything) guard commands; see the command reference.
    """


class ControlApi(_Model):
    """``api.control``: the HTTP control listener."""

    enabled: SBool = True
    """Serve the HTTP control API."""
    listen: ControlListen = Field(default_factory=ControlListen)
    """Where the control API listens."""
    api_key_env: EnvName | None = DEFAULT_API_KEY_ENV
    """Environment variable holding the admin key (every permission). While `enabled`, the
    engine refuses to start when it is unset or empty. `null` means no admin key: with no
    `keys` either, the API asks for no key at all (keep it on loopback).
    """
    keys: tuple[ApiKeySpec, ...] = ()
    """Additional keys, each with its own permissions."""

    def read_api_key(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The admin token, or ``None`` when ``api_key_env`` is null.

        Raises ``ApiError(invalid_argument)`` naming the variable when it is not set
        (the engine then refuses to start, exit status 2); see :func:`environment_problems`.
        """
        if self.api_key_env is None:
            return None
        env = os.environ if environ is None else environ
        value = env.get(self.api_key_env)
        if not value:
            check_environment_details(
                [_unset_variable(self.api_key_env, "api.control.api_key_env")]
            )
        return value


class IpcApi(_Model):
    """``api.ipc``; ``path`` null means :func:`default_ipc_path`."""

    enabled: SBool | None = None
    """Serve the local control socket (docs/ipc.md): queries, commands and event
    subscriptions as newline-delimited JSON; whoever can open it (mode 0600) is admin.
    `null` (unset) means: on when a `path` is given, else on for `spliceway run` and
    off for an engine embedded in a host application (`spliceway.Engine`), so that
    an embedded engine never claims the per-user default socket unasked."""
    path: NonEmptyStr | None = None
    """Socket path; `null` means `$XDG_RUNTIME_DIR/spliceway/control.sock`, else
    `/tmp/spliceway-<uid>/control.sock`.
    """

    def resolved_path(self) -> str:
        """The socket path to use."""
        return self.path if self.path is not None else default_ipc_path()

    def serves(self, unset_default: bool) -> bool:
        """Whether the socket is served; ``unset_default`` is the entry point's choice
        for an unset ``enabled`` with no ``path`` (``True`` for ``spliceway run``)."""
        if self.enabled is not None:
            return self.enabled
        return self.path is not None or unset_default


def resolve_ipc(config: Config, unset_default: bool) -> Config:
    """``config`` with ``api.ipc.enabled`` decided (see :meth:`IpcApi.serves`), so the
    running engine, its ``config`` query and a reload's comparison see a plain bool."""
    ipc = config.api.ipc
    if ipc.enabled is not None:
        return config
    decided = ipc.model_copy(update={"enabled": ipc.serves(unset_default)})
    return config.model_copy(
        update={"api": config.api.model_copy(update={"ipc": decided})}
    )


class GrpcApi(_Model):
    """``api.grpc``: the gRPC control API (docs/grpc.md; needs the ``grpc`` extra)."""

    enabled: SBool = False
    """Serve the gRPC service `spliceway.v1.Control` (with server reflection) on the control
    API's address and port + 1, with its keys and limits. Needs `api.control.enabled` and
    the `grpc` extra (`pip install 'spliceway[grpc]'`); the engine refuses to start
    otherwise (`invalid_argument`, `feature_disabled`).
    """


def _check_socket_path(value: str) -> str:
    if "\0" in value:
        raise ValueError("must not contain a NUL character")
    if len(value.encode("utf-8", "surrogateescape")) > 107:
        raise ValueError("is longer than 107 bytes, the limit of a Unix socket path")
    return value


class FlowHook(_Model):
    """``api.flow_hook``: a local process asked about each new flow (docs/flow-hook.md)."""

    path: Annotated[str, Strict(), Field(min_length=1), AfterValidator(_check_socket_path)]
    """Unix stream socket the hook process serves (at most 107 bytes); the engine connects
    to it at the first selected flow and reconnects, with backoff, when it goes away.
    """
    timeout_ms: Timeout = 200
    """How long a flow waits for the hook's answer, in milliseconds. No answer in time, or
    no hook listening, lets the flow through (fail-open) and emits one `engine.warning`
    `ipc_hook_unreachable` per outage.
    """
    networks: Annotated[tuple[Literal["tcp", "udp"], ...], Field(min_length=1)] = ("tcp", "udp")
    """Which flows ask the hook, by network: `udp` takes in each destination of a SOCKS5
    UDP association and each TUN UDP session (its datagrams wait, bounded, for the answer).
    """
    inbound_tags: Annotated[tuple[NonEmptyStr, ...], Field(min_length=1)] | None = None
    """Which flows ask the hook, by the inbound they came in on; `null` means every
    inbound. Flows of the other inbounds never wait for the hook (and stay on the C
    connection path).
    """

    def settings(self) -> HookSettings:
        """These keys as the flow hook client takes them."""
        return HookSettings(
            path=self.path,
            timeout_ms=self.timeout_ms,
            networks=self.networks,
            inbound_tags=self.inbound_tags,
        )


EventFilter = tuple[Annotated[str, Strict(), AfterValidator(_check_event_type)], ...]


class WebhookSink(_Model):
    """POST every selected event, one JSON envelope per request, to ``url``."""

    type: Literal["webhook"]
    """`webhook`: POST each event to `url`."""
    tag: Tag
    """Name of this sink, unique among sinks; `GET /api/v1/sinks` and the outbox use it."""
    url: Annotated[str, Strict(), AfterValidator(_check_webhook_url)]
    """`http://` or `https://` URL each event is POSTed to as one JSON envelope (redirects are
    not followed).
    """
    events: EventFilter = ()
    """Event types this sink takes (`"*"` or an empty list: every type). `flow.snapshot` never
    reaches a sink.
    """
    source_id: NonEmptyStr | None = None
    """Written into the `source_id` of every envelope this sink sends, to tell engines apart;
    `null` leaves it `null`.
    """
    headers: dict[SStr, SStr] | None = None
    """Extra request headers, e.g. `Authorization` for the receiver to authenticate the engine;
    they override the default `Content-Type` and `User-Agent`.
    """
    secret_env: EnvName | None = None
    """Environment variable holding a Standard Webhooks secret (`whsec_<base64>`): every
    delivery then carries `webhook-id` (the `event_id`), `webhook-timestamp` and
    `webhook-signature` (`v1,<base64 HMAC-SHA256 of "<id>.<timestamp>.<body>">`), signed anew
    at each attempt. The engine refuses to start when it is unset or not such a secret.
    `null`: deliveries are not signed.
    """

    @model_validator(mode="after")
    def _signature_headers_are_the_engines(self) -> WebhookSink:
        if self.secret_env is not None and self.headers:
            taken = sorted(n for n in self.headers if n.lower() in SIGNATURE_HEADERS)
            if taken:
                raise ValueError(
                    f"headers {taken} are set by the signature (secret_env); remove them"
                )
        return self


class NatsSink(_Model):
    """Publish every selected event to NATS JetStream, one message per event."""

    type: Literal["nats"]
    """`nats`: publish each event to a JetStream stream."""
    tag: Tag
    """Name of this sink, unique among sinks; `GET /api/v1/sinks` and the outbox use it."""
    servers: Annotated[
        tuple[Annotated[str, Strict(), AfterValidator(_check_nats_url)], ...],
        Field(min_length=1),
    ]
    """NATS server URLs (`nats://host:port` or `tls://host:port`), tried in turn."""
    subject: Annotated[str, Strict(), AfterValidator(_check_nats_subject)]
    """Subject every event is published on; a JetStream stream must capture it (the engine
    does not create streams: until one exists, delivery fails with `last_error` saying so,
    and the events wait in the outbox).
    """
    events: EventFilter = ()
    """Event types this sink takes (`"*"` or an empty list: every type). `flow.snapshot` never
    reaches a sink.
    """
    source_id: NonEmptyStr | None = None
    """Written into the `source_id` of every envelope this sink sends, to tell engines apart;
    `null` leaves it `null`.
    """
    credentials_env: EnvName | None = None
    """Environment variable holding the credentials: `user:password`, a token (no `:`), or
    `@/path/to/file.creds` (a JWT and NKey credentials file). The engine refuses to start
    when it is unset. `null`: connect without credentials.
    """


class JsonlSink(_Model):
    """Append one envelope per line to ``path``."""

    type: Literal["jsonl"]
    """`jsonl`: append each event to a file."""
    tag: Tag
    """Name of this sink, unique among sinks; `GET /api/v1/sinks` and the outbox use it."""
    path: NonEmptyStr
    """File the envelopes are appended to, one JSON object per line."""
    events: EventFilter = ()
    """Event types this sink takes (`"*"` or an empty list: every type). `flow.snapshot` never
    reaches a sink.
    """


Sink = Annotated[WebhookSink | JsonlSink | NatsSink, Field(discriminator="type")]


class Dispatcher(_Model):
    """``api.dispatcher``: delivery timeouts, backoff and exhaustion behaviour."""

    request_timeout_ms: Timeout = 10000
    """Deadline of one webhook POST (connect, send and the whole answer), in milliseconds."""
    backoff_initial_ms: PosInt = 500
    """Upper bound of the first retry delay, in milliseconds; the bound doubles per failure and
    each delay is random below it (full jitter). Must not exceed `backoff_max_ms`.
    """
    backoff_max_ms: PosInt = 60000
    """Largest retry delay, in milliseconds, also the cap on a receiver's `Retry-After`."""
    retry_threshold: PosInt = 10
    """Attempts one event gets before `on_exhausted` applies."""
    on_exhausted: Literal["retry_forever", "dead_letter", "discard"] = "retry_forever"
    """What happens to an event out of attempts, or at once to one the receiver refused (a
    status other than 2xx, 429 and 5xx): `retry_forever` keeps retrying retryable failures
    (a refused event becomes a dead letter), `dead_letter` keeps it on disk (`spliceway
    connector dead-letters`), `discard` counts and drops it.
    """


class Api(_Model):
    """``api``."""

    control: ControlApi = Field(default_factory=ControlApi)
    """The HTTP control API."""
    ipc: IpcApi = Field(default_factory=IpcApi)
    """The local control socket (docs/ipc.md)."""
    grpc: GrpcApi = Field(default_factory=GrpcApi)
    """The gRPC control API on the control port + 1 (docs/grpc.md; needs the `grpc` extra)."""
    event_sinks: tuple[Sink, ...] = ()
    """Where events are delivered, each sink on its own."""
    outbox_path: NonEmptyStr | None = None
    """Directory of the durable outbox: events for the sinks are written and fsynced there
    before delivery and survive a crash or restart; one engine per directory. `null` queues
    them in memory (at most 100,000 per sink, lost at exit).
    """
    dispatcher: Dispatcher = Field(default_factory=Dispatcher)
    """Retry and timeout settings of webhook deliveries."""
    outbox_min_free_bytes: NonNegInt = 1073741824
    """Free disk space, in bytes, the outbox leaves alone; below the reserve new events wait in
    the event ring instead of being written.
    """
    outbox_min_free_percent: Percent = 5
    """The same reserve as a percentage of the filesystem size; the larger of the two applies."""
    flow_hook: FlowHook | None = None
    """A flow hook: a local process that allows or denies each new flow and may tag it
    with a principal and labels (docs/flow-hook.md); `null` means none, at no cost per flow.
    """


# ---------------------------------------------------------------------------
# the document
# ---------------------------------------------------------------------------

_BUILTIN_DIRECT_OUTBOUND = DirectOutbound(tag=BUILTIN_DIRECT, protocol="direct")


class Config(_Model):
    """A validated configuration. Build it with :func:`parse_config`, not directly.

    Constructing ``Config`` runs only the schema; :func:`parse_config` adds the
    cross-checks (references, uniqueness, cycles) that the engine relies on.
    """

    mode: Mode = Field(default_factory=Mode)
    """The routing mode."""
    inbounds: tuple[Inbound, ...] = ()
    """Listeners that accept client connections."""
    outbounds: tuple[Outbound, ...] = ()
    """Ways to reach targets. The built-in `direct` outbound exists even when not listed."""
    outbound_groups: tuple[OutboundGroup, ...] = ()
    """Groups that choose among outbounds (or other groups) or chain them."""
    rules: tuple[Rule, ...] = ()
    """Routing rules, tried in order in mode `rule`; the first match wins."""
    route: Route = Field(default_factory=Route)
    """What happens to flows no rule matches."""
    runtime: Runtime = Field(default_factory=Runtime)
    """Logging, timeouts, sampling, the event ring and DNS."""
    api: Api = Field(default_factory=Api)
    """Control API, event sinks and their outbox."""

    _outbounds: dict[str, AnyOutbound] = PrivateAttr(default_factory=dict)
    _groups: dict[str, AnyGroup] = PrivateAttr(default_factory=dict)

    def model_post_init(self, context: Any, /) -> None:
        """Index tags (the first occurrence wins; duplicates are cross-check errors)."""
        outbounds: dict[str, AnyOutbound] = {}
        for ob in self.outbounds:
            outbounds.setdefault(ob.tag, ob)
        outbounds.setdefault(BUILTIN_DIRECT, _BUILTIN_DIRECT_OUTBOUND)
        groups: dict[str, AnyGroup] = {}
        for g in self.outbound_groups:
            groups.setdefault(g.tag, g)
        self._outbounds, self._groups = outbounds, groups

    def to_dict(self) -> dict[str, Any]:
        """The normalised document (every default filled in); ``parse_config`` accepts it."""
        return self.model_dump(mode="json")

    def outbound_tags(self) -> tuple[str, ...]:
        """Tags of plain outbounds in document order, plus the built-in ``direct`` if unlisted."""
        return tuple(self._outbounds)

    def group_tags(self) -> tuple[str, ...]:
        """Tags of outbound groups in document order."""
        return tuple(self._groups)

    def is_target(self, tag: str) -> bool:
        """Whether ``tag`` names an outbound (built-in ``direct`` included) or a group."""
        return tag in self._outbounds or tag in self._groups

    def find_outbound(self, tag: str) -> AnyOutbound | None:
        """The plain outbound ``tag`` (the built-in ``direct`` if unlisted), else None."""
        return self._outbounds.get(tag)

    def find_group(self, tag: str) -> AnyGroup | None:
        """The outbound group ``tag``, else None."""
        return self._groups.get(tag)


# ---------------------------------------------------------------------------
# pydantic errors -> Details
# ---------------------------------------------------------------------------

#: Where pydantic inserts a discriminator tag into ``loc``: prefix pattern -> tags.
_UNION_TAGS: dict[tuple[str, ...], frozenset[str]] = {
    ("outbounds", "*"): frozenset({"direct", "block", "socks5", "http", "shadowsocks"}),
    ("outbound_groups", "*"): frozenset(
        {"selector", "url_test", "fallback", "relay", "load_balance"}
    ),
    ("api", "event_sinks", "*"): frozenset({"webhook", "jsonl", "nats"}),
    ("runtime", "dns", "answer"): frozenset({"real", "fake_ip"}),
}

_TYPE_MESSAGES = {
    "missing": "required key is missing",
    "tuple_type": "must be a list",
    "list_type": "must be a list",
    "model_type": "must be an object",
    "model_attributes_type": "must be an object",
    "dict_type": "must be an object",
    "string_type": "must be a string",
    "int_type": "must be an integer",
    "bool_type": "must be a boolean",
    "float_type": "must be a number",
}


def _render_loc(loc: tuple[int | str, ...]) -> str | None:
    out: list[str] = []
    pattern: list[str] = []
    for seg in loc:
        if isinstance(seg, int):
            out.append(f"[{seg}]")
            pattern.append("*")
            continue
        tags = _UNION_TAGS.get(tuple(pattern))
        if tags is not None and seg in tags:
            continue  # the discriminator segment pydantic inserts for unions
        out.append(f".{seg}" if out else seg)
        pattern.append(seg)
    return "".join(out) or None


def _join(path: str | None, key: str) -> str:
    return f"{path}.{key}" if path else key


def _details_from(exc: ValidationError) -> list[Detail]:
    details: list[Detail] = []
    errors = exc.errors(include_url=False)
    for err in errors:
        etype = err["type"]
        path = _render_loc(tuple(err["loc"]))
        ctx = err.get("ctx") or {}
        if etype == "extra_forbidden":
            message = f"unknown key {err['loc'][-1]!r}"
        elif etype in ("union_tag_not_found", "union_tag_invalid"):
            key = str(ctx.get("discriminator", "")).strip("'\"")
            path = _join(path, key)
            if etype == "union_tag_not_found":
                message = "required key is missing"
            else:
                message = f"must be one of {ctx.get('expected_tags')}"
        elif etype == "too_short" and ctx.get("min_length") == 1:
            # pydantic counts only the items that validated: skip when an item failed
            prefix = tuple(err["loc"])
            if any(tuple(o["loc"])[: len(prefix)] == prefix and o is not err for o in errors):
                continue
            message = "must not be empty"
        elif etype == "model_type" and path is None:
            message = "the configuration must be a JSON object"
        elif etype in _TYPE_MESSAGES:
            message = _TYPE_MESSAGES[etype]
        elif etype == "value_error":
            message = str(ctx.get("error", err["msg"]))
        else:
            message = err["msg"].replace("Input should be", "must be", 1)
            message = message.replace("Value should have", "must have", 1)
        details.append(Detail(message, path))
    return details


# ---------------------------------------------------------------------------
# cross-checks over the raw document (defensive: the schema reports type problems)
# ---------------------------------------------------------------------------


def _items(container: Any, key: str) -> list[tuple[int, Mapping[str, Any]]]:
    value = container.get(key) if isinstance(container, Mapping) else None
    if not isinstance(value, list | tuple):
        return []
    return [(i, item) for i, item in enumerate(value) if isinstance(item, Mapping)]


def _sub(container: Any, key: str) -> Mapping[str, Any]:
    value = container.get(key) if isinstance(container, Mapping) else None
    return value if isinstance(value, Mapping) else {}


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def _port(value: Any) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= 65535:
        return value
    return None


def _string_items(value: Any, path: str) -> Iterator[tuple[str, str]]:
    """(item, path) for a list-or-single-string condition value."""
    if isinstance(value, str):
        yield value, path
    elif isinstance(value, list | tuple):
        for j, item in enumerate(value):
            if isinstance(item, str):
                yield item, f"{path}[{j}]"


#: Outbound protocols a relay group can dial through.
RELAY_HOP_PROTOCOLS = frozenset({"socks5", "http", "shadowsocks"})


class _Checker:
    """Collects cross-check problems for one raw document."""

    def __init__(self, doc: Mapping[str, Any]) -> None:
        self.doc = doc
        self.details: list[Detail] = []
        self.inbound_tags: set[str] = set()
        self.targets: set[str] = {BUILTIN_DIRECT}
        self.group_index: dict[str, int] = {}
        self.protocols: dict[str, Any] = {}

    def add(self, message: str, path: str) -> None:
        self.details.append(Detail(message, path))

    def run(self) -> list[Detail]:
        self.check_inbounds()
        self.check_target_tags()
        self.check_outbounds()
        self.check_groups()
        self.check_rules()
        self.check_mode_and_route()
        self.check_runtime()
        self.check_api()
        self.check_listeners()
        return self.details

    def unique(
        self, first: dict[str, int], what: str, value: str, index: int, also: str, path: str
    ) -> None:
        """Report ``value`` when an earlier item (``also[first[value]]``) already used it."""
        if value in first:
            self.add(f"duplicate {what} {value!r} (also {also}[{first[value]}])", path)
        else:
            first[value] = index

    def ref(self, value: Any, path: str) -> None:
        tag = _str(value)
        if tag is not None and tag not in self.targets:
            self.add(f"unknown outbound or group {tag!r}", path)

    def check_inbounds(self) -> None:
        first: dict[str, int] = {}
        for i, ib in _items(self.doc, "inbounds"):
            tag = _str(ib.get("tag"))
            if tag is not None:
                self.unique(first, "inbound tag", tag, i, "inbounds", f"inbounds[{i}].tag")
            basic = ib.get("protocol") in ("http", "mixed")
            names: dict[str, int] = {}
            for j, user in _items(ib, "users"):
                name = _str(user.get("username"))
                if name is None:
                    continue
                path = f"inbounds[{i}].users[{j}].username"
                self.unique(names, "username", name, j, "users", path)
                if basic and ":" in name:
                    self.add("must not contain ':' on an http or mixed inbound", path)
        self.inbound_tags = set(first)

    def check_target_tags(self) -> None:
        first: dict[str, str] = {}
        for section in ("outbounds", "outbound_groups"):
            for i, item in _items(self.doc, section):
                tag = _str(item.get("tag"))
                if tag is None:
                    continue
                path = f"{section}[{i}].tag"
                if tag == BUILTIN_DIRECT and item.get("protocol") != "direct":
                    self.add(
                        "tag 'direct' is reserved for the built-in direct outbound "
                        "(allowed only on an outbound with protocol 'direct')",
                        path,
                    )
                elif tag in first:
                    self.add(
                        f"duplicate tag {tag!r} (also {first[tag]}); outbounds and "
                        "outbound_groups share one namespace",
                        path,
                    )
                else:
                    first[tag] = path.removesuffix(".tag")
                    if section == "outbound_groups":
                        self.group_index[tag] = i
                    else:
                        self.protocols[tag] = item.get("protocol")
        self.targets |= set(first)

    def check_outbounds(self) -> None:
        for i, ob in _items(self.doc, "outbounds"):
            if ob.get("protocol") not in ("socks5", "http"):
                continue
            has_user = ob.get("username") is not None
            has_pass = ob.get("password") is not None
            if has_user and not has_pass:
                self.add("required when username is set", f"outbounds[{i}].password")
            elif has_pass and not has_user:
                self.add("required when password is set", f"outbounds[{i}].username")

    def check_groups(self) -> None:
        edges: dict[str, list[tuple[str, str]]] = {}
        for i, g in _items(self.doc, "outbound_groups"):
            members = g.get("outbounds")
            if not isinstance(members, list | tuple):
                continue  # the schema reports it
            seen: set[str] = set()
            for tag, path in _string_items(members, f"outbound_groups[{i}].outbounds"):
                if tag in seen:
                    self.add(f"member {tag!r} is listed twice", path)
                seen.add(tag)
                self.ref(tag, path)
            if g.get("kind") == "relay":
                self.check_relay_hops(members, f"outbound_groups[{i}].outbounds")
            default = _str(g.get("default"))
            if g.get("kind") == "selector" and default is not None and default not in seen:
                self.add(
                    f"{default!r} is not one of this selector's outbounds",
                    f"outbound_groups[{i}].default",
                )
            tag = _str(g.get("tag"))
            if tag is not None and self.group_index.get(tag) == i:
                edges[tag] = [
                    (m, f"outbound_groups[{i}].outbounds[{j}]")
                    for j, m in enumerate(members)
                    if isinstance(m, str) and m in self.group_index
                ]
        self.check_cycles(edges)

    def check_relay_hops(self, members: list[Any] | tuple[Any, ...], path: str) -> None:
        """Relay hops are proxy outbounds; a shadowsocks hop can only be the last."""
        last = len(members) - 1
        for j, tag in enumerate(members):
            if not isinstance(tag, str):
                continue
            if tag in self.group_index:
                self.add(
                    f"relay hop {tag!r} is a group; hops must be socks5, http or "
                    "shadowsocks outbounds",
                    f"{path}[{j}]",
                )
                continue
            protocol = self.protocols.get(tag, "direct" if tag == BUILTIN_DIRECT else None)
            if protocol is None:
                continue  # unknown tags are reported by ref()
            if protocol not in RELAY_HOP_PROTOCOLS:
                self.add(
                    f"relay hop {tag!r} has protocol {protocol!r}; hops must be socks5, http "
                    "or shadowsocks outbounds",
                    f"{path}[{j}]",
                )
            elif protocol == "shadowsocks" and j != last:
                self.add(
                    f"shadowsocks hop {tag!r} must be the last hop of a relay "
                    "(its stream is encrypted end to end)",
                    f"{path}[{j}]",
                )

    def check_cycles(self, edges: dict[str, list[tuple[str, str]]]) -> None:
        """Report each back edge of a depth-first walk as one cycle."""
        state: dict[str, int] = {}  # 1 = on the stack, 2 = done
        stack: list[str] = []

        def visit(node: str) -> None:
            state[node] = 1
            stack.append(node)
            for nxt, path in edges.get(node, ()):
                if state.get(nxt) == 1:
                    cycle = [*stack[stack.index(nxt) :], nxt]
                    self.add(f"group cycle: {' -> '.join(cycle)}", path)
                elif nxt not in state:
                    visit(nxt)
            stack.pop()
            state[node] = 2

        for tag in edges:
            if tag not in state:
                visit(tag)

    def check_rules(self) -> None:
        for i, rule in _items(self.doc, "rules"):
            base = f"rules[{i}]"
            if not any(rule.get(k) is not None for k in CONDITION_KEYS):
                self.add("a rule needs at least one condition", base)
            action = rule.get("action", "route")
            outbound = rule.get("outbound")
            if action == "route":
                if outbound is None:
                    self.add("required when action is 'route'", f"{base}.outbound")
                else:
                    self.ref(outbound, f"{base}.outbound")
            elif action == "block" and outbound is not None:
                self.add("must not be set when action is 'block'", f"{base}.outbound")
            for tag, path in _string_items(rule.get("inbound_tag"), f"{base}.inbound_tag"):
                if tag not in self.inbound_tags:
                    self.add(f"unknown inbound {tag!r}", path)

    def check_mode_and_route(self) -> None:
        mode = _sub(self.doc, "mode")
        if mode.get("kind") == "global" and mode.get("outbound") is None:
            self.add("required when mode.kind is 'global'", "mode.outbound")
        self.ref(mode.get("outbound"), "mode.outbound")
        self.ref(_sub(self.doc, "route").get("final", BUILTIN_DIRECT), "route.final")

    def check_runtime(self) -> None:
        cache = _sub(_sub(_sub(self.doc, "runtime"), "dns"), "cache")
        low, high = cache.get("min_ttl_seconds"), cache.get("max_ttl_seconds")
        if isinstance(low, int) and isinstance(high, int) and low > high:
            self.add("must not exceed max_ttl_seconds", "runtime.dns.cache.min_ttl_seconds")

    def check_api(self) -> None:
        api = _sub(self.doc, "api")
        first: dict[str, int] = {}
        for i, sink in _items(api, "event_sinks"):
            tag = _str(sink.get("tag"))
            if tag is not None:
                path = f"api.event_sinks[{i}].tag"
                self.unique(first, "sink tag", tag, i, "api.event_sinks", path)
        names: dict[str, int] = {}
        for i, key in _items(_sub(api, "control"), "keys"):
            name = _str(key.get("name"))
            if name is not None:
                path = f"api.control.keys[{i}].name"
                self.unique(names, "key name", name, i, "api.control.keys", path)
        dispatcher = _sub(api, "dispatcher")
        low, high = dispatcher.get("backoff_initial_ms"), dispatcher.get("backoff_max_ms", 60000)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            self.add("must not exceed backoff_max_ms", "api.dispatcher.backoff_initial_ms")
        hook = _sub(api, "flow_hook")
        tags = hook.get("inbound_tags")
        if isinstance(tags, list | tuple):
            for j, tag in enumerate(tags):
                if isinstance(tag, str) and tag and tag not in self.inbound_tags:
                    self.add(f"unknown inbound {tag!r}", f"api.flow_hook.inbound_tags[{j}]")

    def check_listeners(self) -> None:
        used: dict[tuple[str, int], str] = {}

        def claim(listen: Mapping[str, Any], default_port: int | None, path: str) -> None:
            address = listen.get("address", "127.0.0.1")
            port = _port(listen.get("port", default_port))
            if not isinstance(address, str) or port is None:
                return
            key = (address, port)
            if key in used:
                self.add(f"{address}:{port} is already used by {used[key]}", f"{path}.port")
            else:
                used[key] = path

        control = _sub(_sub(self.doc, "api"), "control")
        if control.get("enabled", True) is True:
            claim(_sub(control, "listen"), 9090, "api.control.listen")
        for i, ib in _items(self.doc, "inbounds"):
            claim(_sub(ib, "listen"), None, f"inbounds[{i}].listen")


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def _validate(doc: object) -> tuple[Config | None, list[Detail]]:
    details: list[Detail] = []
    cfg: Config | None = None
    try:
        cfg = Config.model_validate(doc)
    except ValidationError as exc:
        details.extend(_details_from(exc))
    if isinstance(doc, Mapping):
        seen = set(details)
        details.extend(d for d in _Checker(doc).run() if d not in seen)
    return (None if details else cfg), details


def _invalid(details: list[Detail], message: str = "configuration is invalid") -> ApiError:
    first = details[0]
    where = f"{first.field_path}: " if first.field_path else ""
    count = f"{len(details)} problem{'s' if len(details) != 1 else ''}"
    return ApiError(
        "invalid_argument", message, cause=f"{count}: {where}{first.message}", details=details
    )


def validate_document(doc: object) -> list[Detail]:
    """Every problem of ``doc`` (a decoded JSON document); empty when it is valid."""
    return _validate(doc)[1]


def parse_config(doc: object) -> Config:
    """Validate ``doc`` and return the :class:`Config`.

    Raises ``ApiError("invalid_argument", "configuration is invalid", cause=..., details=[...])``
    listing every problem.
    """
    if isinstance(doc, Config):
        return doc
    cfg, details = _validate(doc)
    if details or cfg is None:
        raise _invalid(details or [Detail("configuration is invalid")])
    return cfg


def _unset_variable(name: str, field_path: str) -> Detail:
    if field_path == "api.control.api_key_env":
        remedy = (
            f'export {name}=<the key clients must send>, or set "api_key_env": null in '
            "api.control for a control API without a key (keep it on loopback)"
        )
    else:
        remedy = f"export {name}=<the key>, or remove this entry"
    return Detail(f"environment variable {name} is not set: {remedy}", field_path)


def control_environment_problems(
    control: ControlApi, environ: Mapping[str, str] | None = None
) -> list[Detail]:
    """The control API's key variables (``api_key_env``, ``keys[].key_env``) that are unset."""
    env = os.environ if environ is None else environ
    problems: list[Detail] = []
    if control.api_key_env is not None and not env.get(control.api_key_env):
        problems.append(_unset_variable(control.api_key_env, "api.control.api_key_env"))
    for i, key in enumerate(control.keys):
        if not env.get(key.key_env):
            problems.append(_unset_variable(key.key_env, f"api.control.keys[{i}].key_env"))
    return problems


def environment_problems(config: Config, environ: Mapping[str, str] | None = None) -> list[Detail]:
    """Every environment variable ``config`` needs at start that is unset or empty.

    The document can be valid while its environment is not: ``spliceway validate``
    reports these beside the document's own problems, and the engine refuses to start
    on any of them (the control API's keys are read only when it is enabled).
    """
    control = config.api.control
    problems = control_environment_problems(control, environ) if control.enabled else []
    return problems + sink_environment_problems(config.api.event_sinks, environ)


def sink_environment_problems(
    sinks: Sequence[Sink], environ: Mapping[str, str] | None = None
) -> list[Detail]:
    """The sinks' secret and credential variables that are unset or unusable."""
    return [
        p for i, sink in enumerate(sinks) for p in one_sink_environment_problems(i, sink, environ)
    ]


def one_sink_environment_problems(
    index: int, sink: Sink, environ: Mapping[str, str] | None = None
) -> list[Detail]:
    """:func:`sink_environment_problems` of ``api.event_sinks[index]``."""
    env = os.environ if environ is None else environ
    problems: list[Detail] = []
    for field in ("secret_env", "credentials_env"):
        name = getattr(sink, field, None)
        if name is None:
            continue
        where = f"api.event_sinks[{index}].{field}"
        value = env.get(name)
        if not value:
            problems.append(_unset_variable(name, where))
        elif field == "secret_env":
            try:
                secret_key(value)
            except ValueError as ex:
                problems.append(Detail(f"environment variable {name} {ex}", where))
    return problems


def check_environment(config: Config, environ: Mapping[str, str] | None = None) -> None:
    """Raise ``invalid_argument`` listing every problem :func:`environment_problems` finds."""
    check_environment_details(environment_problems(config, environ))


def check_environment_details(problems: list[Detail]) -> None:
    """Raise ``invalid_argument`` (field path of the first) when ``problems`` is not empty."""
    if problems:
        message = (
            problems[0].message
            if len(problems) == 1
            else f"{len(problems)} environment variables the configuration names are not set"
        )
        error = _invalid(problems, message)
        error.field_path = problems[0].field_path
        raise error


_NOT_JSON = "configuration file is not valid JSON"
_NOT_YAML = "configuration file is not valid YAML"


class _DuplicateKeyError(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise _DuplicateKeyError(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _decode_json(text: str, source: str) -> Any:
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        detail = Detail(f"{source}: line {exc.lineno}, column {exc.colno}: {exc.msg}")
        raise _invalid([detail], "configuration file is not valid JSON") from None
    except _DuplicateKeyError as exc:
        detail = Detail(f"{source}: duplicate key {exc.args[0]!r} in an object")
        raise _invalid([detail], "configuration file is not valid JSON") from None
    except RecursionError:
        raise _invalid([Detail(f"{source}: nested too deeply")], _NOT_JSON) from None
    except ValueError as exc:
        raise _invalid(
            [Detail(f"{source}: {exc}")], "configuration file is not valid JSON"
        ) from None


@functools.cache
def _yaml_loader() -> Any:
    """PyYAML's SafeLoader, except that a mapping may not give a key twice (as in JSON).

    The check runs on the composed nodes, before merge keys are applied, so ``<<``
    keeps its meaning: a mapping may override keys it merges in, and the mappings it
    merges may share keys (the first one listed wins). A key written twice in one
    mapping, ``<<`` included, is an error at the line and column of the second one.
    """
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def __init__(self, stream: Any) -> None:
            super().__init__(stream)
            self._flattening: set[int] = set()

        def compose_mapping_node(self, anchor: Any) -> Any:
            node = super().compose_mapping_node(anchor)
            first: dict[tuple[str, str], Any] = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode):
                    continue
                key = (key_node.tag, key_node.value)
                if key in first:
                    raise yaml.composer.ComposerError(
                        "while composing a mapping",
                        node.start_mark,
                        f"duplicate key {key_node.value!r} in a mapping "
                        f"(first given at line {first[key].line + 1})",
                        key_node.start_mark,
                    )
                first[key] = key_node.start_mark
            return node

        def flatten_mapping(self, node: Any) -> None:
            # The merge-key rules themselves, not PyYAML's: 6.0.4 changed which of two
            # merged mappings wins a shared key (the later one), against the rule that
            # the one listed first wins; the same file must mean the same config on
            # every PyYAML this package allows.
            if id(node) in self._flattening:
                # An anchor merged into itself (`&a {<<: *a}`) would recurse without end.
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping",
                    node.start_mark,
                    "a mapping merges itself (through an alias of its own anchor)",
                    node.start_mark,
                )
            self._flattening.add(id(node))
            try:
                merged = [
                    pairs
                    for key, value in node.value
                    if _is_merge(key)
                    for pairs in self._merged(node, value)
                ]
            finally:
                self._flattening.discard(id(node))
            own = [(key, value) for key, value in node.value if not _is_merge(key)]
            for key, _ in own:
                if key.tag == "tag:yaml.org,2002:value":
                    key.tag = "tag:yaml.org,2002:str"
            if merged:
                # Later pairs win when the dict is built: the mappings listed last go
                # first, and the mapping's own keys after them all.
                node.value = [pair for pairs in reversed(merged) for pair in pairs] + own

        def _merged(self, node: Any, value: Any) -> list[list[Any]]:
            """The flattened pairs of each mapping one ``<<`` names, in the order listed."""
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            out = []
            for source in sources:
                if not isinstance(source, yaml.MappingNode):
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping",
                        node.start_mark,
                        f"expected a mapping or a list of mappings to merge, but found {source.id}",
                        source.start_mark,
                    )
                self.flatten_mapping(source)
                out.append(source.value)
            return out

    def _is_merge(key_node: Any) -> bool:
        return bool(key_node.tag == "tag:yaml.org,2002:merge")

    return UniqueKeyLoader


def _decode_yaml(text: str, source: str) -> Any:
    try:
        import yaml  # optional dependency
    except ImportError:
        detail = Detail(f"{source}: YAML configuration needs PyYAML (pip install pyyaml)")
        raise _invalid([detail], "YAML configuration is not supported") from None
    try:
        return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader: no arbitrary objects
    except RecursionError:
        raise _invalid([Detail(f"{source}: nested too deeply")], _NOT_YAML) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        detail = Detail(f"{source}: {where}{problem}")
        raise _invalid([detail], "configuration file is not valid YAML") from None


def load_config_file(path: str | os.PathLike[str]) -> Config:
    """Read, decode and validate a configuration file (JSON; ``.yaml``/``.yml`` with PyYAML)."""
    return parse_config(read_config_document(path))


def read_config_document(path: str | os.PathLike[str]) -> Any:
    """A configuration file's document, decoded but not validated (``spliceway reload``
    sends it as it is, so the engine's source file gets the user's own document)."""
    source = os.fspath(path)
    try:
        raw = Path(source).read_bytes()
    except OSError as exc:
        detail = Detail(f"cannot read {source}: {exc.strerror or exc}")
        raise _invalid([detail], "configuration file cannot be read") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        detail = Detail(f"{source}: not UTF-8 (byte offset {exc.start})")
        raise _invalid([detail], "configuration file is not valid UTF-8") from None
    if source.lower().endswith((".yaml", ".yml")):
        return _decode_yaml(text, source)
    return _decode_json(text, source)


def config_schema() -> dict[str, Any]:
    """The configuration's JSON Schema (draft 2020-12), as ``spliceway config-schema`` prints it."""
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **Config.model_json_schema(),
        "title": "spliceway configuration",
    }


@functools.cache
def default_config() -> Config:
    """The embedded default: mixed 127.0.0.1:7890, direct + block, a keyless control API."""
    text = resources.files("spliceway.config").joinpath("default_config.json").read_text("utf-8")
    return parse_config(_decode_json(text, "default_config.json"))


def default_ipc_path(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_RUNTIME_DIR/spliceway/control.sock``, else ``/tmp/spliceway-<uid>/control.sock``."""
    env = os.environ if environ is None else environ
    runtime_dir = env.get("XDG_RUNTIME_DIR")
    if runtime_dir:
        return os.path.join(runtime_dir, "spliceway", "control.sock")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return f"/tmp/spliceway-{uid}/control.sock"
