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

    def _line(self) -> dict[str, Any]:
        raw = self._reader.readline()
        if not raw:
            raise ApiError("internal", "the engine closed the IPC connection")
        return orjson.loads(raw)

    def _request(self, frame: dict[str, Any]) -> Any:
        request_id = next(self._ids)
        self._sock.sendall(orjson.dumps({"id": request_id, **frame}) + b"\n")
        reply = self._line()
        if not reply.get("ok"):
            error = reply.get("error") or {}
            details = [
                Detail(d.get("message", ""), d.get("field_path"))
                for d in error.get("details") or ()
                if isinstance(d, dict)
            ]
            raise ApiError(
                error.get("code", "internal"),
                error.get("message", "no message"),
                field_path=error.get("field_path"),
                details=details or None,
                cause=error.get("cause"),
            )
        (result,) = reply["result"].values()
        return result

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
        while True:
            raw = self._reader.readline()
            if not raw:
                return
            yield orjson.loads(raw)
