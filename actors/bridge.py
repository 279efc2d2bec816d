"""The bridge between FlowActors and the C relay: hand-off and completion delivery.

The relay reports completions through an eventfd that stays readable while any
are pending. The dispatcher loop watches it, drains the completions and tells
each flow's actor ``RelayFinished``. There is deliberately no reaper thread:
a second Python thread woken a thousand times a second takes the GIL every
time the dispatcher releases it for a syscall, which measured as ~100 us stalls
per hand-off. Hand-off and delivery both run on the dispatcher thread, so a flow
that completes before ``hand_off`` returns is still routed to its actor.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import pykka
from spliceway.actors.messages import RelayFinished

from spliceway.relay import Completion, Counters, Relay

if TYPE_CHECKING:
    from spliceway.actors.dispatcher import Dispatcher

    from spliceway.outbounds import SealedSession

logger = logging.getLogger(__name__)


def relay_loops() -> int:
    """How many C relay loops the engine runs: one per usable CPU but one.

    The Python dispatcher (handshakes, routing, events) needs a core of its own,
    and on a small host the upstreams (an ss-server, another proxy) share the
    CPUs too: with as many busy relay loops as CPUs, they starve, and measured
    shadowsocks goodput over 8 connections fell to 0.85x of ss-local on 2 CPUs
    (1.10x with one loop).
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)


class RelayBridge:
    """Owns the relay and the handle -> actor map; delivers completions on the loop."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.relay = Relay(loops=relay_loops())
        self._dispatcher = dispatcher
        self._actors: dict[int, pykka.ActorRef[Any]] = {}
        self._attached = False

    def attach(self) -> None:
        """Start watching the completion fd (call on the dispatcher thread)."""
        self._dispatcher.loop.add_reader(self.relay.fileno(), self._on_ready)
        self._attached = True

    def hand_off(
        self,
        client_fd: int,
        upstream_fd: int,
        idle_timeout_ms: int,
        actor: pykka.ActorRef[Any],
        sealed: SealedSession | None = None,
    ) -> int:
        """Give both fds to the relay (dispatcher thread); on success the relay owns them.

        With ``sealed`` the upstream speaks shadowsocks: the caller has sent its salt
        and sealed header, and the relay's AEAD path continues that session.
        """
        if sealed is None:
            handle = self.relay.add(client_fd, upstream_fd, idle_timeout_ms)
        else:
            handle = self.relay.add_aead(
                client_fd,
                upstream_fd,
                idle_timeout_ms,
                cipher=sealed.cipher,
                master_key=sealed.master_key,
                enc_subkey=sealed.encryptor.subkey,
                enc_nonce=sealed.encryptor.nonce_counter,
            )
        self._actors[handle] = actor
        return handle

    def counters(self, handles: list[int]) -> list[Counters | None]:
        """Live counters for many flows in one C call."""
        return self.relay.counters_many(handles)

    def request_close(self, handle: int) -> bool:
        """Ask the relay to close a flow; False if it already finished."""
        return self.relay.request_close(handle)

    def _on_ready(self) -> None:
        for completion in self.relay.drain():
            self._deliver(completion)

    def _deliver(self, completion: Completion) -> None:
        actor = self._actors.pop(completion.handle, None)
        if actor is None:
            logger.warning("relay completion for unknown handle %#x", completion.handle)
            return
        try:
            actor.tell(RelayFinished(completion))
        except pykka.ActorDeadError:
            logger.warning("flow actor of handle %#x died before its completion", completion.handle)

    def shutdown(self) -> None:
        """Stop the relay (any thread): open flows complete with SHUTDOWN, still delivered."""
        self.relay.close()

    def detach(self) -> None:
        """Deliver what is left and stop watching (dispatcher thread, after shutdown)."""
        if self._attached:
            self._on_ready()
            # A shut-down relay keeps its eventfd readable; stop watching it.
            self._dispatcher.loop.remove_reader(self.relay.fileno())
            self._attached = False
