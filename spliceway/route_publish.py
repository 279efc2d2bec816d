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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from spliceway.engine_core import EngineCore


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
