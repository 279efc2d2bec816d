"""HTTP/1.x proxy heads (RFC 9110, RFC 9112), sans-I/O.

Server side (the http inbound):

- :func:`parse_request_head` -- a request head, CONNECT or absolute-form;
- :func:`connect_authority` / :func:`split_absolute_uri` -- where to connect;
- :func:`proxy_basic_credentials` -- Proxy-Authorization: Basic;
- :func:`origin_request` -- the head re-serialised for the origin server;
- :func:`proxy_response` -- the origin's response head re-serialised for the client;
- :func:`response` -- our own responses (errors, 407, the CONNECT 200).

Client side (the http outbound, an upstream CONNECT proxy): :func:`connect_request`
and :func:`parse_response_head`.

Only heads are handled here; where each body ends is
:mod:`spliceway.protocols.http_message`'s. Requests whose body framing is ambiguous
(Content-Length together with Transfer-Encoding, conflicting Content-Length) are
refused here rather than passed on.

Heads are decoded as ISO-8859-1, which maps bytes 1:1 to code points, so header values
with obs-text survive a parse/serialise round trip unchanged.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass
from http import HTTPStatus

from spliceway.protocols import NEED_MORE, NeedMore, ProtocolError

__all__ = [
    "CONNECT_ESTABLISHED",
    "MAX_HEAD_SIZE",
    "RequestHead",
    "ResponseHead",
    "connect_authority",
    "connect_request",
    "origin_request",
    "parse_request_head",
    "parse_response_head",
    "proxy_basic_credentials",
    "proxy_response",
    "response",
    "split_absolute_uri",
]

#: Default bound on a request or response head, terminating empty line included.
MAX_HEAD_SIZE = 65536

#: The answer to a CONNECT once the tunnel is up (no Content-Length: RFC 9110 9.3.6).
CONNECT_ESTABLISHED = b"HTTP/1.1 200 Connection established\r\n\r\n"

# RFC 9110 5.6.2: tchar.
_TOKEN_RE = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# A strict prefix of a request line that could still become valid: token chars, then
# optionally a space and anything. Used to reject garbage (a TLS ClientHello sent to
# the HTTP port, say) without waiting for a full head that will never come.
_TOKEN_PREFIX_RE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]*(?: |\Z)")
# The end of a head: a line feed, an optional carriage return, a line feed.
_HEAD_END_RE = re.compile(rb"\n\r?\n")
# Leading empty lines before a request line (RFC 9112 2.2: SHOULD be ignored).
_LEADING_EOL_RE = re.compile(rb"(?:\r?\n)*")
_HTTP1_VERSION_RE = re.compile(r"HTTP/1\.[0-9]")
_ANY_VERSION_RE = re.compile(r"HTTP/[0-9]\.[0-9]")
# Field values: VCHAR, obs-text, SP, HTAB (RFC 9110 5.5); no other controls.
_BAD_VALUE_CHAR_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
# Request targets: no controls, no whitespace.
_BAD_TARGET_CHAR_RE = re.compile(r"[\x00-\x20\x7f]")
# reg-name as we accept it: DNS-ish labels (underscore included: it occurs in the wild).
_REG_NAME_RE = re.compile(r"[A-Za-z0-9_\-.]+")
_PORT_RE = re.compile(r"[0-9]{1,5}")
_DIGITS_RE = re.compile(r"[0-9]+")
_OWS = " \t"

# Hop-by-hop fields that never go to the origin (RFC 9110 7.6.1; TE is one too, 10.1.4,
# and Upgrade is only kept for a request the proxy lets switch protocols).
_HOP_BY_HOP = frozenset(
    {"connection", "proxy-connection", "keep-alive", "proxy-authorization", "te", "upgrade"}
)
# Hop-by-hop fields of a response: they describe the origin's connection, not ours.
_RESPONSE_HOP_BY_HOP = frozenset({"connection", "proxy-connection", "keep-alive", "upgrade"})
# Fields a client cannot have dropped by naming them in Connection: removing them would
# change the request's framing or routing on the way to the origin.
_NOT_DROPPABLE = frozenset({"host", "content-length", "transfer-encoding"})


@dataclass(frozen=True, slots=True)
class RequestHead:
    """A parsed request head. ``headers`` keeps order and the client's name case."""

    method: str
    target: str
    version: str
    headers: tuple[tuple[str, str], ...]
    consumed: int

    def header(self, name: str) -> str | None:
        """The first value of a header, matched case-insensitively, or None."""
        return _find_header(self.headers, name)


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """A parsed response head."""

    version: str
    status: int
    reason: str
    headers: tuple[tuple[str, str], ...]
    consumed: int

    def header(self, name: str) -> str | None:
        """The first value of a header, matched case-insensitively, or None."""
        return _find_header(self.headers, name)


def _find_header(headers: tuple[tuple[str, str], ...], name: str) -> str | None:
    lowered = name.lower()
    for key, value in headers:
        if key.lower() == lowered:
            return value
    return None


def _bad_request(message: str) -> ProtocolError:
    # The body does not echo the message: it may quote client bytes, and reflecting
    # those into a page a browser renders is asking for trouble. The log gets it.
    return ProtocolError(message, response(400, body=b"Bad Request\n"))


# -- head framing -----------------------------------------------------------------------


def _find_head(buf: bytes | bytearray, max_size: int, start: int) -> tuple[int, bool]:
    """Locate the end of the head that begins at ``start``.

    Returns (end, complete): ``end`` is the offset just past the terminating empty
    line when complete, else the buffer's length; (-1, False) when no terminator can
    fall within ``max_size`` bytes any more.
    """
    match = _HEAD_END_RE.search(buf, start, max_size)
    if match is not None:
        return match.end(), True
    if len(buf) >= max_size:
        return -1, False
    return len(buf), False


def _head_lines(raw: bytes) -> list[str]:
    """Split a complete head (terminator included) into lines without line endings.

    ValueError on a NUL or a bare CR (RFC 9112 2.2 lets us reject the latter).
    """
    text = raw.decode("latin-1")
    if "\x00" in text:
        raise ValueError("NUL in head")
    lines = []
    # The last two items are the terminating empty line and the "" after its LF.
    for line in text.split("\n")[:-2]:
        stripped = line.removesuffix("\r")
        if "\r" in stripped:
            raise ValueError("bare CR in head")
        lines.append(stripped)
    return lines


def _parse_fields(lines: Sequence[str], unfold: bool) -> tuple[tuple[str, str], ...]:
    """Parse field lines. Raises ValueError with a message on malformed input.

    obs-fold is refused in requests (RFC 9112 5.2 lets a server answer 400) and
    replaced by a space in responses (what it requires of a user agent).
    """
    fields: list[tuple[str, str]] = []
    for line in lines:
        if line[:1] in (" ", "\t"):
            if not unfold or not fields:
                raise ValueError("obsolete line folding")
            name, value = fields[-1]
            fields[-1] = (name, f"{value} {line.strip(_OWS)}".strip(_OWS))
            continue
        name, colon, value = line.partition(":")
        if not colon:
            raise ValueError("header line without a colon")
        # RFC 9112 5.1: no whitespace between name and colon; it MUST be rejected.
        if not _TOKEN_RE.fullmatch(name):
            raise ValueError(f"invalid header name {name!r}")
        value = value.strip(_OWS)
        if _BAD_VALUE_CHAR_RE.search(value):
            raise ValueError(f"invalid character in header {name!r}")
        fields.append((name, value))
    return tuple(fields)


def _check_framing(headers: tuple[tuple[str, str], ...]) -> None:
    """Refuse requests whose body length two parsers could disagree on (smuggling)."""
    # A list value ("5, 5") or repeated field is legal if all members agree (RFC 9110
    # 8.6); anything else lets two parsers see different bodies.
    members = {
        m.strip(_OWS) for k, v in headers if k.lower() == "content-length" for m in v.split(",")
    }
    if members:
        if len(members) != 1 or not _DIGITS_RE.fullmatch(next(iter(members))):
            raise ValueError("invalid Content-Length")
        if any(k.lower() == "transfer-encoding" for k, _ in headers):
            raise ValueError("both Content-Length and Transfer-Encoding")
    if sum(1 for k, _ in headers if k.lower() == "host") > 1:
        raise ValueError("more than one Host header")


# -- request heads ----------------------------------------------------------------------


def _parse_request_line(line: str) -> tuple[str, str, str]:
    parts = line.split(" ")
    if len(parts) != 3 or not all(parts):
        raise ValueError("malformed request line")
    method, target, version = parts
    if not _TOKEN_RE.fullmatch(method):
        raise ValueError("invalid method")
    if _BAD_TARGET_CHAR_RE.search(target):
        raise ValueError("invalid request target")
    if not _ANY_VERSION_RE.fullmatch(version):
        raise ValueError("malformed HTTP version")
    return method, target, version


def parse_request_head(
    buf: bytes | bytearray, max_size: int = MAX_HEAD_SIZE
) -> NeedMore | RequestHead:
    """Parse a request head (request line + header fields + empty line).

    Accepts CRLF or bare LF line endings and ignores empty lines before the request
    line. Malformed input raises ProtocolError with a 400 reply (505 for a version
    other than HTTP/1.x); a head larger than ``max_size`` bytes, leading empty lines
    and terminator included, gets 431. Garbage is refused as soon as the first line
    shows it, not only once ``max_size`` bytes have arrived.
    """
    lead = _LEADING_EOL_RE.match(buf)
    start = lead.end() if lead is not None else 0
    end, complete = _find_head(buf, max_size, start)
    if end < 0:
        raise ProtocolError(
            "request head too large", response(431, body=b"Request Header Fields Too Large\n")
        )
    try:
        if not complete:
            _check_partial_request(buf, start)
            return NEED_MORE
        lines = _head_lines(bytes(buf[start:end]))
        method, target, version = _parse_request_line(lines[0])
        headers = _parse_fields(lines[1:], unfold=False)
        _check_framing(headers)
    except ValueError as exc:
        raise _bad_request(str(exc)) from None
    if not _HTTP1_VERSION_RE.fullmatch(version):
        raise ProtocolError(
            f"unsupported version {version}", response(505, body=b"Only HTTP/1.x is supported\n")
        )
    return RequestHead(method, target, version, headers, end)


def _check_partial_request(buf: bytes | bytearray, start: int) -> None:
    """Raise ValueError if the incomplete head at ``start`` can never become valid."""
    if buf[start:] == b"\r":
        return  # maybe the CR of one more empty line before the request line
    newline = buf.find(b"\n", start)
    if newline < 0:
        # Only the method can be judged before the line ends.
        if not _TOKEN_PREFIX_RE.match(buf, start):
            raise ValueError("invalid method")
        if b"\x00" in buf[start:] or b"\r" in buf[start:-1]:
            raise ValueError("invalid request line")
        return
    first = bytes(buf[start:newline]).decode("latin-1").removesuffix("\r")
    if "\x00" in first or "\r" in first:
        raise ValueError("invalid request line")
    _parse_request_line(first)


# -- request targets --------------------------------------------------------------------


def _parse_authority(authority: str, default_port: int | None) -> tuple[str, int]:
    """Split ``host[:port]`` / ``[v6][:port]``; ValueError when malformed.

    Hosts come back lower-cased, IPv6 without brackets in canonical form. userinfo,
    percent-encoding and zone identifiers are refused.
    """
    if authority.startswith("["):
        close = authority.find("]")
        if close < 0:
            raise ValueError("unterminated IPv6 literal")
        literal, rest = authority[1:close], authority[close + 1 :]
        if "%" in literal:
            raise ValueError("IPv6 zone identifiers are not allowed")
        try:
            host = ipaddress.IPv6Address(literal).compressed
        except ipaddress.AddressValueError:
            raise ValueError("invalid IPv6 literal") from None
        if rest and not rest.startswith(":"):
            raise ValueError("garbage after IPv6 literal")
        port_text = rest[1:] if rest else None
    else:
        host, colon, port_text_raw = authority.partition(":")
        port_text = port_text_raw if colon else None
        if not host or not _REG_NAME_RE.fullmatch(host):
            raise ValueError("invalid host")
        host = host.lower()
    if port_text is None or port_text == "":
        # RFC 3986 allows an empty port ("host:"), meaning the scheme's default.
        if default_port is None:
            raise ValueError("port required")
        return host, default_port
    if not _PORT_RE.fullmatch(port_text):
        raise ValueError("invalid port")
    port = int(port_text)
    if not 0 < port <= 0xFFFF:
        raise ValueError("port out of range")
    return host, port


def connect_authority(target: str) -> tuple[str, int]:
    """Split a CONNECT target (``host:port`` or ``[v6]:port``) into host and port.

    The port is required (RFC 9110 9.3.6). ProtocolError with a 400 reply when bad.
    """
    try:
        return _parse_authority(target, None)
    except ValueError as exc:
        raise _bad_request(f"bad CONNECT target: {exc}") from None


def split_absolute_uri(target: str) -> tuple[str, str, int, str]:
    """Split an absolute-form target into (scheme, host, port, origin-form path).

    Only ``http`` is forwardable: an ``https`` absolute URI would oblige us to speak TLS
    to the origin on the client's behalf, which the engine does not do (clients use
    CONNECT for https). The path keeps the query, drops any fragment, and is ``/``
    when empty. ProtocolError with a 400 reply when bad.
    """
    scheme, sep, rest = target.partition("://")
    if not sep or not _TOKEN_RE.fullmatch(scheme):
        raise _bad_request("request target is not an absolute URI")
    scheme = scheme.lower()
    if scheme != "http":
        raise _bad_request(f"cannot forward {scheme}:// requests; use CONNECT")
    cut = len(rest)
    for delimiter in "/?#":
        found = rest.find(delimiter)
        if 0 <= found < cut:
            cut = found
    authority, path = rest[:cut], rest[cut:]
    if "@" in authority:
        # RFC 9110 4.2.4: userinfo in an http URI is deprecated; treat it as an error.
        raise _bad_request("userinfo in request target")
    try:
        host, port = _parse_authority(authority, 80)
    except ValueError as exc:
        raise _bad_request(f"bad request target: {exc}") from None
    path = path.partition("#")[0]
    if not path.startswith("/"):
        path = "/" + path
    return scheme, host, port, path


# -- credentials and re-serialisation ---------------------------------------------------


def proxy_basic_credentials(head: RequestHead) -> tuple[str, str] | None:
    """(user, password) from ``Proxy-Authorization: Basic``, or None.

    None when the header is missing, uses another scheme, or is malformed (bad base64,
    no colon, not UTF-8): the caller answers all of those with 407 alike.
    """
    value = head.header("Proxy-Authorization")
    if value is None:
        return None
    scheme, _, token = value.strip(_OWS).partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(_OWS), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(":")
    if not colon:
        return None
    return user, password


def _check_head_text(value: str, what: str) -> None:
    """Refuse caller-supplied text that would break out of its place in a head."""
    if _BAD_TARGET_CHAR_RE.search(value) or not value:
        raise ValueError(f"invalid {what}: {value!r}")


def origin_request(
    head: RequestHead, path: str, host_header: str, *, connection: str = "close"
) -> bytes:
    """Re-serialise a proxied request head for the origin server.

    The request line goes to origin form (``path``). Hop-by-hop fields are dropped --
    Connection, Proxy-Connection, Keep-Alive, Proxy-Authorization, TE, Upgrade and any
    named in Connection (except Host, Content-Length and Transfer-Encoding, which a
    client must not be able to strip) -- and ``Connection: {connection}`` is added
    (none when empty): ``close`` when the upstream connection is used for this request
    only, ``""`` to keep it for the next (HTTP/1.1's default), ``upgrade`` to forward
    the client's Upgrade (a protocol switch the proxy then tunnels).

    Host is set to ``host_header`` (the authority of the absolute URI), replacing any
    Host the client sent, in place: RFC 9112 3.2.2 says a proxy MUST ignore the
    received Host for an absolute-form request and generate it from the target, and it
    keeps the origin from seeing a different host than the one we routed to.
    """
    _check_head_text(path, "path")
    _check_head_text(host_header, "Host")
    named: set[str] = set()
    for key, value in head.headers:
        if key.lower() == "connection":
            named.update(t.strip(_OWS).lower() for t in value.split(","))
    drop = (_HOP_BY_HOP | named) - _NOT_DROPPABLE
    if connection.lower() == "upgrade":
        drop = drop - {"upgrade"}
    lines = [f"{head.method} {path} {head.version}"]
    host_done = False
    for key, value in head.headers:
        lowered = key.lower()
        if lowered in drop:
            continue
        if lowered == "host":
            if not host_done:
                lines.append(f"{key}: {host_header}")
                host_done = True
            continue
        lines.append(f"{key}: {value}")
    if not host_done:
        lines.insert(1, f"Host: {host_header}")
    if connection:
        lines.append(f"Connection: {connection}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def proxy_response(head: ResponseHead, connection: str | None) -> bytes:
    """Re-serialise an origin's response head for the proxy's client.

    The status line carries our version (RFC 9110 6.2: an intermediary sends its own).
    The origin's hop-by-hop fields go (Connection and the fields it names, Keep-Alive,
    Proxy-Connection, and Upgrade unless this is a 101), as does a Content-Length next
    to a Transfer-Encoding (RFC 9112 6.3: the proxy MUST remove it). ``connection`` is
    the value of our own Connection field for the client's connection, None for none.
    """
    named: set[str] = set()
    for key, value in head.headers:
        if key.lower() == "connection":
            named.update(t.strip(_OWS).lower() for t in value.split(","))
    drop = (_RESPONSE_HOP_BY_HOP | named) - {"transfer-encoding", "content-length"}
    if head.status == 101:
        drop = drop - {"upgrade"}
    if any(k.lower() == "transfer-encoding" for k, _ in head.headers):
        drop = drop | {"content-length"}
    # The space before an empty reason stays: RFC 9112 4 requires it.
    lines = [f"HTTP/1.1 {head.status} {head.reason}"]
    lines.extend(f"{key}: {value}" for key, value in head.headers if key.lower() not in drop)
    if connection:
        lines.append(f"Connection: {connection}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


# -- our own responses ------------------------------------------------------------------


def response(
    status: int,
    reason: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
) -> bytes:
    """Build an HTTP/1.1 response head plus ``body``.

    ``reason`` defaults to the standard phrase. Content-Length is added (unless given)
    when there is a body or the status is an error, and ``Connection: close`` (unless
    given) for errors: after one we close, so the client must not reuse the connection.
    ``response(200, "Connection established")`` equals :data:`CONNECT_ESTABLISHED`.
    """
    if not 100 <= status <= 999:
        raise ValueError(f"invalid status {status}")
    if reason is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = ""
    if any(ch in reason for ch in "\r\n\x00"):
        raise ValueError("invalid reason phrase")
    present = {key.lower() for key, _ in headers}
    lines = [f"HTTP/1.1 {status} {reason}"]
    for key, value in headers:
        if not _TOKEN_RE.fullmatch(key) or _BAD_VALUE_CHAR_RE.search(value):
            raise ValueError(f"invalid header {key!r}")
        lines.append(f"{key}: {value}")
    if (body or status >= 400) and "content-length" not in present:
        lines.append(f"Content-Length: {len(body)}")
    if status >= 400 and "connection" not in present:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


# -- client side (upstream CONNECT proxy) -----------------------------------------------


def _authority(host: str, port: int) -> str:
    """``host:port``, bracketing IPv6 literals."""
    if not 0 < port <= 0xFFFF:
        raise ValueError(f"port out of range: {port}")
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        _check_head_text(host, "host")
        if ":" in host or "/" in host or "@" in host:
            raise ValueError(f"invalid host: {host!r}") from None
        return f"{host}:{port}"
    if ip.version == 6:
        return f"[{ip.compressed}]:{port}"
    return f"{ip}:{port}"


def connect_request(host: str, port: int, credentials: tuple[str, str] | None) -> bytes:
    """Build a CONNECT request head for an upstream HTTP proxy.

    ``credentials`` (user, password) go in ``Proxy-Authorization: Basic`` as UTF-8
    (RFC 7617); a user name containing ``:`` cannot be encoded and is a ValueError.
    """
    authority = _authority(host, port)
    lines = [f"CONNECT {authority} HTTP/1.1", f"Host: {authority}"]
    if credentials is not None:
        user, password = credentials
        if ":" in user:
            raise ValueError("a Basic user name cannot contain ':'")
        token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
        lines.append(f"Proxy-Authorization: Basic {token}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")


_STATUS_PREFIX = b"HTTP/"


def parse_response_head(
    buf: bytes | bytearray, max_size: int = MAX_HEAD_SIZE
) -> NeedMore | ResponseHead:
    """Parse a response head (status line + header fields + empty line).

    For talking to an upstream proxy, so errors carry no reply (we are the client).
    A missing reason phrase (``HTTP/1.1 200\\r\\n``) is accepted; obs-fold is unfolded.
    """
    end, complete = _find_head(buf, max_size, 0)
    if end < 0:
        raise ProtocolError("response head too large")
    prefix = bytes(buf[: len(_STATUS_PREFIX)])
    if not _STATUS_PREFIX.startswith(prefix):
        raise ProtocolError("not an HTTP response")
    if not complete:
        newline = buf.find(b"\n")
        if newline >= 0:
            # The status line is complete: judge it now rather than wait for the rest.
            _parse_status_line(bytes(buf[:newline]).decode("latin-1").removesuffix("\r"))
        return NEED_MORE
    try:
        lines = _head_lines(bytes(buf[:end]))
        headers = _parse_fields(lines[1:], unfold=True)
    except ValueError as exc:
        raise ProtocolError(f"malformed response head: {exc}") from None
    version, status, reason = _parse_status_line(lines[0])
    return ResponseHead(version, status, reason, headers, end)


def _parse_status_line(line: str) -> tuple[str, int, str]:
    version, _, rest = line.partition(" ")
    status_text, _, reason = rest.partition(" ")
    if not _HTTP1_VERSION_RE.fullmatch(version):
        raise ProtocolError(f"unsupported response version {version!r}")
    if len(status_text) != 3 or not status_text.isdigit() or not status_text.isascii():
        raise ProtocolError("malformed status code")
    if _BAD_VALUE_CHAR_RE.search(reason):
        raise ProtocolError("invalid reason phrase")
    status = int(status_text)
    if status < 100:
        raise ProtocolError("malformed status code")
    return version, status, reason
