"""``diagnostics.probe_target`` (interface.md 4.2 rule 9): can the engine reach a server?

One direct TCP connection attempt from the engine host to the outbound's
``server:port`` (resolved through the engine resolver), no proxy protocol, no
TLS, within 2 s for resolution and connection together. An unreachable server
is a result (``reachable: false`` with ``error``), never an error; only an
unknown tag is.
"""

from __future__ import annotations

import errno
import os
import socket
import time
from typing import Any

from spliceway.dns import ResolveError, Resolver
from spliceway.errors import not_found

PROBE_TARGET_TIMEOUT_S = 2.0
NO_FIXED_SERVER = "outbound has no probeable fixed server"


def probe_target(
    outbounds: dict[str, Any],
    resolver: Resolver,
    target_tag: str,
    timeout: float = PROBE_TARGET_TIMEOUT_S,
) -> dict[str, Any]:
    """The ``diagnostics.probe_target`` result for ``target_tag``; blocks up to ``timeout``."""
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
    started = time.monotonic()
    deadline = started + timeout
    try:
        addresses = resolver.lookup(server, timeout=timeout)
    except ResolveError as ex:
        result["error"] = f"cannot resolve {server}: {ex}"
        return result
    if not addresses:
        result["error"] = f"{server} has no addresses"
        return result
    error = "no address answered"
    for address in addresses:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            error = f"timed out after {int(timeout * 1000)} ms"
            break
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(remaining)
            try:
                sock.connect((address, port))
            except TimeoutError:
                error = f"timed out after {int(timeout * 1000)} ms"
                continue
            except OSError as ex:
                code = ex.errno or errno.EIO
                error = f"{address}:{port}: {os.strerror(code)}"
                continue
        result["reachable"] = True
        result["latency_ms"] = round((time.monotonic() - started) * 1000, 3)
        return result
    result["error"] = error
    return result
