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

Decisions this package makes where the spec leaves room:

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

Modules (their public names, but ``diff``'s, are re-exported here):

- ``validators``        field validators, the Annotated scalar types, the models' base
- ``models_inbounds``   ``inbounds``: listeners and their users
- ``models_outbounds``  ``outbounds`` and ``outbound_groups``
- ``models_route``      ``mode``, ``rules``, ``route``
- ``models_runtime``    ``runtime`` (DNS, TUN, timeouts, the event ring)
- ``models_api``        ``api`` (control, IPC, gRPC, flow hook, sinks, outbox)
- ``models``            ``Config``, the document
- ``checks``            the cross-checks over the raw document
- ``validation``        the two passes, pydantic's errors as details, ``parse_config``
- ``environment``       the variables a valid document needs at start
- ``loading``           files (JSON, YAML), the embedded default, the JSON Schema
- ``problems``          problems -> the ``invalid_argument`` error
- ``diff``              which components two documents differ in (what a reload replaces)
"""

from __future__ import annotations

from spliceway.config.environment import (
    check_environment,
    check_environment_details,
    control_environment_problems,
    default_ipc_path,
    environment_problems,
    one_sink_environment_problems,
    sink_environment_problems,
)
from spliceway.config.loading import (
    config_schema,
    default_config,
    load_config_file,
    read_config_document,
)
from spliceway.config.models import Config, resolve_ipc
from spliceway.config.models_api import (
    Api,
    ApiKeySpec,
    ClashApi,
    ControlApi,
    Dispatcher,
    FlowHook,
    GrpcApi,
    IpcApi,
    JsonlSink,
    NatsSink,
    Sink,
    WebhookSink,
)
from spliceway.config.models_inbounds import ControlListen, Inbound, InboundUser, Listen
from spliceway.config.models_outbounds import (
    BlockOutbound,
    DirectOutbound,
    FallbackGroup,
    HttpOutbound,
    LoadBalanceGroup,
    RelayGroup,
    SelectorGroup,
    ShadowsocksOutbound,
    Socks5Outbound,
    UrlTestGroup,
)
from spliceway.config.models_route import Mode, Route, Rule, SubRule
from spliceway.config.models_runtime import (
    DnsCache,
    DnsSettings,
    FakeIpAnswer,
    NetworkSettings,
    RealAnswer,
    Runtime,
    TunSettings,
)
from spliceway.config.validation import parse_config, validate_document
from spliceway.config.validators import (
    BUILTIN_DIRECT,
    CONDITION_KEYS,
    DEFAULT_API_KEY_ENV,
    EVENT_TYPES,
    parse_dns_server,
    parse_port_spec,
)

__all__ = [
    "BUILTIN_DIRECT",
    "CONDITION_KEYS",
    "DEFAULT_API_KEY_ENV",
    "EVENT_TYPES",
    "Api",
    "ApiKeySpec",
    "BlockOutbound",
    "ClashApi",
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
    "Sink",
    "Socks5Outbound",
    "SubRule",
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
    "parse_port_spec",
    "read_config_document",
    "resolve_ipc",
    "sink_environment_problems",
    "validate_document",
]
