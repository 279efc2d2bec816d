"""Latency probes through an outbound (url_test/fallback rounds, ``diagnostics.probe_outbound``).

One probe: dial the URL's host through the outbound (every hop, handshake and
cipher included), for an ``https://`` URL run TLS over that connection (SNI the
URL's host, the certificate verified against the system's trust store), send
``HEAD``, wait for the first byte of the answer and read its status line. The
elapsed time from the start of the dial to that first byte is the latency (the TLS
handshake included, as mihomo's delay test counts it).

Any failure (dial error, refusal, TLS error, early close, timeout, a status outside
the expected ranges) is a result with an error text, never an exception: a dead
member is an ordinary outcome of a probe round.

Decisions:

- TLS runs on :class:`ssl.SSLObject` over memory BIOs, not ``loop.start_tls``: the
  connection may be a shadowsocks session, whose bytes must be sealed and opened
  here, so TLS cannot own the socket.
- The trust store is OpenSSL's default (``ssl.create_default_context``), built per
  probe so ``SSL_CERT_FILE`` / ``SSL_CERT_DIR`` in the engine's environment apply
  (how a private CA is trusted, and how the tests trust theirs).
- An answer that is not HTTP (no ``HTTP/x status`` line) passes when any status is
  expected, as every answer did before statuses were read, with ``status`` null; it
  fails when ``expected`` names statuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from spliceway.flows.outbounds import Dialed, DialError, Outbound
from spliceway.protocols import ProtocolError, shadowsocks
from spliceway.routing.policy import PROBE_TIMEOUT_S, ProbeUrl, StatusRanges, status_allowed

#: Most bytes read looking for the end of the status line.
STATUS_LINE_MAX = 8192
_STATUS_LINE = re.compile(rb"HTTP/\d(?:\.\d)? (\d{3})(?: |\r|\n|$)")


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe found: a latency and the answer's status, or an error text."""

    latency_ms: float | None
    error: str | None
    #: The answer's HTTP status, None when none was read (failure, or not HTTP).
    status: int | None = None
    #: True when the probe ran out of time (a dashboard's delay test answers 504 then).
    timed_out: bool = False

    @property
    def reachable(self) -> bool:
        """True when an answer arrived (with an expected status, if statuses were read)."""
        return self.error is None


class _Channel:
    """The dialed connection's plaintext: shadowsocks sealing and opening done here."""

    def __init__(self, loop: asyncio.AbstractEventLoop, dialed: Dialed) -> None:
        self._loop = loop
        self._sock = dialed.sock
        self._sealed = dialed.sealed
        self._opener = (
            None
            if dialed.sealed is None
            else shadowsocks.Decryptor(
                shadowsocks.CIPHERS[dialed.sealed.cipher], dialed.sealed.master_key
            )
        )
        #: What the target sent before we spoke, through the proxy's reply.
        self._pending = dialed.leftover

    async def send(self, data: bytes) -> None:
        if self._sealed is not None:
            data = self._sealed.encryptor.seal(data)
        await self._loop.sock_sendall(self._sock, data)

    async def recv(self) -> bytes:
        """The next plaintext bytes; b"" at the end of the stream."""
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        while True:
            data = await self._loop.sock_recv(self._sock, 65536)
            if not data or self._opener is None:
                return data
            opened = self._opener.feed(data)
            if opened:
                return opened


class _Tls:
    """TLS client over a :class:`_Channel` (memory BIOs)."""

    def __init__(self, channel: _Channel, host: str) -> None:
        self._channel = channel
        self._in = ssl.MemoryBIO()
        self._out = ssl.MemoryBIO()
        context = ssl.create_default_context()
        self._tls = context.wrap_bio(self._in, self._out, server_hostname=host)

    async def _flush(self) -> None:
        data = self._out.read()
        if data:
            await self._channel.send(data)

    async def _feed(self) -> bool:
        data = await self._channel.recv()
        if data:
            self._in.write(data)
            return True
        self._in.write_eof()
        return False

    async def handshake(self) -> None:
        while True:
            try:
                self._tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._feed():
                    raise ProtocolError("connection closed during the TLS handshake") from None
        await self._flush()

    async def send(self, data: bytes) -> None:
        self._tls.write(data)
        await self._flush()

    async def recv(self) -> bytes:
        while True:
            try:
                return self._tls.read(65536)
            except ssl.SSLWantReadError:
                await self._flush()
                if not await self._feed():
                    return b""
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""


async def probe(
    loop: asyncio.AbstractEventLoop,
    outbound: Outbound,
    url: ProbeUrl,
    timeout: float = PROBE_TIMEOUT_S,
    expected: StatusRanges = (),
) -> ProbeResult:
    """Probe ``url`` through ``outbound`` within ``timeout`` seconds (on ``loop``); a
    status outside ``expected`` (empty: any) fails the probe."""
    started = loop.time()
    try:
        async with asyncio.timeout(timeout):
            dialed = await outbound.dial(loop, url.host, url.port)
            try:
                status, first_byte_at = await _status(loop, dialed, url)
            finally:
                with contextlib.suppress(OSError):
                    dialed.sock.close()
    except TimeoutError:
        return ProbeResult(None, f"no answer within {timeout:g} s", timed_out=True)
    except DialError as ex:
        return ProbeResult(None, ex.message)
    except ssl.SSLError as ex:
        return ProbeResult(None, f"TLS: {ex.reason or ex}")
    except ProtocolError as ex:
        return ProbeResult(None, str(ex))
    except OSError as ex:
        return ProbeResult(None, os.strerror(ex.errno) if ex.errno else str(ex))
    latency = round((first_byte_at - started) * 1000, 3)
    if expected and (status is None or not status_allowed(expected, status)):
        got = "an answer that is not HTTP" if status is None else f"status {status}"
        # A failed probe has no latency, whatever failed (as mihomo's delay 0).
        return ProbeResult(None, f"{got}, not an expected status", status)
    return ProbeResult(latency, None, status)


async def _status(
    loop: asyncio.AbstractEventLoop, dialed: Dialed, url: ProbeUrl
) -> tuple[int | None, float]:
    """Send the request and read the answer up to its status line: its status (None when
    the answer is not HTTP) and the loop time its first byte came."""
    channel = _Channel(loop, dialed)
    stream: _Channel | _Tls = channel
    if url.tls:
        tls = _Tls(channel, url.host)
        await tls.handshake()
        stream = tls
    await stream.send(url.head_request())
    return await _read_status(stream.recv, loop.time)


async def _read_status(
    recv: Callable[[], Awaitable[bytes]], clock: Callable[[], float]
) -> tuple[int | None, float]:
    head = b""
    first_byte_at = 0.0
    while b"\n" not in head and len(head) < STATUS_LINE_MAX:
        data = await recv()
        if not data:
            if not head:
                raise ProtocolError("connection closed before the first byte of the answer")
            break
        if not head:
            first_byte_at = clock()
        head += data
    match = _STATUS_LINE.match(head)
    return (int(match.group(1)) if match else None), first_byte_at
