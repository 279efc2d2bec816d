"""The effective settings of a TUN: ``tun.start`` parameters (or ``runtime.tun``) resolved.

:func:`resolve_tun_options` turns the parameters of interface.md 4.4 into a
:class:`TunOptions` whose every field is final: the interface addresses of both
families, the MTU (the parameter, else ``runtime.network.mtu``), the captured ranges
split by family, and the routing numbers. Everything after it (device, routing,
status) reads only this object, so what ``tun_status`` reports is what was applied.

Decisions beyond 4.4 (documented in docs/tun.md by the integrating change):

- ``addr`` in CIDR form keeps its prefix; a bare IPv4 address takes ``mask``; a bare
  IPv6 address takes ``/64`` (``mask`` is IPv4 only).
- ``dual_stack`` true with no address of the other family adds a default one
  (:data:`DEFAULT_INET4` or :data:`DEFAULT_INET6`), because the system stack needs an
  interface address in each family it captures. ``dual_stack`` false captures only
  the family of ``addr``; a ``secondary_addr`` with it is a contradiction, refused.
- The system stack needs a second address B = A + 1 inside the prefix, so an IPv4
  prefix longer than /30 or an IPv6 prefix longer than /126 is refused.
- An IPv6 MTU below 1280 is refused when IPv6 is captured (the kernel would drop
  IPv6 from the device).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from spliceway.errors import invalid_argument

#: The IPv4 address given to a dual-stack TUN whose parameters name only IPv6. Outside
#: the default fake-ip range (198.18.0.0/15), so the two never overlap.
DEFAULT_INET4 = "172.19.0.1/30"
#: The IPv6 address given to a dual-stack TUN whose parameters name only IPv4 (a
#: unique local address, RFC 4193; the one sing-box's documentation uses).
DEFAULT_INET6 = "fdfe:dcba:9876::1/126"

#: Prefix length of a bare IPv6 ``addr``.
DEFAULT_INET6_PREFIX = 64

#: Policy routing table holding the routes into the TUN ("SW" = 0x5357).
ROUTE_TABLE = 21335
#: Table holding only the default routes into the TUN, used by the ``dns_hijack``
#: rules: port 53 must reach the TUN even when ``include_cidrs`` leaves the default
#: route out of :data:`ROUTE_TABLE`.
DNS_TABLE = 21336
#: First ``ip rule`` priority the engine uses; every rule it adds lies in
#: ``[RULE_PRIORITY_BASE, RULE_PRIORITY_BASE + RULE_PRIORITY_SPAN)``. sing-tun and
#: mihomo use 9000-9010, so this range lets both run on one host and lets a sweep
#: after a crash delete by priority without touching theirs.
RULE_PRIORITY_BASE = 9300
RULE_PRIORITY_SPAN = 20
#: The socket mark (SO_MARK) of the engine's own outbound sockets; a rule sends
#: marked packets around every TUN rule, so they leave by the physical egress.
ENGINE_MARK = 0x5357

#: Device name pattern when ``name`` is not given: the kernel fills in the number,
#: and the prefix tells an engine's device apart in ``ip link``.
DEFAULT_NAME_PATTERN = "swtun%d"

_IFNAMSIZ = 16


@dataclass(frozen=True, slots=True)
class TunOptions:
    """Resolved TUN settings; see the module docstring for how each is derived."""

    tag: str
    """Inbound tag of the flows from the TUN."""
    addr: str
    """The ``addr`` parameter as given (``tun_status.addr``)."""
    name: str
    """Requested device name, or :data:`DEFAULT_NAME_PATTERN`."""
    mtu: int
    """Device MTU."""
    inet4: ipaddress.IPv4Interface | None
    """IPv4 interface address (A) and prefix, when IPv4 is captured."""
    inet6: ipaddress.IPv6Interface | None
    """IPv6 interface address (A) and prefix, when IPv6 is captured."""
    include_cidrs: tuple[str, ...] = ()
    """The ``include_cidrs`` parameter, each normalised to its network."""
    exclude_cidrs: tuple[str, ...] = ()
    """The ``exclude_cidrs`` parameter, each normalised to its network."""
    auto_route: bool = True
    dual_stack: bool = True
    strict_route: bool = True
    dns_hijack: bool = True
    managed_by_config: bool = False
    """True when the TUN comes from ``runtime.tun``."""
    queues: int = 1
    """Device queues (IFF_MULTI_QUEUE when above 1): one file descriptor each."""
    table: int = ROUTE_TABLE
    dns_table: int = DNS_TABLE
    rule_base: int = RULE_PRIORITY_BASE
    mark: int = ENGINE_MARK
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Parameters beyond 4.4 passed through untouched (none are defined yet)."""

    @property
    def interfaces(self) -> tuple[ipaddress.IPv4Interface | ipaddress.IPv6Interface, ...]:
        """The device's addresses, IPv4 first."""
        return tuple(i for i in (self.inet4, self.inet6) if i is not None)

    @property
    def inet4_peer(self) -> ipaddress.IPv4Address | None:
        """Address B = A + 1: the source the system stack rewrites captured IPv4 to."""
        return None if self.inet4 is None else self.inet4.ip + 1

    @property
    def inet6_peer(self) -> ipaddress.IPv6Address | None:
        """Address B = A + 1 for IPv6."""
        return None if self.inet6 is None else self.inet6.ip + 1

    def captured(self, version: int) -> bool:
        """Whether the family (4 or 6) is routed into the TUN."""
        return (self.inet4 if version == 4 else self.inet6) is not None

    def includes(self, version: int) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """Networks of the family routed into the TUN (its default route when none given)."""
        chosen = [n for n in _networks(self.include_cidrs) if n.version == version]
        if chosen or self.include_cidrs:
            # include_cidrs names only the other family: this one is captured for DNS
            # hijack and strict_route only, never by destination.
            return chosen
        return [ipaddress.ip_network("0.0.0.0/0" if version == 4 else "::/0")]

    def excludes(self, version: int) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
        """Networks of the family kept out of the TUN."""
        return [n for n in _networks(self.exclude_cidrs) if n.version == version]

    @property
    def address_family_policy(self) -> str:
        """``dual_stack``, ``ipv4_only`` or ``ipv6_only``: the families captured."""
        if self.inet4 is not None and self.inet6 is not None:
            return "dual_stack"
        return "ipv4_only" if self.inet4 is not None else "ipv6_only"


def _networks(cidrs: Iterable[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    return [ipaddress.ip_network(c, strict=False) for c in cidrs]


def _bool(params: Mapping[str, Any], key: str) -> bool:
    value = params.get(key)
    if value is None:
        return True
    if not isinstance(value, bool):
        raise invalid_argument(f"{key} must be a boolean", key)
    return value


def _interface(
    value: Any, key: str, mask: str | None
) -> ipaddress.IPv4Interface | ipaddress.IPv6Interface:
    if not isinstance(value, str) or not value.strip():
        raise invalid_argument(f"{key} must be an IP address or IP/prefix", key)
    text = value.strip()
    try:
        if "/" not in text:
            ip = ipaddress.ip_address(text)
            if ip.version == 4:
                if mask is not None:
                    return ipaddress.IPv4Interface(f"{text}/{mask}")
                return ipaddress.IPv4Interface(f"{text}/24")
            return ipaddress.IPv6Interface(f"{text}/{DEFAULT_INET6_PREFIX}")
        return ipaddress.ip_interface(text)
    except ValueError as ex:
        raise invalid_argument(f"{key}: {ex}", key) from None


def _check_room(iface: ipaddress.IPv4Interface | ipaddress.IPv6Interface, key: str) -> None:
    """The system stack needs A and B = A + 1, both hosts of the prefix."""
    net = iface.network
    limit = 30 if iface.version == 4 else 126
    if net.prefixlen > limit:
        raise invalid_argument(
            f"{key}: the prefix must be /{limit} or shorter (the TUN needs a second address)",
            key,
        )
    peer = iface.ip + 1
    last = net.broadcast_address if iface.version == 4 else net[-1]
    if iface.ip == net.network_address or peer not in net or (peer == last and iface.version == 4):
        raise invalid_argument(
            f"{key}: {iface.ip} must be a host of {net} followed by another host "
            "(the system stack's second address)",
            key,
        )


def _cidrs(params: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = params.get(key)
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise invalid_argument(f"{key} must be a list of CIDRs", key)
    out: list[str] = []
    for i, item in enumerate(value):
        if not isinstance(item, str):
            raise invalid_argument(f"{key}[{i}] must be a CIDR string", f"{key}[{i}]")
        try:
            out.append(str(ipaddress.ip_network(item.strip(), strict=False)))
        except ValueError:
            raise invalid_argument(
                f"{key}[{i}]: {item!r} is not a valid CIDR (e.g. '10.0.0.0/8')", f"{key}[{i}]"
            ) from None
    return tuple(out)


def _name(value: Any) -> str:
    if value is None:
        return DEFAULT_NAME_PATTERN
    if (
        not isinstance(value, str)
        or not value
        or len(value.encode()) >= _IFNAMSIZ
        or value in (".", "..")
        or any(c.isspace() or c in "/:" for c in value)
    ):
        raise invalid_argument(
            "name must be an interface name: 1 to 15 bytes, no space, '/' or ':'", "name"
        )
    return value


def resolve_tun_options(
    params: Mapping[str, Any],
    *,
    network_mtu: int = 1500,
    managed_by_config: bool = False,
    queues: int = 1,
) -> TunOptions:
    """Validate ``tun.start`` parameters (interface.md 4.4) and derive every effective value.

    ``params`` is the command's ``params`` object or ``runtime.tun`` (a pydantic model
    is accepted through its ``model_dump()``). ``network_mtu`` is
    ``runtime.network.mtu``. Raises ``ApiError(invalid_argument)`` with ``field_path``.
    """
    if hasattr(params, "model_dump"):
        params = params.model_dump()
    if "addr" not in params or params.get("addr") is None:
        raise invalid_argument("addr is required", "addr")
    tag = params.get("tag")
    if not isinstance(tag, str) or not tag:
        raise invalid_argument("tag is required", "tag")
    mask = params.get("mask")
    if mask is not None:
        if not isinstance(mask, str):
            raise invalid_argument("mask must be an IPv4 netmask", "mask")
        try:
            ipaddress.IPv4Network(f"0.0.0.0/{mask}")
        except ValueError:
            raise invalid_argument(f"mask: {mask!r} is not an IPv4 netmask", "mask") from None
    primary = _interface(params["addr"], "addr", mask)
    _check_room(primary, "addr")
    dual_stack = _bool(params, "dual_stack")
    secondary = None
    if params.get("secondary_addr") is not None:
        if not dual_stack:
            raise invalid_argument(
                "secondary_addr needs dual_stack (dual_stack false captures only the "
                "family of addr)",
                "secondary_addr",
            )
        secondary = _interface(params["secondary_addr"], "secondary_addr", None)
        if secondary.version == primary.version:
            raise invalid_argument(
                "secondary_addr must be of the other address family than addr",
                "secondary_addr",
            )
        _check_room(secondary, "secondary_addr")
    elif dual_stack:
        secondary = ipaddress.ip_interface(DEFAULT_INET6 if primary.version == 4 else DEFAULT_INET4)
    inet4 = next((i for i in (primary, secondary) if i is not None and i.version == 4), None)
    inet6 = next((i for i in (primary, secondary) if i is not None and i.version == 6), None)

    mtu = params.get("mtu")
    if mtu is None:
        mtu = network_mtu
    if isinstance(mtu, bool) or not isinstance(mtu, int) or not 68 <= mtu <= 65535:
        raise invalid_argument("mtu must be an integer from 68 to 65535", "mtu")
    if inet6 is not None and mtu < 1280:
        raise invalid_argument(
            "mtu must be at least 1280 when IPv6 is captured (IPv6's minimum link MTU)", "mtu"
        )
    if not 1 <= queues <= 256:
        raise invalid_argument("queues must be from 1 to 256", "queues")
    known = {
        "addr", "tag", "name", "mask", "mtu", "secondary_addr", "include_cidrs",
        "exclude_cidrs", "auto_route", "dual_stack", "strict_route", "dns_hijack",
    }  # fmt: skip
    return TunOptions(
        tag=tag,
        addr=str(params["addr"]),
        name=_name(params.get("name")),
        mtu=mtu,
        inet4=inet4,
        inet6=inet6,
        include_cidrs=_cidrs(params, "include_cidrs"),
        exclude_cidrs=_cidrs(params, "exclude_cidrs"),
        auto_route=_bool(params, "auto_route"),
        dual_stack=dual_stack,
        strict_route=_bool(params, "strict_route"),
        dns_hijack=_bool(params, "dns_hijack"),
        managed_by_config=managed_by_config,
        queues=queues,
        extra={k: v for k, v in params.items() if k not in known},
    )
