"""Python face of the C connection path (``csrc/conn.c``); the only module calling ``sw_conn_*``.

The C path accepts on listening sockets handed to it, runs the inbound handshake,
routes from the table Python compiled (:mod:`spliceway.native.route`), dials and
hands both sockets to the relay, on its own threads. Python learns what happened
from fixed-size records (:class:`ConnRecord`) drained in batches
(:meth:`ConnPath.drain`, when :meth:`ConnPath.fileno` is readable), and gets the
connections C could not finish as :class:`Deferred` items.
"""

from __future__ import annotations

import errno as errno_mod
import ipaddress
import os
import socket
import struct
from dataclasses import dataclass
from typing import Any

from spliceway._relay import ffi, lib
from spliceway.flows.outbounds import SOCKS_REPLY_NAMES, DialError, errno_code
from spliceway.native.relay import Relay, check

__all__ = ["ConnPath", "ConnRecord", "Deferred", "ListenerOptions"]

STARTED = int(lib.SW_REC_STARTED)
ROUTED = int(lib.SW_REC_ROUTED)
ENDED = int(lib.SW_REC_ENDED)
#: Not a flow's: a listener out of descriptors (the first failed accept of an outage,
#: ``err`` its errno, ``flow`` the outage's number), and accepting again (``detail``:
#: the accepts that failed). C pauses that loop's accepting itself (``csrc/conn.h``).
ACCEPT_FAILED = int(lib.SW_REC_ACCEPT_FAILED)
ACCEPT_RESUMED = int(lib.SW_REC_ACCEPT_RESUMED)
NO_PRINCIPAL = (1 << 32) - 1
END_BLOCKED = int(lib.SW_END_BLOCKED)
END_CONNECT_FAILED = int(lib.SW_END_CONNECT_FAILED)
END_CONNECT_TIMEOUT = int(lib.SW_END_CONNECT_TIMEOUT)
END_UPSTREAM_PROTO = int(lib.SW_END_UPSTREAM_PROTO)
END_UPSTREAM_AUTH = int(lib.SW_END_UPSTREAM_AUTH)
END_UPSTREAM_REPLY = int(lib.SW_END_UPSTREAM_REPLY)
END_CLOSED = int(lib.SW_END_CLOSED)
END_CLIENT = int(lib.SW_END_CLIENT)
END_INTERNAL = int(lib.SW_END_INTERNAL)
#: A request C forwarded itself (an http inbound's absolute-URI request): answered
#: whole; the client gone mid-answer; the upstream quiet (detail 0: before its head).
END_FORWARDED = int(lib.SW_END_FORWARDED)
END_FWD_CLIENT = int(lib.SW_END_FWD_CLIENT)
END_FWD_TIMEOUT = int(lib.SW_END_FWD_TIMEOUT)
#: sw_conn_auth -> FlowRecord auth_scheme.
AUTH_SCHEMES = {1: "userpass", 2: "basic"}
_AUTH_DETAILS = {
    int(lib.SW_AUTH_REFUSED_USERPASS): "refused user/password auth",
    int(lib.SW_AUTH_REJECTED): "rejected the credentials",
    int(lib.SW_AUTH_REQUIRED): "requires authentication",
}
_PROTO_CLOSED = int(lib.SW_PROTO_CLOSED)
_PROTO_HTTP = int(lib.SW_PROTO_HTTP)
#: sw_proto_detail -> socks5's ProtocolError text ({} is the offending byte).
_PROTO_DETAILS = {
    int(lib.SW_PROTO_METHOD_VERSION): "server is not SOCKS5: version byte {:#04x}",
    int(lib.SW_PROTO_AUTH_VERSION): "bad username/password status version {}",
    int(lib.SW_PROTO_REPLY_VERSION): "server reply is not SOCKS5: version byte {:#04x}",
    int(lib.SW_PROTO_REPLY_ATYP): "unknown address type {}",
    int(lib.SW_PROTO_EMPTY_DOMAIN): "empty domain name",
    int(lib.SW_PROTO_BAD_DOMAIN): "undecodable domain name",
}
_PROTOCOLS = {
    "socks5": int(lib.SW_IN_SOCKS5),
    "http": int(lib.SW_IN_HTTP),
    "mixed": int(lib.SW_IN_MIXED),
}
#: sw_conn_record.protocol / sw_deferred.protocol -> the handshake spoken ("http_forward":
#: an absolute-URI request C forwards itself, only in records).
_SPOKEN = {1: "socks5", 2: "http", 3: "tun", 4: "http_forward"}
#: Records copied per C call; a drain loops until the rings are empty.
_BATCH = 256

# sw_conn_record, field for field; the C struct adds only tail padding.
_RECORD = struct.Struct("=QQQQIIIiiiIIIIIIIiiHHHBBBBBB16s16sH256s")
_STRIDE = ffi.sizeof("sw_conn_record")
if not _RECORD.size <= _STRIDE < _RECORD.size + 8:
    raise ImportError(f"sw_conn_record is {_STRIDE} bytes, not {_RECORD.size}: rebuild")


def _ip(family: int, raw: bytes) -> str | None:
    # inet_ntop writes the same text as ipaddress (RFC 5952), at a tenth of the cost.
    if family == 4:
        return socket.inet_ntop(socket.AF_INET, raw[:4])
    if family == 6:
        if raw[:10] == _ZERO10 and raw[10:12] in (b"\xff\xff", b"\0\0"):
            # Mapped and compatible forms: libc writes a dotted quad, ipaddress may not.
            return str(ipaddress.IPv6Address(raw))
        return socket.inet_ntop(socket.AF_INET6, raw)
    return None


_ZERO10 = bytes(10)


@dataclass(slots=True)
class ConnRecord:
    """One lifecycle record of a flow C handles (see ``sw_conn_record``)."""

    flow: int
    at_unix_ms: int
    relay_handle: int
    epoch: int
    kind: int
    inbound: int
    principal: int
    rule: int
    target: int
    action: int
    client_rx: int
    client_tx: int
    upstream_rx: int
    upstream_tx: int
    early: int
    end: int
    err: int
    detail: int
    port: int
    source_port: int
    resolved_port: int
    #: The handshake spoken: ``socks5``, ``http`` (CONNECT), ``tun``, or ``http_forward``
    #: (an absolute-URI request C forwards itself).
    protocol: str
    auth: int
    source_ip: str | None
    resolved_ip: str | None
    replied: bool
    #: The upstream connection (and its proxy handshake) was made.
    dialled: bool
    name: str
    #: ROUTED: upstream bytes past the proxy's reply that C sent to the client itself.
    late: int = 0
    #: ENDED by an http proxy's malformed answer: the failure text C kept for it.
    message: str | None = None


@dataclass(slots=True)
class Deferred:
    """A connection C handed to Python (see ``sw_deferred``)."""

    fd: int
    stage: int
    inbound: int
    protocol: str
    principal: int
    auth: int
    client_rx: int
    client_tx: int
    started_unix_ms: int
    port: int
    source_ip: str | None
    source_port: int
    replied: bool
    host: str
    sniffed: str | None
    raw: bytes
    #: The flow C already started (sniffed before routing, then needed Python); 0 if none.
    flow: int = 0
    #: The SOCKS5 command (1 CONNECT; 3 UDP ASSOCIATE, whose host:port is the client's
    #: declared datagram source); 1 for HTTP.
    command: int = 1
    #: FORWARD: the upstream socket (now Python's), the request head's length in raw
    #: (the rest is what the upstream answered so far) and the upstream's byte counts.
    ufd: int = -1
    split: int = 0
    upstream_rx: int = 0
    upstream_tx: int = 0


HANDSHAKE = int(lib.SW_DEFER_HANDSHAKE)
ROUTE = int(lib.SW_DEFER_ROUTE)
FORWARD = int(lib.SW_DEFER_FORWARD)


@dataclass(frozen=True, slots=True)
class ListenerOptions:
    """How C serves one listener."""

    protocol: str
    sniff: bool
    sniff_timeout_ms: int
    handshake_timeout_ms: int
    idle_timeout_ms: int
    #: Forward absolute-URI requests in C's subset itself (http and mixed inbounds
    #: without users; see docs/http-forward.md).
    forward: bool = False


def dial_error(
    rec: ConnRecord, outbound: Any, host: str, port: int, message: str | None = None
) -> DialError:
    """The DialError the Python outbound raises for the failure C reported in ``rec``
    (``message``: the text C kept for it, see :meth:`ConnPath.take_message`)."""
    proxy = outbound.protocol != "direct"
    where = f"{outbound.server}:{outbound.port}" if proxy else f"{host}:{port}"
    if rec.end == END_CONNECT_FAILED:
        err = OSError(rec.err, os.strerror(rec.err))
        return DialError(
            errno_code(err),
            f"connect to {where} failed: {os.strerror(rec.err)}",
            remote=outbound.server if proxy else host,
            member_down=proxy,
        )
    if rec.end == END_CONNECT_TIMEOUT:
        if proxy and rec.upstream_tx:
            message = f"proxy {outbound.tag} handshake timed out"
        else:
            message = f"connect to {where} timed out"
        return DialError("connect_timeout", message, member_down=proxy)
    if rec.end == END_UPSTREAM_AUTH:
        return DialError(
            "auth_failed",
            f"proxy {outbound.tag} {_AUTH_DETAILS.get(rec.detail, '')}",
            member_down=True,
        )
    if rec.end == END_UPSTREAM_REPLY and outbound.protocol == "http":
        return DialError(
            "upstream_rejected",
            f"proxy {outbound.tag} answered {rec.detail} to CONNECT {host}:{port}",
            remote=where,
        )
    if rec.end == END_UPSTREAM_REPLY:
        return DialError(
            SOCKS_REPLY_NAMES.get(rec.detail, "upstream_rejected"),
            f"proxy {outbound.tag} answered SOCKS5 reply {rec.detail} for {host}:{port}",
            remote=where,
        )
    if rec.end == END_UPSTREAM_PROTO:
        kind, byte = rec.detail & 0xFF, rec.detail >> 8
        if kind == _PROTO_HTTP:
            text = message if message is not None else f"proxy {outbound.tag}: bad response"
            return DialError("protocol_error", text, stage="handshake", member_down=True)
        if kind == _PROTO_CLOSED:
            return DialError(
                "protocol_error", "upstream proxy closed during handshake", stage="handshake"
            )
        why = _PROTO_DETAILS.get(kind, "undecodable domain name").format(byte)
        return DialError(
            "protocol_error", f"proxy {outbound.tag}: {why}", stage="handshake", member_down=True
        )
    return DialError(
        "internal_error", f"connection path failure: {os.strerror(rec.err)}", stage="connect"
    )


class ConnPath:
    """The C accept/handshake/route/dial loops feeding ``relay``."""

    def __init__(self, relay: Relay, loops: int = 1, ring_records: int = 8192) -> None:
        out = ffi.new("sw_conn **")
        check(lib.sw_conn_new(relay._ptr, loops, ring_records, out), "sw_conn_new")
        # Keeps the relay alive as long as C may hand flows to it.
        self._relay = relay
        self._ptr = ffi.gc(out[0], lib.sw_conn_free)
        self._records = ffi.new("sw_conn_record[]", _BATCH)
        self._buffer = ffi.buffer(self._records)
        self._deferred = ffi.new("sw_deferred *")
        self._closed = False

    def fileno(self) -> int:
        """An eventfd readable while records or deferred connections are pending."""
        return int(lib.sw_conn_fd(self._ptr))

    def listen(
        self,
        inbound: int,
        fd: int,
        options: ListenerOptions,
        users: list[tuple[str, str, int]] | None,
    ) -> None:
        """Accept on ``fd`` (the caller keeps owning it) as listener ``inbound``."""
        for user, password, principal in users or ():
            check(
                lib.sw_conn_listener_user(
                    self._ptr, inbound, user.encode(), password.encode(), principal
                ),
                "sw_conn_listener_user",
            )
        opts = ffi.new(
            "sw_listener_opts *",
            {
                "protocol": _PROTOCOLS[options.protocol],
                "sniff": int(options.sniff),
                "sniff_timeout_ms": options.sniff_timeout_ms,
                "handshake_timeout_ms": options.handshake_timeout_ms,
                "idle_timeout_ms": options.idle_timeout_ms,
                "users_required": int(bool(users)),
                "forward": int(options.forward),
            },
        )
        check(lib.sw_conn_listen(self._ptr, inbound, fd, opts), "sw_conn_listen")

    def listen_tun(self, inbound: int, fd: int, options: ListenerOptions, tun: object) -> None:
        """Accept on a TUN stack's kernel listener ``fd`` (``TunStack.listeners[v]``) as
        listener ``inbound``: each connection's NAT entry in ``tun`` (its ``sw_tun *``)
        gives the flow's original source and target, and C routes, dials and relays it
        like any other (records carry protocol "tun"). Unlisten before the stack stops."""
        opts = ffi.new(
            "sw_listener_opts *",
            {
                "protocol": lib.SW_IN_TUN,
                "sniff": int(options.sniff),
                "sniff_timeout_ms": options.sniff_timeout_ms,
                "handshake_timeout_ms": options.handshake_timeout_ms,
                "idle_timeout_ms": options.idle_timeout_ms,
            },
        )
        check(lib.sw_conn_listen_tun(self._ptr, inbound, fd, opts, tun), "sw_conn_listen_tun")

    def unlisten(self, inbound: int) -> None:
        """Stop accepting on ``inbound``; afterwards its fd may be closed."""
        code = lib.sw_conn_unlisten(self._ptr, inbound)
        if code < 0 and code != -errno_mod.ENOENT:
            check(code, "sw_conn_unlisten")

    def set_table(self, table: object) -> None:
        """Install a sealed ``sw_table *`` (ownership passes to C)."""
        check(lib.sw_conn_set_table(self._ptr, table), "sw_conn_set_table")

    def dns_put(self, host: str, addresses: list[str], ttl_ms: int) -> None:
        """Let C dial ``host`` at ``addresses`` (tried in this order) for ``ttl_ms``.

        Names that are not ASCII, and answers with more addresses than C keeps, stay
        Python's (C then defers their flows).
        """
        if not addresses or len(addresses) > lib.SW_DNS_MAX_ADDRS:
            return
        try:
            name = host.encode("ascii")
        except UnicodeEncodeError:
            return
        if not name or len(name) >= 256:
            return
        ips = [ipaddress.ip_address(a) for a in addresses]
        families = bytes(ip.version for ip in ips)
        packed = b"".join(ip.packed.ljust(16, b"\0") for ip in ips)
        ttl_ms = min(max(ttl_ms, 0), 0xFFFFFFFF)  # sw_conn_dns_put takes a uint32_t
        code = lib.sw_conn_dns_put(self._ptr, name, len(ips), families, packed, ttl_ms)
        if code < 0 and code != -errno_mod.ENOSPC:
            check(code, "sw_conn_dns_put")

    def dns_flush(self) -> None:
        """Forget every answer :meth:`dns_put` gave (the engine's resolver changed)."""
        lib.sw_conn_dns_flush(self._ptr)

    def take_message(self, flow: int) -> str | None:
        """The failure text C kept for ``flow`` (an http proxy's malformed response)."""
        size = int(lib.SW_HTTP_RESPONSE_ERROR_MAX) + 1024  # the error text and its prefix
        out = ffi.new("char[]", size)
        n = lib.sw_conn_take_message(self._ptr, flow, out, size)
        return None if n < 0 else ffi.string(out, n).decode("utf-8", "surrogateescape")

    def request_close(self, flow: int) -> None:
        """Close a flow C still holds (an ENDED record follows)."""
        code = lib.sw_conn_request_close(self._ptr, flow)
        if code < 0 and code not in (-errno_mod.ENOENT, -errno_mod.ESHUTDOWN):
            check(code, "sw_conn_request_close")

    def drain(self) -> list[ConnRecord]:
        """Every pending record, oldest first per loop."""
        out: list[ConnRecord] = []
        while True:
            n = check(lib.sw_conn_drain(self._ptr, self._records, _BATCH), "sw_conn_drain")
            data = self._buffer[: n * _STRIDE]
            for i in range(n):
                f = _RECORD.unpack_from(data, i * _STRIDE)
                rec = ConnRecord(
                    f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9],
                    f[10], f[11], f[12], f[13], f[14], f[16], f[17], f[18],
                    f[19], f[20], f[21], _SPOKEN.get(f[22], "socks5"), f[23],
                    _ip(f[24], f[28]), _ip(f[25], f[29]), bool(f[26]), bool(f[27]),
                    f[31][: f[30]].decode("utf-8", "surrogateescape"), f[15],
                )  # fmt: skip
                if rec.end == END_UPSTREAM_PROTO and rec.detail & 0xFF == _PROTO_HTTP:
                    # Taken at once, whatever becomes of the record, so none piles up in C.
                    rec.message = self.take_message(rec.flow)
                out.append(rec)
            if n < _BATCH:
                return out

    def take_deferred(self) -> list[Deferred]:
        """Every connection C handed over since the last call."""
        out: list[Deferred] = []
        d = self._deferred
        while lib.sw_conn_take_deferred(self._ptr, d) == 1:
            out.append(
                Deferred(
                    fd=d.fd,
                    stage=d.stage,
                    inbound=d.inbound,
                    protocol=_SPOKEN.get(d.protocol, "socks5"),
                    principal=d.principal,
                    auth=d.auth,
                    client_rx=d.client_rx,
                    client_tx=d.client_tx,
                    started_unix_ms=d.started_unix_ms,
                    port=d.port,
                    source_ip=_ip(d.source_family, bytes(d.source_ip)),
                    source_port=d.source_port,
                    replied=bool(d.replied),
                    flow=int(d.flow),
                    command=int(d.command),
                    host=ffi.string(d.host, d.host_len).decode("utf-8", "surrogateescape"),
                    sniffed=(
                        ffi.string(d.sniffed, d.sniffed_len).decode("ascii", "replace")
                        if d.sniffed_len
                        else None
                    ),
                    raw=bytes(ffi.buffer(d.raw, d.raw_len)),
                    ufd=int(d.ufd),
                    split=int(d.split),
                    upstream_rx=int(d.upstream_rx),
                    upstream_tx=int(d.upstream_tx),
                )
            )
        return out

    def set_mark(self, mark: int) -> None:
        """Put SO_MARK ``mark`` (0: none) on every upstream socket C dials from now on.

        The engine keeps it current with :func:`spliceway.support.socket_mark.subscribe` (see
        ``RelayBridge``). A socket the kernel refuses to mark (no CAP_NET_ADMIN) is
        dialled unmarked and counted in :meth:`stats` ``mark_failed``.
        """
        if not 0 <= mark <= 0xFFFFFFFF:
            raise ValueError(f"mark {mark} is not a 32-bit value")
        check(lib.sw_conn_set_mark(self._ptr, mark), "sw_conn_set_mark")

    def stats(self) -> dict[str, int]:
        """C's own counters (accepted, deferred, paused, mark_failed...)."""
        out = ffi.new("sw_conn_stats *")
        check(lib.sw_conn_stats_get(self._ptr, out), "sw_conn_stats_get")
        return {name: int(getattr(out, name)) for name in dir(out)}

    def close(self) -> None:
        """Stop the loops; flows C still held end with ENDED/closed records."""
        if not self._closed:
            self._closed = True
            lib.sw_conn_shutdown(self._ptr)
