"""The one error type of the engine and the one table mapping its codes to HTTP statuses.

Every transport (HTTP, IPC, gRPC, CLI, embedding) renders an ``ApiError`` the same
way: ``{"code", "message", "field_path"?, "cause"?, "details"?}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Stable error codes and the HTTP status each maps to (docs/http-api.md, "Errors").
HTTP_STATUS: dict[str, int] = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "insufficient_os_privilege": 403,
    "not_found": 404,
    "conflict": 409,
    "rate_limited": 429,
    "internal": 500,
    "feature_disabled": 501,
    "unsupported": 501,
}


#: The code for an HTTP status that arrives without one (an HTTP framework's own
#: routing errors, and the statuses the HTTP transport itself answers): the table
#: read backwards, leaving out the codes that only the engine itself can mean, plus
#: the three statuses the table has no code for. 415 is the control API's answer to
#: a command body that is not declared ``application/json``.
_CODE_FOR_STATUS: dict[int, str] = {
    **{
        status: code
        for code, status in HTTP_STATUS.items()
        if code not in ("insufficient_os_privilege", "feature_disabled", "unsupported")
    },
    405: "unsupported",
    413: "invalid_argument",
    415: "invalid_argument",
}


def code_for_http_status(status: int) -> str:
    """The error code for an HTTP status (``internal`` for any status not in the table)."""
    return _CODE_FOR_STATUS.get(status, "internal")


@dataclass(frozen=True, slots=True)
class Detail:
    """One problem inside a validation failure."""

    message: str
    field_path: str | None = None

    def to_dict(self) -> dict[str, str]:
        """Render as the ``details[]`` item of the envelope."""
        out = {"message": self.message}
        if self.field_path is not None:
            out["field_path"] = self.field_path
        return out


class ApiError(Exception):
    """An error with a stable machine-readable code, raised by every engine surface."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        field_path: str | None = None,
        details: list[Detail] | None = None,
        cause: str | None = None,
        http_status: int | None = None,
    ) -> None:
        if code not in HTTP_STATUS:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.field_path = field_path
        self.details = details
        self.cause = cause
        # Only the HTTP transport itself overrides the table: a wrong method is
        # ``unsupported`` with 405, not 501; a command body of the wrong media type
        # is ``invalid_argument`` with 415, not 400 (see ``code_for_http_status``).
        self._http_status = http_status

    @property
    def http_status(self) -> int:
        """The HTTP status for this error (its code's status unless overridden)."""
        return self._http_status or HTTP_STATUS[self.code]

    def to_dict(self) -> dict[str, Any]:
        """Render as the envelope's ``error`` object."""
        out: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.field_path is not None:
            out["field_path"] = self.field_path
        if self.cause is not None:
            out["cause"] = self.cause
        if self.details is not None:
            out["details"] = [d.to_dict() for d in self.details]
        return out

    def __repr__(self) -> str:
        return f"ApiError({self.code!r}, {self.message!r})"


def invalid_argument(message: str, field_path: str | None = None) -> ApiError:
    """Shorthand for the most common error."""
    return ApiError("invalid_argument", message, field_path=field_path)


def not_found(message: str) -> ApiError:
    """Shorthand for a missing resource."""
    return ApiError("not_found", message)
