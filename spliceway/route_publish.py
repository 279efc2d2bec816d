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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spliceway.engine_core import EngineCore


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """What one route target (an outbound or group tag) leads to now, for C."""

    tag: str
    #: The selection chain from ``tag`` to its leaf outbound (``[tag]`` for an outbound).
    chain: tuple[str, ...]
    #: "direct", "block", "socks5", or "defer" (Python dials it).
    kind: str
    server: str | None = None
    port: int = 0
    username: str | None = None
    password: str | None = None
    connect_timeout_ms: int = 5000


def target_spec(tag: str, policies: Any, outbounds: dict[str, Any]) -> TargetSpec:
    """How C reaches ``tag`` under the current group selections.

    A load_balance group picks per flow (by host, source or turn), which a table
    cannot hold, and http, shadowsocks and relay outbounds are dialled by Python:
    those targets are deferred.
    """
    for group_tag in policies.effective_chains(tag)[0][:-1]:
        view = policies.get(group_tag)
        if view is not None and view.kind == "load_balance":
            return TargetSpec(tag, (tag,), "defer")
    chain = tuple(policies.resolve(tag))
    leaf = outbounds.get(chain[-1])
    if leaf is None:
        return TargetSpec(tag, chain, "defer")
    timeout_ms = int(getattr(leaf, "connect_timeout", 5.0) * 1000)
    if leaf.protocol in ("direct", "block"):
        return TargetSpec(tag, chain, leaf.protocol, connect_timeout_ms=timeout_ms)
    if leaf.protocol == "socks5":
        return TargetSpec(
            tag,
            chain,
            "socks5",
            server=leaf.server,
            port=leaf.port,
            username=leaf.username,
            password=leaf.password,
            connect_timeout_ms=timeout_ms,
        )
    return TargetSpec(tag, chain, "defer")


class RoutePublisher:
    """Compiles and installs route tables; remembers each epoch's mirror."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core
        self._lock = threading.Lock()
        self._mirrors: dict[int, Any] = {}

    def publish(self) -> None:
        """Compile the current routing state and install it in C (none installed yet)."""

    def mirror(self, epoch: int) -> Any:
        """The Python mirror of the table with ``epoch``."""
        with self._lock:
            return self._mirrors[epoch]
