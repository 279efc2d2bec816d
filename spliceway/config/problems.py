"""How a list of problems becomes the ``invalid_argument`` error every entry point raises."""

from __future__ import annotations

from spliceway.errors import ApiError, Detail


def invalid(details: list[Detail], message: str = "configuration is invalid") -> ApiError:
    """``invalid_argument`` with ``message``, every problem in ``details`` and the first as
    the ``cause`` (how many, where, what)."""
    first = details[0]
    where = f"{first.field_path}: " if first.field_path else ""
    count = f"{len(details)} problem{'s' if len(details) != 1 else ''}"
    return ApiError(
        "invalid_argument", message, cause=f"{count}: {where}{first.message}", details=details
    )
