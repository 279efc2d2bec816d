"""The Clash API's plain HTTP routes (mihomo's ``hub/route``), over the command table."""

from __future__ import annotations

from starlette.routing import BaseRoute

from spliceway.api.clash.context import ClashContext

__all__ = ["http_routes"]


def http_routes(ctx: ClashContext) -> list[BaseRoute]:
    """Every plain HTTP route of the Clash API."""
    return []
