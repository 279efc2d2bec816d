"""EngineSupervisor: owns the listeners, the policy group actors, the stats sampler
and the routing mode."""

from __future__ import annotations

import contextlib
import socket
from typing import TYPE_CHECKING, Any

import pykka
from spliceway.actors.dispatcher import LoopActor
from spliceway.actors.listener import ListenerActor
from spliceway.actors.policy import PolicyGroupActor
from spliceway.actors.stats import StatsSamplerActor

if TYPE_CHECKING:
    from spliceway.engine_core import EngineCore


class EngineSupervisor(LoopActor):
    """Starts and stops the engine's long-lived actors; serialises mode changes."""

    def __init__(self, core: EngineCore, sockets: list[socket.socket]) -> None:
        super().__init__(core.dispatcher)
        self.core = core
        self._sockets = sockets
        self.listeners: list[pykka.ActorRef[Any]] = []
        self.sampler: pykka.ActorRef[Any] | None = None

    def on_start(self) -> None:
        """Start the group actors, then one ListenerActor per bound inbound, and the sampler."""
        # Groups first: the first accepted flow may already route through one.
        for view in self.core.policies.views():
            self.core.group_actors[view.tag] = PolicyGroupActor.start(self.core, view)
        for spec, sock in zip(self.core.inbounds, self._sockets, strict=True):
            ref = ListenerActor.start(self.core, spec, sock)
            self.listeners.append(ref)
            self.core.listener_refs[spec.index] = ref
        self._sockets = []
        interval = self.core.config.runtime.stats_interval_ms
        self.sampler = StatsSamplerActor.start(self.core, interval)

    def stop_listeners(self) -> None:
        """Stop accepting new connections (first step of shutdown)."""
        self.core.listener_refs.clear()
        for ref in self.listeners:
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop(block=False)
        self.listeners = []

    def set_mode(self, mode: str, outbound: str | None) -> bool:
        """Switch the routing mode for new flows."""
        self.core.set_mode(mode, outbound)
        return True

    def on_stop(self) -> None:
        """Stop the actors this supervisor started."""
        self.stop_listeners()
        if self.sampler is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                self.sampler.stop(block=False)
            self.sampler = None
        for ref in self.core.group_actors.values():
            with contextlib.suppress(pykka.ActorDeadError):
                ref.stop(block=False)
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
