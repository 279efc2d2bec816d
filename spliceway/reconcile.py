"""``config.apply`` / ``config.apply_runtime`` / SIGHUP: a new configuration, live, or none.

One apply is a transaction over the running engine, serialised by the core's
``apply_lock``:

1. **check**: the document validates; the parts a running control plane cannot
   replace (``api.control``, ``api.ipc``, ``api.grpc``, an open outbox's
   directory) are unchanged (``conflict``); the build can run it.
2. **prepare**, nothing visible yet: the routing parts (reusing every unchanged
   outbound, resolver and group view), and a socket for every inbound that is new
   or changed: bound afresh for a new address, or a duplicate of the running
   listener's socket when the address stays, so clients see no gap; for a changed
   ``runtime.dns``, the fake-ip pool and the DNS server's sockets
   (:mod:`spliceway.dns.service`). A port that cannot be bound fails here, before
   anything changed.
3. **persist** (``config.apply`` with a source file): the file is replaced
   atomically (:mod:`spliceway.atomic_file`); its old bytes are kept to restore.
4. **sinks**: the connector adds, restarts and removes sinks (a removed sink's
   outbox stays on disk).
5. **commit** on the dispatcher thread, where every flow decides, so a flow sees
   the old tables or the new ones, never a mix: listeners swapped, tables and
   group actors replaced, the flow hook's client replaced (the old one settles
   the asks it has), the C route table recompiled and swapped, the fake-ip pool and
   DNS server replaced.

A failure in steps 3 to 5 undoes what was done (sinks reconfigured back, the file
restored) and the error says so; ``config.changed`` is emitted only on success.
Flows already relaying keep their path; only new flows use the new tables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson

from spliceway import assembly
from spliceway.atomic_file import replace_file
from spliceway.config import Config, check_environment, parse_config
from spliceway.errors import ApiError
from spliceway.events import now_ms

if TYPE_CHECKING:
    from spliceway.dns.service import DnsPlan
    from spliceway.engine_core import EngineCore, InboundSpec

logger = logging.getLogger(__name__)

#: The components an apply reconciles, in the order it reports them.
COMPONENTS = (
    "proxy_listeners",
    "outbounds",
    "policy_groups",
    "routing",
    "dns",
    "flow_hook",
    "event_dispatcher",
    "runtime",
    "tun",
)
#: C's listener slots for configured inbounds: csrc/conn.c's MAX_LISTENERS (256) but
#: the last two, which are the TUN's (spliceway.tun.service.TUN_SLOTS).
_SLOTS = 254


@dataclass(slots=True)
class ListenerChange:
    """The listeners of the new configuration, against the running ones."""

    #: The new active inbounds in config order: (spec, bound address).
    active: list[tuple[InboundSpec, tuple[str, int]]] = field(default_factory=list)
    #: New slots to start, each with its socket (bound now, or a running one's dup).
    start: list[tuple[InboundSpec, socket.socket]] = field(default_factory=list)
    #: Running slots to stop; those whose socket a new slot shares stop first.
    retire: list[int] = field(default_factory=list)
    #: Running slots whose socket a new slot takes over, each with a spare duplicate
    #: that can restart the old listener if the apply fails.
    shared: dict[int, socket.socket] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)

    def close_sockets(self) -> None:
        """Close the sockets prepared for new slots (the apply did not go through)."""
        for _, sock in self.start:
            with contextlib.suppress(OSError):
                sock.close()
        self.close_spares()

    def close_spares(self) -> None:
        """Close the spare duplicates of shared sockets (the apply is over)."""
        for sock in self.shared.values():
            with contextlib.suppress(OSError):
                sock.close()
        self.shared.clear()


@dataclass(slots=True)
class Plan:
    """Everything an apply installs, prepared before anything changes."""

    config: Config
    parts: assembly.RoutingParts
    listeners: ListenerChange
    changed: list[str]
    #: The new ``runtime.dns`` (pool, DNS server sockets) when it changed.
    dns: DnsPlan | None = None

    def discard(self) -> None:
        """Close and drop what was prepared (the apply did not go through)."""
        self.listeners.close_sockets()
        if self.dns is not None:
            self.dns.discard()


def check_fixed(old: Config, new: Config, outbox_open: bool) -> None:
    """Refuse (``conflict``) what a running engine cannot replace in itself."""
    fixed = [
        ("api.control", old.api.control, new.api.control),
        ("api.ipc", old.api.ipc, new.api.ipc),
        ("api.grpc", old.api.grpc, new.api.grpc),
    ]
    if outbox_open:
        fixed.append(("api.outbox_path", old.api.outbox_path, new.api.outbox_path))
    for path, before, after in fixed:
        if before != after:
            raise ApiError(
                "conflict",
                f"{path} differs from the running engine's: a control plane cannot replace "
                "itself (nor a running engine its outbox); restart the engine to change it. "
                "Nothing was applied.",
                field_path=f"config.{path}",
            )


def serialize(document: dict[str, Any], path: str) -> bytes:
    """The bytes of a config file holding ``document``: YAML for .yaml/.yml, else JSON."""
    if path.lower().endswith((".yaml", ".yml")):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            pass
        else:
            return yaml.safe_dump(document, sort_keys=False, allow_unicode=True).encode()
    return orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n"


class Reconciler:
    """Applies configurations to one running engine (see the module docstring)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._next_slot = 0

    def apply(self, document: Any, *, persist: bool, trigger: str) -> dict[str, Any]:
        """Apply ``document`` (a whole configuration); ``persist`` writes the source file.

        Returns ``{applied, persistence, reconciled, application_components, changed}``
        once everything is reconciled; raises ApiError, with nothing changed, otherwise.
        """
        core = self._core
        new = parse_config(document) if not isinstance(document, Config) else document
        with core.apply_lock:
            if not core.running:
                raise ApiError("conflict", "the engine is not running (it is stopping)")
            old = core.config
            check_fixed(old, new, core.connector.store is not None)
            check_environment(new)
            try:
                plan = self._prepare(old, new)
            except ApiError as ex:
                raise ApiError(
                    "internal",
                    f"{ex.message}; nothing was applied: the previous configuration is running",
                    field_path=ex.field_path and f"config.{ex.field_path}",
                ) from ex
            try:
                if trigger == "sighup":  # the file itself is what is applied
                    persistence, restore = "source_file", None
                else:
                    persistence, restore = self._persist(document, persist)
            except BaseException:
                plan.discard()
                raise
            tun_swapped = False
            try:
                try:
                    tun_swapped = self._swap_tun(old.runtime.tun, new.runtime.tun)
                    self._install(plan)
                finally:
                    plan.listeners.close_spares()
            except BaseException as ex:
                plan.discard()
                if tun_swapped:
                    self._restore_tun(old.runtime.tun)
                outcome = self._undo_file(restore)
                if isinstance(ex, ApiError):
                    raise ApiError(
                        "internal",
                        f"{ex.message}; rolled back: the previous configuration is running"
                        f"{outcome}",
                        field_path=ex.field_path,
                    ) from ex
                raise ApiError(
                    "internal",
                    f"applying the configuration failed ({ex!r}); rolled back: the previous "
                    f"configuration is running{outcome}",
                ) from ex
        changed_at = now_ms()
        core.log.emit(
            "config.changed",
            {
                "changed_at_unix_ms": changed_at,
                "trigger": trigger,
                "persistence": persistence,
                "changed_components": plan.changed,
            },
        )
        if core.on_runtime_changed is not None and "runtime" in plan.changed:
            with contextlib.suppress(Exception):
                core.on_runtime_changed(new.runtime)
        return {
            "applied": True,
            "persistence": persistence,
            "reconciled": True,
            "application_components": list(COMPONENTS),
            "changed_components": plan.changed,
        }

    # -- the TUN of runtime.tun ----------------------------------------------------------

    def _swap_tun(self, before: Any, after: Any) -> bool:
        """Make the TUN match a changed ``runtime.tun`` (first, so a TUN that cannot
        start fails the apply before anything else changed); True when it changed."""
        tun = self._core.tun
        if tun is None or before == after:
            return False
        if tun.running and (tun.managed_by_config or after is not None):
            tun.stop()
        if after is None:
            return True
        try:
            tun.start(
                after.model_dump(exclude_none=True),
                managed_by_config=True,
                field_prefix="config.runtime.tun.",
            )
        except BaseException:
            self._restore_tun(before)
            raise
        return True

    def _restore_tun(self, before: Any) -> None:
        """Put the previous configuration's TUN back (a rollback); logged, never raised."""
        tun = self._core.tun
        if tun is None:
            return
        try:
            if tun.running:
                tun.stop()
            if before is not None:
                tun.start(before.model_dump(exclude_none=True), managed_by_config=True)
        except Exception:
            logger.exception("restoring the previous configuration's TUN failed")

    # -- prepare ----------------------------------------------------------------------

    def _prepare(self, old: Config, new: Config) -> Plan:
        core = self._core
        parts = assembly.build_routing(new, core.parts, old, core.policies, core.route_state)
        listeners = self._plan_listeners(old, new)
        changed = []
        if listeners.added or listeners.removed or listeners.changed:
            changed.append("proxy_listeners")
        if old.outbounds != new.outbounds:
            changed.append("outbounds")
        if old.outbound_groups != new.outbound_groups or old.runtime.latency_test_url != (
            new.runtime.latency_test_url
        ):
            changed.append("policy_groups")
        if (old.rules, old.route, old.mode) != (new.rules, new.route, new.mode):
            changed.append("routing")
        if old.runtime.dns != new.runtime.dns:
            changed.append("dns")
        if old.api.flow_hook != new.api.flow_hook:
            changed.append("flow_hook")
        if (old.api.event_sinks, old.api.dispatcher) != (new.api.event_sinks, new.api.dispatcher):
            changed.append("event_dispatcher")
        if old.runtime != new.runtime:
            changed.append("runtime")
        if old.runtime.tun != new.runtime.tun:
            changed.append("tun")
        dns = None
        if old.runtime.dns != new.runtime.dns:
            try:
                dns = core.dns.prepare(new.runtime.dns)
            except BaseException:
                listeners.close_sockets()
                raise
        return Plan(new, parts, listeners, changed, dns)

    def _plan_listeners(self, old: Config, new: Config) -> ListenerChange:
        """Which listeners stay, start and stop; binds the new addresses (may raise)."""
        core = self._core
        running = {a.spec.tag: a for a in core.active_inbounds}
        idle_same = old.runtime.tcp_idle_timeout_seconds == new.runtime.tcp_idle_timeout_seconds
        change = ListenerChange()
        used = {a.spec.index for a in core.active_inbounds}
        kept_tags: set[str] = set()
        try:
            for i, ib in enumerate(new.inbounds):
                current = running.get(ib.tag)
                if current is not None and current.spec.source == ib and idle_same:
                    change.active.append((current.spec, current.bound))
                    kept_tags.add(ib.tag)
                    continue
                slot = self._allocate_slot(used)
                used.add(slot)
                spec = _spec(slot, ib)
                sock = self._socket_for(ib, i, change)
                change.start.append((spec, sock))
                change.active.append((spec, sock.getsockname()[:2]))
                (change.changed if current is not None else change.added).append(ib.tag)
        except BaseException:
            change.close_sockets()
            raise
        new_tags = {ib.tag for ib in new.inbounds}
        for a in core.active_inbounds:
            if a.spec.tag not in kept_tags:
                change.retire.append(a.spec.index)
                if a.spec.tag not in new_tags:
                    change.removed.append(a.spec.tag)
        return change

    def _socket_for(self, ib: Any, index: int, change: ListenerChange) -> socket.socket:
        """The socket a new or changed inbound listens on: a running listener's when the
        configured address is the same (no gap, no EADDRINUSE), else a new one.

        Port 0 (any free port) matches only the same inbound's own listener, which keeps
        the port it was given.
        """
        from spliceway.engine_core import bind_listener

        address, port = ib.listen.address, ib.listen.port
        for a in self._core.active_inbounds:
            listen = a.spec.source.listen
            same_address = (listen.address, listen.port) == (address, port)
            if same_address and (port != 0 or a.spec.tag == ib.tag):
                sock = self._core.listen_sockets.get(a.spec.index)
                if sock is not None and a.spec.index not in change.shared:
                    change.shared[a.spec.index] = sock.dup()
                    return sock.dup()
        return bind_listener(address, port, ib.tag, index)

    def _allocate_slot(self, used: set[int]) -> int:
        # Round-robin, so a slot a reload freed is the last to be used again: records
        # of its old listener's last flows name it for a while.
        for _ in range(_SLOTS):
            slot = self._next_slot
            self._next_slot = (self._next_slot + 1) % _SLOTS
            if slot not in used:
                return slot
        raise ApiError("conflict", f"more than {_SLOTS} inbounds")

    # -- persist ----------------------------------------------------------------------

    def _persist(self, document: Any, persist: bool) -> tuple[str, bytes | None]:
        """Write the source file (config.apply with one); the old bytes, to restore."""
        path = self._core.config_path
        if not persist or path is None:
            return "runtime_only", None
        if isinstance(document, Config):
            document = document.model_dump(mode="json")
        try:
            with open(path, "rb") as f:
                before = f.read()
        except FileNotFoundError:
            before = b""
        except OSError as ex:
            raise ApiError(
                "internal", f"cannot read {path}: {ex.strerror or ex}; nothing was applied"
            ) from ex
        try:
            replace_file(path, serialize(document, path))
        except OSError as ex:
            raise ApiError(
                "internal",
                f"cannot write {path}: {ex.strerror or ex}; nothing was applied, the file is "
                "unchanged",
            ) from ex
        return "source_file", before

    def _undo_file(self, before: bytes | None) -> str:
        """Put the old source file back; a sentence for the error message."""
        path = self._core.config_path
        if before is None or path is None:
            return ""
        try:
            replace_file(path, before)
        except OSError as ex:
            logger.error("could not restore %s after a failed apply: %s", path, ex)
            return f", but restoring {path} failed ({ex.strerror or ex}): it holds the new one"
        return f" and {path} is restored"

    # -- install ----------------------------------------------------------------------

    def _install(self, plan: Plan) -> None:
        core = self._core
        old_api = core.config.api
        try:
            core.connector.reconfigure(plan.config.api)
            assert core.supervisor is not None
            core.supervisor.proxy().reconfigure(plan).get(timeout=30)
        except BaseException:
            try:
                core.connector.reconfigure(old_api)
            except Exception:
                logger.exception("restoring the event sinks after a failed apply failed")
            raise


def _spec(slot: int, inbound: Any) -> InboundSpec:
    from spliceway.engine_core import InboundSpec

    return InboundSpec.of(slot, inbound)


def read_document(path: str) -> Any:
    """The configuration in ``path``, validated (for SIGHUP); ApiError on failure."""
    from spliceway.config import load_config_file

    return load_config_file(os.fspath(path))
