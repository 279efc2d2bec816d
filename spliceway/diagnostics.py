"""``diagnostics.probe_target`` (interface.md 4.2 rule 9): can the engine reach a server?

One direct TCP connection attempt from the engine host to the outbound's
``server:port``, no proxy protocol, no TLS, within 2 s for resolution and
connection together. It is the outbounds' own ``open_tcp`` (engine resolver,
each address in turn, one deadline), run on the dispatcher loop. An unreachable
server is a result (``reachable: false`` with ``error``), never an error; only
an unknown tag is.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any

from spliceway.dns import Resolver
from spliceway.errors import not_found
from spliceway.outbounds import DialError, open_tcp

PROBE_TARGET_TIMEOUT_S = 2.0
NO_FIXED_SERVER = "outbound has no probeable fixed server"


def probe_target(
    outbounds: dict[str, Any],
    resolver: Resolver,
    loop: asyncio.AbstractEventLoop,
    target_tag: str,
    timeout: float = PROBE_TARGET_TIMEOUT_S,
) -> dict[str, Any]:
    """The ``diagnostics.probe_target`` result for ``target_tag``; blocks up to ``timeout``.

    Called from a thread other than ``loop``'s.
    """
    outbound = outbounds.get(target_tag)
    if outbound is None:
        raise not_found(f"outbound {target_tag!r} does not exist")
    server: str | None = getattr(outbound, "server", None)
    port: int | None = getattr(outbound, "port", None)
    result: dict[str, Any] = {
        "target_tag": target_tag,
        "server": server,
        "port": port,
        "reachable": False,
        "latency_ms": None,
    }
    if server is None or port is None:
        result["error"] = NO_FIXED_SERVER
        return result

    async def connect() -> None:
        sock, _ = await open_tcp(loop, server, port, loop.time() + timeout, resolver)
        sock.close()

    started = time.monotonic()
    try:
        # open_tcp enforces the deadline; the margin only covers getting onto the loop.
        asyncio.run_coroutine_threadsafe(connect(), loop).result(timeout + 1.0)
    except DialError as ex:
        result["error"] = ex.message
        return result
    except concurrent.futures.TimeoutError:
        result["error"] = f"connect to {server}:{port} timed out"
        return result
    result["reachable"] = True
    result["latency_ms"] = round((time.monotonic() - started) * 1000, 3)
    return result
