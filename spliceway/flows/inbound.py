"""Server side of the inbound handshakes (socks5, http, mixed), run by a FlowActor.

The parsing is in ``spliceway.protocols``; this module only reads, writes and
decides which reply to send. A handshake ends in a ``Handshake`` (what the
client asked for) or a ``HandshakeFailed`` after the protocol's error reply has
been written. The reply to a successful request is sent later by the FlowActor
through ``Handshake.success_reply``/``failure_reply``, because it depends on
routing and dialing.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import socket
import struct
from dataclasses import dataclass
from typing import Any

from spliceway.protocols import NEED_MORE, ProtocolError, http_message, socks5
from spliceway.protocols import http as http_proto
from spliceway.shapes.flow import ClientProtocol

_READ_CHUNK = 16 * 1024
_BASIC_REALM = (("Proxy-Authenticate", 'Basic realm="spliceway"'),)


class HandshakeFailed(Exception):
    """The client's handshake was malformed, unauthorised or unsupported."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(slots=True)
class Handshake:
    """What a client asked for, and the bytes its handshake moved."""

    protocol: str  # "socks5", "http" or "tun"
    host: str
    port: int
    principal_key: str | None
    auth_scheme: str | None
    rx_bytes: int
    tx_bytes: int
    #: Bytes to send upstream before relaying (pipelined client data, or a rewritten request).
    early: bytes = b""
    #: True for absolute-URI forwarding: no reply on success, the origin answers.
    forward: bool = False
    #: The absolute-URI request being forwarded (``forward``); ``early`` then holds the
    #: bytes after its head (its body, maybe the next requests).
    request: ForwardRequest | None = None
    #: A SOCKS5 UDP ASSOCIATE: host:port is the client's declared datagram source, and
    #: the connection becomes the association's control line.
    udp: bool = False

    @property
    def client_protocol(self) -> ClientProtocol:
        """What the client spoke, as its record's ``inbound.client_protocol`` says:
        ``socks5``, ``http`` (forwarded), ``http_connect`` or ``tun``."""
        if self.protocol == "http":
            return "http" if self.forward else "http_connect"
        return "socks5" if self.protocol == "socks5" else "tun"

    def success_reply(self) -> bytes:
        """Bytes telling the client its tunnel is open (none for a TUN's: the kernel's
        handshake already told it)."""
        if self.forward or self.protocol == "tun":
            return b""
        if self.protocol == "socks5":
            return socks5.reply(socks5.REP_SUCCEEDED)
        return http_proto.CONNECT_ESTABLISHED

    def failure_reply(self, socks_code: int, http_status: int, message: str) -> bytes:
        """Bytes telling the client the request failed (none for a TUN's: it is reset,
        see :func:`refuse_quietly`)."""
        if self.protocol == "tun":
            return b""
        if self.protocol == "socks5":
            return socks5.reply(socks_code)
        return http_proto.response(http_status, body=(message + "\n").encode())


def refuse_quietly(sock: socket.socket) -> None:
    """Make closing ``sock`` send a reset: what a TUN's client, which only knows a TCP
    connection, gets for a refused one (as C's SW_IN_TUN listener does)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class Users:
    """Inbound credentials: username -> (password, principal_key)."""

    def __init__(self, users: Any) -> None:
        self._users: dict[str, tuple[bytes, str]] | None = None
        if users is not None:
            self._users = {u.username: (u.password.encode(), u.principal_key) for u in users}

    @property
    def required(self) -> bool:
        """Whether clients must authenticate."""
        return self._users is not None

    def check(self, username: str, password: str) -> str | None:
        """The principal_key for valid credentials, else None (constant-time compare)."""
        assert self._users is not None
        entry = self._users.get(username)
        expected = entry[0] if entry else b"\0" * 32
        ok = hmac.compare_digest(expected, password.encode(errors="surrogateescape"))
        return entry[1] if entry and ok else None


class _Reader:
    """Accumulates client bytes on the loop until a parser is satisfied."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        self.loop = loop
        self.sock = sock
        self.buf = b""
        self.rx = 0
        self.tx = 0

    async def parse(self, parser: Any) -> Any:
        while True:
            result = parser(self.buf)
            if result is not NEED_MORE:
                self.buf = self.buf[result.consumed :]
                return result
            try:
                chunk = await self.loop.sock_recv(self.sock, _READ_CHUNK)
            except OSError as ex:
                raise HandshakeFailed("client_error", f"client socket error: {ex}") from ex
            if not chunk:
                raise HandshakeFailed("client_closed", "client closed during handshake")
            self.rx += len(chunk)
            self.buf += chunk

    async def send(self, data: bytes) -> None:
        try:
            await self.loop.sock_sendall(self.sock, data)
        except OSError as ex:
            raise HandshakeFailed("client_error", f"client socket error: {ex}") from ex
        self.tx += len(data)

    async def fail(self, reply: bytes | None, code: str, message: str) -> HandshakeFailed:
        if reply:
            with contextlib.suppress(HandshakeFailed):
                await self.send(reply)
        return HandshakeFailed(code, message)


async def accept(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    protocol: str,
    users: Users,
    timeout: float,
    *,
    initial: bytes = b"",
    udp: bool = True,
) -> Handshake:
    """Run the server side of ``protocol`` ("socks5", "http" or "mixed") on ``sock``.

    ``initial``: bytes already read from ``sock`` (by the C connection path, which wrote
    nothing back), parsed before anything more is read. ``udp``: whether SOCKS5 UDP
    ASSOCIATE is offered (the inbound's ``udp``); refused as an unsupported command if not.
    """
    reader = _Reader(loop, sock)
    reader.buf = initial
    reader.rx = len(initial)
    try:
        # One deadline for the whole handshake: cheaper than a timer per read.
        async with asyncio.timeout(timeout):
            if protocol == "mixed":
                first = await reader.parse(_first_byte)
                protocol = "socks5" if first.value == 5 else "http"
            try:
                if protocol == "socks5":
                    return await _socks5(reader, users, udp)
                return await _http(reader, users)
            except ProtocolError as ex:
                raise await reader.fail(ex.reply, "protocol_error", str(ex)) from ex
    except TimeoutError as ex:
        raise HandshakeFailed("handshake_timeout", "client handshake timed out") from ex


@dataclass(slots=True)
class _First:
    value: int
    consumed: int = 0


def _first_byte(buf: bytes) -> Any:
    return _First(buf[0]) if buf else NEED_MORE


async def _socks5(reader: _Reader, users: Users, udp: bool) -> Handshake:
    greeting = await reader.parse(socks5.parse_greeting)
    principal: str | None = None
    scheme: str | None = None
    if users.required:
        if socks5.METHOD_USERPASS not in greeting.methods:
            raise await reader.fail(
                socks5.method_selection(socks5.METHOD_NO_ACCEPTABLE),
                "auth_required",
                "client offered no acceptable SOCKS5 auth method",
            )
        await reader.send(socks5.method_selection(socks5.METHOD_USERPASS))
        creds = await reader.parse(socks5.parse_userpass)
        principal = users.check(creds.username, creds.password)
        if principal is None:
            raise await reader.fail(
                socks5.userpass_status(False), "auth_failed", "SOCKS5 credentials rejected"
            )
        await reader.send(socks5.userpass_status(True))
        scheme = "userpass"
    else:
        if socks5.METHOD_NO_AUTH not in greeting.methods:
            raise await reader.fail(
                socks5.method_selection(socks5.METHOD_NO_ACCEPTABLE),
                "auth_unsupported",
                "client requires an auth method this inbound does not offer",
            )
        await reader.send(socks5.method_selection(socks5.METHOD_NO_AUTH))
    request = await reader.parse(socks5.parse_request)
    offered = (socks5.CMD_CONNECT, socks5.CMD_UDP_ASSOCIATE) if udp else (socks5.CMD_CONNECT,)
    if request.command not in offered:
        # BIND is not offered; UDP ASSOCIATE only where the inbound's `udp` is on.
        raise await reader.fail(
            socks5.reply(socks5.REP_COMMAND_NOT_SUPPORTED),
            "command_not_supported",
            f"SOCKS5 command {request.command} is not supported",
        )
    return Handshake(
        "socks5",
        request.host,
        request.port,
        principal,
        scheme,
        reader.rx,
        reader.tx,
        udp=request.command == socks5.CMD_UDP_ASSOCIATE,
        early=reader.buf,
    )


#: The answer to a request without valid credentials (the connection is closed after it).
PROXY_AUTH_REQUIRED = http_proto.response(
    407, headers=_BASIC_REALM, body=b"proxy authentication required\n"
)


def http_auth(
    head: http_proto.RequestHead, users: Users
) -> tuple[str | None, str | None, str | None]:
    """(principal_key, auth scheme, refusal code) of a request on an http inbound: the
    refusal code (``auth_required``/``auth_failed``) is None when the request may pass."""
    if not users.required:
        return None, None, None
    creds = http_proto.proxy_basic_credentials(head)
    principal = users.check(*creds) if creds is not None else None
    if principal is None:
        return None, None, "auth_failed" if creds is not None else "auth_required"
    return principal, "basic", None


async def _http(reader: _Reader, users: Users) -> Handshake:
    head = await reader.parse(http_proto.parse_request_head)
    principal, scheme, refused = http_auth(head, users)
    if refused is not None:
        raise await reader.fail(
            PROXY_AUTH_REQUIRED, refused, "HTTP proxy credentials missing or rejected"
        )
    if head.method.upper() == "CONNECT":
        host, port = http_proto.connect_authority(head.target)
        return Handshake(
            "http", host, port, principal, scheme, reader.rx, reader.tx, early=reader.buf
        )
    request = forward_request(head)
    return Handshake(
        "http",
        request.host,
        request.port,
        principal,
        scheme,
        reader.rx,
        reader.tx,
        early=reader.buf,
        forward=True,
        request=request,
    )


@dataclass(slots=True)
class ForwardRequest:
    """An absolute-URI request: where it goes and how its body and connection are framed."""

    head: http_proto.RequestHead
    host: str
    port: int
    path: str
    host_header: str
    #: The body's framing (``http_message.request_framing``).
    body_kind: int
    body_length: int
    #: Whether the client wants its connection kept after the response (RFC 9112 9.3).
    keep_alive: bool
    #: Whether the client asks to switch protocols (Upgrade, named in Connection).
    upgrade: bool


def forward_request(head: http_proto.RequestHead) -> ForwardRequest:
    """Check an absolute-URI request head; ProtocolError (with its 400 reply) when it
    cannot be forwarded: not ``http://``, a bad authority, an untrustworthy body length."""
    _, host, port, path = http_proto.split_absolute_uri(head.target)
    bracketed = f"[{host}]" if ":" in host else host
    host_header = bracketed if port == 80 else f"{bracketed}:{port}"
    try:
        kind, length = http_message.request_framing(head)
    except ProtocolError as ex:
        raise ProtocolError(str(ex), http_proto.response(400, body=b"Bad Request\n")) from None
    # Proxy-Connection is not standard, but clients still send it for their proxy hop.
    tokens = http_message.connection_tokens(head.headers, "Connection", "Proxy-Connection")
    if head.version == "HTTP/1.0":
        keep_alive = "keep-alive" in tokens and "close" not in tokens
    else:
        keep_alive = "close" not in tokens
    upgrade = (
        head.version != "HTTP/1.0"
        and "upgrade" in http_message.connection_tokens(head.headers, "Connection")
        and head.header("Upgrade") is not None
    )
    return ForwardRequest(
        head, host, port, path, host_header, kind, length, keep_alive and not upgrade, upgrade
    )
