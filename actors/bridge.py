"""The bridge between FlowActors and the C relay: hand-off and the reaper thread.

The relay reports completions through an eventfd; one reaper thread waits on it
(without the GIL) and tells each completed flow's actor ``RelayFinished``. A
handle is mapped to its actor under the same lock as the hand-off, so a flow
that completes before ``add`` returns is still routed to its actor.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pykka
from spliceway.actors.messages import RelayFinished
from spliceway.relay import Completion, Counters, Relay

logger = logging.getLogger(__name__)


class RelayBridge:
    """Owns the relay, the handle -> actor map and the reaper thread."""

    def __init__(self, loops: int = 0) -> None:
        self.relay = Relay(loops=loops)
        self._actors: dict[int, pykka.ActorRef[Any]] = {}
        self._lock = threading.Lock()
        self._stopping = False
        self._thread = threading.Thread(target=self._reap, name="spliceway-reaper", daemon=True)

    def start(self) -> None:
        """Start the reaper thread."""
        self._thread.start()

    def hand_off(
        self, client_fd: int, upstream_fd: int, idle_timeout_ms: int, actor: pykka.ActorRef[Any]
    ) -> int:
        """Give both fds to the relay; on success the relay owns them."""
        with self._lock:
            handle = self.relay.add(client_fd, upstream_fd, idle_timeout_ms)
            self._actors[handle] = actor
        return handle

    def counters(self, handles: list[int]) -> list[Counters | None]:
        """Live counters for many flows in one C call."""
        return self.relay.counters_many(handles)

    def request_close(self, handle: int) -> bool:
        """Ask the relay to close a flow; False if it already finished."""
        return self.relay.request_close(handle)

    def _reap(self) -> None:
        while True:
            completions = self.relay.wait(0.5)
            for completion in completions:
                self._deliver(completion)
            if self._stopping and not completions:
                return

    def _deliver(self, completion: Completion) -> None:
        with self._lock:
            actor = self._actors.pop(completion.handle, None)
        if actor is None:
            logger.warning("relay completion for unknown handle %#x", completion.handle)
            return
        try:
            actor.tell(RelayFinished(completion))
        except pykka.ActorDeadError:
            logger.warning("flow actor of handle %#x died before its completion", completion.handle)

    def stop(self) -> None:
        """Close the relay (remaining flows complete as SHUTDOWN) and join the reaper."""
        self._stopping = True
        self.relay.close()
        self._thread.join(10)
