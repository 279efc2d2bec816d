"""The TUN "system stack": Python's handle on the C packet loop (csrc/tun.c).

The loop runs on its own thread, off the GIL, over a TUN device someone else created
(``spliceway.tun.device``). For each family the TUN has an address for, the prefix
gives A (the interface address) and B = A + 1; :class:`TunStack` opens a kernel TCP
listener on A and starts the loop, which NATs every captured TCP connection onto that
listener (source B:natport) and back. The accepted sockets are ordinary kernel sockets:
:meth:`TunStack.lookup_peer` (or C's SW_IN_TUN listener in csrc/conn.c) turns one back
into its original source and destination, and the relay splices it like any other.

With ``dns_tcp``, a second listener per family on A (:attr:`TunStack.dns_listeners`)
takes the TCP connections to port 53 (csrc/tun.h, "DNS over TCP"), so a DNS hijack
answers them itself (:mod:`spliceway.tun.dns_hijack`) instead of the connection path
relaying them; their NAT entries look up like any other's.

With ``vnet_hdr``, the fd is a TUN opened with IFF_VNET_HDR and its offloads
(:func:`spliceway.tun.device.open_tun` with ``vnet_hdr=True``, or ``TunDevice.create``):
each read brings a virtio-net header and up to 64 KiB of TCP segments at once (GSO) with
checksums left partial, and the loop writes them back the same way (csrc/tun.h,
"Offloads"), so a bulk transfer costs a read and a write per burst rather than per
MTU-sized packet. The option must match how the device was opened.

UDP datagrams come out as :class:`UdpRecord` (``records()``, with ``fileno()``
readable while any wait); replies go back with :meth:`TunStack.udp_send`. ICMP echo is
answered inside C. See csrc/tun.h for the exact contract and every counter.

The listeners are created in the calling thread's network namespace: the one the TUN
is in (tests enter a namespace with ``setns`` around ``start()``).
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from spliceway import _relay

ffi, lib = _relay.ffi, _relay.lib

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPInterface = ipaddress.IPv4Interface | ipaddress.IPv6Interface

#: linux/in.h (the socket module lacks it); it also applies to IPv6 sockets.
_IP_FREEBIND = 15

#: The congestion control the listeners ask for, first available wins (accepted sockets
#: inherit it). Their peer is the client's own socket on this machine, reached through
#: the TUN: a hop with no loss but the device's queue and no link to probe. A pacing
#: algorithm (BBR, where it is the system default) releases every burst from an
#: hrtimer there (tcp_pace_kick showed in the packet loop thread's profile): measured
#: on 2 vCPUs, download through the TUN +25 % with 1 stream and +35-45 % with 8 with
#: cubic instead of BBR (benchmarks/bench_tun.py; docs/tun.md, "Speed"). The relay's
#: upstream sockets (the real network) keep the system's default.
LISTENER_CONGESTION = (b"cubic", b"reno")

#: csrc/tun.h's SW_TUN_ABI_VERSION this module is written for.
ABI_VERSION = 3

#: sw_tun_tcp_state names.
TCP_STATES = {1: "syn", 2: "established", 3: "fin", 4: "closed"}
#: sw_tun_end names.
END_REASONS = {1: "idle", 2: "closed", 3: "shutdown"}
#: The sw_tun_stats fields, in order (every one is a counter or a gauge).
STATS_FIELDS: tuple[str, ...] = tuple(name for name, _ in ffi.typeof("sw_tun_stats").fields)


class TunStackError(OSError):
    """A C call refused (errno and sw_strerror's text)."""


def _check(rc: int, what: str) -> int:
    if rc < 0:
        raise TunStackError(-rc, f"{what}: {ffi.string(lib.sw_strerror(rc)).decode()}")
    return rc


def _addr(version: int, raw: Any) -> IPAddress:
    data = bytes(raw)
    return ipaddress.IPv4Address(data[:4]) if version == 4 else ipaddress.IPv6Address(data)


def _packed(addr: IPAddress) -> bytes:
    return addr.packed + bytes(16 - len(addr.packed))


def _set_congestion(sock: socket.socket) -> None:
    """The first of :data:`LISTENER_CONGESTION` the kernel has and allows (best effort:
    none of them leaves the system's default)."""
    for name in LISTENER_CONGESTION:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name)
            return
        except OSError:
            continue


@dataclass(frozen=True)
class TunFlow:
    """The original endpoints behind a NAT port (sw_tun_flow)."""

    version: int
    src: IPAddress
    sport: int
    dst: IPAddress
    dport: int
    natport: int
    state: str
    created_unix_ms: int
    packets_out: int
    packets_in: int


@dataclass(frozen=True)
class UdpRecord:
    """A datagram from the TUN (``kind == "udp"``) or a session's end (``"ended"``)."""

    kind: str
    session: int
    version: int
    src: IPAddress
    sport: int
    dst: IPAddress
    dport: int
    at_unix_ms: int
    payload: bytes = b""
    new_session: bool = False
    reason: str | None = None
    packets_in: int = 0
    bytes_in: int = 0
    packets_out: int = 0
    bytes_out: int = 0


@dataclass(frozen=True)
class Endpoints:
    """A family's addresses: A (the TUN's own, the listener's) and B (the NAT source)."""

    version: int
    address: IPAddress
    nat_address: IPAddress

    @classmethod
    def from_interface(cls, iface: IPInterface) -> Endpoints:
        """A is the interface's address, B the next one, which must be in the prefix (and,
        for IPv4, not its broadcast address)."""
        a = iface.ip
        b = a + 1
        net = iface.network
        last = net.broadcast_address if a.version == 4 and net.prefixlen < 31 else None
        if b not in net or b == last:
            raise ValueError(f"{iface}: the system stack needs a second address in the prefix")
        return cls(a.version, a, b)


class TunStack:
    """The C packet loop over one TUN fd, with its kernel listeners.

    ``addresses``: the TUN's interfaces (at most one per family; the first of a family
    counts). Timeouts are in seconds; 0 or None means csrc/tun.h's default.
    ``dns_tcp``: TCP connections to port 53 go to :attr:`dns_listeners` instead.
    ``vnet_hdr``: the fd was opened with IFF_VNET_HDR (and its offloads): every packet
    read and written has a virtio-net header (see the module's docstring).
    """

    def __init__(
        self,
        fd: int,
        addresses: Sequence[IPInterface | str],
        mtu: int = 1500,
        *,
        max_tcp: int = 0,
        max_udp: int = 0,
        syn_timeout: float | None = None,
        tcp_idle_timeout: float | None = None,
        tcp_closed_timeout: float | None = None,
        udp_idle_timeout: float | None = None,
        ring_records: int = 0,
        ring_bytes: int = 0,
        batch: int = 0,
        no_rst: bool = False,
        backlog: int = 4096,
        dns_tcp: bool = False,
        vnet_hdr: bool = False,
    ) -> None:
        self.fd = fd
        self.mtu = mtu
        self.endpoints: dict[int, Endpoints] = {}
        for item in addresses:
            iface = ipaddress.ip_interface(item) if isinstance(item, str) else item
            self.endpoints.setdefault(iface.version, Endpoints.from_interface(iface))
        if not self.endpoints:
            raise ValueError("no address: the stack needs an IPv4 or IPv6 interface address")
        self._limits = {
            "max_tcp": max_tcp, "max_udp": max_udp, "ring_records": ring_records,
            "ring_bytes": ring_bytes, "batch": batch,
        }  # fmt: skip
        self._timeouts = {
            "syn_timeout_ms": syn_timeout, "tcp_idle_ms": tcp_idle_timeout,
            "tcp_closed_ms": tcp_closed_timeout, "udp_idle_ms": udp_idle_timeout,
        }  # fmt: skip
        self.no_rst = no_rst
        self.backlog = backlog
        self.dns_tcp = dns_tcp
        self.vnet_hdr = vnet_hdr
        #: The kernel listener on A per family (4, 6): every captured TCP connection.
        self.listeners: dict[int, socket.socket] = {}
        #: With ``dns_tcp``: the listener on A per family taking the connections to
        #: port 53 instead (the caller serves them; they close with :meth:`stop`).
        self.dns_listeners: dict[int, socket.socket] = {}
        self._tun: Any = None
        self._rec = ffi.new("sw_tun_record[]", 256)
        self._payload = ffi.new("uint8_t[]", 65536 * 4)
        self._used = ffi.new("size_t *")

    # -- lifecycle ---------------------------------------------------------------------

    def _listen(self, ep: Endpoints) -> socket.socket:
        family = socket.AF_INET if ep.version == 4 else socket.AF_INET6
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # A may still be tentative or the link down a moment longer: binding to
            # it anyway is what the listener needs (it is only ever reached through
            # the TUN).
            sock.setsockopt(socket.SOL_IP, _IP_FREEBIND, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            _set_congestion(sock)
            sock.bind((str(ep.address), 0))
            sock.listen(self.backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        return sock

    def start(self) -> None:
        """Opens the listeners (in this thread's network namespace) and starts the loop."""
        if self._tun is not None:
            return
        if lib.sw_tun_abi_version() != ABI_VERSION:
            raise TunStackError(0, "the extension's TUN stack is another version; rebuild it")
        opts = ffi.new("sw_tun_opts *")
        opts.fd = self.fd
        opts.mtu = self.mtu
        opts.no_rst = int(self.no_rst)
        opts.vnet_hdr = int(self.vnet_hdr)
        for name, value in self._limits.items():
            setattr(opts, name, value)
        for name, seconds in self._timeouts.items():
            if seconds:
                setattr(opts, name, max(1, round(seconds * 1000)))
        try:
            for version, ep in self.endpoints.items():
                sock = self.listeners[version] = self._listen(ep)
                port = sock.getsockname()[1]
                dns_port = 0
                if self.dns_tcp:
                    dns_sock = self.dns_listeners[version] = self._listen(ep)
                    dns_port = dns_sock.getsockname()[1]
                if version == 4:
                    opts.has4, opts.port4, opts.dns_port4 = 1, port, dns_port
                    ffi.memmove(opts.addr4, ep.address.packed, 4)
                    ffi.memmove(opts.next4, ep.nat_address.packed, 4)
                else:
                    opts.has6, opts.port6, opts.dns_port6 = 1, port, dns_port
                    ffi.memmove(opts.addr6, ep.address.packed, 16)
                    ffi.memmove(opts.next6, ep.nat_address.packed, 16)
            out = ffi.new("sw_tun **")
            _check(lib.sw_tun_new(opts, out), "sw_tun_new")
        except BaseException:
            self._close_listeners()
            raise
        self._tun = out[0]

    def _close_listeners(self) -> None:
        for sock in (*self.listeners.values(), *self.dns_listeners.values()):
            sock.close()
        self.listeners.clear()
        self.dns_listeners.clear()

    def stop(self) -> list[UdpRecord]:
        """Stops the loop and closes the listeners; returns the records still waiting
        (the sessions' ends among them). The TUN fd stays the caller's."""
        if self._tun is None:
            return []
        lib.sw_tun_shutdown(self._tun)
        rest: list[UdpRecord] = []
        while batch := self.records():
            rest += batch
        lib.sw_tun_free(self._tun)
        self._tun = None
        self._close_listeners()
        return rest

    def __enter__(self) -> TunStack:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._tun is not None

    @property
    def handle(self) -> Any:
        """The ``sw_tun *`` (for ``ConnPath.listen_tun``); valid until :meth:`stop`."""
        return self._need()

    def _need(self) -> Any:
        if self._tun is None:
            raise TunStackError(0, "the TUN stack is not running")
        return self._tun

    # -- TCP ---------------------------------------------------------------------------

    def listen_port(self, version: int) -> int:
        return int(self.listeners[version].getsockname()[1])

    def dns_port(self, version: int) -> int:
        """The DNS listener's port of a family (``dns_tcp``), else 0."""
        sock = self.dns_listeners.get(version)
        return int(sock.getsockname()[1]) if sock is not None else 0

    def nat_lookup(self, version: int, natport: int) -> TunFlow | None:
        """The original endpoints behind NAT port ``natport``, or None."""
        out = ffi.new("sw_tun_flow *")
        if lib.sw_tun_nat_lookup(self._need(), version, natport, out) < 0:
            return None
        return TunFlow(
            version=out.version, src=_addr(out.version, out.src), sport=out.sport,
            dst=_addr(out.version, out.dst), dport=out.dport, natport=out.natport,
            state=TCP_STATES.get(out.state, str(out.state)),
            created_unix_ms=out.created_unix_ms, packets_out=out.packets_out,
            packets_in=out.packets_in,
        )  # fmt: skip

    def lookup_peer(self, sock: socket.socket) -> TunFlow | None:
        """The original endpoints of a socket accepted on one of the listeners."""
        host, port = sock.getpeername()[:2]
        addr = ipaddress.ip_address(host)
        ep = self.endpoints.get(addr.version)
        if ep is None or addr != ep.nat_address:
            return None
        return self.nat_lookup(addr.version, port)

    # -- UDP ---------------------------------------------------------------------------

    def fileno(self) -> int:
        """An eventfd readable while records wait (drain with :meth:`records`)."""
        return int(lib.sw_tun_fd(self._need()))

    def records(self, max_records: int = 256) -> list[UdpRecord]:
        """The records waiting, oldest first (at most ``max_records``)."""
        n = lib.sw_tun_drain(
            self._need(), self._rec, min(max_records, len(self._rec)), self._payload,
            len(self._payload), self._used,
        )  # fmt: skip
        out = []
        for i in range(n):
            r = self._rec[i]
            v = r.version
            common: dict[str, Any] = {
                "session": r.session, "version": v, "src": _addr(v, r.src), "sport": r.sport,
                "dst": _addr(v, r.dst), "dport": r.dport, "at_unix_ms": r.at_unix_ms,
            }  # fmt: skip
            if r.kind == lib.SW_TUN_REC_UDP:
                payload = bytes(ffi.buffer(self._payload + r.payload_off, r.payload_len))
                out.append(
                    UdpRecord("udp", payload=payload, new_session=bool(r.new_session), **common)
                )
            else:
                out.append(UdpRecord(
                    "ended", reason=END_REASONS.get(r.reason, str(r.reason)),
                    packets_in=r.packets_in, bytes_in=r.bytes_in, packets_out=r.packets_out,
                    bytes_out=r.bytes_out, **common,
                ))  # fmt: skip
        return out

    def udp_send(
        self, session: int, payload: bytes, src: tuple[str | IPAddress, int] | None = None
    ) -> int:
        """A reply to the session's client, from the address it sent to (or ``src``)."""
        if src is None:
            rc = lib.sw_tun_udp_send(self._need(), session, ffi.NULL, 0, payload, len(payload))
        else:
            addr = ipaddress.ip_address(src[0])
            rc = lib.sw_tun_udp_send(
                self._need(), session, _packed(addr), src[1], payload, len(payload)
            )
        return _check(rc, "sw_tun_udp_send")

    def udp_close(self, session: int) -> None:
        _check(lib.sw_tun_udp_close(self._need(), session), "sw_tun_udp_close")

    def inject_udp(
        self, src: tuple[str | IPAddress, int], dst: tuple[str | IPAddress, int], payload: bytes
    ) -> int:
        """A datagram from ``src`` to ``dst`` written into the TUN, outside any session."""
        s, d = ipaddress.ip_address(src[0]), ipaddress.ip_address(dst[0])
        if s.version != d.version:
            raise ValueError("src and dst of different families")
        rc = lib.sw_tun_inject_udp(
            self._need(), s.version, _packed(s), src[1], _packed(d), dst[1], payload, len(payload)
        )
        return _check(rc, "sw_tun_inject_udp")

    # -- counters ----------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        out = ffi.new("sw_tun_stats *")
        lib.sw_tun_stats_get(self._need(), out)
        return {name: int(getattr(out, name)) for name in STATS_FIELDS}
