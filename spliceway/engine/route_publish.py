"""Keeps the C connection path's route table in step with the engine's routing state.

Every change that can alter a route (start, ``mode.set``, a group's new selection)
calls :meth:`RoutePublisher.publish`, which compiles the rules, the mode and each
route target's current outbound into a sealed table and installs it in C (an
atomic swap there). Each table carries an epoch; C's records name the epoch that
routed a flow, and :meth:`RoutePublisher.mirror` maps it back to the decisions
Python would have made, for the flow's record. A table is compiled from one
:class:`~spliceway.engine.generation.Generation`, taken once (a reload may publish
the next one meanwhile, on another thread), and its mirror records that
generation's serial.

Until a table is installed C defers every flow to Python after its handshake. A table
also names the listener slots the flow hook (``api.flow_hook``) selects: C hands their
flows to Python after the handshake, before routing, so Python asks the hook first; and
the fake-ip range (``runtime.dns.answer``), whose addresses C hands over likewise, so
Python routes them by the domain they stand for. And ``runtime.process_lookup`` with this
host's addresses: a ``process_name`` rule defers flows from clients on this host to
Python (which finds the process) and fails others; ``always`` hands every such flow over.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, NamedTuple

from spliceway.config import BUILTIN_DIRECT
from spliceway.native.route import (
    OUT_BLOCK,
    OUT_DEFER,
    OUT_DIRECT,
    OUT_HTTP,
    OUT_SOCKS5,
    CompiledRoutes,
    TargetSpec,
    compile_route_table,
)

if TYPE_CHECKING:
    from spliceway.engine.core import EngineCore


_DEFER = TargetSpec(OUT_DEFER)
#: How many tables' mirrors are kept: a flow C routed is looked up by its table's
#: epoch when its record is drained, which is soon, but a dial can outlast a few
#: publishes. A mirror is small (the rule set is shared), so keep plenty.
_MIRRORS_KEPT = 1024


class Mirror(NamedTuple):
    """What turns a C record routed by one table back into Python's route."""

    routes: CompiledRoutes
    #: The selection chain of each target index when the table was compiled.
    chains: list[list[str]]
    #: The outbounds the chains name (a reload replaces the engine's set).
    outbounds: dict[str, Any]
    #: The serial of the generation the table was compiled from.
    generation: int = 0


def target_spec(tag: str, policies: Any, outbounds: dict[str, Any]) -> tuple[list[str], TargetSpec]:
    """The selection chain from ``tag`` to its leaf outbound now, and how C reaches it.

    A load_balance group picks per flow (by host, source or turn), which a table
    cannot hold, and shadowsocks and relay outbounds are dialled by Python: those
    targets are deferred.
    """
    for group_tag in policies.effective_chains(tag)[0][:-1]:
        view = policies.get(group_tag)
        if view is not None and view.kind == "load_balance":
            return [tag], _DEFER
    chain = policies.resolve(tag)
    leaf = outbounds.get(chain[-1])
    if leaf is None:
        return chain, _DEFER
    timeout_ms = int(getattr(leaf, "connect_timeout", 5.0) * 1000)
    if leaf.protocol == "direct":
        return chain, TargetSpec(OUT_DIRECT, connect_timeout_ms=timeout_ms)
    if leaf.protocol == "block":
        return chain, TargetSpec(OUT_BLOCK)
    if leaf.protocol in ("socks5", "http"):
        kind = OUT_SOCKS5 if leaf.protocol == "socks5" else OUT_HTTP
        spec = TargetSpec(
            kind, leaf.server, leaf.port, leaf.username, leaf.password, timeout_ms, leaf.tag
        )
        return chain, spec
    return chain, _DEFER


class RoutePublisher:
    """Compiles and installs route tables; remembers each epoch's mirror."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        #: Serialises compile-and-install, so tables go to C in the order compiled.
        self._publish_lock = threading.Lock()
        #: Guards the mirrors only: a record's lookup never waits for a compile.
        self._lock = threading.Lock()
        self._mirrors: OrderedDict[int, Mirror] = OrderedDict()
        self._epoch = 0
        #: What the installed table was compiled from, to skip a publish that changes
        #: nothing (a probe round that keeps every selection).
        self._installed: tuple[Any, ...] | None = None
        self._installed_generation: Any = None
        self._closed = False

    def publish(self) -> None:
        """Compile the current routing state and install it in C, if it changed.

        Safe from any thread; tables are installed in the order they were compiled.
        Does nothing before the engine's connection path exists.
        """
        core = self._core
        with self._publish_lock:
            conn = getattr(getattr(core, "bridge", None), "conn", None)
            if conn is None or self._closed:
                return
            # Taken once: a reload publishes a new generation whole (dispatcher thread),
            # and a publish from another thread reads one or the other, never a mix.
            g = core.generation
            state, rules, outbounds = g.route_state, g.config.rules, g.outbounds
            hook = core.flow_hook
            # Only TCP flows reach C; a hook for UDP alone leaves C's path as it is.
            inbounds = core.route_inbounds(g)
            deferred = (
                tuple(
                    slot
                    for tag, slots in inbounds.items()
                    if hook.settings.selects("tcp", tag)
                    for slot in slots
                )
                if hook is not None
                else ()
            )
            # Fake-ip addresses: Python maps them back to their domain, then routes.
            answer = g.config.runtime.dns.answer
            cidrs = (answer.fake_ip_range,) if answer.type == "fake_ip" else ()
            process_lookup = g.config.runtime.process_lookup
            local = tuple(sorted(core.process_lookup.local.addresses))
            tags = [state.final]
            tags += [r.outbound for r in rules if r.action == "route" and r.outbound]
            tags += [state.mode_outbound or BUILTIN_DIRECT, BUILTIN_DIRECT]
            chains: list[list[str]] = []
            targets: dict[str, TargetSpec] = {}
            for tag in dict.fromkeys(tags):
                chain, spec = target_spec(tag, g.policies, outbounds)
                chains.append(chain)
                targets[tag] = spec
            key = (
                tuple(inbounds.items()),
                tuple(map(tuple, chains)),
                tuple(targets.items()),
                deferred,
                cidrs,
                process_lookup,
                local,
            )
            if g is self._installed_generation and key == self._installed:
                return
            self._epoch += 1
            routes = compile_route_table(
                rules,
                mode_kind=state.mode,
                mode_outbound=state.mode_outbound,
                final=state.final,
                targets=targets,
                inbounds=inbounds,
                principals=core.principal_ids,
                epoch=self._epoch,
                ruleset=state.ruleset,
                deferred_inbounds=deferred,
                deferred_cidrs=cidrs,
                process_lookup=process_lookup,
                local_addresses=local,
            )
            with self._lock:
                self._mirrors[self._epoch] = Mirror(routes, chains, outbounds, g.serial)
                while len(self._mirrors) > _MIRRORS_KEPT:
                    self._mirrors.popitem(last=False)
            conn.set_table(routes.detach())
            self._installed, self._installed_generation = key, g

    @property
    def epoch(self) -> int:
        """The epoch of the last table compiled (0 before the first)."""
        return self._epoch

    def close(self) -> None:
        """Publish nothing more (before the connection path shuts down)."""
        with self._publish_lock:
            self._closed = True

    def mirror(self, epoch: int) -> Mirror:
        """The Python mirror of the table with ``epoch``."""
        with self._lock:
            return self._mirrors[epoch]
