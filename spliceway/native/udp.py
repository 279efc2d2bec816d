"""Python face of the C UDP datagram relay (csrc/udp.h) for SOCKS5 UDP ASSOCIATE.

C moves datagrams, Python decides.  The relay's C loops read client datagrams in
batches, keep only those from the client's address, parse the SOCKS5 UDP header, and
send payloads on; replies come back wrapped in a SOCKS5 header.  Python only hears
about what needs a decision or is over, as records (:meth:`UdpRelay.drain`, or poll
:meth:`UdpRelay.fileno`):

* :class:`NewDest` -- a destination (one ``DST.ADDR:DST.PORT`` as the client sent it:
  a UDP flow) appeared; answer with :meth:`UdpRelay.set_direct`, :meth:`set_drop
  <UdpRelay.set_drop>` or :meth:`set_python <UdpRelay.set_python>`.  Its datagrams are
  held (bounded) until then.
* :class:`Datagram` -- a datagram of a destination Python relays itself (socks5 and
  shadowsocks outbounds); replies go back with :meth:`UdpRelay.send_to_client`.
* :class:`DestEnded`, :class:`UpstreamEnded`, :class:`AssocEnded` -- with final
  counters; per association they come in order, its ``AssocEnded`` last.

The objects: an *association* (:meth:`UdpRelay.add_association`, one per UDP ASSOCIATE,
closed when its TCP connection ends), its *destinations* (ids from 1 per association,
created by C), and its *upstreams*: UDP sockets Python creates, one per (association,
outbound), handed over with :meth:`UdpRelay.add_upstream` and shared by every DIRECT
destination put on them.  Sockets handed to C are C's from then on (it closes them):
pass ``sock.detach()``.

Every method is thread-safe and synchronous: when it returns, C has applied it.  The
counters' exact meanings are in csrc/udp.h (``sw_udp_counters``, ``sw_udp_stats``).
"""

from __future__ import annotations

import enum
import errno as errno_mod
import ipaddress
import math
import select
import threading
from dataclasses import dataclass
from typing import Any, NamedTuple

from spliceway._relay import ffi, lib
from spliceway.native.relay import RelayError, check

__all__ = [
    "ABI_VERSION",
    "UDP_UPSTREAM_FIELDS",
    "Action",
    "AssocEnded",
    "Datagram",
    "DestEnded",
    "End",
    "NewDest",
    "UdpCounters",
    "UdpDrops",
    "UdpRecord",
    "UdpRelay",
    "UdpStats",
    "UpstreamEnded",
]

#: The C ABI this module was written against; the compiled library must match.
ABI_VERSION = 2

_U32_MAX = (1 << 32) - 1
_U64_MAX = (1 << 64) - 1
_INT_MAX = (1 << 31) - 1
#: DATAGRAM payloads copied per drain call at most (C needs >= 65536).
_PAYLOAD_BUFFER = 1 << 20
_GONE = (errno_mod.ENOENT, errno_mod.ESHUTDOWN)


class Action(enum.IntEnum):
    """A destination's verdict (``sw_udp_action``)."""

    PENDING = 0  # no verdict yet: datagrams are held
    DIRECT = 1  # sent by C to the resolved address over an upstream socket
    DROP = 2  # discarded and counted (a block rule)
    PYTHON = 3  # handed to Python as Datagram records


class End(enum.IntEnum):
    """Why a destination, upstream or association ended (``sw_udp_end``)."""

    IDLE = 1  # its idle timeout passed with no datagram
    CLOSED = 2  # closed by the matching close_* call
    ASSOC = 3  # its association ended
    UPSTREAM = 4  # (destination) its upstream ended
    ERROR = 5  # a socket error: see the record's errno
    SHUTDOWN = 6  # the relay was closed


class UdpCounters(NamedTuple):
    """Exact counts of one destination (or an upstream's, or an association's sum).

    For the flow record: ``bytes_up``/``bytes_down`` are these (plus what Python
    relayed itself), ``packets_up`` is ``upstream_tx_packets`` (plus Python's),
    ``packets_down`` is ``client_tx_packets``, and the boundary byte counters are
    ``client_rx_bytes`` (inbound rx), ``client_tx_bytes`` (inbound tx),
    ``upstream_rx_bytes`` (outbound rx) and ``upstream_tx_bytes`` (outbound tx).
    Client sizes include the SOCKS5 header; upstream sizes are as sent (the payload).
    """

    client_rx_packets: int
    client_rx_bytes: int
    upstream_tx_packets: int
    upstream_tx_bytes: int
    bytes_up: int
    upstream_rx_packets: int
    upstream_rx_bytes: int
    client_tx_packets: int
    client_tx_bytes: int
    bytes_down: int
    python_packets: int
    python_bytes: int
    dropped_pending: int
    dropped_blocked: int
    dropped_python: int
    send_failures: int
    client_send_failures: int
    last_activity_unix_ms: int


class UdpDrops(NamedTuple):
    """What an association (or upstream) dropped that belongs to no destination."""

    dropped_foreign: int
    dropped_fragment: int
    dropped_malformed: int
    dropped_no_dest: int
    dropped_unsolicited: int
    recv_failures: int
    destinations: int


class UdpStats(NamedTuple):
    """Relay-wide totals (``sw_udp_stats``); the first eleven are ``stats.udp_upstream``.

    Those count what happens inside C only (``dropped_associations`` is always 0: a
    refused :meth:`UdpRelay.add_association` is the caller's to count, and so is a
    failed :meth:`UdpRelay.send_to_client`), so the engine adds its own Python-relayed
    counts to them without counting anything twice.
    """

    active_associations: int
    created_associations: int
    reused_associations: int
    closed_associations: int
    idle_timeouts: int
    dropped_associations: int
    failed_association_attempts: int
    send_failures: int
    recv_failures: int
    packets_sent: int
    packets_received: int
    assocs_active: int
    assocs_added: int
    assocs_ended: int
    dests_active: int
    dests_created: int
    dests_ended: int
    dest_idle_timeouts: int
    client_packets_received: int
    client_packets_sent: int
    client_send_failures: int
    client_recv_failures: int
    dropped_foreign: int
    dropped_fragment: int
    dropped_malformed: int
    dropped_no_dest: int
    dropped_pending: int
    dropped_blocked: int
    dropped_python: int
    dropped_unsolicited: int
    records_overflowed: int
    upstream_errors: int
    upstream_recv_failures: int

    def udp_upstream(self) -> dict[str, int]:
        """The ``stats.udp_upstream`` object's fields, for C's upstreams."""
        return {name: getattr(self, name) for name in UDP_UPSTREAM_FIELDS}


#: ``stats.udp_upstream`` (spliceway.shapes.stats.UdpUpstreamCounters), the leading UdpStats
#: fields.
UDP_UPSTREAM_FIELDS = UdpStats._fields[:11]


@dataclass(frozen=True, slots=True)
class NewDest:
    """A destination appeared; its datagrams wait for a verdict."""

    assoc: int
    dest: int
    at_unix_ms: int
    host: str  # exactly socks5.parse_udp_datagram's host (IP text or the domain)
    port: int
    atyp: int  # 1 IPv4, 3 domain, 4 IPv6
    client_ip: str  # the client's address as learned (IPv4-mapped shown as IPv4)
    client_port: int


@dataclass(frozen=True, slots=True)
class Datagram:
    """A datagram for a destination whose verdict is PYTHON."""

    assoc: int
    dest: int
    at_unix_ms: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class DestEnded:
    """A destination ended (its UDP flow completes) with its final counters."""

    assoc: int
    dest: int
    at_unix_ms: int
    reason: End
    errno: int
    action: Action  # its verdict when it ended
    upstream: int  # the upstream it was on (0 none)
    counters: UdpCounters


@dataclass(frozen=True, slots=True)
class UpstreamEnded:
    """An upstream socket was closed by C, with its counters."""

    assoc: int
    upstream: int
    at_unix_ms: int
    reason: End
    errno: int
    counters: UdpCounters
    drops: UdpDrops


@dataclass(frozen=True, slots=True)
class AssocEnded:
    """An association ended, after every other record of it."""

    assoc: int
    at_unix_ms: int
    reason: End
    errno: int
    counters: UdpCounters  # the sum over all of its destinations
    drops: UdpDrops


UdpRecord = NewDest | Datagram | DestEnded | UpstreamEnded | AssocEnded


def native_abi_version() -> int:
    """The UDP ABI version the loaded ``spliceway._relay`` was compiled with."""
    return int(lib.sw_udp_abi_version())


def _int_arg(name: str, value: object, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


def _timeout_ms(name: str, seconds: float | None) -> int:
    """Seconds (None = never) -> whole ms for C (0 = never), at least 1 ms."""
    if seconds is None:
        return 0
    if not isinstance(seconds, int | float) or isinstance(seconds, bool):
        raise TypeError(f"{name} must be a number or None")
    if math.isnan(seconds) or seconds <= 0:
        raise ValueError(f"{name} must be > 0 or None")
    return min(max(1, math.ceil(seconds * 1000)), _U32_MAX)


def _ip(text: str) -> tuple[int, bytes]:
    """IP text -> (4 or 6, 16 bytes with IPv4 in the first four)."""
    ip = ipaddress.ip_address(text)
    return (4, ip.packed + bytes(12)) if ip.version == 4 else (6, ip.packed)


def _ip_text(family: int, raw: bytes) -> str:
    if family == 4:
        return str(ipaddress.IPv4Address(raw[:4]))
    return str(ipaddress.IPv6Address(raw[:16]))


def _counters(c: Any) -> UdpCounters:
    return UdpCounters(*(int(getattr(c, f)) for f in UdpCounters._fields))


def _drops(d: Any) -> UdpDrops:
    return UdpDrops(*(int(getattr(d, f)) for f in UdpDrops._fields))


class UdpRelay:
    """The C UDP relay: ``loops`` epoll threads and what they hold; thread-safe.

    Limits (0 = the C default): ``max_assocs`` concurrent associations (4096),
    ``ring_records`` records waiting per loop (4096), ``max_dests`` live destinations
    per association (1024), ``pending_max`` datagrams held per undecided destination
    (16), ``pending_bytes_max`` held bytes per loop (4 MiB), ``python_bytes_max``
    Datagram bytes waiting per loop (8 MiB).  Beyond any of them datagrams are
    dropped and counted, never queued.  ``busy_poll_us`` > 0 makes a loop poll
    that long after each batch with datagrams before it sleeps again: ping-pong
    traffic then costs no thread wake-ups in the relay (much lower latency at
    window 1) for a CPU spinning while traffic flows.  Call :meth:`close` (or use
    ``with``).
    """

    def __init__(
        self,
        loops: int = 1,
        *,
        max_assocs: int = 0,
        ring_records: int = 0,
        max_dests: int = 0,
        pending_max: int = 0,
        pending_bytes_max: int = 0,
        python_bytes_max: int = 0,
        busy_poll_us: int = 0,
    ) -> None:
        native = native_abi_version()
        if native != ABI_VERSION:
            raise RelayError(
                errno_mod.ELIBBAD,
                f"spliceway._relay UDP ABI {native} does not match spliceway.native.udp ABI "
                f"{ABI_VERSION}; rebuild the extension",
            )
        opts = ffi.new("sw_udp_opts *")
        opts.loops = _int_arg("loops", loops, 1, 256)
        for name, value in (
            ("max_assocs", max_assocs),
            ("ring_records", ring_records),
            ("max_dests", max_dests),
            ("pending_max", pending_max),
            ("pending_bytes_max", pending_bytes_max),
            ("python_bytes_max", python_bytes_max),
            ("busy_poll_us", busy_poll_us),
        ):
            setattr(opts, name, _int_arg(name, value, 0, _U32_MAX))
        out = ffi.new("sw_udp **")
        check(lib.sw_udp_new(opts, out), "sw_udp_new")
        # Freed with the Python object, so no call can run on a freed relay.
        self._ptr = ffi.gc(out[0], lib.sw_udp_free)
        self._loops = loops
        self._close_lock = threading.Lock()
        self._closed = False
        self._drain_lock = threading.Lock()
        self._records = ffi.new("sw_udp_record[]", 256)
        self._payload = ffi.new("uint8_t[]", _PAYLOAD_BUFFER)
        self._used = ffi.new("size_t *")

    def __enter__(self) -> UdpRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"associations={self.stats().assocs_active}"
        return f"<UdpRelay loops={self._loops} {state}>"

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has run."""
        return self._closed

    def close(self) -> None:
        """Stop the loops and end everything (reason SHUTDOWN); idempotent.

        The records stay drainable.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            check(lib.sw_udp_shutdown(self._ptr), "shutdown")

    def fileno(self) -> int:
        """An eventfd, readable while records are pending."""
        return check(lib.sw_udp_fd(self._ptr), "fd")

    # -- associations --------------------------------------------------------------

    def add_association(
        self,
        client_fd: int,
        client_ip: str | None,
        client_port: int = 0,
        dest_idle_timeout: float | None = None,
    ) -> int:
        """Relay for one UDP ASSOCIATE; returns its id.

        ``client_fd`` is the UDP socket Python bound (the BND.ADDR/BND.PORT told to the
        client); C owns it on success (detach it first), the caller still does on
        failure.  Datagrams are accepted only from ``client_ip`` (None: any address,
        learned from the first datagram) and ``client_port`` (0: learned from the
        first datagram from that IP).  A destination with no datagram either way for
        ``dest_idle_timeout`` seconds ends (None: never).
        """
        opts = ffi.new("sw_udp_assoc_opts *")
        opts.client_fd = _int_arg("client_fd", client_fd, 0, _INT_MAX)
        opts.client_port = _int_arg("client_port", client_port, 0, 0xFFFF)
        opts.dest_idle_timeout_ms = _timeout_ms("dest_idle_timeout", dest_idle_timeout)
        if client_ip is not None:
            family, raw = _ip(client_ip)
            opts.client_family = family
            ffi.memmove(opts.client_ip, raw, 16)
        out = ffi.new("uint64_t *")
        check(lib.sw_udp_assoc_add(self._ptr, opts, out), "add_association")
        return int(out[0])

    def close_association(self, assoc: int) -> bool:
        """End an association now (its TCP connection ended); False if it had ended."""
        return self._done(lib.sw_udp_assoc_close(self._ptr, _assoc(assoc)), "close_association")

    def association_counters(self, assoc: int) -> tuple[UdpCounters, UdpDrops] | None:
        """Live totals of an association (ended destinations included), or None."""
        total = ffi.new("sw_udp_counters *")
        drops = ffi.new("sw_udp_drops *")
        rc = lib.sw_udp_assoc_counters(self._ptr, _assoc(assoc), total, drops)
        if not self._done(rc, "association_counters"):
            return None
        return _counters(total[0]), _drops(drops[0])

    def association_dests(self, assoc: int) -> dict[int, UdpCounters] | None:
        """Every live destination of an association with its counters (one C call),
        or None once the association has ended."""
        size = 64
        while True:
            ids = ffi.new("uint32_t[]", size)
            out = ffi.new("sw_udp_counters[]", size)
            rc = lib.sw_udp_assoc_dests(self._ptr, _assoc(assoc), ids, out, size)
            if not self._done(rc, "association_dests"):
                return None
            if rc <= size:
                return {int(ids[i]): _counters(out[i]) for i in range(rc)}
            size = rc + 16  # more appeared than room: ask again, bigger

    # -- upstreams -----------------------------------------------------------------

    def add_upstream(self, assoc: int, fd: int, idle_timeout: float | None = None) -> int:
        """Hand an unconnected UDP socket to the association; returns its upstream id.

        C owns ``fd`` on success (detach it first) and closes it when it has been idle
        for ``idle_timeout`` seconds (None: never), on :meth:`close_upstream`, or
        with the association; an :class:`UpstreamEnded` record says so.
        """
        _int_arg("fd", fd, 0, _INT_MAX)
        out = ffi.new("uint32_t *")
        ms = _timeout_ms("idle_timeout", idle_timeout)
        check(lib.sw_udp_upstream_add(self._ptr, _assoc(assoc), fd, ms, out), "add_upstream")
        return int(out[0])

    def close_upstream(self, assoc: int, upstream: int) -> bool:
        """Close an upstream and end the destinations on it; False if it had ended."""
        _int_arg("upstream", upstream, 1, _U32_MAX)
        rc = lib.sw_udp_upstream_close(self._ptr, _assoc(assoc), upstream)
        return self._done(rc, "close_upstream")

    # -- destinations --------------------------------------------------------------

    def set_direct(self, assoc: int, dest: int, upstream: int, ip: str, port: int) -> bool:
        """Send the destination's datagrams to ``ip:port`` over ``upstream``'s socket.

        Replies from exactly that address are wrapped with the destination's own
        address (as the client sent it) and sent to the client.  Held datagrams go at
        once.  False if the destination (or association) has ended; RelayError
        ENXIO for an unknown (or ended) upstream, EAFNOSUPPORT for an address the
        upstream's socket family cannot reach.
        """
        family, raw = _ip(ip)
        v = ffi.new("sw_udp_verdict *")
        v.action = Action.DIRECT
        v.upstream = _int_arg("upstream", upstream, 1, _U32_MAX)
        v.family = family
        v.port = _int_arg("port", port, 1, 0xFFFF)
        ffi.memmove(v.ip, raw, 16)
        return self._verdict(assoc, dest, v, upstream)

    def set_drop(self, assoc: int, dest: int) -> bool:
        """Discard the destination's datagrams (counted); False if it has ended."""
        v = ffi.new("sw_udp_verdict *")
        v.action = Action.DROP
        return self._verdict(assoc, dest, v, None)

    def set_python(self, assoc: int, dest: int) -> bool:
        """Hand the destination's datagrams to Python as :class:`Datagram` records."""
        v = ffi.new("sw_udp_verdict *")
        v.action = Action.PYTHON
        return self._verdict(assoc, dest, v, None)

    def close_dest(self, assoc: int, dest: int) -> bool:
        """End a destination now (DestEnded, reason CLOSED); False if it had ended."""
        rc = lib.sw_udp_dest_close(self._ptr, _assoc(assoc), _dest(dest))
        return self._done(rc, "close_dest")

    def dest_counters(self, assoc: int, dest: int) -> UdpCounters | None:
        """Live counters of a destination, or None once it has ended."""
        out = ffi.new("sw_udp_counters *")
        rc = lib.sw_udp_dest_counters(self._ptr, _assoc(assoc), _dest(dest), out)
        return _counters(out[0]) if self._done(rc, "dest_counters") else None

    def send_to_client(
        self,
        assoc: int,
        dest: int,
        payload: bytes | bytearray | memoryview,
        source: tuple[str, int] | None = None,
    ) -> int | None:
        """Send ``payload`` to the client as a reply from the destination.

        The SOCKS5 header carries the destination's address as the client sent it, or
        ``source`` (an IP and port) when given.  Counted as the destination's.  Returns
        the bytes written (header included), or None when the destination has ended;
        RelayError for a refused send (ENOTCONN before the client's address is
        known, EMSGSIZE, a full socket buffer).
        """
        family, raw, port = 0, ffi.NULL, 0
        if source is not None:
            family, packed = _ip(source[0])
            raw = ffi.from_buffer(packed)
            port = _int_arg("source port", source[1], 0, 0xFFFF)
        data = ffi.from_buffer(payload)
        rc = lib.sw_udp_send_to_client(
            self._ptr, _assoc(assoc), _dest(dest), family, raw, port, data, len(data)
        )
        if rc == -errno_mod.ENOENT:
            return None
        return check(rc, "send_to_client")

    # -- records and stats ----------------------------------------------------------

    def drain(self) -> list[UdpRecord]:
        """Take the pending records (up to 256) without blocking, oldest first per loop."""
        with self._drain_lock:
            recs, payload = self._records, self._payload
            n = check(
                lib.sw_udp_drain(self._ptr, recs, 256, payload, _PAYLOAD_BUFFER, self._used),
                "drain",
            )
            return [_record(recs[i], payload) for i in range(n)]

    def wait(self, timeout: float | None = None) -> list[UdpRecord]:
        """Block until records are pending (or ``timeout`` seconds pass), then drain."""
        if timeout is not None and (math.isnan(timeout) or timeout < 0):
            raise ValueError("timeout must be >= 0")
        # poll, not select: the descriptor may be above select()'s 1,023.
        poller = select.poll()
        poller.register(self.fileno(), select.POLLIN)
        poller.poll(None if timeout is None else timeout * 1000)
        return self.drain()

    def stats(self) -> UdpStats:
        """Relay-wide counters, summed over the loops."""
        out = ffi.new("sw_udp_stats *")
        check(lib.sw_udp_stats_get(self._ptr, out), "stats")
        return UdpStats(*(int(getattr(out, f)) for f in UdpStats._fields))

    # -- internals -------------------------------------------------------------------

    def _verdict(self, assoc: int, dest: int, v: Any, upstream: int | None) -> bool:
        rc = lib.sw_udp_dest_set(self._ptr, _assoc(assoc), _dest(dest), v)
        if rc == -errno_mod.ENXIO:
            raise RelayError(errno_mod.ENXIO, f"set_direct: no upstream {upstream}")
        return self._done(rc, "set_dest")

    @staticmethod
    def _done(rc: int, what: str) -> bool:
        """True on success, False for a finished object or a closed relay."""
        if rc < 0 and -rc in _GONE:
            return False
        check(rc, what)
        return True


def _assoc(assoc: int) -> int:
    return _int_arg("assoc", assoc, 1, _U64_MAX)


def _dest(dest: int) -> int:
    return _int_arg("dest", dest, 1, _U32_MAX)


def _record(r: Any, payload: Any) -> UdpRecord:
    kind = int(r.kind)
    assoc, at = int(r.assoc), int(r.at_unix_ms)
    if kind == lib.SW_UDP_REC_DATAGRAM:
        off, n = int(r.payload_off), int(r.payload_len)
        return Datagram(assoc, int(r.dest), at, bytes(ffi.buffer(payload + off, n)))
    if kind == lib.SW_UDP_REC_NEW_DEST:
        host = ffi.string(r.host, r.host_len).decode("utf-8")
        client = _ip_text(int(r.client_family), bytes(r.client_ip))
        atyp = int(r.atyp)
        return NewDest(assoc, int(r.dest), at, host, int(r.port), atyp, client, int(r.client_port))
    reason, err = End(r.reason), int(r.err)
    if kind == lib.SW_UDP_REC_DEST_ENDED:
        counters = _counters(r.counters)
        return DestEnded(
            assoc, int(r.dest), at, reason, err, Action(r.action), int(r.upstream), counters
        )
    if kind == lib.SW_UDP_REC_UPSTREAM_ENDED:
        return UpstreamEnded(
            assoc, int(r.upstream), at, reason, err, _counters(r.counters), _drops(r.drops)
        )
    return AssocEnded(assoc, at, reason, err, _counters(r.counters), _drops(r.drops))
