"""The DNS server's wire screen and fast-path key: a query judged by its bytes, unparsed.

:func:`screen` refuses by the header alone what dnspython is not to parse (unbound's
checks, plus the length and the EDNS OPT's framing); ``_fast_key`` reads the question
a plain query asks, the key of :class:`~spliceway.dns.server.DnsResponder`'s wire cache.
:data:`SLOW` and :data:`ACCEPTED` are their "parse it" answers. Pure functions of the
bytes: no sockets, no state (tested in ``tests/dns/test_server_screen.py``).
"""

from __future__ import annotations

import struct
from typing import Final

import dns.rcode

__all__ = [
    "ACCEPTED",
    "MAX_EDNS_OPTIONS",
    "MAX_QUERY_BYTES",
    "SLOW",
    "screen",
    "unanswerable",
]

#: Longest query read, over UDP or TCP. A query is one question (a name of at most 255
#: bytes) and at most an EDNS OPT (a cookie, padding to a 128-byte block): some 500 bytes
#: at most. A longer message is answered FORMERR from its header without being parsed.
MAX_QUERY_BYTES: Final = 1232
#: EDNS options in a query: the ones a client sends (cookie, padding, client subnet,
#: keepalive, NSID) are five at most. More is FORMERR, unparsed.
MAX_EDNS_OPTIONS: Final = 8

_HEADER = struct.Struct(">HHHHHH")
_ID_FLAGS = struct.Struct(">HH")
_QR = 0x8000
_OPCODE = 0x7800
_RD_CD = 0x0110
_RA = 0x0080
_TC = 0x0200
_OPT = 41
_PADDING = 12


class _Slow:
    """The fast path's "build it properly" answer."""


#: Returned by :meth:`~spliceway.dns.server.DnsResponder.quick` when the full path must
#: answer.
SLOW: Final = _Slow()


def _header_reply(data: bytes, rcode: int) -> bytes | None:
    """A bare answer (no sections) with ``rcode`` to the query whose header starts
    ``data``; None when ``data`` has no header or is not a query."""
    if len(data) < 12:
        return None
    qid, flags = _ID_FLAGS.unpack_from(data)
    if flags & _QR:
        return None
    out = _QR | (flags & _OPCODE) | (flags & 0x0100) | _RA | rcode
    return _HEADER.pack(qid, out, 0, 0, 0, 0)


class _Accepted:
    """:func:`screen`'s "parse it" answer."""


#: Returned by :func:`screen` for a message whose header reads as a query to answer.
ACCEPTED: Final = _Accepted()


def unanswerable(data: bytes) -> bool:
    """Whether ``data`` is to be dropped unanswered: shorter than a header, or with QR
    set (a response: answering it could loop)."""
    return len(data) < 12 or bool(data[2] & 0x80)


def screen(data: bytes) -> tuple[bytes | None, int] | _Accepted:
    """Judge a message by its 12-byte header and its length alone, before any parse.

    :data:`ACCEPTED` when it is a standard query with one question, no answer or
    authority records, no additional record but an EDNS OPT of at most
    :data:`MAX_EDNS_OPTIONS` options (its framing walked, not parsed) and at most
    :data:`MAX_QUERY_BYTES` long. Otherwise ``(reply, rcode)``: a header-only answer
    (ID, opcode and RD copied, no question echoed, so it is never longer than the query
    nor than 512 bytes) with NOTIMP for another opcode and FORMERR for anything else;
    ``reply`` is None (drop) for a message shorter than a header or with QR set (a
    response: answering it could loop). These are unbound's checks
    (``worker_check_request``), plus the length and the OPT."""
    if unanswerable(data):
        return None, 0
    _, flags, qd, an, ns, ar = _HEADER.unpack_from(data)
    if flags & _OPCODE:
        return _header_reply(data, dns.rcode.NOTIMP), dns.rcode.NOTIMP
    if len(data) > MAX_QUERY_BYTES or qd != 1 or an or ns or ar > 1:
        return _header_reply(data, dns.rcode.FORMERR), dns.rcode.FORMERR
    if ar and not _plain_opt(data):
        return _header_reply(data, dns.rcode.FORMERR), dns.rcode.FORMERR
    return ACCEPTED


def _plain_opt(data: bytes) -> bool:
    """Whether the one additional record of the query ``data`` is an EDNS OPT (root
    owner, type 41) of at most :data:`MAX_EDNS_OPTIONS` well-framed options that ends
    the message. Anything else would be parsed by dnspython at a cost the length does
    not bound: a 1 KiB TXT record of empty strings took it 20 ms, 300 empty options 8."""
    n, i = len(data), 12
    while True:  # the question's name
        if i >= n:
            return False
        length = data[i]
        if length == 0:
            i += 1
            break
        if length >= 0xC0:  # a compression pointer ends it
            i += 2
            break
        if length > 63:
            return False
        i += length + 1
    i += 4  # type, class
    if i + 11 > n or data[i] != 0 or data[i + 1] != 0 or data[i + 2] != _OPT:
        return False
    j = i + 11
    if j + ((data[i + 9] << 8) | data[i + 10]) != n:
        return False
    count = 0
    while j < n:
        count += 1
        if count > MAX_EDNS_OPTIONS or j + 4 > n:
            return False
        j += 4 + ((data[j + 2] << 8) | data[j + 3])
    return j == n


def _plain_options(data: bytes, start: int) -> bool:
    """Whether the OPT record's options from ``start`` to the end of ``data`` are
    whole, at most :data:`MAX_EDNS_OPTIONS`, and without padding (see _fast_key)."""
    j, end, options = start, len(data), 0
    while j < end:
        options += 1
        if j + 4 > end or options > MAX_EDNS_OPTIONS:
            return False
        code = (data[j] << 8) | data[j + 1]
        olen = (data[j + 2] << 8) | data[j + 3]
        if code == _PADDING:
            return False
        j += 4 + olen
    return j == end


def _fast_key(data: bytes, tcp: bool) -> tuple[bytes, int, int] | None:
    """``(key, end of question, size limit)`` for a plain query the wire cache can
    answer: QR clear, opcode QUERY, one question with an uncompressed name, no answer
    or authority records, and at most one additional record which is an EDNS(0) OPT
    without padding, of at most :data:`MAX_EDNS_OPTIONS` options (so :func:`screen`
    accepts what this takes). None otherwise (the full path decides)."""
    n = len(data)
    if n < 17:
        return None
    _, flags, qd, an, ns, ar = _HEADER.unpack_from(data)
    if flags & 0xF800 or qd != 1 or an or ns or ar > 1:
        return None
    i = 12
    while True:
        if i >= n:
            return None
        length = data[i]
        if length == 0:
            break
        if length > 63:
            return None
        i += length + 1
    qend = i + 5
    if qend > n:
        return None
    if not ar:
        if qend != n:
            return None
        # Label lengths are below 0x41, so lower() changes only the labels' letters.
        return data[12:i].lower() + data[i:qend], qend, 65535 if tcp else 512
    # One OPT: root name, type 41, class = payload, TTL = ext-rcode, version, flags.
    if n < qend + 11 or data[qend] != 0 or data[qend + 1] != 0 or data[qend + 2] != _OPT:
        return None
    payload = (data[qend + 3] << 8) | data[qend + 4]
    rdlen = (data[qend + 9] << 8) | data[qend + 10]
    if data[qend + 6] != 0 or qend + 11 + rdlen != n or not _plain_options(data, qend + 11):
        return None
    limit = 65535 if tcp else max(512, payload)
    return data[12:i].lower() + data[i:qend] + b"E", qend, limit
