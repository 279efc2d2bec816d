"""The local process behind a flow: its socket by netlink ``sock_diag``, its owner by ``/proc``.

Reference: docs/configuration.md (``runtime.process_lookup``), docs/events.md
(``source.process_id``, ``source.process_name``, ``source.process_path``).

A flow whose client runs on this host (its address is loopback or one of this host's
interface addresses: :class:`LocalAddresses`) has a client socket in this network
namespace. Its 4-tuple, as that socket sees it (local = the flow's source, remote = the
inbound's address), finds the socket through ``NETLINK_SOCK_DIAG`` (an exact
``inet_diag_req_v2`` lookup, else a filtered dump), which gives its inode and uid; the
process holding a descriptor ``socket:[inode]`` is then found under ``/proc``
(:class:`ProcTable`, cached by inode and checked with one ``readlink`` on reuse).

Everything that touches the kernel runs in one worker thread owned by
:class:`ProcessLookup` (the dispatcher's loop only awaits it), with a bound on the
lookups in flight: past it a flow gets no process rather than a queue.

The parsers (:func:`parse_diag_reply`, :func:`parse_addr_reply`) are pure, take the
bytes one ``recv`` returned, and raise :class:`NetlinkParseError` for anything that is
not well-formed netlink, never another exception.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno as errno_mod
import ipaddress
import logging
import os
import socket
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "DiagReply",
    "LocalAddresses",
    "NetlinkError",
    "NetlinkParseError",
    "ProcTable",
    "ProcessInfo",
    "ProcessLookup",
    "SockDiag",
    "SockInfo",
    "build_addr_request",
    "build_diag_request",
    "build_dump_request",
    "is_loopback",
    "lookup_active",
    "parse_addr_reply",
    "parse_diag_reply",
]

logger = logging.getLogger(__name__)

LookupMode = Literal["auto", "always", "off"]

# -- netlink constants (linux/netlink.h, linux/sock_diag.h, linux/inet_diag.h, rtnetlink.h)

NETLINK_ROUTE = 0
NETLINK_SOCK_DIAG = 4
NLM_F_REQUEST = 0x1
NLM_F_MULTI = 0x2
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
NLMSG_NOOP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
SOCK_DIAG_BY_FAMILY = 20
RTM_NEWADDR = 20
RTM_GETADDR = 22
RTMGRP_IPV4_IFADDR = 0x10
RTMGRP_IPV6_IFADDR = 0x100
IFA_ADDRESS = 1
IFA_LOCAL = 2
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_BC_S_COND = 7
INET_DIAG_BC_D_COND = 8
INET_DIAG_NOCOOKIE = 0xFFFFFFFF

#: TCP states a client socket of a live flow can be in (everything but LISTEN,
#: TIME_WAIT, CLOSE and NEW_SYN_RECV, none of which belongs to a process).
_TCP_FLOW_STATES = sum(1 << s for s in (1, 2, 4, 5, 8, 9, 11))  # ESTABLISHED .. CLOSING
_ALL_STATES = 0xFFFFFFFF

_NLMSGHDR = struct.Struct("=IHHII")
_NLMSG_ERR = struct.Struct("=i")
_RTATTR = struct.Struct("=HH")
_DIAG_REQ = struct.Struct("=BBBxI")  # family, protocol, ext, pad, states
_SOCKID_PORTS = struct.Struct(">HH")
_SOCKID_TAIL = struct.Struct("=III")  # if, cookie[2]
# inet_diag_msg: family, state, timer, retrans (4 bytes), sockid (ports, src, dst, then
# this tail's first three), expires, rqueue, wqueue, uid, inode.
_DIAG_MSG_TAIL = struct.Struct("=IIIIIIII")  # if, cookie[2], expires, rq, wq, uid, inode
_DIAG_MSG_LEN = 72
_IFADDRMSG = struct.Struct("=BBBBI")
_BC_OP = struct.Struct("=BBH")
_HOSTCOND = struct.Struct("=BBxxi")

_FAMILIES = {4: socket.AF_INET, 6: socket.AF_INET6}
# Keyed by the family number as netlink carries it (a plain int, not AddressFamily).
_VERSIONS: dict[int, int] = {socket.AF_INET: 4, socket.AF_INET6: 6}
_ADDR_LEN: dict[int, int] = {socket.AF_INET: 4, socket.AF_INET6: 16}


def _align(n: int) -> int:
    return (n + 3) & ~3


class NetlinkParseError(ValueError):
    """Bytes that are not a well-formed netlink reply of the expected kind."""


class NetlinkError(OSError):
    """The kernel answered a netlink request with an error (``errno`` set)."""


@dataclass(frozen=True, slots=True)
class SockInfo:
    """One socket as ``sock_diag`` describes it (addresses as text, IPv4 plain)."""

    family: int
    state: int
    src: str
    sport: int
    dst: str
    dport: int
    uid: int
    inode: int


@dataclass(frozen=True, slots=True)
class DiagReply:
    """What one ``recv`` of a ``sock_diag`` reply held."""

    sockets: tuple[SockInfo, ...]
    #: The reply is complete (``NLMSG_DONE``, or an answer to a non-dump request).
    done: bool


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """The process owning a socket: ``source.process_*`` of a flow record."""

    pid: int
    #: The executable's base name (``/proc/<pid>/comm`` when the executable is unreadable).
    name: str
    #: The executable's path; None when ``/proc/<pid>/exe`` cannot be read.
    path: str | None


# -- messages ----------------------------------------------------------------------------


def _messages(data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
    """``(type, flags, seq, payload)`` of each message in ``data``; raises on bad framing."""
    offset = 0
    end = len(data)
    while offset < end:
        if end - offset < _NLMSGHDR.size:
            raise NetlinkParseError(f"truncated netlink header at {offset}")
        length, mtype, flags, seq, _pid = _NLMSGHDR.unpack_from(data, offset)
        if length < _NLMSGHDR.size or length > end - offset:
            raise NetlinkParseError(f"bad netlink message length {length} at {offset}")
        yield mtype, flags, seq, data[offset + _NLMSGHDR.size : offset + length]
        offset += _align(length)


def _error_payload(payload: bytes) -> int:
    """The (negative) errno of an ``NLMSG_ERROR``, 0 for an acknowledgement."""
    if len(payload) < _NLMSG_ERR.size:
        raise NetlinkParseError("truncated netlink error message")
    return int(_NLMSG_ERR.unpack_from(payload)[0])


def _addr_text(family: int, raw: bytes) -> str:
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    return str(ipaddress.IPv6Address(raw[:16]))


def parse_diag_reply(data: bytes, seq: int | None = None) -> DiagReply:
    """Parse the bytes of one ``recv`` on a ``NETLINK_SOCK_DIAG`` socket.

    Messages of another ``seq`` (when given) are skipped. Raises :class:`NetlinkError`
    for the kernel's error answer (``ENOENT``: no such socket) and
    :class:`NetlinkParseError` for malformed bytes.
    """
    found: list[SockInfo] = []
    done = False
    for mtype, flags, mseq, payload in _messages(data):
        if seq is not None and mseq != seq:
            continue
        if mtype == NLMSG_DONE:
            # A dump's end; a negative int there is a dump that failed part-way.
            if len(payload) >= _NLMSG_ERR.size and _error_payload(payload) < 0:
                code = -_error_payload(payload)
                raise NetlinkError(code, os.strerror(code))
            done = True
        elif mtype == NLMSG_ERROR:
            code = _error_payload(payload)
            if code < 0:
                raise NetlinkError(-code, os.strerror(-code))
            done = True
        elif mtype == SOCK_DIAG_BY_FAMILY:
            found.append(_parse_diag_msg(payload))
            if not flags & NLM_F_MULTI:
                done = True  # the one answer to an exact lookup
        elif mtype == NLMSG_NOOP:
            continue
        else:
            raise NetlinkParseError(f"unexpected netlink message type {mtype}")
    return DiagReply(tuple(found), done)


def _parse_diag_msg(payload: bytes) -> SockInfo:
    if len(payload) < _DIAG_MSG_LEN:
        raise NetlinkParseError(f"inet_diag_msg of {len(payload)} bytes")
    family, state, _timer, _retrans = payload[0], payload[1], payload[2], payload[3]
    if family not in _ADDR_LEN:
        raise NetlinkParseError(f"inet_diag_msg of address family {family}")
    sport, dport = _SOCKID_PORTS.unpack_from(payload, 4)
    src, dst = payload[8:24], payload[24:40]
    tail = _DIAG_MSG_TAIL.unpack_from(payload, 40)
    uid, inode = tail[6], tail[7]
    return SockInfo(
        family=_VERSIONS[family],
        state=state,
        src=_addr_text(family, src),
        sport=sport,
        dst=_addr_text(family, dst),
        dport=dport,
        uid=uid,
        inode=inode,
    )


def parse_addr_reply(data: bytes, seq: int | None = None) -> tuple[tuple[str, ...], bool]:
    """Parse one ``recv`` of an ``RTM_GETADDR`` dump: ``(addresses, done)``.

    An address is the interface's own (``IFA_LOCAL``, else ``IFA_ADDRESS``), as text.
    Raises like :func:`parse_diag_reply`.
    """
    out: list[str] = []
    done = False
    for mtype, _flags, mseq, payload in _messages(data):
        if seq is not None and mseq != seq:
            continue
        if mtype == NLMSG_DONE:
            done = True
        elif mtype == NLMSG_ERROR:
            code = _error_payload(payload)
            if code < 0:
                raise NetlinkError(-code, os.strerror(-code))
            done = True
        elif mtype == RTM_NEWADDR:
            addr = _parse_ifaddr(payload)
            if addr is not None:
                out.append(addr)
        elif mtype == NLMSG_NOOP:
            continue
        else:
            raise NetlinkParseError(f"unexpected netlink message type {mtype}")
    return tuple(out), done


def _parse_ifaddr(payload: bytes) -> str | None:
    if len(payload) < _IFADDRMSG.size:
        raise NetlinkParseError(f"ifaddrmsg of {len(payload)} bytes")
    family = payload[0]
    attrs = _attributes(payload, _IFADDRMSG.size)
    size = _ADDR_LEN.get(family)
    if size is None:
        return None  # another family (none is asked for): nothing of ours
    raw = attrs.get(IFA_LOCAL, attrs.get(IFA_ADDRESS))
    if raw is None:
        return None
    if len(raw) != size:
        raise NetlinkParseError(f"address attribute of {len(raw)} bytes for family {family}")
    return _addr_text(family, raw)


def _attributes(payload: bytes, offset: int) -> dict[int, bytes]:
    """The rtattrs from ``offset``: type -> value (the last of a repeated type)."""
    attrs: dict[int, bytes] = {}
    end = len(payload)
    offset = _align(offset)
    while offset + _RTATTR.size <= end:
        length, atype = _RTATTR.unpack_from(payload, offset)
        if length < _RTATTR.size or length > end - offset:
            raise NetlinkParseError(f"bad attribute length {length} at {offset}")
        attrs[atype & 0x3FFF] = payload[offset + _RTATTR.size : offset + length]
        offset += _align(length)
    return attrs


# -- requests -----------------------------------------------------------------------------


def _packed(version: int, ip: str) -> bytes:
    return socket.inet_pton(_FAMILIES[version], ip).ljust(16, b"\0")


def build_diag_request(
    seq: int, version: int, protocol: int, src: tuple[str, int], dst: tuple[str, int]
) -> bytes:
    """An exact ``inet_diag_req_v2`` lookup of the socket whose id is ``src``/``dst``.

    For TCP ``src`` is the socket's local end; for UDP its remote end (``udp_dump_one``
    looks the id up as a datagram from ``src`` to ``dst`` would be).
    """
    sockid = (
        _SOCKID_PORTS.pack(src[1], dst[1])
        + _packed(version, src[0])
        + _packed(version, dst[0])
        + _SOCKID_TAIL.pack(0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    )
    body = _DIAG_REQ.pack(_FAMILIES[version], protocol, 0, _ALL_STATES) + sockid
    return (
        _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, seq, 0)
        + body
    )


def build_dump_request(
    seq: int, version: int, protocol: int, local: tuple[str | None, int], dport: int | None
) -> bytes:
    """A dump of the sockets of ``version``/``protocol`` whose local end is ``local`` (any
    address when None: an unconnected UDP socket is bound to the wildcard) and remote
    port ``dport`` (any when None), filtered by the kernel with inet_diag bytecode."""
    family = _FAMILIES[version]
    sockid = _SOCKID_PORTS.pack(0, 0) + bytes(32) + _SOCKID_TAIL.pack(0, 0, 0)
    states = _TCP_FLOW_STATES if protocol == socket.IPPROTO_TCP else _ALL_STATES
    body = _DIAG_REQ.pack(family, protocol, 0, states) + sockid
    bytecode = _filter_bytecode(family, local, dport)
    body += _RTATTR.pack(_RTATTR.size + len(bytecode), INET_DIAG_REQ_BYTECODE) + bytecode
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, flags, seq, 0) + body


def _filter_bytecode(family: int, local: tuple[str | None, int], dport: int | None) -> bytes:
    """``local address and port match, and remote port == dport`` as inet_diag bytecode.

    Each op jumps ``yes`` bytes on a match (to the next op, or exactly to the end:
    accepted) and ``no`` bytes on a miss (4 past the end: rejected), the only jumps the
    kernel's bytecode audit accepts.
    """
    if local[0] is None:
        s_cond = _HOSTCOND.pack(socket.AF_UNSPEC, 0, local[1])
    else:
        addr = socket.inet_pton(family, local[0])
        s_cond = _HOSTCOND.pack(family, len(addr) * 8, local[1]) + addr
    conds = [(INET_DIAG_BC_S_COND, s_cond)]
    if dport is not None:
        conds.append((INET_DIAG_BC_D_COND, _HOSTCOND.pack(socket.AF_UNSPEC, 0, dport)))
    remaining = sum(_BC_OP.size + len(c) for _, c in conds)
    out = b""
    for code, cond in conds:
        size = _BC_OP.size + len(cond)
        out += _BC_OP.pack(code, size, remaining + 4) + cond
        remaining -= size
    return out


def build_addr_request(seq: int) -> bytes:
    """An ``RTM_GETADDR`` dump of every address of every family."""
    body = _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
    flags = NLM_F_REQUEST | NLM_F_DUMP
    return _NLMSGHDR.pack(_NLMSGHDR.size + len(body), RTM_GETADDR, flags, seq, 0) + body


# -- the kernel side -------------------------------------------------------------------------


def _unmapped(ip: str) -> tuple[int, str]:
    """``(version, text)`` of an address; IPv4-mapped IPv6 read as IPv4."""
    addr = ipaddress.ip_address(ip.strip("[]"))
    if addr.version == 6:
        mapped = addr.ipv4_mapped
        if mapped is not None:
            return 4, str(mapped)
    return addr.version, str(addr)


def _mapped(ip: str) -> str:
    return f"::ffff:{ip}"


class SockDiag:
    """A ``NETLINK_SOCK_DIAG`` socket (one thread's: it is not thread-safe)."""

    _RECV = 65536

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        # A lost reply must not hang the worker.
        self._sock.settimeout(1.0)
        self._seq = 0

    def close(self) -> None:
        """Close the netlink socket."""
        self._sock.close()

    def _ask(self, request_of: Callable[[int], bytes]) -> list[SockInfo]:
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        seq = self._seq
        self._sock.send(request_of(seq))
        found: list[SockInfo] = []
        while True:
            reply = parse_diag_reply(self._sock.recv(self._RECV), seq)
            found.extend(reply.sockets)
            if reply.done:
                return found

    def lookup(
        self, version: int, protocol: int, src: tuple[str, int], dst: tuple[str, int]
    ) -> SockInfo | None:
        """The socket with exactly this id (see :func:`build_diag_request`), or None."""
        try:
            found = self._ask(lambda seq: build_diag_request(seq, version, protocol, src, dst))
        except NetlinkError as ex:
            if ex.errno == errno_mod.ENOENT:
                return None
            raise
        return found[0] if found else None

    def dump_local(
        self, version: int, protocol: int, local: tuple[str | None, int], dport: int | None
    ) -> list[SockInfo]:
        """Sockets of ``version``/``protocol`` with this local end and remote port (see
        :func:`build_dump_request`), whatever their remote address."""
        return self._ask(lambda seq: build_dump_request(seq, version, protocol, local, dport))

    def find_client(
        self, protocol: int, client: tuple[str, int], server: tuple[str | None, int]
    ) -> SockInfo | None:
        """The socket of a local client at ``client`` connected to ``server`` (this
        engine's end; address None when its listener is on a wildcard address, port 0
        when unknown).

        Tries the exact lookup first (with the client's own address as the server's
        when unknown: a connection to one of this host's addresses normally has it as
        its source too), then a filtered dump; for an IPv4 client, also the IPv4-mapped
        form an IPv6 socket would have.
        """
        version, cip = _unmapped(client[0])
        sip = None if server[0] is None or _is_wildcard(server[0]) else _unmapped(server[0])[1]
        forms: list[tuple[int, str, str | None]] = [(version, cip, sip)]
        if version == 4:
            forms.append((6, _mapped(cip), _mapped(sip) if sip is not None else None))
        for fam, c_ip, s_ip in forms:
            guess = s_ip if s_ip is not None else c_ip
            if protocol == socket.IPPROTO_UDP:
                info = self.lookup(fam, protocol, (guess, server[1]), (c_ip, client[1]))
            else:
                info = self.lookup(fam, protocol, (c_ip, client[1]), (guess, server[1]))
            if info is not None and info.inode:
                return info
            if protocol == socket.IPPROTO_UDP:
                # The exact lookup finds a wildcard-bound socket too; a dump by the port
                # alone is the last resort (an unconnected socket has no remote port).
                dumped = self.dump_local(fam, protocol, (None, client[1]), None)
            elif s_ip is None:
                # Port 0: the server's port is unknown too (its listener is gone).
                dport = server[1] or None
                dumped = self.dump_local(fam, protocol, (c_ip, client[1]), dport)
            else:
                dumped = []
            for info in dumped:
                if info.inode:
                    return info
        return None


def _is_wildcard(ip: str) -> bool:
    return ip in ("", "0.0.0.0", "::", "::ffff:0.0.0.0")


def is_loopback(ip: str) -> bool:
    """Whether ``ip`` (canonical text, as sockets give it) is a loopback address: 127/8,
    ``::1``, or 127/8 IPv4-mapped."""
    if ip.startswith("::ffff:"):
        ip = ip[7:]
    return ip.startswith("127.") or ip == "::1"


class LocalAddresses:
    """This host's addresses (every interface's, this network namespace), kept current.

    :meth:`refresh` dumps them over ``NETLINK_ROUTE``; :meth:`watch_socket` gives a
    socket subscribed to address changes, readable when one happened (the engine
    watches it on its loop and refreshes off the loop). :meth:`is_local` reads the
    current snapshot only: cheap enough for the loop.
    """

    def __init__(self, addresses: frozenset[str] = frozenset()) -> None:
        self._addresses = addresses

    @property
    def addresses(self) -> frozenset[str]:
        """The snapshot (text, IPv4 plain, IPv6 compressed)."""
        return self._addresses

    def is_local(self, ip: str) -> bool:
        """Whether a peer at ``ip`` (canonical text, as sockets give it) is on this host:
        loopback or one of its addresses. A set lookup and a prefix test: loop-safe."""
        if ip in self._addresses or is_loopback(ip):
            return True
        return ip.startswith("::ffff:") and ip[7:] in self._addresses

    def refresh(self) -> frozenset[str]:
        """Dump the addresses now (blocking: call off the loop); the new snapshot."""
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        try:
            sock.settimeout(1.0)
            sock.send(build_addr_request(1))
            found: list[str] = []
            while True:
                addresses, done = parse_addr_reply(sock.recv(65536), 1)
                found.extend(addresses)
                if done:
                    break
        finally:
            sock.close()
        self._addresses = frozenset(_unmapped(a)[1] for a in found)
        return self._addresses

    @staticmethod
    def watch_socket() -> socket.socket:
        """A non-blocking netlink socket that becomes readable on any address change."""
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        sock.bind((0, RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR))
        sock.setblocking(False)
        return sock


# -- /proc ------------------------------------------------------------------------------------


class ProcTable:
    """Finds the process holding a socket inode under ``proc`` (default ``/proc``).

    Caches: inode -> (pid, fd) of every socket descriptor a scan walked past (checked
    with one ``readlink`` before use, so a closed or reused descriptor is never
    believed), and the pids that owned sockets lately, scanned first. A full scan goes
    from the highest pid down (a new client is usually a new process) and, when the
    socket's uid is known, skips processes of other users.
    """

    def __init__(self, proc: str = "/proc", *, max_inodes: int = 65536, hot_pids: int = 64) -> None:
        self._proc = proc
        self._max_inodes = max_inodes
        self._hot_max = hot_pids
        self._inodes: dict[int, tuple[int, int]] = {}
        self._hot: OrderedDict[int, None] = OrderedDict()
        #: Full scans done (for tests and the benchmark).
        self.scans = 0

    def find(self, inode: int, uid: int | None = None) -> ProcessInfo | None:
        """The process with a descriptor on socket ``inode``, or None."""
        if inode <= 0:
            return None
        target = f"socket:[{inode}]"
        cached = self._inodes.get(inode)
        if cached is not None:
            pid, fd = cached
            if self._readlink(f"{self._proc}/{pid}/fd/{fd}") == target:
                return self._found(pid)
            del self._inodes[inode]
        for pid in list(reversed(self._hot)):
            if self._scan_pid(pid, inode):
                return self._found(pid)
        self.scans += 1
        for pid in self._pids():
            if pid in self._hot:
                continue
            if uid is not None and not self._owned_by(pid, uid):
                continue
            if self._scan_pid(pid, inode):
                return self._found(pid)
        return None

    def forget(self) -> None:
        """Drop every cache."""
        self._inodes.clear()
        self._hot.clear()

    def _pids(self) -> list[int]:
        try:
            names = os.listdir(self._proc)
        except OSError:
            return []
        return sorted((int(n) for n in names if n.isdigit()), reverse=True)

    def _owned_by(self, pid: int, uid: int) -> bool:
        try:
            return os.stat(f"{self._proc}/{pid}").st_uid == uid
        except OSError:
            return False

    @staticmethod
    def _readlink(path: str) -> str | None:
        try:
            return os.readlink(path)
        except OSError:
            return None

    def _scan_pid(self, pid: int, inode: int) -> bool:
        """Walk ``pid``'s descriptors, remembering every socket; True if one is ``inode``."""
        base = f"{self._proc}/{pid}/fd"
        try:
            fds = os.listdir(base)
        except OSError:
            self._hot.pop(pid, None)
            return False
        hit = False
        if len(self._inodes) + len(fds) > self._max_inodes:
            self._inodes.clear()  # bounded: start over rather than track ages
        for name in fds:
            link = self._readlink(f"{base}/{name}")
            if link is None or not link.startswith("socket:["):
                continue
            try:
                found = int(link[8:-1])
            except ValueError:
                continue
            self._inodes[found] = (pid, int(name))
            if found == inode:
                hit = True
        return hit

    def _found(self, pid: int) -> ProcessInfo | None:
        self._hot[pid] = None
        self._hot.move_to_end(pid)
        while len(self._hot) > self._hot_max:
            self._hot.popitem(last=False)
        return self.describe(pid)

    def describe(self, pid: int) -> ProcessInfo | None:
        """``pid``'s executable path and base name now (None when it is gone)."""
        path = self._readlink(f"{self._proc}/{pid}/exe")
        if path is not None:
            # The kernel marks an executable replaced or removed since it started.
            path = path.removesuffix(" (deleted)")
            name = os.path.basename(path)
            if name:
                return ProcessInfo(pid, name, path)
        try:
            with open(f"{self._proc}/{pid}/comm", encoding="utf-8", errors="replace") as f:
                comm = f.read().rstrip("\n")
        except OSError:
            return None
        return ProcessInfo(pid, comm, None) if comm else None


# -- the engine's service ---------------------------------------------------------------------


def lookup_active(mode: LookupMode, process_rules: bool) -> bool:
    """Whether ``runtime.process_lookup`` ``mode`` looks flows up, given whether a rule
    names a ``process_name``."""
    return mode == "always" or (mode == "auto" and process_rules)


class ProcessLookup:
    """``runtime.process_lookup`` for the engine: which flows to look up, and the lookups.

    The mode and the rules are the caller's (a reload replaces them): :meth:`wanted`
    takes them. Lookups run in one worker thread; :meth:`lookup_tcp` is awaited on the
    loop. ``max_pending`` bounds the lookups queued or running: past it a flow gets None.
    """

    def __init__(
        self,
        *,
        max_pending: int = 256,
        proc: ProcTable | None = None,
        local: LocalAddresses | None = None,
        on_local_change: Callable[[], None] | None = None,
    ) -> None:
        self.local = local if local is not None else LocalAddresses()
        self._proc = proc if proc is not None else ProcTable()
        self._max_pending = max_pending
        self._pending = 0
        self._executor: ThreadPoolExecutor | None = None
        self._diag: SockDiag | None = None
        self._lock = threading.Lock()
        #: Flows whose records wait for a lookup (the loop's count; a stop waits for them).
        self.holding = 0
        #: Called (in the worker) when this host's addresses changed: the route table
        #: knows them too.
        self._on_local_change = on_local_change
        #: Counters: lookups done, found, refused for the bound, failed by an error.
        self.looked_up = 0
        self.found = 0
        self.shed = 0
        self.errors = 0

    def wanted(self, peer_ip: str, mode: LookupMode, process_rules: bool) -> bool:
        """Whether a flow from ``peer_ip`` is to be looked up (cheap: loop-safe)."""
        return lookup_active(mode, process_rules) and self.local.is_local(peer_ip)

    def _worker(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="spliceway-proc")
            return self._executor

    def refresh_local(self) -> None:
        """Re-read this host's addresses (blocking); ``on_local_change`` if they changed."""
        before = self.local.addresses
        try:
            after = self.local.refresh()
        except (OSError, NetlinkParseError) as ex:
            logger.warning("cannot list this host's addresses: %s", ex)
            return
        callback = self._on_local_change
        if after != before and callback is not None:
            try:
                callback()
            except Exception:
                logger.exception("reacting to this host's new addresses failed")

    def refresh_local_later(self) -> None:
        """Re-read this host's addresses in the worker (from the loop)."""
        self._worker().submit(self.refresh_local)

    async def lookup_tcp(
        self, client: tuple[str, int], server: tuple[str | None, int]
    ) -> ProcessInfo | None:
        """The process behind a local TCP client at ``client`` connected to ``server``
        (this engine's end; address None when unknown), or None. Runs in the worker."""
        return await self._run(socket.IPPROTO_TCP, client, server)

    async def lookup_udp(
        self, client: tuple[str, int], server: tuple[str | None, int]
    ) -> ProcessInfo | None:
        """As :meth:`lookup_tcp`, for a UDP client socket."""
        return await self._run(socket.IPPROTO_UDP, client, server)

    async def _run(
        self, protocol: int, client: tuple[str, int], server: tuple[str | None, int]
    ) -> ProcessInfo | None:
        if self._pending >= self._max_pending:
            self.shed += 1
            return None
        self._pending += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._worker(), self.find, protocol, client, server)
        finally:
            self._pending -= 1

    def find(
        self, protocol: int, client: tuple[str, int], server: tuple[str | None, int]
    ) -> ProcessInfo | None:
        """The lookup itself (blocking; the worker's). Errors are logged, not raised."""
        self.looked_up += 1
        try:
            if self._diag is None:
                self._diag = SockDiag()
            info = self._diag.find_client(protocol, client, server)
            result = self._proc.find(info.inode, info.uid) if info is not None else None
        except (OSError, ValueError) as ex:
            self.errors += 1
            logger.debug("process lookup for %s failed: %s", client, ex)
            if isinstance(ex, OSError) and self._diag is not None:
                # A timeout may leave a late reply queued: start on a fresh socket.
                with contextlib.suppress(OSError):
                    self._diag.close()
                self._diag = None
            return None
        if result is not None:
            self.found += 1
        return result

    def close(self) -> None:
        """Stop the worker (waits for the lookup it runs, drops the queued ones)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=True)
        if self._diag is not None:
            with contextlib.suppress(OSError):
                self._diag.close()
            self._diag = None
