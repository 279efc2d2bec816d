"""ListenerActor: owns one inbound's listening socket, which the C connection path accepts on.

Connections C hands back before their handshake go to the engine core, not here:
a reload may stop this listener while such a connection is on its way.
"""

from __future__ import annotations

import contextlib
import socket
from typing import TYPE_CHECKING

from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.flow import HANDSHAKE_TIMEOUT
from spliceway.native.conn import ListenerOptions

if TYPE_CHECKING:
    from spliceway.engine.core import EngineCore, InboundSpec


class ListenerActor(LoopActor):
    """Accepts connections on one bound socket while alive."""

    def __init__(self, core: EngineCore, inbound: InboundSpec, sock: socket.socket) -> None:
        super().__init__(core.dispatcher)
        self.core = core
        self.inbound = inbound
        self.sock: socket.socket | None = sock

    def on_start(self) -> None:
        """Hand the socket to the C connection path (it accepts); we keep owning it."""
        assert self.sock is not None
        self.sock.setblocking(False)
        self.core.bridge.conn.listen(
            self.inbound.index,
            self.sock.fileno(),
            ListenerOptions(
                protocol=self.inbound.protocol,
                sniff=self.inbound.sniff,
                sniff_timeout_ms=self.inbound.sniff_timeout_ms,
                handshake_timeout_ms=int(HANDSHAKE_TIMEOUT * 1000),
                idle_timeout_ms=self.core.tcp_idle_timeout_ms,
                # C forwards what it can of an http inbound's absolute-URI requests
                # (docs/http-forward.md); anything else still comes to Python.
                forward=self.inbound.protocol in ("http", "mixed"),
            ),
            self.core.listener_users(self.inbound),
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
            self.core.bridge.conn.unlisten(self.inbound.index)
        # Stopped in an outage, it is no longer a listener out of descriptors.
        self.core.bridge.forget_listener(self.inbound.index)
        with contextlib.suppress(OSError):
            self.sock.close()
        self.sock = None
