"""``ControlPlane``: what the control API's transports call on a running engine.

The HTTP app, the IPC socket and the gRPC service are built on this and nothing
else: they answer queries and run commands through the engine's one query and
command tables, subscribe to its event log, and read the ``api`` section of its
configuration. The composition root (``spliceway.app.transports``) implements it
over the engine's core, so no module of ``spliceway.api`` imports the engine's
state or the ``Engine`` built on top of the transports (see the import-linter
contract in ``pyproject.toml``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from prometheus_client import CollectorRegistry

from spliceway.config import Api
from spliceway.events.log import EventLog

__all__ = ["ControlPlane"]


class ControlPlane(Protocol):
    """A running engine as its control transports see it."""

    @property
    def running(self) -> bool:
        """True between the engine's start and stop."""
        ...

    @property
    def api_settings(self) -> Api:
        """The running configuration's ``api`` section (keys, listeners, which
        transports are enabled)."""
        ...

    @property
    def log(self) -> EventLog:
        """The engine's event log: emit, subscribe, encode."""
        ...

    @property
    def state_dir(self) -> str:
        """Directory for the engine's small state files that are not configuration (the
        Clash API's ``/storage``): beside the fake-ip table when it persists, else beside
        the outbox, else the user's state directory."""
        ...

    def flow_records(self) -> list[dict[str, Any]]:
        """The latest record of every active flow (a subscription's ``flow.snapshot``)."""
        ...

    def run_query(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Answer the query ``name`` (``spliceway.control.queries``); ApiError on failure."""
        ...

    def execute(
        self,
        method: object,
        params: object,
        permissions: Iterable[str] = ...,
        *,
        transport: str | None = None,
    ) -> dict[str, Any]:
        """Run one command (``spliceway.control.commands``) as a caller holding
        ``permissions`` (all of them by default); ApiError on failure."""
        ...

    def connector_state(self) -> dict[str, Any]:
        """``spliceway connector state`` of this engine's open outbox (IPC only)."""
        ...

    def metrics_registry(self, sse_streams: Callable[[], int]) -> CollectorRegistry:
        """The Prometheus registry ``GET /metrics`` serves; ``sse_streams`` counts the
        HTTP app's open event streams."""
        ...
