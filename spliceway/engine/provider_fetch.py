"""One HTTP(S) GET through an outbound: how providers' content and geodata are downloaded.

The connection is dialled through an outbound of the running engine (``via``; the
built-in ``direct`` by default), every hop and cipher included, exactly as a flow's
would be, so a subscription can be fetched through a proxy. For an ``https://`` URL,
TLS runs over that connection (memory BIOs, as the latency probes do: the connection
may be a shadowsocks session), the certificate verified against OpenSSL's default
trust store (``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` apply), SNI the URL's host.

Bounds, so a broken or hostile origin costs little:

- ``deadline_s``: the whole exchange, redirects included;
- ``stall_s``: the longest wait for the next bytes (an origin that sends its headers
  and then nothing fails here, long before the deadline);
- ``size_limit``: a ``Content-Length`` above it is refused before the body is read,
  and a body is never buffered past it (chunked or read until the close);
- at most :data:`MAX_REDIRECTS` redirects (301, 302, 303, 307, 308), to ``http`` or
  ``https`` URLs only; headers at most :data:`MAX_HEAD` bytes.

The answer is parsed by llhttp (``httptools``, a core dependency already): chunked
bodies are decoded. ``Accept-Encoding: identity`` is sent, so bodies come as they are.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import unquote, urljoin, urlsplit

import httptools

from spliceway import __version__
from spliceway.flows.outbounds import DialError, Outbound
from spliceway.flows.probe import _Channel, _Tls
from spliceway.protocols import ProtocolError

__all__ = [
    "MAX_REDIRECTS",
    "USER_AGENT",
    "FetchError",
    "Fetched",
    "fetch",
]

#: What subscription services see. They choose the body's format by it: ``clash.meta``
#: (mihomo's own ``clash.meta/<version>``) gets the Clash YAML with every proxy type,
#: and the product token says who is really asking.
USER_AGENT = f"clash.meta/1.19.0 spliceway/{__version__}"
MAX_REDIRECTS = 5
#: Most bytes of a response head (status line and headers).
MAX_HEAD = 64 * 1024
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
_RECV = 256 * 1024


class FetchError(Exception):
    """The download failed; the message says how (a sentence for the provider status)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        #: The origin's final HTTP status, when it answered one.
        self.status = status


@dataclass(frozen=True, slots=True)
class Fetched:
    """A complete answer: its status, headers (names lowercased; a repeated one's last
    value), body, and the URL it came from after redirects."""

    status: int
    headers: Mapping[str, str]
    body: bytes
    url: str
    redirects: tuple[str, ...] = field(default=())


@dataclass(frozen=True, slots=True)
class _Target:
    tls: bool
    host: str
    port: int
    target: str
    authorization: str | None

    @classmethod
    def of(cls, url: str) -> _Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchError(f"not an http:// or https:// URL with a host: {url!r}")
        try:
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise FetchError(f"bad port in {url!r}") from None
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        auth = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            auth = "Basic " + base64.b64encode(pair.encode()).decode("ascii")
        return cls(parts.scheme == "https", parts.hostname, port, target, auth)

    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.tls else 80
        return host if self.port == default else f"{host}:{self.port}"

    def request(self, headers: Mapping[str, str]) -> bytes:
        lines = [
            f"GET {self.target} HTTP/1.1",
            f"Host: {self.host_header()}",
            f"User-Agent: {USER_AGENT}",
            "Accept: */*",
            "Accept-Encoding: identity",
            "Connection: close",
        ]
        if self.authorization is not None:
            lines.append(f"Authorization: {self.authorization}")
        lines.extend(f"{k}: {v}" for k, v in headers.items())
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class _Answer:
    """httptools callbacks: the answer being read, with the size limit enforced."""

    def __init__(self, size_limit: int) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.size_limit = size_limit
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_bytes = 0
        self.headers_done = False
        self.interim = False
        self.delimited = False
        self.done = False
        self.body = bytearray()
        #: Set when the body is larger than the limit: the size it declared, else -1.
        self.too_large: int | None = None

    def on_header(self, name: bytes, value: bytes) -> None:
        key = name.decode("latin-1").lower()
        self.headers[key] = value.decode("latin-1")
        if key in ("content-length", "transfer-encoding"):
            self.delimited = True

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status <= 199:
            self.interim = True
            self.headers = {}
            self.delimited = False
            return
        self.status = status
        self.headers_done = True
        length = self.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.size_limit and status // 100 == 2:
            self.too_large = int(length)

    def on_body(self, body: bytes) -> None:
        if self.status // 100 != 2 or self.too_large is not None:
            return  # an error page's body, or one past the limit, is not kept
        if len(self.body) + len(body) > self.size_limit:
            self.too_large = -1
            self.body.clear()
            return
        self.body += body

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self.done = True


async def _recv(stream: _Channel | _Tls, stall_s: float) -> bytes:
    try:
        async with asyncio.timeout(stall_s):
            return await stream.recv()
    except TimeoutError:
        raise FetchError(f"the origin sent nothing for {stall_s:g} s (stalled)") from None


async def _exchange(
    loop: asyncio.AbstractEventLoop,
    outbound: Outbound,
    target: _Target,
    headers: Mapping[str, str],
    size_limit: int,
    stall_s: float,
) -> _Answer:
    dialed = await outbound.dial(loop, target.host, target.port)
    try:
        channel = _Channel(loop, dialed)
        stream: _Channel | _Tls = channel
        if target.tls:
            tls = _Tls(channel, target.host)
            async with asyncio.timeout(stall_s):
                await tls.handshake()
            stream = tls
        await stream.send(target.request(headers))
        answer = _Answer(size_limit)
        while not answer.done:
            data = await _recv(stream, stall_s)
            if not data:
                if answer.headers_done and not answer.delimited:
                    return answer  # no length, not chunked: the body ends with the connection
                raise FetchError(
                    "the connection closed before a complete answer"
                    if answer.headers_done
                    else "the connection closed before an answer"
                )
            if not answer.headers_done:
                answer.head_bytes += len(data)
                if answer.head_bytes > MAX_HEAD:
                    raise FetchError(f"the answer's head is longer than {MAX_HEAD} bytes")
            try:
                answer.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                raise FetchError("the origin answered with a protocol upgrade") from None
            except httptools.HttpParserError as ex:
                raise FetchError(f"not an HTTP answer ({ex})") from None
            if answer.too_large is not None:
                return answer  # refused by the caller; nothing more is read
        return answer
    finally:
        with contextlib.suppress(OSError):
            dialed.sock.close()


async def fetch(
    loop: asyncio.AbstractEventLoop,
    outbound: Outbound,
    url: str,
    *,
    size_limit: int,
    deadline_s: float,
    stall_s: float,
    headers: Mapping[str, str] | None = None,
) -> Fetched:
    """GET ``url`` through ``outbound`` (see the module docstring). A 2xx or a 304 answer
    is returned; anything else raises :class:`FetchError` with a sentence saying why."""
    redirects: list[str] = []
    current = url
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                target = _Target.of(current)
                answer = await _exchange(loop, outbound, target, headers or {}, size_limit, stall_s)
                if answer.too_large is not None:
                    declared = answer.too_large
                    said = f" (it declares {declared} bytes)" if declared >= 0 else ""
                    raise FetchError(
                        f"the body is larger than size_limit_bytes ({size_limit}){said}"
                    )
                status = answer.status
                if status in _REDIRECTS and "location" in answer.headers:
                    if len(redirects) >= MAX_REDIRECTS:
                        raise FetchError(f"more than {MAX_REDIRECTS} redirects", status=status)
                    current = urljoin(current, answer.headers["location"])
                    redirects.append(current)
                    continue
                if status == 304 or 200 <= status <= 299:
                    return Fetched(
                        status, answer.headers, bytes(answer.body), current, tuple(redirects)
                    )
                raise FetchError(f"the origin answered HTTP {status}", status=status)
    except TimeoutError:
        raise FetchError(f"no complete answer within {deadline_s:g} s") from None
    except DialError as ex:
        raise FetchError(
            f"cannot reach {urlsplit(current).netloc} through {outbound.tag!r}: {ex.message}"
        ) from None
    except ssl.SSLError as ex:
        raise FetchError(f"TLS: {ex.reason or ex}") from None
    except ProtocolError as ex:
        raise FetchError(str(ex)) from None
    except OSError as ex:
        raise FetchError(
            os.strerror(ex.errno) if ex.errno else str(ex) or type(ex).__name__
        ) from None
