"""A TCP flow's states and transitions, without I/O (h11's ``Connection`` is the model).

:class:`FlowMachine` knows where one flow stands and what its end means. The
:class:`~spliceway.actors.flow.FlowActor` feeds it events (the handshake is done,
a route was applied, the dial succeeded, the relay ended...) and performs what it
answers: a :class:`Verdict` to record when the flow completes, a :class:`CloseAction`
when a close is asked for. The machine touches no socket, reads no clock and starts
no thread: what only the I/O side knows (is an upstream connection open, does a task
or C or the relay hold the flow) comes in with the events, so every path is tested
without sockets (tests/flows/test_machine.py).

The phases, in order::

    opening --Started--> handshaken --Routed--> routed --Dialing--> dialing
        --Dialed--> dialed --Relaying--> relaying --(an end)--> completed

A flow the C connection path runs is reported routed and relaying at once (C dialled
it: ``routed --Relaying--> relaying``). Every phase from ``handshaken`` has failure
edges to ``completed``: the hook denied it, a rule blocked it, the dial failed, an
internal error, a close. ``opening`` has none: before its handshake completed a flow
has no record, and ends without one. An event a phase has no edge for raises
:class:`IllegalTransition`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from spliceway.flows import records


class Phase(enum.StrEnum):
    """Where a flow stands."""

    OPENING = "opening"  # the inbound handshake; no record yet
    HANDSHAKEN = "handshaken"  # flow.started: the record exists, no route applied
    ROUTED = "routed"  # a route applied (an outbound chosen, or a block)
    DIALING = "dialing"  # connecting to the outbound
    DIALED = "dialed"  # the upstream is connected, the client not yet relayed
    RELAYING = "relaying"  # flow.routed: bytes move (the record's ``active``)
    COMPLETED = "completed"  # flow.completed: the outcome is final


#: The phases a flow has a record in and may still end from.
LIVE = frozenset({Phase.HANDSHAKEN, Phase.ROUTED, Phase.DIALING, Phase.DIALED, Phase.RELAYING})


class IllegalTransition(RuntimeError):
    """An event the flow's phase has no edge for (a bug in whoever fed it)."""

    def __init__(self, phase: Phase, event: object) -> None:
        super().__init__(f"flow machine: {type(event).__name__} is not legal in phase {phase}")
        self.phase = phase
        self.event = event


class Holder(enum.Enum):
    """What runs the flow when a close is asked for (the I/O side knows)."""

    RELAY = "relay"  # the C relay has its fds (a relay handle)
    CONN = "conn"  # the C connection path still holds it (dialling or sniffing)
    TASK = "task"  # a running establishment task on the dispatcher loop
    NOTHING = "nothing"  # nothing to stop


class CloseAction(enum.Enum):
    """What the actor does for a close request."""

    CLOSE_RELAY = "close_relay"  # ask the relay to end it; its completion ends the flow
    CLOSE_CONN = "close_conn"  # ask C to end it; its ENDED record ends the flow
    CANCEL_TASK = "cancel_task"  # cancel the task; its cancellation ends the flow
    IGNORE = "ignore"  # already ending or ended, or nothing runs it


# -- events ------------------------------------------------------------------------
# Immutable NamedTuples, as the actors' messages are: cheap to make, a few per flow.
# Being tuples, two events of different types may compare equal: the machine tells
# them apart by type, never by ==.


class Started(NamedTuple):
    """The handshake completed and the record started (flow.started)."""


class Routed(NamedTuple):
    """A route was applied; ``outbound``: it names an outbound (``chained`` through a
    proxy). C repeats the route it took in each of its records."""

    outbound: bool
    chained: bool = False


class Dialing(NamedTuple):
    """Connecting to the outbound began (or a pooled upstream is about to be reused)."""


class Dialed(NamedTuple):
    """The upstream connection is there."""


class Relaying(NamedTuple):
    """Bytes move: the relay has both fds, or Python forwards the request
    (flow.routed; the record's state ``active``)."""


class HookDenied(NamedTuple):
    """The flow hook denied the flow."""


class Blocked(NamedTuple):
    """A rule (or a block outbound, or no outbound) blocked the flow."""


class Failed(NamedTuple):
    """The flow failed: its dial, its upstream, or something internal."""

    failure: records.Failure


class Closed(NamedTuple):
    """The flow was stopped (a close, an engine stop, a task cancelled); ``dialled``:
    its upstream connection existed (the client was told the tunnel is open)."""

    dialled: bool


class Ended(NamedTuple):
    """The flow ended of itself (both sides done, the client gone, a forwarded
    request answered); ``dialled`` as for :class:`Closed`."""

    dialled: bool


class RelayEnded(NamedTuple):
    """The relay reported the flow's end: ``cause`` is the relay's ``Cause`` name
    (DONE, RESET, ERROR, IDLE, CLOSED, SHUTDOWN), ``side`` which socket ended it,
    ``remote`` the record's remote host and port."""

    cause: str
    side: str | None
    errno: int
    remote: dict[str, object]


Event = (
    Started
    | Routed
    | Dialing
    | Dialed
    | Relaying
    | HookDenied
    | Blocked
    | Failed
    | Closed
    | Ended
    | RelayEnded
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """How a flow completed: what flow.completed records."""

    outcome: str
    close_reason: str | None = None
    failure: records.Failure | None = None


#: Progress edges: (phase, event type) -> the phase after.
_PROGRESS: dict[tuple[Phase, type], Phase] = {
    (Phase.OPENING, Started): Phase.HANDSHAKEN,
    (Phase.HANDSHAKEN, Routed): Phase.ROUTED,
    # C repeats the route it took in a later record (a forwarded request's ENDED after
    # its ROUTED): the same phase, the same route.
    (Phase.ROUTED, Routed): Phase.ROUTED,
    (Phase.RELAYING, Routed): Phase.RELAYING,
    (Phase.ROUTED, Dialing): Phase.DIALING,
    (Phase.DIALING, Dialed): Phase.DIALED,
    (Phase.DIALED, Relaying): Phase.RELAYING,
    # C dialled the flow itself: its ROUTED record hands it to the relay.
    (Phase.ROUTED, Relaying): Phase.RELAYING,
}

#: Failure and end edges: event type -> the phases it may end a flow from.
_ENDS: dict[type, frozenset[Phase]] = {
    HookDenied: frozenset({Phase.HANDSHAKEN}),
    # C blocks before the Python side has applied a route when its record names none.
    Blocked: frozenset({Phase.HANDSHAKEN, Phase.ROUTED}),
    Failed: LIVE,
    Closed: LIVE,
    Ended: LIVE,
    RelayEnded: frozenset({Phase.RELAYING}),
}


class _Node(NamedTuple):
    """A phase with its edges, resolved once: a transition is one dict lookup by type."""

    phase: Phase
    edges: dict[type, _Node]
    live: bool


_NODES = {phase: _Node(phase, {}, phase in LIVE) for phase in Phase}
for (_phase, _kind), _after in _PROGRESS.items():
    _NODES[_phase].edges[_kind] = _NODES[_after]
for _kind, _phases in _ENDS.items():
    for _phase in _phases:
        _NODES[_phase].edges[_kind] = _NODES[Phase.COMPLETED]
_OPENING = _NODES[Phase.OPENING]
_COMPLETED = _NODES[Phase.COMPLETED]
_RELAYING = _NODES[Phase.RELAYING]


class FlowMachine:
    """One flow's phase, route facts and close request; events in, verdicts out."""

    __slots__ = ("_node", "chained", "close_reason", "close_requested", "has_outbound")

    def __init__(self) -> None:
        self._node = _OPENING
        #: Whether the route applied names an outbound, and one that chains through a
        #: proxy (kept: the outbound may leave the engine's outbounds by a reload).
        self.has_outbound = False
        self.chained = False
        #: A close went to C or the relay: the flow is ending, a second close is moot.
        self.close_requested = False
        #: Why the flow is being stopped (``records.MANUAL`` for flows.close), if it is.
        self.close_reason: str | None = None

    @property
    def phase(self) -> Phase:
        """Where the flow stands."""
        return self._node.phase

    @property
    def started(self) -> bool:
        """Whether the flow has a record (flow.started was published)."""
        return self._node is not _OPENING

    @property
    def live(self) -> bool:
        """Whether the flow has a record and has not completed."""
        return self._node.live

    @property
    def done(self) -> bool:
        """Whether the flow completed."""
        return self._node is _COMPLETED

    def handle(self, event: Event) -> Verdict | None:
        """Take ``event``: the new phase, and the verdict when it completes the flow.

        Raises :class:`IllegalTransition` when the phase has no edge for it (the
        phase is then unchanged)."""
        after = self._node.edges.get(type(event))
        if after is None:
            raise IllegalTransition(self._node.phase, event)
        if after is _COMPLETED:
            # Decided in the phase the flow ends from (a relayed outcome depends on it).
            verdict = self._verdict(event)
            self._node = after
            return verdict
        if type(event) is Routed and event.outbound:
            # Kept once known: a later report without an outbound (the table it
            # named is gone) does not undo the outbound the flow went to.
            self.has_outbound = True
            self.chained = event.chained
        self._node = after
        return None

    def close(self, reason: str | None, holder: Holder) -> CloseAction:
        """A close request (``reason``: ``records.MANUAL`` for flows.close, None for an
        engine stop) while ``holder`` runs the flow: what to do about it."""
        if self.done or self.close_requested:
            return CloseAction.IGNORE
        if holder is Holder.RELAY or holder is Holder.CONN:
            self.close_requested = True
            self.close_reason = reason
            return CloseAction.CLOSE_RELAY if holder is Holder.RELAY else CloseAction.CLOSE_CONN
        if holder is Holder.TASK:
            # The cancellation ends it; a later close may cancel again (harmlessly).
            self.close_reason = reason
            return CloseAction.CANCEL_TASK
        return CloseAction.IGNORE

    def _verdict(self, event: Event) -> Verdict:
        if isinstance(event, HookDenied):
            return Verdict(records.BLOCKED, None, records.HOOK_DENIED)
        if isinstance(event, Blocked):
            return Verdict(records.BLOCKED)
        if isinstance(event, Failed):
            return Verdict(records.FAILED, records.UPSTREAM_ERROR, event.failure)
        if isinstance(event, Closed):
            # flows.close is a manual cancel; an engine stop is an ordinary end.
            if self.close_reason == records.MANUAL:
                return Verdict(records.CANCELLED, records.MANUAL)
            return Verdict(self._relayed_outcome(event.dialled))
        if isinstance(event, Ended):
            return Verdict(self._relayed_outcome(event.dialled))
        assert isinstance(event, RelayEnded)
        return self._relay_verdict(event)

    def _relay_verdict(self, event: RelayEnded) -> Verdict:
        cause = event.cause
        if cause == "CLOSED":
            return self._verdict(Closed(dialled=True))
        if cause == "IDLE":
            return Verdict(self._relayed_outcome(True), records.IDLE_TIMEOUT)
        if cause in ("RESET", "ERROR") and event.side == "upstream":
            failure = records.Failure(
                "relay",
                "upstream_reset" if cause == "RESET" else "upstream_error",
                f"upstream connection failed: errno {event.errno}",
                dict(event.remote),
            )
            return Verdict(records.FAILED, records.UPSTREAM_ERROR, failure)
        # Both sides done, a client-side reset, or engine shutdown: an ordinary end.
        return Verdict(self._relayed_outcome(True))

    def _relayed_outcome(self, dialled: bool) -> str:
        # Stopped before its upstream connection existed (while routing or dialling):
        # there was never a path to relay over. (Once dialled, the client has been told
        # the tunnel is open, even if sniffing still holds the hand-off.)
        if not self.has_outbound or (self._node is not _RELAYING and not dialled):
            return records.CANCELLED
        return records.CHAINED_RELAYED if self.chained else records.DIRECT_RELAYED
