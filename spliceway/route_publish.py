"""Keeps the C connection path's route table in step with the engine's routing state.

Every change that can alter a route (start, ``mode.set``, a group's new selection)
calls :meth:`RoutePublisher.publish`, which compiles the rules, the mode and each
route target's current outbound into a sealed table and installs it in C (an
atomic swap there). Each table carries an epoch; C's records name the epoch that
routed a flow, and :meth:`RoutePublisher.mirror` maps it back to the decisions
Python would have made, for the flow's record.

Until a table is installed C defers every flow to Python after its handshake.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, NamedTuple

from spliceway.route_tables import (
    OUT_BLOCK,
    OUT_DEFER,
    OUT_DIRECT,
    OUT_SOCKS5,
    CompiledRoutes,
    TargetSpec,
)

if TYPE_CHECKING:
    from spliceway.engine_core import EngineCore


_DEFER = TargetSpec(OUT_DEFER)


class Mirror(NamedTuple):
    """What turns a C record routed by one table back into Python's route."""

    routes: CompiledRoutes
    #: The selection chain of each target index when the table was compiled.
    chains: list[list[str]]


def target_spec(tag: str, policies: Any, outbounds: dict[str, Any]) -> tuple[list[str], TargetSpec]:
    """The selection chain from ``tag`` to its leaf outbound now, and how C reaches it.

    A load_balance group picks per flow (by host, source or turn), which a table
    cannot hold, and http, shadowsocks and relay outbounds are dialled by Python:
    those targets are deferred.
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
    if leaf.protocol == "socks5":
        spec = TargetSpec(
            OUT_SOCKS5, leaf.server, leaf.port, leaf.username, leaf.password, timeout_ms
        )
        return chain, spec
    return chain, _DEFER


class RoutePublisher:
    """Compiles and installs route tables; remembers each epoch's mirror."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._mirrors: dict[int, Mirror] = {}

    def publish(self) -> None:
        """Compile the current routing state and install it in C (none installed yet)."""

    def mirror(self, epoch: int) -> Mirror:
        """The Python mirror of the table with ``epoch``."""
        with self._lock:
            return self._mirrors[epoch]
