"""The OpenAPI 3.1 document of the control API (served at /api/v1/openapi.json)."""

from __future__ import annotations

from typing import Any


def openapi_document() -> dict[str, Any]:
    """The document (work in progress: paths only)."""
    return {
        "openapi": "3.1.0",
        "info": {"title": "spliceway control API", "version": "1"},
        "paths": {},
    }
