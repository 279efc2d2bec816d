"""Sans-I/O wire-protocol codecs for the proxy's inbounds and outbounds.

Every parser here is a pure function over the bytes received so far: no sockets, no
clock, no global state. It returns :data:`NEED_MORE` while the message is incomplete,
or a result whose ``consumed`` field says how many leading bytes of the buffer the
message used (the caller keeps the rest), and it raises :class:`ProtocolError` -- and
nothing else -- on malformed input. Size bounds are enforced so that no input makes a
parser ask for more bytes forever.

Modules:

- :mod:`spliceway.protocols.socks5` -- SOCKS5 (RFC 1928) and its username/password
  sub-negotiation (RFC 1929): server-side parsers for the socks5 inbound, client-side
  builders and parsers for the socks5 outbound, and the UDP datagram header.
- :mod:`spliceway.protocols.http` -- HTTP/1.x proxy heads: request heads (CONNECT and
  absolute-form), re-serialisation for the origin, proxy responses, and the client side
  of an upstream HTTP CONNECT proxy.
- :mod:`spliceway.protocols.sniff` -- best-effort destination sniffing: the SNI of a TLS
  ClientHello or the Host of a plain HTTP/1.x request. Never raises.

This module holds what they share: :data:`NEED_MORE` and :class:`ProtocolError`.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["NEED_MORE", "NeedMore", "ProtocolError"]


class NeedMore(enum.Enum):
    """Type of :data:`NEED_MORE`.

    A one-member enum rather than a plain object so that type checkers narrow
    ``result is NEED_MORE`` / ``result is not NEED_MORE`` on a ``NeedMore | T`` union,
    and so that it stays a singleton across copy and pickle.
    """

    NEED_MORE = enum.auto()

    def __repr__(self) -> str:
        return "NEED_MORE"

    __str__ = __repr__


#: Returned by a parser when the buffer holds an incomplete message.
NEED_MORE: Final = NeedMore.NEED_MORE


class ProtocolError(Exception):
    """Malformed or unacceptable input from the peer.

    ``reply`` is what a server should send before closing the connection (the
    protocol's own error reply, e.g. a SOCKS5 failure reply or an HTTP 400), or None
    when the protocol has nothing to say (or we are the client).
    """

    def __init__(self, message: str, reply: bytes | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reply = reply

    def __repr__(self) -> str:
        return f"ProtocolError({self.message!r}, reply={self.reply!r})"
