"""The gRPC control API's lifecycle: ``spliceway.v1.Control`` beside the HTTP control API.

It listens on the HTTP control API's address and port + 1 (a configured port 0
gives both an ephemeral port) and shares the HTTP app's state: the same keys and
the same per-engine rate limits and event-stream slots, so a second transport
never doubles a budget. The service itself is ``spliceway.api.grpc_service``
(docs/grpc.md).

This module imports without the ``grpc`` extra, because the engine imports it
whatever its configuration; grpc is loaded only when a server is made.
``api.grpc.enabled`` without the extra is a start error (``feature_disabled``),
and so is it without ``api.control.enabled`` (``invalid_argument``): gRPC has no
listen address or keys of its own.

Stop order, as for the other transports: ``stop_accepting`` (the engine calls it
before stopping the core) closes the listener and refuses new calls while event
streams go on, so ``engine.stopped`` is their last event; ``stop`` then ends what
is left, cancels calls still running after a short grace (a client that stopped
reading) and joins the worker threads.
"""

from __future__ import annotations

import importlib
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from spliceway.api.app import ControlState
from spliceway.config import Api
from spliceway.control.capabilities import grpc_missing
from spliceway.errors import ApiError, invalid_argument

# Only for their names: both need the grpc extra, which this module must not.
if TYPE_CHECKING:
    import grpc

    from spliceway.api.grpc_service import ControlService

logger = logging.getLogger(__name__)

_SERVICE_MODULE = "spliceway.api.grpc_service"
#: Worker threads beyond the event-stream slots (each open stream holds one), so
#: open streams never starve queries and commands.
_SPARE_THREADS = 8
#: Grace of stop_accepting: long enough for any core stop; stop() shortens it.
_DRAIN_S = 60.0
#: Grace of stop(): the core has stopped, so streams have their last event queued.
_FINISH_S = 2.0
_JOIN_S = 10.0
_MAX_PORT = 65535


def grpc_port(control_port: int) -> int:
    """The gRPC port for an HTTP control port: the next one; 0 (any free port) stays 0."""
    return control_port + 1 if control_port else 0


def check_grpc(api: Api) -> None:
    """Refuse a start whose ``api.grpc.enabled`` cannot be served; nothing when disabled."""
    if not api.grpc.enabled:
        return
    if not api.control.enabled:
        raise invalid_argument(
            "api.grpc.enabled needs api.control.enabled: gRPC listens on the control "
            "API's address and port + 1 and takes its keys",
            "api.grpc.enabled",
        )
    if api.control.listen.port >= _MAX_PORT:
        raise invalid_argument(
            f"gRPC listens on the control API's port + 1, and {_MAX_PORT} has none",
            "api.control.listen.port",
        )
    missing = grpc_missing()
    if missing is not None:
        raise ApiError(
            "feature_disabled",
            f"api.grpc.enabled needs the grpc extra (pip install 'spliceway[grpc]'): {missing}",
            field_path="api.grpc.enabled",
        )


class GrpcServer:
    """The gRPC control API of one running engine."""

    def __init__(self, state: ControlState, address: str, control_port: int) -> None:
        """Bind (``conflict`` when the port is taken); serving starts with :meth:`start`."""
        service_module = importlib.import_module(_SERVICE_MODULE)
        self._service: ControlService = service_module.ControlService(state)
        workers = state.limits.sse_streams + _SPARE_THREADS
        server, executor, port = service_module.build_server(
            self._service, address, grpc_port(control_port), workers
        )
        self._server: grpc.Server = server
        self._executor: ThreadPoolExecutor = executor
        #: ``(address, port)`` actually bound.
        self.address: tuple[str, int] = (address, port)
        self._accepting = True

    @property
    def target(self) -> str:
        """``host:port`` as a gRPC client dials it."""
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def start(self) -> None:
        """Start serving."""
        self._server.start()
        logger.info("gRPC control API listening on %s", self.target)

    def stop_accepting(self) -> None:
        """Close the listener and refuse new calls; running ones (event streams) go on.
        Idempotent."""
        if not self._accepting:
            return
        self._accepting = False
        # grpc's stop: shutdown starts now, calls still running when the grace ends are
        # cancelled. Non-blocking; stop() calls it again with a short grace.
        self._server.stop(_DRAIN_S)

    def stop(self) -> None:
        """End every event stream, cancel calls still running after a short grace, join."""
        self.stop_accepting()
        # After the engine's stop, every stream has engine.stopped queued already; after a
        # failed start, this is what ends them.
        self._service.close_streams()
        done = self._server.stop(_FINISH_S)
        if not done.wait(_FINISH_S + _JOIN_S):
            logger.warning("gRPC server did not stop within %.0f s", _FINISH_S + _JOIN_S)
        self._executor.shutdown(wait=True)
