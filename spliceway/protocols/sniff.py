"""Destination sniffing from the first bytes a client sends through a tunnel, sans-I/O.

:func:`sniff` recognises a TLS ClientHello (and returns its SNI host name) or a plain
HTTP/1.x request (and returns its Host). It is best-effort and never raises: anything
it cannot read is None, so the caller falls back to the address it was given.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Literal

from spliceway.protocols import NEED_MORE, NeedMore

__all__ = ["SNIFF_LIMIT", "Sniffed", "normalize_host", "sniff"]

#: The most bytes sniff() waits for: one maximal TLS record (2**14) plus its header.
#: A ClientHello or HTTP Host line not complete within this many bytes gives None.
SNIFF_LIMIT = 16384 + 5

_RECORD_HANDSHAKE = 22
_HANDSHAKE_CLIENT_HELLO = 1
_EXT_SERVER_NAME = 0
_NAME_TYPE_HOST = 0
_MAX_RECORD = 16384

_HTTP_METHODS = (
    b"GET",
    b"POST",
    b"HEAD",
    b"PUT",
    b"DELETE",
    b"OPTIONS",
    b"PATCH",
    b"TRACE",
    b"CONNECT",
)
_METHOD_PREFIXES = tuple(m + b" " for m in _HTTP_METHODS)
_REQUEST_LINE_RE = re.compile(rb"[A-Z]+ [^\x00-\x20\x7f]+ HTTP/1\.[0-9]\r?")
_HOST_LABEL_RE = re.compile(r"[a-z0-9_](?:[a-z0-9_\-]*[a-z0-9_])?")


@dataclass(frozen=True, slots=True)
class Sniffed:
    """What the client is talking and to which host (lower-cased, no trailing dot)."""

    protocol: Literal["tls", "http"]
    host: str


def sniff(buf: bytes | bytearray) -> NeedMore | Sniffed | None:
    """Sniff the protocol and destination host from the start of a stream.

    NEED_MORE while a ClientHello or HTTP head is plausibly still arriving (at most
    :data:`SNIFF_LIMIT` bytes), a :class:`Sniffed` when a host was found, else None.
    """
    if not buf:
        return NEED_MORE
    if buf[0] == _RECORD_HANDSHAKE:
        return _sniff_tls(buf)
    return _sniff_http(buf)


def normalize_host(raw: str) -> str | None:
    """Lower-case, drop one trailing dot and validate a host name or IP literal.

    Returns None for anything that is not a plausible DNS name (letters, digits,
    hyphen, underscore; labels of 1..63, at most 253 in all) or IP address.
    """
    host = raw.lower()
    if host.endswith("."):
        host = host[:-1]
    if not host or len(host) > 253 or not host.isascii():
        return None
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host).compressed
        except ValueError:
            return None
    labels = host.split(".")
    if all(len(label) <= 63 and _HOST_LABEL_RE.fullmatch(label) for label in labels):
        return host
    return None


# -- TLS --------------------------------------------------------------------------------


def _sniff_tls(buf: bytes | bytearray) -> NeedMore | Sniffed | None:
    """Reassemble the ClientHello from consecutive handshake records and read its SNI."""
    handshake = bytearray()
    pos = 0
    needed: int | None = None  # the whole handshake message's length, once known
    while needed is None or len(handshake) < needed:
        if len(buf) < pos + 5:
            return _more_or_give_up(buf)
        header = buf[pos : pos + 5]
        length = int.from_bytes(header[3:5], "big")
        # Later records of a fragmented ClientHello must also be handshake records
        # (RFC 8446 5.1: no interleaving); the legacy version's major byte is 3.
        if header[0] != _RECORD_HANDSHAKE or header[1] != 3 or not 0 < length <= _MAX_RECORD:
            return None
        if len(buf) < pos + 5 + length:
            # Records are reassembled whole; waiting for the rest of this one is the
            # common case (a ClientHello rarely spans records).
            return _more_or_give_up(buf)
        handshake += buf[pos + 5 : pos + 5 + length]
        pos += 5 + length
        if needed is None and len(handshake) >= 4:
            if handshake[0] != _HANDSHAKE_CLIENT_HELLO:
                return None
            needed = 4 + int.from_bytes(handshake[1:4], "big")
            if needed > SNIFF_LIMIT:
                return None
    host = _client_hello_sni(bytes(handshake[4:needed]))
    return None if host is None else Sniffed("tls", host)


def _more_or_give_up(buf: bytes | bytearray) -> NeedMore | None:
    return NEED_MORE if len(buf) < SNIFF_LIMIT else None


def _client_hello_sni(body: bytes) -> str | None:
    """The host_name from a ClientHello body's server_name extension, or None."""
    # legacy_version(2) random(32), then session_id<0..32>.
    pos = 34
    if len(body) < pos + 1:
        return None
    pos += 1 + body[pos]
    # cipher_suites<2..2^16-2>, legacy_compression_methods<1..2^8-1>.
    if len(body) < pos + 2:
        return None
    pos += 2 + int.from_bytes(body[pos : pos + 2], "big")
    if len(body) < pos + 1:
        return None
    pos += 1 + body[pos]
    if len(body) < pos + 2:
        return None  # no extensions at all (SSL 3 style): no SNI
    ext_end = pos + 2 + int.from_bytes(body[pos : pos + 2], "big")
    if ext_end > len(body):
        return None
    pos += 2
    while pos + 4 <= ext_end:
        ext_type = int.from_bytes(body[pos : pos + 2], "big")
        ext_len = int.from_bytes(body[pos + 2 : pos + 4], "big")
        pos += 4
        if pos + ext_len > ext_end:
            return None
        if ext_type == _EXT_SERVER_NAME:
            return _server_name(body[pos : pos + ext_len])
        pos += ext_len
    return None


def _server_name(ext: bytes) -> str | None:
    """The first host_name entry of a ServerNameList (RFC 6066 3), normalised."""
    if len(ext) < 2:
        return None
    end = 2 + int.from_bytes(ext[:2], "big")
    if end > len(ext):
        return None
    pos = 2
    while pos + 3 <= end:
        name_type = ext[pos]
        name_len = int.from_bytes(ext[pos + 1 : pos + 3], "big")
        pos += 3
        if pos + name_len > end:
            return None
        if name_type == _NAME_TYPE_HOST:
            try:
                name = ext[pos : pos + name_len].decode("ascii")
            except UnicodeDecodeError:
                return None
            # RFC 6066 forbids IP literals in SNI; a ':' here is malformed, not IPv6.
            return None if ":" in name else normalize_host(name)
        pos += name_len
    return None


# -- HTTP -------------------------------------------------------------------------------


def _sniff_http(buf: bytes | bytearray) -> NeedMore | Sniffed | None:
    """Find the Host of an HTTP/1.x request whose method is a well-known one."""
    head = bytes(buf[:SNIFF_LIMIT])
    if not head.startswith(_METHOD_PREFIXES):
        # Still a prefix of some "METHOD " (e.g. b"GE")? Then wait.
        if any(prefix.startswith(head) for prefix in _METHOD_PREFIXES):
            return NEED_MORE
        return None
    # The last item is a line still arriving (or b"" after a final LF): ignore it.
    complete = head.split(b"\n")[:-1]
    if not complete:
        return _more_or_give_up(buf)
    if not _REQUEST_LINE_RE.fullmatch(complete[0]):
        return None
    for line in complete[1:]:
        line = line.removesuffix(b"\r")
        if not line:
            return None  # end of head without a Host
        name, colon, value = line.partition(b":")
        if colon and name.lower() == b"host":
            return _http_host(value.strip(b" \t"))
    return _more_or_give_up(buf)


def _http_host(value: bytes) -> Sniffed | None:
    """Parse a Host value (``host[:port]`` / ``[v6][:port]``) into a Sniffed."""
    try:
        text = value.decode("ascii")
    except UnicodeDecodeError:
        return None
    if text.startswith("["):
        literal, close, rest = text[1:].partition("]")
        if not close or (rest and not _valid_port_suffix(rest)) or "%" in literal:
            return None
        try:
            host: str | None = ipaddress.IPv6Address(literal).compressed
        except ValueError:
            return None
    else:
        name, colon, port = text.partition(":")
        if colon and not _valid_port_suffix(":" + port):
            return None
        host = normalize_host(name)
    return None if host is None else Sniffed("http", host)


def _valid_port_suffix(rest: str) -> bool:
    """``:`` followed by 0..5 digits (an empty port is legal in a URI authority)."""
    digits = rest[1:]
    return rest.startswith(":") and len(digits) <= 5 and (not digits or digits.isdigit())
