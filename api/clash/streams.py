"""``/traffic``, ``/memory``, ``/logs`` and ``/connections``: WebSocket or chunked HTTP."""

from __future__ import annotations

from starlette.routing import BaseRoute

from spliceway.api.clash.context import ClashContext

__all__ = ["stream_routes"]


def stream_routes(ctx: ClashContext) -> list[BaseRoute]:
    """The streaming routes of the Clash API."""
    return []
