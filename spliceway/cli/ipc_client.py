"""A client of a running engine's IPC control socket (docs/ipc.md), as the CLI uses it."""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator
from typing import Any

import orjson

from spliceway.config import default_ipc_path
from spliceway.errors import ApiError, Detail

#: The environment variable that overrides the default socket path.
IPC_ENV = "SPLICEWAY_IPC"


def socket_path(given: str | None) -> str:
    """``--ipc``, else ``$SPLICEWAY_IPC``, else the engine's default path."""
    return given or os.environ.get(IPC_ENV) or default_ipc_path()


class IpcClient:
    """One connection; requests are answered in order, so each call waits for its reply."""

    def __init__(self, path: str, timeout: float | None = 30.0) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        try:
            self._sock.connect(path)
        except OSError as ex:
            self._sock.close()
            raise ApiError(
                "not_found",
                f"no engine is listening on {path} ({ex.strerror or ex}); "
                f"start one, or give its socket with --ipc or {IPC_ENV}",
            ) from ex
        self._reader = self._sock.makefile("rb")
        self._ids = itertools.count(1)

    def close(self) -> None:
        """Close the connection."""
        self._reader.close()
        self._sock.close()

    def __enter__(self) -> IpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _broken(self, what: str, ex: BaseException) -> ApiError:
        """A transport failure as the CLI reports it: ``internal`` (interface.md 7 has no
        code of its own for it), naming the socket and what went wrong."""
        if isinstance(ex, TimeoutError):
            reason = "no reply in time"
        elif isinstance(ex, OSError):
            reason = ex.strerror or type(ex).__name__
        else:
            reason = str(ex) or type(ex).__name__
        return ApiError("internal", f"IPC connection to {self.path}: {what}: {reason}")

    def _line(self) -> dict[str, Any] | None:
        """The next frame; None at the end of the connection."""
        try:
            raw = self._reader.readline()
        except OSError as ex:
            raise self._broken("reading a reply failed", ex) from ex
        except ValueError as ex:  # the file object was closed under us
            raise self._broken("reading a reply failed", ex) from ex
        if not raw:
            return None
        if not raw.endswith(b"\n"):
            raise self._broken("the reply was cut off", EOFError("the engine closed mid-frame"))
        try:
            frame = orjson.loads(raw)
        except orjson.JSONDecodeError as ex:
            raise self._broken("the reply is not JSON", ex) from ex
        if not isinstance(frame, dict):
            raise self._broken("the reply is not a JSON object", TypeError(type(frame).__name__))
        return frame

    def _request(self, frame: dict[str, Any]) -> Any:
        request_id = next(self._ids)
        try:
            self._sock.sendall(orjson.dumps({"id": request_id, **frame}) + b"\n")
        except OSError as ex:
            raise self._broken("sending the request failed", ex) from ex
        reply = self._line()
        if reply is None:
            raise ApiError("internal", "the engine closed the IPC connection")
        if reply.get("ok") is not True:
            error = reply.get("error")
            if not isinstance(error, dict):
                raise self._broken("the reply is not an envelope", ValueError(str(reply)[:200]))
            details = [
                Detail(str(d.get("message", "")), d.get("field_path"))
                for d in error.get("details") or ()
                if isinstance(d, dict)
            ]
            raise ApiError(
                str(error.get("code", "internal")),
                str(error.get("message", "no message")),
                field_path=error.get("field_path"),
                details=details or None,
                cause=error.get("cause"),
            )
        result = reply.get("result")
        if not (isinstance(result, dict) and len(result) == 1):
            raise self._broken("the reply is not an envelope", ValueError(str(reply)[:200]))
        (value,) = result.values()
        return value

    def query(self, name: str, params: dict[str, Any] | None = None) -> Any:
        """The result of query ``name``."""
        return self._request({name: params or {}})

    def command(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """The result of command ``method``."""
        return self._request({"command": {"method": method, "params": params or {}}})

    def subscribe(self, events: list[str] | None = None) -> Iterator[dict[str, Any]]:
        """Every envelope after the subscription (flow.snapshot first), until the
        engine ends the connection."""
        self._request({"type": "subscribe", "events": events or []})
        self._sock.settimeout(None)
        while (envelope := self._line()) is not None:
            yield envelope
