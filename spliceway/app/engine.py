"""``Engine``: the engine as a library inside a threaded host application.

```python
from spliceway import Engine
with Engine.from_file("config.json") as engine:
    engine.execute("mode.set", {"mode": "direct"})
    stats = engine.query("stats")
    for event in engine.subscribe(["flow.completed"], timeout=5):
        ...
```

Thread-safe; needs no event loop from the host; starts its threads in
``start()``/``__enter__`` and joins them in ``stop()``/``__exit__``. Every
failure is a ``spliceway.ApiError`` with the same code, message, field_path
and details the HTTP envelope carries.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import Any

from spliceway.api.plane import ControlPlane
from spliceway.app.compose import build_core
from spliceway.app.transports import CorePlane, Transports
from spliceway.config import (
    Config,
    default_config,
    load_config_file,
    parse_config,
    resolve_ipc,
)
from spliceway.engine.core import EngineCore
from spliceway.errors import ApiError, not_found
from spliceway.events.log import Subscription
from spliceway.support.fdlimit import raise_nofile_limit


class Engine:
    """A running (or startable) spliceway engine."""

    def __init__(
        self,
        config: dict[str, Any] | Config | None = None,
        *,
        config_path: str | None = None,
        ipc_by_default: bool = False,
        on_runtime_changed: Callable[[Any], None] | None = None,
    ) -> None:
        """Validate ``config`` (a document, a parsed Config, or None for the embedded default).

        ``ipc_by_default`` is what an unset ``api.ipc.enabled`` with no ``path`` means:
        a host application's engine leaves the per-user default socket alone unless its
        configuration asks (docs/ipc.md); ``spliceway run`` passes ``True``.
        ``on_runtime_changed`` is called with the new ``runtime`` section after a reload
        that changed it (``spliceway run`` re-applies its logging settings).
        """
        parsed = default_config() if config is None else parse_config(config)
        parsed = resolve_ipc(parsed, ipc_by_default)
        self._core = build_core(parsed, config_path, on_runtime_changed=on_runtime_changed)
        self._plane = CorePlane(self._core)
        self._transports = Transports(self._plane)
        self._lock = threading.Lock()
        self._started = False

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Engine:
        """An engine for the configuration file at ``path``."""
        return cls(load_config_file(path), config_path=os.path.abspath(path))

    @property
    def core(self) -> EngineCore:
        """The engine's internals (the CLI's startup log lines, tests)."""
        return self._core

    @property
    def control_plane(self) -> ControlPlane:
        """What a control transport is built on (``spliceway.api.app.create_app``, the
        IPC and gRPC servers): queries, commands, the event log, the ``api`` settings."""
        return self._plane

    @property
    def running(self) -> bool:
        """True between a successful start() and stop()."""
        return self._core.running

    def start(self) -> Engine:
        """Bind the inbounds, start every actor and, when enabled, the HTTP control API
        (and the gRPC API beside it).

        Raises ApiError on failure (an unset ``api_key_env`` variable, a port in
        use); nothing is left running then.
        """
        with self._lock:
            if self._started:
                raise ApiError("conflict", "engine already started")
            # Before anything starts: an unset key variable, gRPC without its extra or
            # without the control API.
            self._transports.prepare()
            # Every flow holds two descriptors: a shell's soft limit of 1,024 would run
            # out near 500 (docs/running.md). The engine never select()s.
            raise_nofile_limit()
            self._core.start()
            try:
                self._transports.start()
            except BaseException:
                self._core.stop()
                raise
            self._started = True
        return self

    def stop(self, reason: str | None = None) -> None:
        """Stop accepting, complete every flow, emit engine.stopped, end every event
        stream after that event, stop the control API, join all threads."""
        with self._lock:
            # No new control connections; the open ones (SSE streams among them) go on
            # while the core stops, so engine.stopped is the streams' last frame, and
            # the control API stops once they have ended.
            self._transports.stop_accepting()
            try:
                self._core.stop(reason)
            finally:
                self._transports.stop()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def listen_address(self, tag: str | None = None) -> tuple[str, int]:
        """The (address, port) an inbound actually bound (the first one by default)."""
        for active in self._core.active_inbounds:
            if tag is None or active.spec.tag == tag:
                return active.bound
        raise not_found(f"no inbound {tag!r}")

    def dns_address(self) -> tuple[str, int]:
        """The (address, port) the DNS server (``runtime.dns.listen``) bound, UDP and TCP
        alike; ``not_found`` when it is not running."""
        server = self._core.dns.server
        if server is None:
            raise not_found("the DNS server is not running (runtime.dns.listen is null)")
        return server.bound

    @property
    def clash_url(self) -> str:
        """Base URL (``http://host:port``) of the running Clash API (``api.clash``)."""
        return self._transports.clash_url

    @property
    def control_url(self) -> str:
        """Base URL (``http://host:port``) of the running HTTP control API."""
        return self._transports.control_url

    def query(self, name: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Answer a query (docs/http-api.md) by name (``health``, ``stats``, ``flows``...)."""
        self._require_running()
        return self._plane.run_query(name, params)

    def execute(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """Run a command (docs/commands.md) through the engine's one command table."""
        self._require_running()
        return self._plane.execute(method, {} if params is None else params, transport="embedded")

    def subscribe(
        self,
        types: Iterable[str] | None = None,
        *,
        timeout: float | None = None,
        since: int | None = None,
        snapshot: bool = False,
    ) -> Subscription:
        """Live events, optionally resuming from the ring after sequence ``since``.

        Iteration ends when no event arrives for ``timeout`` seconds (never, if
        None) or when the engine stops. With ``snapshot=True`` and flow types
        included, the live phase starts with a ``flow.snapshot`` baseline, as
        SSE and IPC subscriptions do.
        """
        core = self._core
        return core.log.subscribe(
            types,
            since=since,
            snapshot=core.flows.records if snapshot else None,
            timeout=timeout,
        )

    def _require_running(self) -> None:
        if not self._core.running:
            raise ApiError("conflict", "engine is not running")
