"""The Clash API's Starlette app: routes, streams and the dashboard under one guard."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.types import ASGIApp

from spliceway.api.clash import guard, routes, static, storage, streams
from spliceway.api.clash.context import ClashContext

__all__ = ["create_clash_app"]


def create_clash_app(ctx: ClashContext) -> ASGIApp:
    """The ASGI app of one Clash listener over ``ctx``.

    The guard wraps everything, so CORS preflights are answered before the secret is
    asked for (as mihomo does) and every answer, errors included, is mihomo's
    ``{"message"}`` shape.
    """
    app = Starlette(
        routes=[
            *static.ui_routes(ctx),
            *streams.stream_routes(ctx),
            *storage.storage_routes(ctx),
            *routes.http_routes(ctx),
        ],
        exception_handlers=guard.exception_handlers(),
    )
    return guard.wrap(app, ctx)
