"""``api``: the control API (HTTP, IPC, gRPC), the flow hook, event sinks and the outbox."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, Strict, model_validator

from spliceway.config.environment import (
    _unset_variable,
    check_environment_details,
    default_ipc_path,
)
from spliceway.config.models_inbounds import ControlListen
from spliceway.config.validators import (
    DEFAULT_API_KEY_ENV,
    EnvName,
    IpAddr,
    ListenPort,
    NonEmptyStr,
    NonNegInt,
    Percent,
    PosInt,
    SBool,
    SStr,
    Tag,
    Timeout,
    _check_event_type,
    _check_nats_subject,
    _check_nats_url,
    _check_webhook_url,
    _Model,
)
from spliceway.support.webhook_secret import SIGNATURE_HEADERS

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


class GrpcApi(_Model):
    """``api.grpc``: the gRPC control API (docs/grpc.md; needs the ``grpc`` extra)."""

    enabled: SBool = False
    """Serve the gRPC service `spliceway.v1.Control` (with server reflection) on the control
    API's address and port + 1, with its keys and limits. Needs `api.control.enabled` and
    the `grpc` extra (`pip install 'spliceway[grpc]'`); the engine refuses to start
    otherwise (`invalid_argument`, `feature_disabled`).
    """


class ClashListen(_Model):
    """``api.clash.listen`` (defaults 127.0.0.1:9097)."""

    address: IpAddr = "127.0.0.1"
    """IP address the Clash API binds (`0.0.0.0` or `::` for every interface), or
    `localhost`. Keep it on loopback unless `secret_env` is set.
    """
    port: ListenPort = 9097
    """TCP port of the Clash API; `0` lets the operating system choose."""


class ClashApi(_Model):
    """``api.clash``: a listener speaking mihomo's external-controller API (docs/clash-api.md),
    for the dashboards and tools of the Clash world (zashboard, metacubexd, Yacd)."""

    enabled: SBool = False
    """Serve the Clash-compatible API on its own port (the control API keeps its own)."""
    listen: ClashListen = Field(default_factory=ClashListen)
    """Where the Clash API listens."""
    secret_env: EnvName | None = None
    """Environment variable holding the secret clients send as `Authorization: Bearer`
    (or `?token=` on WebSocket upgrades). While `enabled`, the engine refuses to start when
    it is unset or empty. `null`: no secret; then only loopback clients with a local `Host`
    and `Origin` are served, as for a control API without a key.
    """
    cors_allow_origins: tuple[NonEmptyStr, ...] = ()
    """Origins (`scheme://host[:port]`, or `*`) a browser page may call the API from; an
    empty list allows none but the API's own origin.
    """
    external_ui: NonEmptyStr | None = None
    """Directory of a dashboard's built files (zashboard, metacubexd, Yacd) served at
    `/ui/` on this listener, or `null` for none.
    """

    def read_secret(self, environ: Mapping[str, str] | None = None) -> str | None:
        """The secret, or ``None`` when ``secret_env`` is null; ``invalid_argument`` naming
        the variable when it is unset or empty."""
        if self.secret_env is None:
            return None
        env = os.environ if environ is None else environ
        value = env.get(self.secret_env)
        if not value:
            check_environment_details([_unset_variable(self.secret_env, "api.clash.secret_env")])
        return value


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
    clash: ClashApi = Field(default_factory=ClashApi)
    """A Clash-compatible (mihomo external-controller) API for Clash dashboards and tools
    (docs/clash-api.md); off by default.
    """
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
