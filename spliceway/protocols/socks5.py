"""SOCKS5 (RFC 1928) and username/password authentication (RFC 1929), sans-I/O.

Server side (the socks5 inbound), in conversation order::

    parse_greeting -> method_selection
    [parse_userpass -> userpass_status]
    parse_request  -> reply

Client side (the socks5 outbound)::

    client_greeting -> parse_method_selection
    [client_userpass -> parse_userpass_status]
    client_connect  -> parse_reply

Plus the UDP ASSOCIATE datagram header: :func:`parse_udp_datagram` and
:func:`build_udp_datagram`.

Parsers take the whole buffer received so far and return :data:`NEED_MORE` or a result
with ``consumed``; they raise :class:`ProtocolError` (and nothing else) on bad input.
Builders raise :class:`ValueError` on arguments that cannot be encoded: those are our
own configuration or programming errors, not the peer's.
"""

from __future__ import annotations

import functools
import ipaddress
from typing import NamedTuple

from spliceway.protocols import NEED_MORE, NeedMore, ProtocolError

__all__ = [
    "ATYP_DOMAIN",
    "ATYP_IPV4",
    "ATYP_IPV6",
    "CMD_BIND",
    "CMD_CONNECT",
    "CMD_UDP_ASSOCIATE",
    "METHOD_NO_ACCEPTABLE",
    "METHOD_NO_AUTH",
    "METHOD_USERPASS",
    "REP_ADDRESS_TYPE_NOT_SUPPORTED",
    "REP_COMMAND_NOT_SUPPORTED",
    "REP_CONNECTION_REFUSED",
    "REP_GENERAL_FAILURE",
    "REP_HOST_UNREACHABLE",
    "REP_NETWORK_UNREACHABLE",
    "REP_NOT_ALLOWED",
    "REP_SUCCEEDED",
    "REP_TTL_EXPIRED",
    "USERPASS_FAILURE",
    "Greeting",
    "MethodSelection",
    "Reply",
    "Request",
    "UdpDatagram",
    "UserPass",
    "UserPassStatus",
    "build_udp_datagram",
    "client_connect",
    "client_greeting",
    "client_request",
    "client_userpass",
    "method_selection",
    "parse_greeting",
    "parse_method_selection",
    "parse_reply",
    "parse_request",
    "parse_udp_datagram",
    "parse_userpass",
    "parse_userpass_status",
    "reply",
    "userpass_status",
]

VERSION = 5
USERPASS_VERSION = 1

METHOD_NO_AUTH = 0x00
METHOD_USERPASS = 0x02
METHOD_NO_ACCEPTABLE = 0xFF

CMD_CONNECT = 1
CMD_BIND = 2
CMD_UDP_ASSOCIATE = 3

ATYP_IPV4 = 1
ATYP_DOMAIN = 3
ATYP_IPV6 = 4

REP_SUCCEEDED = 0
REP_GENERAL_FAILURE = 1
REP_NOT_ALLOWED = 2
REP_NETWORK_UNREACHABLE = 3
REP_HOST_UNREACHABLE = 4
REP_CONNECTION_REFUSED = 5
REP_TTL_EXPIRED = 6
REP_COMMAND_NOT_SUPPORTED = 7
REP_ADDRESS_TYPE_NOT_SUPPORTED = 8

#: RFC 1929 status reply meaning "authentication failed"; any non-zero status fails.
USERPASS_FAILURE = bytes([USERPASS_VERSION, 0x01])


class Greeting(NamedTuple):
    """The client's version identifier / method selection message."""

    methods: tuple[int, ...]
    consumed: int


class UserPass(NamedTuple):
    """An RFC 1929 username/password request."""

    username: str
    password: str
    consumed: int


class Request(NamedTuple):
    """A SOCKS5 request. ``host`` is an IP address in canonical text form or a domain."""

    command: int
    host: str
    port: int
    address_type: int
    consumed: int


class MethodSelection(NamedTuple):
    """The server's choice of authentication method."""

    method: int
    consumed: int


class UserPassStatus(NamedTuple):
    """The server's answer to an RFC 1929 username/password request."""

    ok: bool
    consumed: int


class Reply(NamedTuple):
    """The server's reply to a SOCKS5 request."""

    code: int
    bind_host: str
    bind_port: int
    consumed: int


class UdpDatagram(NamedTuple):
    """A UDP ASSOCIATE datagram: header fields plus the payload."""

    fragment: int
    host: str
    port: int
    payload: bytes


# -- shared address codec ---------------------------------------------------------------


def _ip_text(packed: bytes) -> str:
    """Canonical text for a packed IPv4 or IPv6 address (RFC 5952 for IPv6)."""
    if len(packed) == 4:
        return str(ipaddress.IPv4Address(packed))
    ip = ipaddress.IPv6Address(packed)
    # Python 3.13 changed str() of IPv4-mapped addresses to the RFC 5952 section 5
    # mixed form; spell it out so the output does not depend on the interpreter.
    if ip.ipv4_mapped is not None:
        return f"::ffff:{ip.ipv4_mapped}"
    return ip.compressed


def _decode_domain(raw: bytes) -> str | None:
    """Decode a DOMAINNAME field, or None when empty, not UTF-8, or holding controls.

    Control characters and spaces are refused because the name travels on into logs,
    DNS queries and HTTP CONNECT lines, where a CR/LF or NUL could inject or truncate.
    """
    if not raw:
        return None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if any(ord(ch) <= 0x20 or ord(ch) == 0x7F for ch in text):
        return None
    return text


def _parse_address(
    buf: bytes | bytearray, offset: int, error_reply: bytes | None, unknown_atyp_reply: bytes | None
) -> NeedMore | tuple[int, str, int, int]:
    """Parse ``ATYP ADDR PORT`` at ``offset``: NEED_MORE or (atyp, host, port, end)."""
    if len(buf) <= offset:
        return NEED_MORE
    atyp = buf[offset]
    start = offset + 1
    if atyp == ATYP_IPV4:
        end = start + 4
    elif atyp == ATYP_IPV6:
        end = start + 16
    elif atyp == ATYP_DOMAIN:
        if len(buf) <= start:
            return NEED_MORE
        # Validate the length byte before waiting for the name: a zero length can
        # never become valid, so fail now rather than after more bytes arrive.
        if buf[start] == 0:
            raise ProtocolError("empty domain name", error_reply)
        start += 1
        end = start + buf[start - 1]
    else:
        raise ProtocolError(f"unknown address type {atyp}", unknown_atyp_reply)
    if len(buf) < end + 2:
        return NEED_MORE
    raw = bytes(buf[start:end])
    if atyp == ATYP_DOMAIN:
        host = _decode_domain(raw)
        if host is None:
            raise ProtocolError("undecodable domain name", error_reply)
    else:
        host = _ip_text(raw)
    port = int.from_bytes(buf[end : end + 2], "big")
    return atyp, host, port, end + 2


def encode_address(host: str, port: int) -> bytes:
    """Encode ``ATYP ADDR PORT`` for a host (IP literal or domain) and port."""
    if not 0 <= port <= 0xFFFF:
        raise ValueError(f"port out of range: {port}")
    port_bytes = port.to_bytes(2, "big")
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(literal)
    except ValueError:
        pass
    else:
        atyp = ATYP_IPV4 if ip.version == 4 else ATYP_IPV6
        return bytes([atyp]) + ip.packed + port_bytes
    try:
        raw = host.encode("ascii")
    except UnicodeEncodeError:
        # Resolvers on the far side expect A-labels; IDNA 2003 is what the stdlib has.
        raw = host.encode("idna")
    if not 1 <= len(raw) <= 255:
        raise ValueError(f"domain name must be 1..255 bytes, got {len(raw)}")
    if _decode_domain(raw) is None:
        raise ValueError(f"invalid characters in domain name {host!r}")
    return bytes([ATYP_DOMAIN, len(raw)]) + raw + port_bytes


def _check_byte(value: int, what: str) -> None:
    if not 0 <= value <= 0xFF:
        raise ValueError(f"{what} must fit in one byte, got {value}")


# -- server side ------------------------------------------------------------------------


def parse_greeting(buf: bytes | bytearray) -> NeedMore | Greeting:
    """Parse ``VER NMETHODS METHODS...``.

    A wrong version gets no reply (the peer does not speak SOCKS5, so no SOCKS5 reply
    means anything to it). An empty method list is answered "no acceptable methods".
    """
    if not buf:
        return NEED_MORE
    if buf[0] != VERSION:
        raise ProtocolError(f"not SOCKS5: version byte {buf[0]:#04x}")
    if len(buf) < 2:
        return NEED_MORE
    count = buf[1]
    if count == 0:
        raise ProtocolError("greeting offers no methods", method_selection(METHOD_NO_ACCEPTABLE))
    end = 2 + count
    if len(buf) < end:
        return NEED_MORE
    return Greeting(tuple(buf[2:end]), end)


def method_selection(method: int) -> bytes:
    """Build the server's ``VER METHOD`` answer to a greeting."""
    _check_byte(method, "method")
    return bytes([VERSION, method])


def parse_userpass(buf: bytes | bytearray) -> NeedMore | UserPass:
    """Parse an RFC 1929 ``VER ULEN UNAME PLEN PASSWD`` request.

    Names are decoded as strict UTF-8 (what clients send in practice); undecodable ones
    are refused rather than surrogate-escaped so that the strings stay valid Unicode
    all the way into logs and JSON events. Zero lengths are accepted even though the
    RFC says 1..255: some clients send an empty password, and the credential check
    rejects it anyway if it is wrong.
    """
    if not buf:
        return NEED_MORE
    if buf[0] != USERPASS_VERSION:
        raise ProtocolError(f"bad username/password version {buf[0]}", USERPASS_FAILURE)
    if len(buf) < 2:
        return NEED_MORE
    ulen = buf[1]
    plen_at = 2 + ulen
    if len(buf) <= plen_at:
        return NEED_MORE
    end = plen_at + 1 + buf[plen_at]
    if len(buf) < end:
        return NEED_MORE
    try:
        username = bytes(buf[2:plen_at]).decode("utf-8")
        password = bytes(buf[plen_at + 1 : end]).decode("utf-8")
    except UnicodeDecodeError:
        raise ProtocolError("username/password is not UTF-8", USERPASS_FAILURE) from None
    return UserPass(username, password, end)


def userpass_status(ok: bool) -> bytes:
    """Build the RFC 1929 ``VER STATUS`` answer (status 0 = success)."""
    return bytes([USERPASS_VERSION, 0x00]) if ok else USERPASS_FAILURE


def parse_request(buf: bytes | bytearray) -> NeedMore | Request:
    """Parse ``VER CMD RSV ATYP DST.ADDR DST.PORT``.

    An unknown command is returned, not raised: the caller answers
    REP_COMMAND_NOT_SUPPORTED, which needs the whole request to have been read. The
    reserved byte is ignored: it carries no meaning and refusing it would buy nothing.
    """
    if not buf:
        return NEED_MORE
    if buf[0] != VERSION:
        raise ProtocolError(f"bad request version {buf[0]}", reply(REP_GENERAL_FAILURE))
    if len(buf) < 3:
        return NEED_MORE
    parsed = _parse_address(
        buf, 3, reply(REP_GENERAL_FAILURE), reply(REP_ADDRESS_TYPE_NOT_SUPPORTED)
    )
    if parsed is NEED_MORE:
        return NEED_MORE
    atyp, host, port, end = parsed
    return Request(buf[1], host, port, atyp, end)


@functools.lru_cache(maxsize=64)
def reply(code: int, bind_host: str = "0.0.0.0", bind_port: int = 0) -> bytes:
    """Build ``VER REP RSV ATYP BND.ADDR BND.PORT`` (bind_host: IP literal or domain).

    Cached: a proxy sends the same few replies for every flow.
    """
    _check_byte(code, "reply code")
    return bytes([VERSION, code, 0]) + encode_address(bind_host, bind_port)


# -- client side ------------------------------------------------------------------------


def client_greeting(with_userpass: bool) -> bytes:
    """Build the greeting offering exactly one method: user/password or no-auth.

    With credentials configured only user/password is offered, so a server cannot
    quietly pick no-auth and leave the configured identity unused.
    """
    return bytes([VERSION, 1, METHOD_USERPASS if with_userpass else METHOD_NO_AUTH])


def parse_method_selection(buf: bytes | bytearray) -> NeedMore | MethodSelection:
    """Parse the server's ``VER METHOD``; the caller checks the method was offered."""
    if not buf:
        return NEED_MORE
    if buf[0] != VERSION:
        raise ProtocolError(f"server is not SOCKS5: version byte {buf[0]:#04x}")
    if len(buf) < 2:
        return NEED_MORE
    return MethodSelection(buf[1], 2)


def client_userpass(username: str, password: str) -> bytes:
    """Build an RFC 1929 request; ValueError if either field exceeds 255 UTF-8 bytes."""
    user = username.encode("utf-8")
    pw = password.encode("utf-8")
    if len(user) > 255 or len(pw) > 255:
        raise ValueError("SOCKS5 username and password are limited to 255 bytes each")
    return bytes([USERPASS_VERSION, len(user)]) + user + bytes([len(pw)]) + pw


def parse_userpass_status(buf: bytes | bytearray) -> NeedMore | UserPassStatus:
    """Parse the server's RFC 1929 ``VER STATUS``.

    Version 5 is tolerated besides the RFC's 1: some servers echo the SOCKS version
    there, and the status byte is what matters.
    """
    if not buf:
        return NEED_MORE
    if buf[0] not in (USERPASS_VERSION, VERSION):
        raise ProtocolError(f"bad username/password status version {buf[0]}")
    if len(buf) < 2:
        return NEED_MORE
    return UserPassStatus(buf[1] == 0, 2)


def client_request(command: int, host: str, port: int) -> bytes:
    """Build ``VER CMD RSV ATYP DST.ADDR DST.PORT`` for any command.

    An IPv4/IPv6 literal (IPv6 optionally in brackets) becomes ATYP 1/4, anything else
    a domain name (ATYP 3) resolved by the server.
    """
    _check_byte(command, "command")
    return bytes([VERSION, command, 0]) + encode_address(host, port)


def client_connect(host: str, port: int) -> bytes:
    """Build a CONNECT request for ``host:port`` (see :func:`client_request`)."""
    return client_request(CMD_CONNECT, host, port)


def parse_reply(buf: bytes | bytearray) -> NeedMore | Reply:
    """Parse the server's ``VER REP RSV ATYP BND.ADDR BND.PORT``.

    A non-zero ``code`` is returned, not raised: it is a well-formed answer.
    """
    if not buf:
        return NEED_MORE
    if buf[0] != VERSION:
        raise ProtocolError(f"server reply is not SOCKS5: version byte {buf[0]:#04x}")
    if len(buf) < 3:
        return NEED_MORE
    parsed = _parse_address(buf, 3, None, None)
    if parsed is NEED_MORE:
        return NEED_MORE
    _atyp, host, port, end = parsed
    return Reply(buf[1], host, port, end)


# -- UDP ASSOCIATE ----------------------------------------------------------------------


def parse_udp_datagram(data: bytes | bytearray) -> UdpDatagram:
    """Parse ``RSV(2) FRAG ATYP DST.ADDR DST.PORT DATA`` from one whole datagram.

    A datagram cannot be continued, so truncation is a ProtocolError (with no reply:
    UDP relays drop bad datagrams silently).
    """
    if len(data) < 3:
        raise ProtocolError("truncated UDP datagram header")
    parsed = _parse_address(data, 3, None, None)
    if parsed is NEED_MORE:
        raise ProtocolError("truncated UDP datagram header")
    _atyp, host, port, end = parsed
    return UdpDatagram(data[2], host, port, bytes(data[end:]))


def build_udp_datagram(host: str, port: int, payload: bytes, fragment: int = 0) -> bytes:
    """Build a UDP ASSOCIATE datagram (``fragment`` 0 = standalone, the only kind we use)."""
    _check_byte(fragment, "fragment")
    return bytes([0, 0, fragment]) + encode_address(host, port) + payload
