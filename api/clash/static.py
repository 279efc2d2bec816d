"""``external_ui``: a dashboard's built files at ``/ui/`` on the Clash listener.

As mihomo does: ``/ui`` redirects (307) to ``/ui/`` (keeping the query string, where
Yacd reads ``?hostname=&port=&secret=``), ``/ui/`` serves the directory's
``index.html`` and ``/ui/<path>`` its files, without the secret (the files hold no data;
the page asks for the secret itself). Starlette's ``StaticFiles`` serves them: it
resolves every path, symbolic links included, and refuses one outside the directory
(404), ``..`` and its encodings among them.

A start whose ``external_ui`` is missing, not a directory or unreadable is refused by
:func:`check_external_ui` (``invalid_argument`` on ``api.clash.external_ui``).
"""

from __future__ import annotations

import os

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from spliceway.api.clash.context import ClashContext
from spliceway.config import ClashApi
from spliceway.errors import ApiError

__all__ = ["UI_PATH", "check_external_ui", "ui_routes"]

UI_PATH = "/ui"
_FIELD = "api.clash.external_ui"


def check_external_ui(settings: ClashApi) -> None:
    """Refuse (ApiError ``invalid_argument``) an enabled Clash API whose ``external_ui``
    is not a readable directory; nothing to check when it is unset or the API is off."""
    path = settings.external_ui
    if not settings.enabled or path is None:
        return
    shown = os.path.abspath(path)
    if not os.path.exists(path):
        problem = "does not exist"
    elif not os.path.isdir(path):
        problem = "is not a directory"
    elif not os.access(path, os.R_OK | os.X_OK):
        problem = "cannot be read by this process"
    else:
        return
    raise ApiError(
        "invalid_argument",
        f"external_ui {shown} {problem}; give the directory of a dashboard's built files "
        "(the one holding its index.html), or null",
        field_path=_FIELD,
    )


async def _to_ui(request: Request) -> Response:
    query = request.url.query
    return RedirectResponse(f"{UI_PATH}/?{query}" if query else f"{UI_PATH}/", status_code=307)


def ui_routes(ctx: ClashContext) -> list[BaseRoute]:
    """``/ui`` and ``/ui/...`` when ``external_ui`` is set, else nothing (ApiError
    ``invalid_argument`` when the directory is not usable; see :func:`check_external_ui`)."""
    settings = ctx.settings
    if settings.external_ui is None:
        return []
    check_external_ui(settings)
    files = StaticFiles(directory=os.path.abspath(settings.external_ui), html=True)
    return [
        Route(UI_PATH, _to_ui, methods=["GET", "HEAD"]),
        Mount(UI_PATH, app=files),
    ]
