"""The control transports' side of the composition root: HTTP, IPC and gRPC over one engine.

mopidy's ``commands.py`` starts its frontends with a proxy of the core; this module
does the same for spliceway. :class:`CorePlane` is the engine's core as the
transports see it (a :class:`~spliceway.api.plane.ControlPlane`), and
:class:`Transports` builds, starts and stops the servers over it in the order the
engine's lifecycle needs. ``Engine`` (``spliceway.app.engine``) calls this and is
the only caller, so neither the core nor the transports import each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry

from spliceway.api.app import create_app
from spliceway.api.auth import KeyTable
from spliceway.api.clash.app import create_clash_app
from spliceway.api.clash.context import ClashContext
from spliceway.api.clash.server import ClashServer
from spliceway.api.clash.static import check_external_ui
from spliceway.api.grpc_server import GrpcServer, check_grpc
from spliceway.api.ipc import IpcServer
from spliceway.api.metrics import metrics_registry
from spliceway.api.plane import ControlPlane
from spliceway.api.server import ControlServer
from spliceway.config import Api
from spliceway.connector import inspect
from spliceway.control import commands, queries
from spliceway.engine.core import EngineCore
from spliceway.errors import not_found
from spliceway.events.log import EventLog

__all__ = ["CorePlane", "Transports"]


class CorePlane:
    """The :class:`~spliceway.api.plane.ControlPlane` of an engine's core: every read
    goes to the core at call time, so a reload's new configuration is what it sees."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    @property
    def running(self) -> bool:
        """True between the core's start and stop."""
        return self._core.running

    @property
    def api_settings(self) -> Api:
        """The running configuration's ``api`` section."""
        return self._core.config.api

    @property
    def log(self) -> EventLog:
        """The core's event log."""
        return self._core.log

    @property
    def state_dir(self) -> str:
        """Beside ``runtime.dns.answer.persist_path``, else ``api.outbox_path``, else
        ``$XDG_STATE_HOME/spliceway`` (``~/.local/state/spliceway``)."""
        config = self._core.config
        persist = getattr(config.runtime.dns.answer, "persist_path", None)
        if persist:
            return os.path.dirname(os.path.abspath(persist))
        if config.api.outbox_path:
            return os.path.abspath(config.api.outbox_path)
        base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        return os.path.join(base, "spliceway")

    def flow_records(self) -> list[dict[str, Any]]:
        """The latest record of every active flow."""
        return self._core.flows.records()

    def run_query(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Answer one named query from the engine's query table."""
        return queries.run_query(self._core, name, params)

    def execute(
        self,
        method: object,
        params: object,
        permissions: Iterable[str] = commands.PERMISSIONS,
        *,
        transport: str | None = None,
    ) -> dict[str, Any]:
        """Run one command through the engine's command table."""
        return commands.execute(self._core, method, params, permissions, transport=transport)

    def connector_state(self) -> dict[str, Any]:
        """The open outbox's state (``spliceway connector state``)."""
        return inspect.live_state(self._core)

    def metrics_registry(self, sse_streams: Callable[[], int]) -> CollectorRegistry:
        """The registry ``GET /metrics`` serves."""
        return metrics_registry(self._core, sse_streams)


class Transports:
    """The HTTP, IPC and gRPC control servers of one engine, as its configuration's
    ``api`` section enables them.

    :meth:`prepare` runs before the core starts (what can refuse a start without
    binding anything), :meth:`start` after it; :meth:`stop_accepting` before the core
    stops (open event streams go on, so ``engine.stopped`` is their last event) and
    :meth:`stop` after it.
    """

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self._api: Api | None = None
        self._keys: KeyTable | None = None
        self._control: ControlServer | None = None
        self._ipc: IpcServer | None = None
        self._grpc: GrpcServer | None = None
        self._clash_ctx: ClashContext | None = None
        self._clash: ClashServer | None = None

    def prepare(self) -> None:
        """Refuse, with ApiError, a start the transports cannot serve: an unset
        ``api_key_env`` variable, gRPC without its extra or without the control API."""
        api = self._plane.api_settings
        self._keys = KeyTable.from_config(api.control) if api.control.enabled else None
        check_grpc(api)
        clash = api.clash
        check_external_ui(clash)
        self._clash_ctx = (
            ClashContext(
                self._plane,
                clash,
                clash.read_secret(),
                storage_dir=os.path.join(self._plane.state_dir, "clash-storage"),
            )
            if clash.enabled
            else None
        )
        self._api = api

    def start(self) -> None:
        """Bind and start every enabled transport (after :meth:`prepare`, with the core
        running). On failure (a port in use) none is left running, and it raises."""
        api = self._api
        if api is None:
            raise RuntimeError("Transports.start before prepare")
        control = api.control
        ipc = api.ipc
        try:
            if ipc.enabled:
                path = ipc.resolved_path()
                self._ipc = IpcServer(self._plane, path, private_dir=ipc.path is None)
                self._ipc.start()
            if self._keys is not None:
                app = create_app(self._plane, keys=self._keys)
                self._control = ControlServer(app, control.listen.address, control.listen.port)
                self._control.start()
                if api.grpc.enabled:
                    # Shares the app's state: its keys, rate limits and stream slots.
                    self._grpc = GrpcServer(app.state, control.listen.address, control.listen.port)
                    self._grpc.start()
            if self._clash_ctx is not None:
                ctx = self._clash_ctx
                listen = api.clash.listen
                self._clash = ClashServer(create_clash_app(ctx), listen.address, listen.port)
                ctx.listen = self._clash.bind()
                self._clash.start()
        except BaseException:
            # The ones started before something after them failed (gRPC's port taken).
            self.stop()
            raise

    def stop_accepting(self) -> None:
        """No new connections or calls; the open ones (event streams among them) go on."""
        if self._control is not None:
            self._control.stop_accepting()
        if self._ipc is not None:
            self._ipc.stop_accepting()
        if self._grpc is not None:
            self._grpc.stop_accepting()

    def stop(self) -> None:
        """End what is left and join the servers' threads (idempotent)."""
        if self._clash is not None:
            self._clash.stop()
            self._clash = None
        if self._grpc is not None:
            self._grpc.stop()
            self._grpc = None
        if self._control is not None:
            self._control.stop()
            self._control = None
        if self._ipc is not None:
            self._ipc.stop()
            self._ipc = None

    @property
    def ipc(self) -> IpcServer | None:
        """The IPC control socket's server while it runs."""
        return self._ipc

    @property
    def grpc(self) -> GrpcServer | None:
        """The gRPC control API's server while it runs."""
        return self._grpc

    @property
    def clash_url(self) -> str:
        """Base URL (``http://host:port``) of the running Clash API."""
        if self._clash is None:
            raise not_found("the Clash API is not running")
        return self._clash.base_url

    @property
    def control_url(self) -> str:
        """Base URL (``http://host:port``) of the running HTTP control API."""
        if self._control is None:
            raise not_found("the HTTP control API is not running")
        return self._control.base_url
