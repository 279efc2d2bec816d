"""ListenerActor: owns one inbound's listening socket, which the C connection path accepts on.

Connections C hands back before their handshake go to the engine core, not here:
a reload may stop this listener while such a connection is on its way.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from spliceway.actors.dispatcher import Dispatcher, LoopActor
from spliceway.actors.flow import HANDSHAKE_TIMEOUT
from spliceway.native.conn import ListenerOptions

if TYPE_CHECKING:
    from spliceway.actors.bridge import RelayBridge
    from spliceway.engine.generation import InboundSpec


@dataclass(frozen=True, slots=True)
class ListenerPorts:
    """What a ListenerActor uses of the engine."""

    dispatcher: Dispatcher
    bridge: RelayBridge
    #: ``runtime.tcp_idle_timeout_seconds`` now, in milliseconds.
    idle_timeout_ms: Callable[[], int]
    #: An inbound's credentials as C takes them, None without authentication.
    listener_users: Callable[[InboundSpec], list[tuple[str, str, int]] | None]


class ListenerActor(LoopActor):
    """Accepts connections on one bound socket while alive."""

    def __init__(self, ports: ListenerPorts, inbound: InboundSpec, sock: socket.socket) -> None:
        super().__init__(ports.dispatcher)
        self.ports = ports
        self.inbound = inbound
        self.sock: socket.socket | None = sock

    def on_start(self) -> None:
        """Hand the socket to the C connection path (it accepts); we keep owning it."""
        assert self.sock is not None
        self.sock.setblocking(False)
        self.ports.bridge.conn.listen(
            self.inbound.index,
            self.sock.fileno(),
            ListenerOptions(
                protocol=self.inbound.protocol,
                sniff=self.inbound.sniff,
                sniff_timeout_ms=self.inbound.sniff_timeout_ms,
                handshake_timeout_ms=int(HANDSHAKE_TIMEOUT * 1000),
                idle_timeout_ms=self.ports.idle_timeout_ms(),
                # C forwards what it can of an http inbound's absolute-URI requests
                # (docs/http-forward.md); anything else still comes to Python.
                forward=self.inbound.protocol in ("http", "mixed"),
            ),
            self.ports.listener_users(self.inbound),
        )

    def on_stop(self) -> None:
        """Stop accepting and close the socket (idempotent)."""
        self._teardown()

    def on_failure(self, *exc_info: object) -> None:
        """Never leave a dead listener's socket open."""
        self._teardown()

    def _teardown(self) -> None:
        if self.sock is None:
            return
        # Returns once no C loop can touch the fd again: only then may it close.
        with contextlib.suppress(Exception):
            self.ports.bridge.conn.unlisten(self.inbound.index)
        # Stopped in an outage, it is no longer a listener out of descriptors.
        self.ports.bridge.forget_listener(self.inbound.index)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.sock = None
