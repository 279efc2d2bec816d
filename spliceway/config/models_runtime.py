"""``runtime``: logging, timeouts, sampling, the event ring, DNS and the TUN."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, Strict

from spliceway.config.models_inbounds import Listen
from spliceway.config.validators import (
    Cidr,
    NonEmptyStr,
    NonNegInt,
    PosInt,
    ProbeUrl,
    SBool,
    Tag,
    _check_dns_server,
    _check_interface_address,
    _check_netmask,
    _Model,
)


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


class GeoData(_Model):
    """``runtime.geodata``: the databases behind ``geoip``, ``source_geoip`` and ``geosite``."""

    geoip_path: NonEmptyStr | None = None
    """MaxMind-format database (`.mmdb`, a country or an ASN database) read by `geoip` and
    `source_geoip` rules; `null`: such rules are a configuration error."""
    asn_path: NonEmptyStr | None = None
    """MaxMind-format ASN database (GeoLite2-ASN and the like: `autonomous_system_number`)
    read by `ip_asn` and `source_ip_asn` rules; `null`: they read `geoip_path` (a database
    that carries both)."""
    geosite_path: NonEmptyStr | None = None
    """v2fly `geosite.dat` (a protobuf list of domain lists) read by `geosite` rules; `null`:
    such rules are a configuration error."""
    geoip_url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    """URL `providers.update` downloads `geoip_path` from (through the built-in `direct`
    outbound). Nothing is downloaded unless this is set."""
    geosite_url: Annotated[str, Field(pattern=r"^https?://")] | None = None
    """URL `providers.update` downloads `geosite_path` from (through the built-in `direct`
    outbound). Nothing is downloaded unless this is set."""


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
    providers_cache_dir: NonEmptyStr | None = None
    """Directory holding the last good copy of every fetched provider (so the engine starts
    offline); `null`: a `providers/` directory beside `api.outbox_path`, else
    `$XDG_STATE_HOME/spliceway/providers`."""
    geodata: GeoData = Field(default_factory=GeoData)
    """GeoIP and GeoSite databases."""
