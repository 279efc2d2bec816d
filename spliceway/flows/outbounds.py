"""Outbounds: how a flow reaches its target once routing picked a tag.

Every outbound exposes one coroutine, ``dial(loop, host, port) -> Dialed``, run
on the dispatcher loop by the FlowActor; it returns a connected non-blocking
socket whose next byte belongs to the client, plus the bytes its own handshake
moved (for the boundary counters). Failures raise ``DialError`` carrying the
stage, a stable code and the reply each inbound protocol should send. Names
(targets and upstream proxy servers) are resolved through the engine's
``runtime.dns`` resolver, given to each outbound at construction.

Proxy outbounds (socks5, http, shadowsocks) split into "reach the proxy" and
``negotiate`` (its handshake over an already connected socket), so a relay
chain dials its first hop and then negotiates each hop through the ones before
it. Shadowsocks cannot be spliced: its ``Dialed`` carries the session
(``SealedSession``) the C relay continues with.

``DialError.member_down`` tells a failure of the outbound itself (its server
unreachable, its handshake broken) from the outbound reporting that the target
failed: only the former marks a policy group member unhealthy.
"""

from __future__ import annotations

import abc
import asyncio
import errno
import os
import select
import socket
from dataclasses import dataclass, field
from typing import Any, Protocol

from spliceway.dns import ResolveError, Resolver
from spliceway.errors import ApiError
from spliceway.protocols import NEED_MORE, ProtocolError, shadowsocks, socks5
from spliceway.protocols import http as http_proto
from spliceway.support.socket_mark import apply_mark

#: SOCKS5 reply code for a failure code (RFC 1928 6).
_SOCKS_REPLY = {
    "connection_refused": socks5.REP_CONNECTION_REFUSED,
    "network_unreachable": socks5.REP_NETWORK_UNREACHABLE,
    "host_unreachable": socks5.REP_HOST_UNREACHABLE,
    "connect_timeout": socks5.REP_TTL_EXPIRED,
    "dns_failed": socks5.REP_HOST_UNREACHABLE,
    "blocked": socks5.REP_NOT_ALLOWED,
}
#: HTTP status a proxy answers for a failure code.
_HTTP_STATUS = {"connect_timeout": 504, "blocked": 403, "no_member": 503}
_MAX_PROXY_REPLY = 64 * 1024


class DialError(Exception):
    """An outbound could not establish the connection."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        stage: str = "connect",
        remote: str | None = None,
        member_down: bool = False,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.stage = stage
        self.remote = remote
        #: The outbound itself failed (not the target behind it).
        self.member_down = member_down

    @property
    def socks_reply(self) -> int:
        """The SOCKS5 reply code an inbound sends for this failure."""
        return _SOCKS_REPLY.get(self.code, socks5.REP_GENERAL_FAILURE)

    @property
    def http_status(self) -> int:
        """The HTTP status an inbound sends for this failure."""
        return _HTTP_STATUS.get(self.code, 502)


@dataclass(frozen=True, slots=True)
class SealedSession:
    """A shadowsocks session whose salt and header are already on the wire."""

    cipher: str
    master_key: bytes
    encryptor: shadowsocks.Encryptor


@dataclass(slots=True)
class Dialed:
    """A connected upstream socket and what its establishment moved."""

    sock: socket.socket
    remote_host: str
    remote_port: int
    resolved_ip: str | None = None
    tx_bytes: int = 0
    rx_bytes: int = 0
    leftover: bytes = b""
    relay_chain: list[str] = field(default_factory=list)
    #: Set when the upstream speaks shadowsocks: bytes must be sealed, not spliced.
    sealed: SealedSession | None = None


class Outbound(Protocol):
    """What the FlowActor needs from an outbound."""

    tag: str
    protocol: str
    #: True when traffic goes through another proxy (outcome chained_relayed).
    chained: bool

    # Read-only: a proxy outbound's are never None (properties are covariant, plain
    # attributes of a Protocol are not).
    @property
    def server(self) -> str | None:
        """The upstream proxy's host; None when there is none (direct, block, relay)."""
        ...

    @property
    def port(self) -> int | None:
        """The upstream proxy's port; None when there is none."""
        ...

    async def dial(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> Dialed:
        """Connect to ``host:port`` through this outbound."""
        ...


def errno_code(err: OSError) -> str:
    if isinstance(err, TimeoutError):
        return "connect_timeout"
    return {
        errno.ECONNREFUSED: "connection_refused",
        errno.ENETUNREACH: "network_unreachable",
        errno.EHOSTUNREACH: "host_unreachable",
        errno.ETIMEDOUT: "connect_timeout",
    }.get(err.errno or 0, "connect_failed")


async def open_tcp(
    loop: asyncio.AbstractEventLoop, host: str, port: int, deadline: float, resolver: Resolver
) -> tuple[socket.socket, str]:
    """Resolve ``host`` with ``resolver`` and connect to the first address that answers.

    ``deadline`` is on the loop's clock and bounds resolution and connection together.
    Returns the connected non-blocking socket and the IP it reached.
    """
    try:
        async with asyncio.timeout_at(deadline):
            return await _open_tcp(loop, host, port, deadline, resolver)
    except TimeoutError as ex:
        raise DialError("connect_timeout", f"connect to {host}:{port} timed out") from ex


def _connected_at_once(sock: socket.socket, address: tuple[str, int]) -> bool:
    """Start a non-blocking connect; True when it has finished already.

    A local peer's handshake (loopback, this host) completes inside connect() even when
    it answers EINPROGRESS, as csrc/conn.c's start_connect relies on too: a zero-timeout
    poll sees it, and the dial goes on without a round of the loop (a writer
    registered, an epoll wait, the writer removed). A failure raises the OSError the
    loop's sock_connect would (its errno; ETIMEDOUT is a TimeoutError either way).
    False: still in progress, for ``loop.sock_connect`` to wait on (connect() again
    then says EALREADY, which it waits on as on EINPROGRESS).
    """
    try:
        sock.connect(address)
        return True
    except (BlockingIOError, InterruptedError):
        pass
    # poll, not select: a busy engine's descriptors pass FD_SETSIZE.
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    if not poller.poll(0):
        return False
    err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if err:
        raise OSError(err, f"Connect call failed {address}")
    return True


async def _open_tcp(
    loop: asyncio.AbstractEventLoop, host: str, port: int, deadline: float, resolver: Resolver
) -> tuple[socket.socket, str]:
    try:
        # The resolver splits its budget between its servers, so it must know the
        # deadline; the timeout around us still has the last word.
        ips = await resolver.resolve(host, timeout=max(deadline - loop.time(), 0.001))
    except ResolveError as ex:
        raise DialError("dns_failed", str(ex), stage="resolve") from ex
    if not ips:
        raise DialError("dns_failed", f"no address for {host}", stage="resolve")
    last: OSError | None = None
    for ip in ips:
        # The resolver returns only IP literals: a colon means IPv6.
        sock = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            # While a TUN routes this host, the engine's own connections must leave by
            # the physical egress, not loop back into it (spliceway.support.socket_mark).
            apply_mark(sock)
            if not _connected_at_once(sock, (ip, port)):
                await loop.sock_connect(sock, (ip, port))
        except BaseException as ex:
            sock.close()
            if not isinstance(ex, OSError) or isinstance(ex, TimeoutError):
                raise
            last = ex
            continue
        return sock, ip
    assert last is not None
    # asyncio's connect errors read "Connect call failed (addr)"; the errno's own
    # text ("Connection refused") is what flow records and probes should carry.
    reason = os.strerror(last.errno) if last.errno else str(last)
    raise DialError(errno_code(last), f"connect to {host}:{port} failed: {reason}", remote=host)


async def _recv_until(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    buf: bytearray,
    parse: Any,
) -> Any:
    """Read into ``buf`` until ``parse(bytes(buf))`` stops returning NEED_MORE."""
    while True:
        result = parse(bytes(buf))
        if result is not NEED_MORE:
            return result
        if len(buf) > _MAX_PROXY_REPLY:
            raise DialError("protocol_error", "upstream proxy reply too large", stage="handshake")
        try:
            chunk = await loop.sock_recv(sock, 4096)
        except ConnectionError:
            chunk = b""  # a reset ends the handshake as a close does (so says the C path too)
        if not chunk:
            raise DialError(
                "protocol_error", "upstream proxy closed during handshake", stage="handshake"
            )
        buf += chunk


class DirectOutbound:
    """Connects straight to the target."""

    protocol = "direct"
    chained = False
    server: str | None = None
    port: int | None = None

    def __init__(self, tag: str, connect_timeout_ms: int = 5000, *, resolver: Resolver) -> None:
        self.tag = tag
        self.connect_timeout = connect_timeout_ms / 1000
        self.resolver = resolver

    async def dial(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> Dialed:
        """Connect to the target itself."""
        deadline = loop.time() + self.connect_timeout
        sock, ip = await open_tcp(loop, host, port, deadline, self.resolver)
        return Dialed(sock, host, port, resolved_ip=ip)


class BlockOutbound:
    """Refuses every flow routed to it."""

    protocol = "block"
    chained = False
    server: str | None = None
    port: int | None = None

    def __init__(self, tag: str) -> None:
        self.tag = tag

    async def dial(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> Dialed:
        """Always fails: a block outbound carries nothing."""
        raise DialError("blocked", f"outbound {self.tag} blocks all traffic", stage="route")


#: The protocol of a group's stand-in while the group has no member (``NoMemberOutbound``).
NO_MEMBER_PROTOCOL = "none"


class NoMemberOutbound:
    """Stands for a group that has no member (its proxy providers gave it none yet): every
    flow routed to it fails with code ``no_member``, never going anywhere else."""

    protocol = NO_MEMBER_PROTOCOL
    chained = False
    server: str | None = None
    port: int | None = None

    def __init__(self, tag: str) -> None:
        self.tag = tag

    @property
    def message(self) -> str:
        """Why flows routed here fail."""
        return (
            f"group {self.tag!r} has no member (its providers have no outbound yet, or "
            "their filters match none)"
        )

    async def dial(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> Dialed:
        """Always fails: there is nothing to dial through."""
        raise DialError("no_member", self.message, stage="route")


class _ProxyOutbound(abc.ABC):
    """An outbound that reaches targets through an upstream proxy server."""

    chained = True
    #: Each concrete proxy's protocol name (``socks5``, ``http``, ``shadowsocks``).
    protocol: str

    def __init__(
        self,
        tag: str,
        server: str,
        port: int,
        connect_timeout_ms: int = 5000,
        *,
        resolver: Resolver,
    ) -> None:
        self.tag = tag
        self.resolver = resolver
        self.server = server
        self.port = port
        self.connect_timeout = connect_timeout_ms / 1000

    async def dial(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> Dialed:
        """Connect to the proxy and run its handshake, within ``connect_timeout_ms``."""
        deadline = loop.time() + self.connect_timeout
        sock = await self.reach(loop, deadline)
        return await self.through(loop, sock, host, port, deadline)

    async def reach(self, loop: asyncio.AbstractEventLoop, deadline: float) -> socket.socket:
        """A connected socket to this proxy's server (a failure is the member's)."""
        try:
            sock, _ = await open_tcp(loop, self.server, self.port, deadline, self.resolver)
        except DialError as ex:
            ex.member_down = True
            raise
        return sock

    async def through(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        host: str,
        port: int,
        deadline: float,
        pending: bytes = b"",
    ) -> Dialed:
        """Run the handshake for ``host:port`` on ``sock`` (connected to this proxy,
        possibly through earlier hops) before ``deadline``; closes ``sock`` on failure.

        ``pending`` holds bytes already read from ``sock`` past the previous hop's reply.
        """
        try:
            async with asyncio.timeout_at(deadline):
                return await self.negotiate(loop, sock, host, port, bytearray(pending))
        except TimeoutError as ex:
            sock.close()
            raise DialError(
                "connect_timeout", f"proxy {self.tag} handshake timed out", member_down=True
            ) from ex
        except BaseException:
            sock.close()
            raise

    @abc.abstractmethod
    async def negotiate(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        host: str,
        port: int,
        buf: bytearray,
    ) -> Dialed:
        """The proxy protocol's handshake on a connected socket (no timeout of its own)."""

    def _broken(self, ex: ProtocolError) -> DialError:
        return DialError(
            "protocol_error", f"proxy {self.tag}: {ex}", stage="handshake", member_down=True
        )

    def _auth_failed(self, what: str) -> DialError:
        return DialError("auth_failed", f"proxy {self.tag} {what}", member_down=True)


class _CredentialedProxy(_ProxyOutbound):
    """A socks5 or http proxy, optionally with a username and password."""

    def __init__(
        self,
        tag: str,
        server: str,
        port: int,
        username: str | None = None,
        password: str | None = None,
        connect_timeout_ms: int = 5000,
        *,
        resolver: Resolver,
    ) -> None:
        super().__init__(tag, server, port, connect_timeout_ms, resolver=resolver)
        self.username = username
        self.password = password


class Socks5Outbound(_CredentialedProxy):
    """Connects through an upstream SOCKS5 proxy (optionally with user/password)."""

    protocol = "socks5"

    async def negotiate(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        host: str,
        port: int,
        buf: bytearray,
    ) -> Dialed:
        """SOCKS5 handshake on a connected socket (no timeout of its own)."""
        # Bytes already in buf were counted by whoever read them (the previous hop).
        consumed = -len(buf)
        tx, consumed, reply = await self._request(
            loop, sock, buf, socks5.client_connect(host, port), consumed
        )
        if reply.code != socks5.REP_SUCCEEDED:
            raise DialError(
                SOCKS_REPLY_NAMES.get(reply.code, "upstream_rejected"),
                f"proxy {self.tag} answered SOCKS5 reply {reply.code} for {host}:{port}",
                remote=f"{self.server}:{self.port}",
            )
        return Dialed(
            sock,
            self.server,
            self.port,
            tx_bytes=tx,
            rx_bytes=consumed + len(buf),
            leftover=bytes(buf[reply.consumed :]),
        )

    async def udp_associate(
        self, loop: asyncio.AbstractEventLoop
    ) -> tuple[socket.socket, tuple[str, int]]:
        """A UDP association with this proxy (RFC 1928 section 7): its TCP control
        connection (the association ends when it closes) and the relay address to send
        datagrams to. DialError on failure, within ``connect_timeout_ms``."""
        deadline = loop.time() + self.connect_timeout
        sock = await self.reach(loop, deadline)
        buf = bytearray()
        try:
            async with asyncio.timeout_at(deadline):
                request = socks5.client_request(socks5.CMD_UDP_ASSOCIATE, "0.0.0.0", 0)
                _, _, reply = await self._request(loop, sock, buf, request, 0)
        except TimeoutError as ex:
            sock.close()
            raise DialError(
                "connect_timeout", f"proxy {self.tag} handshake timed out", member_down=True
            ) from ex
        except BaseException:
            sock.close()
            raise
        if reply.code != socks5.REP_SUCCEEDED:
            sock.close()
            raise DialError(
                SOCKS_REPLY_NAMES.get(reply.code, "upstream_rejected"),
                f"proxy {self.tag} answered SOCKS5 reply {reply.code} to UDP ASSOCIATE",
                remote=f"{self.server}:{self.port}",
            )
        host = reply.bind_host
        if host in ("0.0.0.0", "::"):
            # "Send to the address you reached me on" (RFC 1928 leaves it open).
            host = sock.getpeername()[0]
        return sock, (host, reply.bind_port)

    async def _request(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        buf: bytearray,
        request: bytes,
        consumed: int,
    ) -> tuple[int, int, socks5.Reply]:
        """Greeting, authentication and ``request``; (bytes sent, bytes consumed, reply)."""
        with_auth = self.username is not None
        # Not pipelined with the request: some servers (microsocks) drop bytes sent
        # before their method selection, and a lost request costs a whole timeout.
        greeting = socks5.client_greeting(with_auth)
        tx = len(greeting)
        await loop.sock_sendall(sock, greeting)
        try:
            sel = await _recv_until(loop, sock, buf, socks5.parse_method_selection)
            del buf[: sel.consumed]
            consumed += sel.consumed
            if with_auth:
                if sel.method != socks5.METHOD_USERPASS:
                    raise self._auth_failed("refused user/password auth")
                auth = socks5.client_userpass(self.username or "", self.password or "")
                await loop.sock_sendall(sock, auth)
                tx += len(auth)
                status = await _recv_until(loop, sock, buf, socks5.parse_userpass_status)
                del buf[: status.consumed]
                consumed += status.consumed
                if not status.ok:
                    raise self._auth_failed("rejected the credentials")
            elif sel.method != socks5.METHOD_NO_AUTH:
                raise self._auth_failed("requires authentication")
            await loop.sock_sendall(sock, request)
            tx += len(request)
            reply = await _recv_until(loop, sock, buf, socks5.parse_reply)
        except ProtocolError as ex:
            raise self._broken(ex) from ex
        return tx, consumed, reply


SOCKS_REPLY_NAMES = {
    socks5.REP_CONNECTION_REFUSED: "connection_refused",
    socks5.REP_NETWORK_UNREACHABLE: "network_unreachable",
    socks5.REP_HOST_UNREACHABLE: "host_unreachable",
    socks5.REP_TTL_EXPIRED: "connect_timeout",
    socks5.REP_NOT_ALLOWED: "upstream_not_allowed",
}


class HttpOutbound(_CredentialedProxy):
    """Connects through an upstream HTTP proxy with CONNECT (optionally Basic auth)."""

    protocol = "http"

    async def negotiate(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        host: str,
        port: int,
        buf: bytearray,
    ) -> Dialed:
        """CONNECT on a connected socket (no timeout of its own)."""
        credentials = (self.username, self.password or "") if self.username is not None else None
        request = http_proto.connect_request(host, port, credentials)
        already = len(buf)
        await loop.sock_sendall(sock, request)
        try:
            head = await _recv_until(loop, sock, buf, http_proto.parse_response_head)
        except ProtocolError as ex:
            raise self._broken(ex) from ex
        if not 200 <= head.status < 300:
            raise DialError(
                "upstream_rejected",
                f"proxy {self.tag} answered {head.status} to CONNECT {host}:{port}",
                remote=f"{self.server}:{self.port}",
            )
        return Dialed(
            sock,
            self.server,
            self.port,
            tx_bytes=len(request),
            rx_bytes=len(buf) - already,
            leftover=bytes(buf[head.consumed :]),
        )


class ShadowsocksOutbound(_ProxyOutbound):
    """Connects through a Shadowsocks AEAD server (SIP004).

    The salt and the sealed target header go out at dial time, without waiting
    for the first client byte; the session then moves to the C relay's copy path.
    """

    protocol = "shadowsocks"

    def __init__(
        self,
        tag: str,
        server: str,
        port: int,
        method: str,
        password: str,
        connect_timeout_ms: int = 5000,
        *,
        resolver: Resolver,
    ) -> None:
        super().__init__(tag, server, port, connect_timeout_ms, resolver=resolver)
        self.cipher = shadowsocks.CIPHERS[method]
        self.master_key = shadowsocks.master_key(password, self.cipher.key_size)

    async def negotiate(
        self,
        loop: asyncio.AbstractEventLoop,
        sock: socket.socket,
        host: str,
        port: int,
        buf: bytearray,
    ) -> Dialed:
        """Send the salt and the sealed target; the server answers nothing until data."""
        if buf:
            raise DialError(
                "protocol_error",
                f"proxy {self.tag}: unexpected bytes before the shadowsocks session",
                stage="handshake",
                member_down=True,
            )
        encryptor = shadowsocks.Encryptor(self.cipher, self.master_key)
        header = encryptor.header + encryptor.seal(shadowsocks.target_header(host, port))
        await loop.sock_sendall(sock, header)
        return Dialed(
            sock,
            self.server,
            self.port,
            tx_bytes=len(header),
            sealed=SealedSession(self.cipher.name, self.master_key, encryptor),
        )


class RelayOutbound:
    """A relay group: dials its first hop, then each next hop through the ones before.

    Every hop but the last is asked to connect to the next hop's server; the last
    is asked for the target. Each hop's handshake has its own ``connect_timeout_ms``.
    Any failure on a hop but the last means a hop of the chain is down.
    """

    protocol = "relay"
    chained = True
    server: str | None = None
    port: int | None = None

    def __init__(self, tag: str, hops: list[_ProxyOutbound]) -> None:
        self.tag = tag
        self.hops = hops
        self.relay_chain = [hop.tag for hop in hops]

    async def dial(self, loop: asyncio.AbstractEventLoop, host: str, port: int) -> Dialed:
        """Open the chain hop by hop and ask the last hop for ``host:port``."""
        first = self.hops[0]
        sock = await first.reach(loop, loop.time() + first.connect_timeout)
        tx = rx = 0
        pending = b""
        dialed: Dialed | None = None
        for hop, nxt in zip(self.hops, [*self.hops[1:], None], strict=True):
            want_host, want_port = (host, port) if nxt is None else (nxt.server, nxt.port)
            deadline = loop.time() + (nxt or hop).connect_timeout
            try:
                dialed = await hop.through(loop, sock, want_host, want_port, deadline, pending)
            except DialError as ex:
                if nxt is not None:
                    ex.member_down = True
                raise
            tx += dialed.tx_bytes
            rx += dialed.rx_bytes
            pending = dialed.leftover
        assert dialed is not None
        dialed.tx_bytes, dialed.rx_bytes = tx, rx
        dialed.relay_chain = list(self.relay_chain)
        return dialed


_PROXIES: dict[str, type[_CredentialedProxy]] = {"socks5": Socks5Outbound, "http": HttpOutbound}


def build_outbound(spec: Any, resolver: Resolver) -> Outbound:
    """Create the outbound object for one validated outbound config entry.

    ``resolver`` (the engine's runtime.dns) resolves every name the outbound dials.
    """
    kind = spec.protocol
    timeout = getattr(spec, "connect_timeout_ms", 5000)
    if kind == "direct":
        return DirectOutbound(spec.tag, timeout, resolver=resolver)
    if kind == "block":
        return BlockOutbound(spec.tag)
    if kind == "shadowsocks":
        return ShadowsocksOutbound(
            spec.tag,
            spec.server,
            spec.port,
            spec.method,
            spec.password,
            timeout,
            resolver=resolver,
        )
    proxy = _PROXIES.get(kind)
    if proxy is not None:
        args = (spec.tag, spec.server, spec.port, spec.username, spec.password, timeout)
        return proxy(*args, resolver=resolver)
    raise ApiError("unsupported", f"outbound protocol {kind!r} is not built")


def build_relay(tag: str, hops: list[Outbound]) -> RelayOutbound:
    """The outbound of a relay group over already built hop outbounds.

    Config validation guarantees the hops are proxy outbounds and that a
    shadowsocks hop can only be the last.
    """
    proxies = [hop for hop in hops if isinstance(hop, _ProxyOutbound)]
    assert len(proxies) == len(hops), f"relay {tag!r} has a hop that is not a proxy"
    return RelayOutbound(tag, proxies)
