"""The UDP relaying Python does itself: proxy upstreams, shared by the UDP actors.

Both the SOCKS5 UDP ASSOCIATE actor (``actors/udp.py``) and the TUN's UDP actor
(``actors/tun_udp.py``) relay a destination routed to a ``socks5`` or ``shadowsocks``
outbound through an *upstream association* Python holds: ``socks5``, its own UDP
ASSOCIATE with the proxy (whose TCP control connection it keeps) and datagrams with
the SOCKS5 UDP header; ``shadowsocks``, each datagram sealed on its own (AEAD per
packet, SIP004) to the server's UDP port. Destinations share one upstream per *key*
(the SOCKS5 actor: the outbound; the TUN: the outbound and the client's socket), and
replies are matched back to a destination by the address they come from.

:class:`ProxyUpstreams` owns those upstreams for one actor, on its dispatcher's loop.
The actor keeps its destinations and their flows; it is called back to hand a reply
to its client (``deliver``) and when a proxy ends an association (``lost``). The
upstreams' counters are the engine's ``stats.udp_upstream``.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from spliceway.dns import InvalidHostname, ResolveError
from spliceway.flows.outbounds import DialError
from spliceway.protocols import ProtocolError, shadowsocks, socks5
from spliceway.support.socket_mark import apply_mark

if TYPE_CHECKING:
    from spliceway.actors.dispatcher import Dispatcher
    from spliceway.dns import Resolver
    from spliceway.engine.runtime import Counters

logger = logging.getLogger(__name__)

#: Largest datagram read from a proxy upstream (a UDP payload cannot be larger).
MAX_DATAGRAM = 65535
#: Datagrams read per readiness event before yielding to other actors.
BATCH = 64


class ProxyDest(Protocol):
    """What a destination relayed through a proxy upstream has: its target, and the
    counts of what Python relayed for it."""

    #: Where its datagrams go: an address, or the domain a fake-ip address stands for.
    target: tuple[str, int]
    py_packets_up: int
    py_bytes_up: int
    py_wire_up: int
    py_wire_down: int


@dataclass(slots=True)
class ProxyUpstream:
    """An *upstream association* Python relays: the UDP socket one proxy outbound's
    destinations share (``socks5``: to the proxy's relay over an association whose TCP
    control connection it holds; ``shadowsocks``: sealed packets to the server)."""

    tag: str
    kind: str
    outbound: Any
    #: What the destinations sharing it have in common (see :meth:`ProxyUpstreams.open`).
    key: Hashable = None
    sock: socket.socket | None = None
    relay: tuple[str, int] | None = None
    control: socket.socket | None = None
    #: Set once it is up (True) or could not open (False).
    ready: asyncio.Future[bool] | None = None
    #: Reply source -> destination.
    by_source: dict[tuple[str, int], Any] = field(default_factory=dict)


class ProxyUpstreams:
    """One actor's proxy upstreams (dispatcher thread only).

    ``resolver()``: the engine's resolver now (a shadowsocks server by name).
    ``alive()``: False once the actor is ending (nothing more opens or is delivered).
    ``deliver(dest, payload)``: hand a reply to the destination's client; True when it
    went out (it counts ``send_failures`` itself when it did not).
    ``lost(dest, proxy)``: the proxy ended the association ``dest`` used; the actor
    completes the destination's flow (failed), which releases it here.
    """

    def __init__(
        self,
        counters: Counters,
        dispatcher: Dispatcher,
        resolver: Callable[[], Resolver],
        alive: Callable[[], bool],
        deliver: Callable[[Any, bytes], bool],
        lost: Callable[[Any, ProxyUpstream], None],
    ) -> None:
        self.counters = counters
        self.dispatcher = dispatcher
        self.resolver = resolver
        self.alive = alive
        self.deliver = deliver
        self.lost = lost
        self.proxies: dict[Hashable, ProxyUpstream] = {}

    async def open(self, outbound: Any, key: Hashable = None) -> ProxyUpstream | None:
        """The upstream association of a proxy ``outbound`` for ``key`` (default: the
        outbound's tag), opened or reused for a new destination (``stats.udp_upstream``
        counts them); None when it cannot open."""
        counters = self.counters.udp
        key = outbound.tag if key is None else key
        proxy = self.proxies.get(key)
        if proxy is not None:
            if proxy.ready is not None and not await proxy.ready:
                return None
            counters["reused_associations"] += 1
            return proxy
        proxy = ProxyUpstream(outbound.tag, outbound.protocol, outbound, key)
        proxy.ready = self.dispatcher.loop.create_future()
        self.proxies[key] = proxy
        sock = None
        try:
            if proxy.kind == "socks5":
                proxy.control, proxy.relay = await outbound.udp_associate(self.dispatcher.loop)
            else:
                proxy.relay = await self._server_address(outbound)
            family = socket.AF_INET6 if ":" in proxy.relay[0] else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_DGRAM)
            apply_mark(sock)  # to the proxy by the physical egress while a TUN runs
            sock.bind(("::" if family == socket.AF_INET6 else "0.0.0.0", 0))
            sock.setblocking(False)
        except (OSError, DialError, ResolveError, InvalidHostname) as ex:
            logger.debug("UDP upstream %s failed: %s", outbound.tag, ex)
            counters["failed_association_attempts"] += 1
            self.proxies.pop(key, None)
            for s in (sock, proxy.control):
                if s is not None:
                    s.close()
            proxy.ready.set_result(False)
            return None
        if not self.alive():
            sock.close()
            if proxy.control is not None:
                proxy.control.close()
            proxy.ready.set_result(False)
            return None
        proxy.sock = sock
        loop = self.dispatcher.loop
        loop.add_reader(sock.fileno(), self._readable, proxy)
        if proxy.control is not None:
            proxy.control.setblocking(False)
            loop.add_reader(proxy.control.fileno(), self._control_readable, proxy)
        counters["created_associations"] += 1
        counters["active_associations"] += 1
        proxy.ready.set_result(True)
        return proxy

    async def open_for(
        self, outbound: Any, key: Hashable, wanted: Callable[[], bool]
    ) -> ProxyUpstream | None:
        """:meth:`open` for a destination that may end while it opens (``wanted()`` then
        False): None when it cannot open or is no longer wanted; one opened for nobody
        is closed, unless a destination waiting on it too takes it first."""
        proxy = await self.open(outbound, key)
        if not wanted():
            if proxy is not None:
                self.dispatcher.loop.call_soon(self.close_unused, proxy)
            return None
        return proxy if proxy is not None and proxy.sock is not None else None

    async def _server_address(self, outbound: Any) -> tuple[str, int]:
        """Where a shadowsocks server takes UDP: its address, resolved by the engine."""
        if is_ip(outbound.server):
            return norm(outbound.server), outbound.port
        addresses = await self.resolver().resolve(outbound.server)
        if not addresses:
            raise OSError(f"{outbound.server} has no address")
        return addresses[0], outbound.port

    def attach(self, proxy: ProxyUpstream, dest: ProxyDest) -> None:
        """``dest``'s replies come through ``proxy`` from now on."""
        proxy.by_source[(norm_host(dest.target[0]), dest.target[1])] = dest

    def release(self, proxy: ProxyUpstream, dest: ProxyDest, *, idle: bool) -> None:
        """``dest`` ended: ``proxy`` closes with its last destination (``idle``: the
        destination ended idle, counted in ``idle_timeouts``)."""
        for source in [k for k, d in proxy.by_source.items() if d is dest]:
            del proxy.by_source[source]
        if not proxy.by_source:
            self.close(proxy, idle=idle)

    def send(self, proxy: ProxyUpstream | None, dest: ProxyDest, payload: bytes) -> bool:
        """One datagram of ``dest`` through ``proxy``; True when it was sent."""
        if proxy is None or proxy.sock is None or proxy.relay is None:
            return False
        if proxy.kind == "socks5":
            wire = socks5.build_udp_datagram(*dest.target, payload)
        else:
            ob = proxy.outbound
            wire = shadowsocks.seal_packet(ob.cipher, ob.master_key, *dest.target, payload)
        try:
            proxy.sock.sendto(wire, proxy.relay)
        except OSError:
            self.counters.udp["send_failures"] += 1
            return False
        dest.py_packets_up += 1
        dest.py_bytes_up += len(payload)
        dest.py_wire_up += len(wire)
        self.counters.udp["packets_sent"] += 1
        return True

    def _readable(self, proxy: ProxyUpstream) -> None:
        if proxy.sock is None or not self.alive():
            return
        counters = self.counters.udp
        for _ in range(BATCH):
            try:
                data, source = proxy.sock.recvfrom(MAX_DATAGRAM)
            except BlockingIOError:
                return
            except OSError:
                counters["recv_failures"] += 1
                return
            if (norm(source[0]), source[1]) != proxy.relay and source[:2] != proxy.relay:
                continue  # only the proxy speaks on this socket
            try:
                if proxy.kind == "socks5":
                    reply = socks5.parse_udp_datagram(data)
                    origin, payload = (norm_host(reply.host), reply.port), reply.payload
                else:
                    ob = proxy.outbound
                    host, port, payload = shadowsocks.open_packet(ob.cipher, ob.master_key, data)
                    origin = (norm_host(host), port)
            except ProtocolError:
                continue
            dest = proxy.by_source.get(origin)
            if dest is None and len(proxy.by_source) == 1:
                # A proxy reports the address it heard from, not the name it was given:
                # a destination named by domain has an upstream of its own
                # (upstream_key), so its replies are the only ones on it.
                (only,) = proxy.by_source.values()
                if not is_ip(only.target[0]):
                    dest = only
            if dest is None:
                self.counters.udp_unmatched_replies += 1
                continue
            counters["packets_received"] += 1
            if self.deliver(dest, payload):
                dest.py_wire_down += len(data)
            if proxy.sock is None:
                return  # closed by what the delivery set off

    def _control_readable(self, proxy: ProxyUpstream) -> None:
        # The proxy ended the association: its destinations cannot go on.
        assert proxy.control is not None
        try:
            if proxy.control.recv(4096):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        for dest in list(proxy.by_source.values()):
            self.lost(dest, proxy)
        self.close(proxy, idle=False)

    def close_unused(self, proxy: ProxyUpstream) -> None:
        """Close ``proxy`` if no destination uses it."""
        if not proxy.by_source:
            self.close(proxy, idle=False)

    def close(self, proxy: ProxyUpstream, *, idle: bool) -> None:
        """Close ``proxy`` (idempotent)."""
        if self.proxies.get(proxy.key) is proxy:
            del self.proxies[proxy.key]
        loop = self.dispatcher.loop
        opened = proxy.sock is not None
        for sock in (proxy.sock, proxy.control):
            if sock is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(sock.fileno())
                sock.close()
        proxy.sock = proxy.control = None
        if not opened:
            return
        counters = self.counters.udp
        counters["active_associations"] -= 1
        counters["closed_associations"] += 1
        if idle:
            counters["idle_timeouts"] += 1

    def close_all(self) -> None:
        """Close every upstream (the actor stops)."""
        for proxy in list(self.proxies.values()):
            self.close(proxy, idle=False)


def upstream_key(outbound: Any, target: tuple[str, int], *scope: Hashable) -> Hashable:
    """Which upstream association a destination shares: one per outbound (and ``scope``,
    e.g. the TUN client's socket) for destinations named by address; one of its own for
    a destination named by domain. The proxy resolves a domain and names its replies by
    the address, which another destination could also be: replies are matched by their
    source, so only an upstream no other destination uses is unambiguous."""
    if is_ip(target[0]) and not scope:
        return outbound.tag
    if is_ip(target[0]):
        return (outbound.tag, *scope)
    return (outbound.tag, *scope, target[0].lower(), target[1])


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def v6(ip: str) -> str:
    """``ip`` as a dual-stack socket reaches it (IPv4 as ``::ffff:a.b.c.d``)."""
    addr = ipaddress.ip_address(ip)
    return f"::ffff:{addr}" if addr.version == 4 else str(addr)


def norm_host(host: str) -> str:
    """A reply or destination host in the form replies are matched by."""
    return norm(host) if is_ip(host) else host.lower()


def norm(ip: str) -> str:
    """An address as the socket API reports it (IPv4-mapped IPv6 unwrapped)."""
    addr = ipaddress.ip_address(ip.split("%")[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return str(addr.ipv4_mapped)
    return str(addr)
