"""Messages between the engine's actors: immutable values, never shared dicts."""

from __future__ import annotations

from typing import Any, NamedTuple

# What a command sends (flows.close) is the control plane's, defined below the actors.
from spliceway.control.messages import CloseFlow

__all__ = [
    "CloseFlow",
    "ConnEnded",
    "ConnRouted",
    "ConnTakeOver",
    "RelayFinished",
    "StopFlow",
    "TrafficSample",
]


class RelayFinished(NamedTuple):
    """The C relay completed a flow (delivered by the relay bridge on the dispatcher loop)."""

    completion: Any  # spliceway.native.relay.Completion


class TrafficSample(NamedTuple):
    """The stats sampler read new relay counters for a flow."""

    counters: Any  # spliceway.native.relay.Counters
    sampled_at_unix_ms: int


class StopFlow(NamedTuple):
    """Engine shutdown: end the flow without a manual close reason."""


class ConnRouted(NamedTuple):
    """The C connection path dialled and handed the flow to the relay."""

    record: Any  # spliceway.native.conn.ConnRecord (kind ROUTED)


class ConnEnded(NamedTuple):
    """The C connection path ended the flow before the relay (blocked, failed, closed)."""

    record: Any  # spliceway.native.conn.ConnRecord (kind ENDED)


class ConnTakeOver(NamedTuple):
    """The C connection path started this flow, then found only Python can route it:
    the connection is the flow actor's now, to carry on from the route."""

    deferred: Any  # spliceway.native.conn.Deferred (stage ROUTE, flow set)
