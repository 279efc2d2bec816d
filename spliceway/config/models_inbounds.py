"""``inbounds``: the proxy's listeners, their addresses and users."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from spliceway.config.validators import (
    Credential,
    IpAddr,
    ListenPort,
    NonEmptyStr,
    NonNegInt,
    SBool,
    Tag,
    _fill_from,
    _Model,
    _schema_optional,
)


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
