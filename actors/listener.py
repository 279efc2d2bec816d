"""ListenerActor: owns one inbound's listening socket and spawns a FlowActor per client."""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
from typing import TYPE_CHECKING

from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.flow import FlowActor

if TYPE_CHECKING:
    from spliceway.engine_core import EngineCore, InboundSpec

logger = logging.getLogger(__name__)

#: Accepts per readiness callback: enough to drain a burst, small enough to stay fair.
_ACCEPT_BATCH = 64


class ListenerActor(LoopActor):
    """Accepts connections on one bound socket while alive."""

    def __init__(self, core: EngineCore, inbound: InboundSpec, sock: socket.socket) -> None:
        super().__init__(core.dispatcher)
        self.core = core
        self.inbound = inbound
        self.sock: socket.socket | None = sock
        self._ids = itertools.count(1)
        self._prefix = f"{core.flow_id_prefix}{inbound.index}-"

    def on_start(self) -> None:
        """Start accepting on the dispatcher loop."""
        assert self.sock is not None
        self.sock.setblocking(False)
        self.dispatcher.loop.add_reader(self.sock.fileno(), self._on_readable)

    def on_stop(self) -> None:
        """Stop accepting and close the socket (idempotent)."""
        self._teardown()

    def on_failure(self, *exc_info: object) -> None:
        """Never leave a dead listener's socket open."""
        self._teardown()

    def _teardown(self) -> None:
        if self.sock is None:
            return
        with contextlib.suppress(Exception):
            self.dispatcher.loop.remove_reader(self.sock.fileno())
        with contextlib.suppress(OSError):
            self.sock.close()
        self.sock = None

    def _on_readable(self) -> None:
        sock = self.sock
        if sock is None or self.actor_stopped.is_set():
            return
        for _ in range(_ACCEPT_BATCH):
            try:
                client, peer = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as ex:
                # EMFILE and friends: log and let the next readiness retry.
                logger.warning("accept on %s failed: %s", self.inbound.tag, ex)
                return
            client.setblocking(False)
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            flow_id = f"{self._prefix}{next(self._ids)}"
            FlowActor.start(self.core, self.inbound, client, peer, flow_id)
