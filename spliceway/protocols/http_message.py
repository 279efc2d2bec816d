"""HTTP/1.1 message framing for the forward proxy (RFC 9112 6 and 7), sans-I/O.

A forward proxy that keeps a client connection for its next request must know where
each request body ends (to find the next head) and where each response ends (to know
the client may send again). This module answers that, and nothing else:

- :func:`request_framing` / :func:`response_framing` -- which body follows a head
  (none, a Content-Length, chunked, or -- responses only -- until the connection
  closes), with RFC 9112 6.3's special cases (HEAD, 1xx, 204, 304);
- :class:`BodyFramer` -- fed the bytes after a head, it says how many of them belong to
  the body and when the body is complete. Bodies are never decoded or re-encoded: the
  proxy forwards exactly the bytes it received (chunk extensions and trailers
  included), so what a flow record counts is what crossed the proxy.

Why not h11: it decodes chunked bodies and re-chunks them on the way out (extensions
dropped, chunk sizes changed, so forwarded bytes differ from received ones), and it is
pure Python per event; the heads are parsed by :mod:`spliceway.protocols.http`, whose
C twin is held to it by differential tests, so only the framing is needed here.

Chunked framing is strict: chunk-size lines and the CRLF after chunk data must end in
CRLF (a bare LF is refused), sizes are at most 16 hex digits, lines and the trailer
section are bounded. A proxy that is laxer than the origin behind it is how request
smuggling happens; a proxy that is stricter only refuses a request.
"""

from __future__ import annotations

import re
from typing import Final

from spliceway.protocols import ProtocolError
from spliceway.protocols.http import RequestHead, ResponseHead

__all__ = [
    "CHUNKED",
    "CLOSE",
    "LENGTH",
    "NONE",
    "BodyFramer",
    "connection_tokens",
    "request_framing",
    "response_framing",
]

#: Body kinds.
NONE: Final = 0  # no body at all
LENGTH: Final = 1  # exactly Content-Length bytes
CHUNKED: Final = 2  # chunked transfer coding, up to and including the trailer section
CLOSE: Final = 3  # until the sender closes (responses only)

#: Longest chunk-size line (size, extensions, CRLF) and longest trailer section.
MAX_CHUNK_LINE: Final = 4096
MAX_TRAILERS: Final = 65536

_OWS = " \t"
_CHUNK_SIZE_RE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\x00-\x08\x0a-\x1f\x7f]*)?")
_DIGITS_RE = re.compile(r"[0-9]+")

# Chunked-parser states.
_SIZE, _DATA, _DATA_END, _TRAILER, _DONE = range(5)


def connection_tokens(headers: tuple[tuple[str, str], ...], *names: str) -> set[str]:
    """The lower-cased tokens of every ``names`` field (Connection, Proxy-Connection)."""
    wanted = {n.lower() for n in names}
    tokens: set[str] = set()
    for key, value in headers:
        if key.lower() in wanted:
            tokens.update(t.strip(_OWS).lower() for t in value.split(","))
    tokens.discard("")
    return tokens


def _transfer_codings(headers: tuple[tuple[str, str], ...]) -> list[str] | None:
    """Transfer-Encoding's codings in order (lower-cased, parameters dropped), or None."""
    found = False
    codings: list[str] = []
    for key, value in headers:
        if key.lower() == "transfer-encoding":
            found = True
            for member in value.split(","):
                coding = member.split(";", 1)[0].strip(_OWS).lower()
                if coding:
                    codings.append(coding)
    return codings if found else None


def _content_length(headers: tuple[tuple[str, str], ...]) -> int | None:
    """Content-Length when present and consistent; ValueError when it is not."""
    members = {
        m.strip(_OWS) for k, v in headers if k.lower() == "content-length" for m in v.split(",")
    }
    if not members:
        return None
    if len(members) != 1 or not _DIGITS_RE.fullmatch(value := next(iter(members))):
        raise ValueError("invalid Content-Length")
    return int(value)


def request_framing(head: RequestHead) -> tuple[int, int]:
    """(kind, length) of the body following a request head (RFC 9112 6.3).

    ProtocolError (the caller answers 400 and closes) when no length can be trusted:
    Transfer-Encoding in an HTTP/1.0 request, or with a final coding other than chunked.
    (Content-Length together with Transfer-Encoding, or conflicting Content-Lengths, are
    already refused by :func:`~spliceway.protocols.http.parse_request_head`.)
    """
    codings = _transfer_codings(head.headers)
    if codings is not None:
        if head.version == "HTTP/1.0":
            raise ProtocolError("Transfer-Encoding in an HTTP/1.0 request")
        if not codings or codings[-1] != "chunked":
            raise ProtocolError("request Transfer-Encoding does not end in chunked")
        return CHUNKED, 0
    try:
        length = _content_length(head.headers)
    except ValueError as ex:
        raise ProtocolError(str(ex)) from None
    if not length:
        return NONE, 0
    return LENGTH, length


def response_framing(head: ResponseHead, method: str) -> tuple[int, int]:
    """(kind, length) of the body following a response to a ``method`` request.

    ProtocolError (the caller answers 502) for an invalid Content-Length. A
    Transfer-Encoding overrides Content-Length (RFC 9112 6.3 point 3); one that does
    not end in chunked runs until the connection closes.
    """
    status = head.status
    if method == "HEAD" or status < 200 or status in (204, 304):
        return NONE, 0
    codings = _transfer_codings(head.headers)
    if codings is not None:
        if codings and codings[-1] == "chunked":
            return CHUNKED, 0
        return CLOSE, 0
    try:
        length = _content_length(head.headers)
    except ValueError as ex:
        raise ProtocolError(f"upstream response: {ex}") from None
    if length is None:
        return CLOSE, 0
    if length == 0:
        return NONE, 0
    return LENGTH, length


class BodyFramer:
    """Finds the end of one message body in the bytes that follow its head.

    :meth:`feed` is given successive pieces of the stream and returns how many leading
    bytes of each belong to the body; once :attr:`done`, the rest of that piece (and
    everything after) is the next message's. A ``CLOSE`` body takes every byte and is
    done only when the caller sees the end of the stream (:meth:`at_eof`).
    """

    __slots__ = ("_line", "_remaining", "_state", "_trailer_size", "done", "kind")

    def __init__(self, kind: int, length: int = 0) -> None:
        self.kind = kind
        self._remaining = length
        self._state = _SIZE
        self._line = bytearray()
        self._trailer_size = 0
        self.done = kind == NONE or (kind == LENGTH and length == 0)

    def feed(self, data: bytes) -> int:
        """How many leading bytes of ``data`` belong to the body (ProtocolError when the
        chunked framing is broken)."""
        if self.done:
            return 0
        if self.kind == LENGTH:
            taken = min(self._remaining, len(data))
            self._remaining -= taken
            self.done = self._remaining == 0
            return taken
        if self.kind == CLOSE:
            return len(data)
        return self._feed_chunked(data)

    def at_eof(self) -> bool:
        """The stream ended: True if that completes the body (only a ``CLOSE`` body)."""
        if self.kind == CLOSE:
            self.done = True
        return self.done

    def _feed_chunked(self, data: bytes) -> int:
        pos = 0
        end = len(data)
        while pos < end and not self.done:
            state = self._state
            if state == _DATA:
                taken = min(self._remaining, end - pos)
                pos += taken
                self._remaining -= taken
                if self._remaining == 0:
                    self._state = _DATA_END
                continue
            # A line: the chunk size, the CRLF after data, or a trailer field.
            newline = data.find(b"\n", pos, end)
            stop = end if newline < 0 else newline + 1
            self._line += data[pos:stop]
            pos = stop
            limit = MAX_CHUNK_LINE if state != _TRAILER else MAX_TRAILERS - self._trailer_size
            if len(self._line) > limit:
                raise ProtocolError("chunk-size line or trailer section too long")
            if newline < 0:
                continue
            line = bytes(self._line)
            self._line.clear()
            if not line.endswith(b"\r\n") or b"\r" in line[:-2]:
                raise ProtocolError("chunked framing line does not end in CRLF")
            self._line_done(state, line[:-2])
        return pos

    def _line_done(self, state: int, line: bytes) -> None:
        if state == _DATA_END:
            if line:
                raise ProtocolError("chunk data not followed by CRLF")
            self._state = _SIZE
        elif state == _SIZE:
            match = _CHUNK_SIZE_RE.fullmatch(line)
            if match is None:
                raise ProtocolError("malformed chunk-size line")
            size = int(match.group(1), 16)
            if size == 0:
                self._state = _TRAILER
            else:
                self._remaining = size
                self._state = _DATA
        else:  # _TRAILER
            self._trailer_size += len(line) + 2
            if not line:
                self._state = _DONE
                self.done = True
            elif line[:1] in (b" ", b"\t") or b":" not in line or b"\x00" in line:
                raise ProtocolError("malformed trailer field")
