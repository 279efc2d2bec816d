"""``outbounds`` and ``outbound_groups``: the ways to reach a target, and groups over them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from spliceway.config.validators import (
    Credential,
    NonEmptyStr,
    NonNegInt,
    PosInt,
    ProbeUrl,
    RegexList,
    RemotePort,
    SStr,
    Tag,
    Timeout,
    _fill_from,
    _Model,
    _schema_optional,
)


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


#: Inline members of a group; may be empty when the group lists ``providers`` (a cross-check
#: says so when it has neither).
Members = tuple[Tag, ...]
#: Proxy providers whose outbounds a group takes as members, after its inline ones.
ProviderMembers = tuple[Tag, ...]

# The three fields every group kind shares, declared once with their description (a
# docstring under each of the five classes would repeat it word for word).
GroupProviders = Annotated[
    ProviderMembers,
    Field(
        description=(
            "Proxy providers (names under `providers.proxies`) whose outbounds become members"
            " after the inline `outbounds`, provider by provider in this order (each filtered"
            " by its provider's `filter` and `exclude_filter`, then by this group's). A group"
            " whose members are all absent (its providers not fetched yet, empty or filtered "
            "to nothing) stays, showing no member; a flow routed to it fails with code "
            "`no_member`."
        )
    ),
]
GroupFilter = Annotated[
    RegexList | None,
    Field(
        description=(
            "Keep only the provider members (what `providers` give, after each provider's own"
            " `filter` and `exclude_filter`) whose name matches one of these regular "
            "expressions (searched, Python `re` syntax), in mihomo's order: each provider's "
            "matches of the first expression, then of the next. With two or more expressions "
            "and two or more sources (the inline `outbounds` count as one), all members are "
            "then put in that order across sources, those no expression matches last. Inline "
            "`outbounds` are never dropped by it, so without `providers` it changes nothing. "
            "A provider's outbound is matched by its name with the provider's `override` "
            "prefix and suffix."
        )
    ),
]
GroupExcludeFilter = Annotated[
    RegexList | None,
    Field(
        description=(
            "Drop every member, inline or from a provider, whose name matches one of these "
            "regular expressions (searched, Python `re` syntax), after `filter`: an inline "
            "member by its tag, a provider's outbound by its name with the provider's "
            "`override` prefix and suffix. A group without `providers` must keep a member."
        )
    ),
]


class SelectorGroup(_Model):
    """Manually selected member; ``default`` is the initial selection (first member)."""

    model_config = ConfigDict(json_schema_extra=_schema_optional("default"))

    tag: Tag
    """Name of this group, unique among outbounds and groups."""
    kind: Literal["selector"]
    """`selector`: flows take the member chosen by hand (command `policies.select`)."""
    outbounds: Members = ()
    """Members: outbound or group tags, each at most once (may be empty when `providers`
    gives members)."""
    providers: GroupProviders = ()
    filter: GroupFilter = None
    exclude_filter: GroupExcludeFilter = None
    default: Tag | None = None
    """Member selected at start; defaults to the first member (a provider's outbound, by
    its tag, when the group has providers; with a group `filter`, the first member after
    it). A selection made with `policies.select` lasts
    while the member exists (also across a provider's refresh) until the engine stops.
    """

    @model_validator(mode="before")
    @classmethod
    def _default_first(cls, data: Any) -> Any:
        # A group `filter` may put a provider's outbound before the inline members (two
        # expressions or more): the first member is known once the providers are merged.
        if isinstance(data, dict) and data.get("providers") and data.get("filter"):
            return data
        return _fill_from(data, "default", "outbounds", first=True)


class UrlTestGroup(_Model):
    """Lowest-latency healthy member, re-probed every ``interval_seconds``."""

    tag: Tag
    """Name of this group, unique among outbounds and groups."""
    kind: Literal["url_test"]
    """`url_test`: flows take the healthy member with the lowest probe latency."""
    outbounds: Members = ()
    """Members: outbound or group tags, each at most once, probed in every round."""
    providers: GroupProviders = ()
    filter: GroupFilter = None
    exclude_filter: GroupExcludeFilter = None
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
    outbounds: Members = ()
    """Members in order of preference: outbound or group tags, each at most once."""
    providers: GroupProviders = ()
    filter: GroupFilter = None
    exclude_filter: GroupExcludeFilter = None
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
    outbounds: Members = ()
    """Hops in dialling order: `socks5`, `http` or `shadowsocks` outbounds (not groups); a
    `shadowsocks` hop can only be the last.
    """
    providers: GroupProviders = ()
    filter: GroupFilter = None
    exclude_filter: GroupExcludeFilter = None


class LoadBalanceGroup(_Model):
    """Spread flows over the healthy members."""

    tag: Tag
    """Name of this group, unique among outbounds and groups."""
    kind: Literal["load_balance"]
    """`load_balance`: flows are spread over the healthy members (over all members when none is
    healthy).
    """
    outbounds: Members = ()
    """Members: outbound or group tags, each at most once."""
    providers: GroupProviders = ()
    filter: GroupFilter = None
    exclude_filter: GroupExcludeFilter = None
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
