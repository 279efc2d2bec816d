"""The dashboard's static files (``GET /ui/``), served from the package.

The files carry no secrets, so they need no key (decisions: the page asks the user
for the API key and calls the API with it); a keyless API still refuses foreign
Hosts and origins for them as for everything else (the gate). They are read once,
when the app is built, and only names in the package's ``ui`` directory exist.
"""

from __future__ import annotations

from importlib import resources

import falcon

from spliceway.errors import not_found

UI_PATH = "/ui"
#: Content types by suffix; a file with any other suffix is not served.
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
#: The page loads only its own files and talks only to this API.
_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _load() -> dict[str, tuple[bytes, str]]:
    files: dict[str, tuple[bytes, str]] = {}
    root = resources.files("spliceway.api") / "ui"
    if not root.is_dir():
        return files
    for item in root.iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1] if "." in item.name else ""
        if item.is_file() and suffix in _TYPES and not item.name.startswith("."):
            files[item.name] = (item.read_bytes(), _TYPES[suffix])
    return files


def is_ui_path(path: str) -> bool:
    """Whether a request path is one of the dashboard's (no key needed)."""
    return path == UI_PATH or path.startswith(UI_PATH + "/")


class UiFiles:
    """``GET /ui/`` (the page) and ``GET /ui/{name}`` (its scripts and styles)."""

    def __init__(self) -> None:
        self._files = _load()

    def on_get(self, req: falcon.Request, resp: falcon.Response, name: str = "") -> None:
        raw_path = req.env.get("PATH_INFO", req.path)
        if not name and not raw_path.endswith("/"):
            # The page's relative links resolve against /ui/, not /.
            resp.status = falcon.HTTP_301
            resp.location = UI_PATH + "/"
            return
        found = self._files.get(name or "index.html")
        if found is None:
            raise not_found(f"no dashboard file {name!r}")
        body, content_type = found
        resp.content_type = content_type
        resp.data = body
        resp.set_header("Cache-Control", "no-cache")
        resp.set_header("X-Content-Type-Options", "nosniff")
        resp.set_header("Content-Security-Policy", _CSP)
        resp.set_header("Referrer-Policy", "no-referrer")
