"""``/storage/{key}``: small JSON documents dashboards keep on the engine (zashboard's
settings sync), on disk beside the fake-ip state."""

from __future__ import annotations

from starlette.routing import BaseRoute

from spliceway.api.clash.context import ClashContext

__all__ = ["storage_routes"]


def storage_routes(ctx: ClashContext) -> list[BaseRoute]:
    """``GET``, ``PUT`` and ``DELETE /storage/{key}``."""
    return []
