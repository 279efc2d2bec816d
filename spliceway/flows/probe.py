"""Latency probes through an outbound (url_test/fallback rounds, ``diagnostics.probe_outbound``).

One probe: dial the URL's host through the outbound (every hop, handshake and
cipher included), send ``HEAD``, wait for the first byte of the answer. The
elapsed time from the start of the dial is the latency. Any failure (dial
error, refusal, early close, timeout) is a result with an error text, never an
exception: a dead member is an ordinary outcome of a probe round.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass

from spliceway.flows.outbounds import Dialed, DialError, Outbound
from spliceway.protocols import ProtocolError, shadowsocks
from spliceway.routing.policy import PROBE_TIMEOUT_S, ProbeUrl


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """What one probe found: a latency, or an error text."""

    latency_ms: float | None
    error: str | None

    @property
    def reachable(self) -> bool:
        """True when the first byte of an answer arrived."""
        return self.error is None


async def probe(
    loop: asyncio.AbstractEventLoop,
    outbound: Outbound,
    url: ProbeUrl,
    timeout: float = PROBE_TIMEOUT_S,
) -> ProbeResult:
    """Probe ``url`` through ``outbound`` within ``timeout`` seconds (on ``loop``)."""
    started = loop.time()
    try:
        async with asyncio.timeout(timeout):
            dialed = await outbound.dial(loop, url.host, url.port)
            try:
                await _first_byte(loop, dialed, url)
            finally:
                with contextlib.suppress(OSError):
                    dialed.sock.close()
    except TimeoutError:
        return ProbeResult(None, f"no answer within {timeout:g} s")
    except DialError as ex:
        return ProbeResult(None, ex.message)
    except ProtocolError as ex:
        return ProbeResult(None, str(ex))
    except OSError as ex:
        return ProbeResult(None, os.strerror(ex.errno) if ex.errno else str(ex))
    return ProbeResult(round((loop.time() - started) * 1000, 3), None)


async def _first_byte(loop: asyncio.AbstractEventLoop, dialed: Dialed, url: ProbeUrl) -> None:
    if dialed.leftover:
        return  # the target spoke first, through the proxy's reply
    request = url.head_request()
    sealed = dialed.sealed
    if sealed is None:
        await loop.sock_sendall(dialed.sock, request)
        if not await loop.sock_recv(dialed.sock, 1):
            raise ProtocolError("connection closed before the first byte of the answer")
        return
    await loop.sock_sendall(dialed.sock, sealed.encryptor.seal(request))
    opener = shadowsocks.Decryptor(shadowsocks.CIPHERS[sealed.cipher], sealed.master_key)
    while True:
        data = await loop.sock_recv(dialed.sock, 65536)
        if not data:
            raise ProtocolError("connection closed before the first byte of the answer")
        if opener.feed(data):
            return
