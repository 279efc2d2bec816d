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
3. **stage** (``config.apply`` with a source file): the new bytes are written to a
   temporary file beside it and fsynced; the file itself is not touched yet.
4. **sinks**: the connector adds, restarts and removes sinks (a removed sink's
   outbox stays on disk).
5. **commit** on the dispatcher thread, where every flow decides, so a flow sees
   the old tables or the new ones, never a mix: listeners swapped, tables and
   group actors replaced, the flow hook's client replaced (the old one settles
   the asks it has), the C route table recompiled and swapped, the fake-ip pool and
   DNS server replaced.
6. **persist**: the staged file is renamed over the source file (atomic) and the
   directory fsynced. A crash before the rename leaves the previous file, after it
   the new one: never a torn file, never one that was not applied. Should the
   rename fail, the previous configuration is installed again (and the error says
   whether that worked).

A failure in steps 3 to 5 undoes what was done (sinks reconfigured back, the staged
file removed) and the error says so; ``config.changed`` is emitted only on success,
still under the apply lock, so the events are in the order of the applies.
Flows already relaying keep their path; only new flows use the new tables.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
import pykka

from spliceway.config import Config, check_environment, parse_config, resolve_ipc
from spliceway.config.diff import COMPONENTS, diff
from spliceway.engine import assembly
from spliceway.engine.generation import InboundSpec
from spliceway.errors import ApiError
from spliceway.events.log import now_ms
from spliceway.support.atomic_file import StagedFile, remove_stale_staged

if TYPE_CHECKING:
    from spliceway.dns.service import DnsPlan
    from spliceway.engine.core import EngineCore

logger = logging.getLogger(__name__)

#: How long an apply waits for the dispatcher to install the new configuration.
INSTALL_TIMEOUT_S = 30.0
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
    #: The proxy provider each outbound merged from one came from, by tag.
    origins: Mapping[str, str] = field(default_factory=dict)
    #: What each proxy provider gave the configuration, by name.
    provider_members: Mapping[str, Any] = field(default_factory=dict)

    def discard(self) -> None:
        """Close and drop what was prepared (the apply did not go through)."""
        self.listeners.close_sockets()
        if self.dns is not None:
            self.dns.discard()


def check_fixed(old: Config, new: Config, outbox_open: bool) -> None:
    """Refuse (``conflict``) what a running engine cannot replace in itself."""
    fixed: list[tuple[str, object, object]] = [
        ("api.control", old.api.control, new.api.control),
        ("api.ipc", old.api.ipc, new.api.ipc),
        ("api.grpc", old.api.grpc, new.api.grpc),
        ("api.clash", old.api.clash, new.api.clash),
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
            import yaml
        except ImportError:
            pass
        else:
            return yaml.safe_dump(document, sort_keys=False, allow_unicode=True).encode()
    return orjson.dumps(document, option=orjson.OPT_INDENT_2) + b"\n"


class Reconciler:
    """Applies configurations to one running engine (see the module docstring)."""

    def __init__(
        self, core: EngineCore, on_runtime_changed: Callable[[Any], None] | None = None
    ) -> None:
        self._core = core
        self._next_slot = 0
        #: Called with the runtime section after an apply that changed it.
        self._on_runtime_changed = on_runtime_changed
        #: The last apply's ``persistence`` (a provider's refresh reports it again).
        self._persistence = "source_file"

    def apply(self, document: Any, *, persist: bool, trigger: str) -> dict[str, Any]:
        """Apply ``document`` (a whole configuration); ``persist`` writes the source file.

        Returns ``{applied, persistence, reconciled, application_components, changed}``
        once everything is reconciled; raises ApiError, with nothing changed, otherwise.
        """
        core = self._core
        source = parse_config(document) if not isinstance(document, Config) else document
        with core.apply_lock:
            if not core.running:
                raise ApiError("conflict", "the engine is not running (it is stopping)")
            result = self._apply_locked(source, document, persist=persist, trigger=trigger)
        self._runtime_changed(result)
        return result

    def refresh(self, *, force: bool, trigger: str = "provider") -> dict[str, Any] | None:
        """Apply the running configuration again with the providers' current content (a
        provider's refresh): nothing when the merged configuration is the running one,
        unless ``force`` (a rule set or a geodata file changed under the same
        configuration). Never writes the source file; raises ApiError as ``apply``."""
        core = self._core
        with core.apply_lock:
            if not core.running:
                raise ApiError("conflict", "the engine is not running (it is stopping)")
            source = core.source_config
            if not force and core.providers.materialise(source).config == core.generation.config:
                return None
            result = self._apply_locked(source, None, persist=False, trigger=trigger, force=force)
        self._runtime_changed(result)
        return result

    def _runtime_changed(self, result: dict[str, Any]) -> None:
        """Outside the apply lock: tell the host an apply changed ``runtime``."""
        if self._on_runtime_changed is not None and "runtime" in result["changed_components"]:
            with contextlib.suppress(Exception):
                self._on_runtime_changed(self._core.generation.config.runtime)

    def _apply_locked(
        self,
        source: Config,
        document: Any,
        *,
        persist: bool,
        trigger: str,
        force: bool = False,
    ) -> dict[str, Any]:
        """``apply``'s transaction, under the apply lock: ``source`` is the configuration as
        written (``document`` its text for the source file, None for a refresh), merged
        here with the providers' current content."""
        core = self._core
        old = core.generation.config
        # An unset api.ipc.enabled means what it meant when this engine started.
        source = resolve_ipc(source, bool(old.api.ipc.enabled))
        # Under the lock, with the content of now: a refresh that finished meanwhile is
        # in it, and one still running applies again after this one.
        merged = core.providers.materialise(source)
        new = merged.config
        check_fixed(old, new, core.connector.store is not None)
        check_environment(new)
        plan = self._prepare_or_refuse(old, new)
        plan.origins, plan.provider_members = merged.origins, merged.members
        if force and "routing" not in plan.changed:
            plan.changed.append("routing")  # a rule set or geodata file was replaced
        staged: StagedFile | None = None
        try:
            if trigger == "sighup":  # the file itself is what is applied
                persistence = "source_file"
            elif document is None:
                # A refresh: the document is the running one, the file as it was.
                persistence = self._persistence
            else:
                persistence, staged = self._stage(document, persist)
        except BaseException:
            plan.discard()
            raise
        try:
            self._install_with_tun(plan, old.runtime.tun, new.runtime.tun)
        except BaseException as ex:
            file = ""
            if staged is not None:
                staged.discard()
                file = f" and {staged.path} is unchanged"
            if isinstance(ex, Unconfirmed):
                raise ApiError(
                    "internal",
                    f"{ex.message}: it may still be installed, or not (query the config "
                    f"and the listeners to see which); the event sinks are the previous "
                    f"ones{file}",
                ) from ex
            if isinstance(ex, ApiError):
                raise ApiError(
                    "internal",
                    f"{ex.message}; rolled back: the previous configuration is running{file}",
                    field_path=ex.field_path,
                ) from ex
            raise ApiError(
                "internal",
                f"applying the configuration failed ({ex!r}); rolled back: the previous "
                f"configuration is running{file}",
            ) from ex
        if staged is not None:
            # Only now, with the new configuration running: a crash before this line
            # leaves the previous file, after it the new one, never a torn one and
            # never one that did not apply.
            try:
                staged.commit()
            except OSError as ex:
                outcome = self._revert(new, old)
                raise ApiError(
                    "internal",
                    f"cannot write {ex.filename or staged.path}: {ex.strerror or ex}; {outcome}",
                ) from ex
        core.source_config = source
        self._persistence = persistence
        # Under the lock: config.changed events are in the order of the applies.
        core.log.emit(
            "config.changed",
            {
                "changed_at_unix_ms": now_ms(),
                "trigger": trigger,
                "persistence": persistence,
                "changed_components": plan.changed,
            },
        )
        return {
            "applied": True,
            "persistence": persistence,
            "reconciled": True,
            "application_components": list(COMPONENTS),
            "changed_components": plan.changed,
        }

    def _prepare_or_refuse(self, old: Config, new: Config) -> Plan:
        """``_prepare``, any failure an ApiError saying nothing was applied."""
        try:
            return self._prepare(old, new)
        except ApiError as ex:
            raise ApiError(
                "internal",
                f"{ex.message}; nothing was applied: the previous configuration is running",
                field_path=ex.field_path and f"config.{ex.field_path}",
            ) from ex
        except Exception as ex:
            logger.exception("preparing a configuration failed")
            raise ApiError(
                "internal",
                f"preparing the configuration failed ({type(ex).__name__}: {ex}); nothing was "
                "applied: the previous configuration is running",
            ) from ex

    def _revert(self, running: Config, previous: Config) -> str:
        """Put ``previous`` back after ``running`` was installed but its file could not be
        written (a rollback); a sentence saying how that went."""
        try:
            plan = self._prepare(running, previous)
        except Exception as ex:
            logger.exception("preparing the rollback of an apply failed")
            return (
                f"putting the previous configuration back failed ({ex}): the new "
                "configuration is running, and the file still holds the previous one"
            )
        try:
            self._install_with_tun(plan, running.runtime.tun, previous.runtime.tun)
        except BaseException as ex:
            logger.exception("the rollback of an apply failed")
            return (
                f"putting the previous configuration back failed ({ex}): the new "
                "configuration is running, and the file still holds the previous one"
            )
        return "rolled back: the previous configuration is running and the file is unchanged"

    def _install_with_tun(self, plan: Plan, tun_before: Any, tun_after: Any) -> None:
        """The TUN of ``runtime.tun`` first, then ``plan``; on failure the plan is
        discarded and the TUN put back before the exception goes on."""
        tun_swapped = False
        try:
            try:
                tun_swapped = self._swap_tun(tun_before, tun_after)
                self._install(plan)
            finally:
                plan.listeners.close_spares()
        except BaseException:
            plan.discard()
            if tun_swapped:
                self._restore_tun(tun_before)
            raise

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
        g = core.generation
        parts = assembly.build_routing(
            new, g.parts, old, g.policies, g.route_state, on_answer=core.dns_answer
        )
        listeners = self._plan_listeners(old, new)
        difference = diff(old, new)
        changed = list(difference.changed)
        dns = None
        if difference.dns:
            try:
                dns = core.dns.prepare(new.runtime.dns)
            except BaseException:
                listeners.close_sockets()
                raise
        return Plan(new, parts, listeners, changed, dns)

    def _plan_listeners(self, old: Config, new: Config) -> ListenerChange:
        """Which listeners stay, start and stop; binds the new addresses (may raise)."""
        active = self._core.generation.active_inbounds
        running = {a.spec.tag: a for a in active}
        idle_same = old.runtime.tcp_idle_timeout_seconds == new.runtime.tcp_idle_timeout_seconds
        change = ListenerChange()
        used = {a.spec.index for a in active}
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
        for a in active:
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
        from spliceway.engine.core import bind_listener

        address, port = ib.listen.address, ib.listen.port
        for a in self._core.generation.active_inbounds:
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

    def _stage(self, document: Any, persist: bool) -> tuple[str, StagedFile | None]:
        """The source file's new bytes, written beside it and fsynced (config.apply with a
        file), to be renamed over it once the apply has succeeded."""
        path = self._core.config_path
        if not persist or path is None:
            return "runtime_only", None
        # A symlinked source file: the file it points to is replaced (and its .prev kept
        # beside it); the link stays a link, so the file the user edits and the one the
        # engine runs remain the same file.
        path = os.path.realpath(path)
        if isinstance(document, Config):
            document = document.model_dump(mode="json")
        remove_stale_staged(path)  # what a killed apply left (the apply lock is held)
        try:
            staged = StagedFile.write(path, serialize(document, path), keep_previous=True)
            return "source_file", staged
        except OSError as ex:
            raise ApiError(
                "internal",
                f"cannot write {path}: {ex.strerror or ex}; nothing was applied, the file is "
                "unchanged",
            ) from ex

    # -- install ----------------------------------------------------------------------

    def _install(self, plan: Plan) -> None:
        core = self._core
        old_api = core.generation.config.api
        try:
            core.connector.reconfigure(plan.config.api)
            assert core.supervisor is not None
            try:
                core.supervisor.proxy().reconfigure(plan).get(timeout=INSTALL_TIMEOUT_S)
            except pykka.Timeout as ex:
                raise Unconfirmed(
                    "internal",
                    f"the engine did not confirm installing the new configuration within "
                    f"{INSTALL_TIMEOUT_S:g} s",
                ) from ex
        except BaseException:
            try:
                core.connector.reconfigure(old_api)
            except Exception:
                logger.exception("restoring the event sinks after a failed apply failed")
            raise


class Unconfirmed(ApiError):
    """The dispatcher did not answer the install in time: it may yet run it."""


def _spec(slot: int, inbound: Any) -> InboundSpec:
    return InboundSpec.of(slot, inbound)


def read_document(path: str) -> Any:
    """The configuration in ``path``, validated (for SIGHUP); ApiError on failure."""
    from spliceway.config import load_config_file

    return load_config_file(os.fspath(path))
