"""Diagnostics that dial (docs/commands.md): probe_target, probe_outbound.

``probe_target`` asks whether the engine can reach an outbound's server: one
direct TCP connection attempt from the engine host to the outbound's
``server:port``, no proxy protocol, no TLS, within 2 s for resolution and
connection together. It is the outbounds' own ``open_tcp`` (engine resolver,
each address in turn, one deadline), run on the dispatcher loop. An unreachable
server is a result (``reachable: false`` with ``error``), never an error; only
an unknown tag is. Groups and relays have no fixed server.

``probe_outbound`` is one latency probe *through* an outbound or group (its
current choice): HEAD for an ``http://`` or ``https://`` URL (TLS verified against
the system store), latency to the first byte of the answer, its status read and
checked against ``expected_status`` (mihomo's range syntax), within ``timeout_ms``
(5 s by default). Its result is recorded as the target's latest health
(``PolicyTable.record_probe``), so ``member_health`` and a Clash dashboard's next
``GET /proxies`` show it with its time. The URL, first that applies:
1. ``runtime.latency_test_url`` when configured (it always wins);
2. the command's ``url``;
3. when ``target_tag`` is a url_test, fallback or load_balance group, the
   ``url`` that group configures for its own probes;
4. the built-in default (``policy.DEFAULT_PROBE_URL``).
The result's ``url`` is the URL actually probed. A ``url`` given while
``latency_test_url`` wins is still checked, so a malformed request is reported
rather than silently ignored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import TYPE_CHECKING, Any

from spliceway.errors import invalid_argument, not_found
from spliceway.events.log import now_ms
from spliceway.flows.outbounds import DialError, open_tcp
from spliceway.flows.probe import probe
from spliceway.routing import policy

if TYPE_CHECKING:
    from spliceway.engine.core import EngineCore

PROBE_TARGET_TIMEOUT_S = 2.0
NO_FIXED_SERVER = "outbound has no probeable fixed server"


def _known(core: EngineCore, target_tag: str) -> None:
    if target_tag not in core.outbounds and target_tag not in core.policies:
        raise not_found(f"outbound or group {target_tag!r} does not exist")


def probe_target(
    core: EngineCore, target_tag: str, timeout: float = PROBE_TARGET_TIMEOUT_S
) -> dict[str, Any]:
    """The ``diagnostics.probe_target`` result for ``target_tag``; blocks up to ``timeout``.

    Called from a thread other than the dispatcher's.
    """
    _known(core, target_tag)
    outbound = core.outbounds.get(target_tag)
    server: str | None = getattr(outbound, "server", None)
    port: int | None = getattr(outbound, "port", None)
    loop, resolver = core.dispatcher.loop, core.resolver
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


def _group_probe_url(core: EngineCore, target_tag: str) -> str | None:
    """The ``url`` probing group ``target_tag`` configures, or None (not a probing group,
    or one without a url of its own)."""
    group = core.config.find_group(target_tag)
    if group is None or group.kind not in policy.PROBING_KINDS:
        return None
    own: str | None = getattr(group, "url", None)
    return own


def probe_outbound(
    core: EngineCore,
    target_tag: str,
    url: str | None,
    *,
    timeout_ms: int = int(policy.PROBE_TIMEOUT_S * 1000),
    expected_status: str | None = None,
) -> dict[str, Any]:
    """The ``diagnostics.probe_outbound`` result; blocks up to ``timeout_ms``."""
    _known(core, target_tag)
    if url is not None:
        try:
            policy.parse_probe_url(url)
        except ValueError as ex:
            raise invalid_argument(f"url: {ex}", "params.url") from ex
    try:
        expected = policy.parse_expected_status(expected_status)
    except ValueError as ex:
        raise invalid_argument(f"expected_status: {ex}", "params.expected_status") from ex
    chosen = (
        core.config.runtime.latency_test_url
        or url
        or _group_probe_url(core, target_tag)
        or policy.DEFAULT_PROBE_URL
    )
    parsed = policy.parse_probe_url(chosen)
    loop = core.dispatcher.loop
    outbound = core.leaf_outbound(target_tag)
    timeout = timeout_ms / 1000
    result = asyncio.run_coroutine_threadsafe(
        probe(loop, outbound, parsed, timeout, expected), loop
    ).result(timeout + 1.0)
    core.policies.record_probe(
        target_tag,
        policy.MemberHealth(result.reachable, result.latency_ms, now_ms(), result.error),
    )
    answer: dict[str, Any] = {
        "target_tag": target_tag,
        "url": chosen,
        "via": "through_proxy",
        "reachable": result.reachable,
        "latency_ms": result.latency_ms,
        "status": result.status,
        "timed_out": result.timed_out,
    }
    if result.error is not None:
        answer["error"] = result.error
    return answer
