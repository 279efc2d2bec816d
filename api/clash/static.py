"""``external_ui``: a dashboard's built files at ``/ui/`` on the Clash listener."""

from __future__ import annotations

from starlette.routing import BaseRoute

from spliceway.api.clash.context import ClashContext

__all__ = ["ui_routes"]


def ui_routes(ctx: ClashContext) -> list[BaseRoute]:
    """``/ui`` and ``/ui/...`` when ``external_ui`` is set, else nothing."""
    return []
