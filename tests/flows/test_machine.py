"""FlowMachine without sockets: every edge, every verdict, every refusal."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.flows import records
from spliceway.flows.machine import (
    LIVE,
    Blocked,
    CloseAction,
    Closed,
    Dialed,
    Dialing,
    Ended,
    Failed,
    FlowMachine,
    Holder,
    HookDenied,
    IllegalTransition,
    Phase,
    RelayEnded,
    Relaying,
    Routed,
    Started,
    Verdict,
)

REMOTE = {"host": "203.0.113.7", "port": 443}
DIAL_FAILURE = records.Failure("connect", "connection_refused", "refused", {"host": "h"})

#: The events that lead a fresh machine to each phase (through a direct outbound).
PATHS: dict[Phase, list[Any]] = {
    Phase.OPENING: [],
    Phase.HANDSHAKEN: [Started()],
    Phase.ROUTED: [Started(), Routed(outbound=True)],
    Phase.DIALING: [Started(), Routed(outbound=True), Dialing()],
    Phase.DIALED: [Started(), Routed(outbound=True), Dialing(), Dialed()],
    Phase.RELAYING: [Started(), Routed(outbound=True), Dialing(), Dialed(), Relaying()],
}
PATHS[Phase.COMPLETED] = [*PATHS[Phase.RELAYING], Ended(True)]

#: One instance of every event type.
EVENTS: list[Any] = [
    Started(),
    Routed(outbound=True),
    Dialing(),
    Dialed(),
    Relaying(),
    HookDenied(),
    Blocked(),
    Failed(DIAL_FAILURE),
    Closed(dialled=False),
    Ended(dialled=False),
    RelayEnded("DONE", None, 0, REMOTE),
]

#: Every legal edge: (phase, event type) -> the phase after.
LEGAL: dict[tuple[Phase, type], Phase] = {
    (Phase.OPENING, Started): Phase.HANDSHAKEN,
    (Phase.HANDSHAKEN, Routed): Phase.ROUTED,
    (Phase.ROUTED, Routed): Phase.ROUTED,
    (Phase.RELAYING, Routed): Phase.RELAYING,
    (Phase.ROUTED, Dialing): Phase.DIALING,
    (Phase.DIALING, Dialed): Phase.DIALED,
    (Phase.DIALED, Relaying): Phase.RELAYING,
    (Phase.ROUTED, Relaying): Phase.RELAYING,
    (Phase.HANDSHAKEN, HookDenied): Phase.COMPLETED,
    (Phase.HANDSHAKEN, Blocked): Phase.COMPLETED,
    (Phase.ROUTED, Blocked): Phase.COMPLETED,
    (Phase.RELAYING, RelayEnded): Phase.COMPLETED,
    **{(phase, kind): Phase.COMPLETED for phase in LIVE for kind in (Failed, Closed, Ended)},
}


def at(phase: Phase, **routed: Any) -> FlowMachine:
    """A machine driven to ``phase`` (``routed``: the Routed event's fields)."""
    machine = FlowMachine()
    for event in PATHS[phase]:
        if isinstance(event, Routed) and routed:
            event = Routed(**routed)
        machine.handle(event)
    assert machine.phase is phase
    return machine


def test_a_new_flow_is_opening_without_a_record():
    machine = FlowMachine()
    assert machine.phase is Phase.OPENING
    assert not machine.started
    assert not machine.live
    assert not machine.done


@pytest.mark.parametrize(
    ("phase", "event"),
    [(phase, event) for phase in Phase for event in EVENTS],
    ids=lambda v: v.value if isinstance(v, Phase) else type(v).__name__,
)
def test_every_phase_takes_exactly_its_edges(phase, event):
    machine = at(phase)
    after = LEGAL.get((phase, type(event)))
    if after is None:
        with pytest.raises(IllegalTransition, match=f"{type(event).__name__} is not legal"):
            machine.handle(event)
        assert machine.phase is phase
        return
    verdict = machine.handle(event)
    assert machine.phase is after
    assert (verdict is not None) == (after is Phase.COMPLETED)


def test_an_illegal_transition_names_the_phase_and_the_event():
    machine = at(Phase.OPENING)
    with pytest.raises(IllegalTransition) as caught:
        machine.handle(Relaying())
    assert caught.value.phase is Phase.OPENING
    assert isinstance(caught.value.event, Relaying)
    assert "phase opening" in str(caught.value)


def test_the_python_tunnel_path_ends_direct_relayed():
    machine = FlowMachine()
    for event in (Started(), Routed(outbound=True), Dialing(), Dialed(), Relaying()):
        assert machine.handle(event) is None
    assert machine.live
    verdict = machine.handle(RelayEnded("DONE", None, 0, REMOTE))
    assert verdict == Verdict(records.DIRECT_RELAYED)
    assert machine.done


def test_a_flow_c_dialled_goes_from_routed_to_relaying():
    machine = at(Phase.ROUTED, outbound=True, chained=True)
    machine.handle(Relaying())
    assert machine.phase is Phase.RELAYING
    assert machine.handle(RelayEnded("DONE", None, 0, REMOTE)) == Verdict(records.CHAINED_RELAYED)


def test_the_hook_denying_a_flow_blocks_it():
    verdict = at(Phase.HANDSHAKEN).handle(HookDenied())
    assert verdict == Verdict(records.BLOCKED, None, records.HOOK_DENIED)


@pytest.mark.parametrize("phase", [Phase.HANDSHAKEN, Phase.ROUTED])
def test_a_blocked_flow_is_blocked_without_a_close_reason(phase):
    assert at(phase).handle(Blocked()) == Verdict(records.BLOCKED)


@pytest.mark.parametrize("phase", sorted(LIVE))
def test_a_failure_fails_the_flow_as_an_upstream_error(phase):
    verdict = at(phase).handle(Failed(DIAL_FAILURE))
    assert verdict == Verdict(records.FAILED, records.UPSTREAM_ERROR, DIAL_FAILURE)


@pytest.mark.parametrize(
    ("phase", "dialled", "outcome"),
    [
        (Phase.HANDSHAKEN, False, records.CANCELLED),  # no outbound yet
        (Phase.HANDSHAKEN, True, records.CANCELLED),
        (Phase.ROUTED, False, records.CANCELLED),  # never a path to relay over
        (Phase.DIALING, False, records.CANCELLED),
        (Phase.DIALED, True, records.DIRECT_RELAYED),  # told the tunnel is open
        (Phase.ROUTED, True, records.DIRECT_RELAYED),  # C dialled it, still sniffing
        (Phase.RELAYING, False, records.DIRECT_RELAYED),
    ],
)
def test_a_stopped_flow_was_relayed_once_its_upstream_existed(phase, dialled, outcome):
    assert at(phase).handle(Closed(dialled)) == Verdict(outcome)
    assert at(phase).handle(Ended(dialled)) == Verdict(outcome)


def test_a_manual_close_cancels_whatever_the_phase():
    for phase in LIVE:
        machine = at(phase)
        machine.close(records.MANUAL, Holder.TASK)
        assert machine.handle(Closed(dialled=True)) == Verdict(records.CANCELLED, records.MANUAL)


def test_a_chained_route_ends_chained_relayed():
    machine = at(Phase.RELAYING, outbound=True, chained=True)
    assert machine.handle(Ended(True)) == Verdict(records.CHAINED_RELAYED)


def test_a_route_without_an_outbound_never_relays():
    machine = at(Phase.ROUTED, outbound=False)
    assert not machine.has_outbound
    assert machine.handle(Closed(dialled=True)) == Verdict(records.CANCELLED)


def test_a_later_route_report_keeps_the_outbound_and_its_chaining():
    machine = at(Phase.ROUTED, outbound=True, chained=True)
    machine.handle(Routed(outbound=False))
    assert machine.has_outbound
    assert machine.chained


@pytest.mark.parametrize(
    ("cause", "side", "expected"),
    [
        ("DONE", None, Verdict(records.DIRECT_RELAYED)),
        ("SHUTDOWN", None, Verdict(records.DIRECT_RELAYED)),
        ("RESET", "client", Verdict(records.DIRECT_RELAYED)),
        ("ERROR", "client", Verdict(records.DIRECT_RELAYED)),
        ("IDLE", None, Verdict(records.DIRECT_RELAYED, records.IDLE_TIMEOUT)),
        ("CLOSED", None, Verdict(records.DIRECT_RELAYED)),
        (
            "RESET",
            "upstream",
            Verdict(
                records.FAILED,
                records.UPSTREAM_ERROR,
                records.Failure(
                    "relay", "upstream_reset", "upstream connection failed: errno 104", REMOTE
                ),
            ),
        ),
        (
            "ERROR",
            "upstream",
            Verdict(
                records.FAILED,
                records.UPSTREAM_ERROR,
                records.Failure(
                    "relay", "upstream_error", "upstream connection failed: errno 104", REMOTE
                ),
            ),
        ),
    ],
)
def test_the_relay_end_maps_to_its_outcome(cause, side, expected):
    machine = at(Phase.RELAYING)
    assert machine.handle(RelayEnded(cause, side, 104, REMOTE)) == expected


def test_a_relay_closed_by_flows_close_is_a_manual_cancel():
    machine = at(Phase.RELAYING)
    assert machine.close(records.MANUAL, Holder.RELAY) is CloseAction.CLOSE_RELAY
    verdict = machine.handle(RelayEnded("CLOSED", None, 0, REMOTE))
    assert verdict == Verdict(records.CANCELLED, records.MANUAL)


def test_an_idle_relay_with_no_outbound_recorded_is_cancelled():
    machine = at(Phase.HANDSHAKEN)
    machine.handle(Routed(outbound=False))
    machine.handle(Relaying())
    assert machine.handle(RelayEnded("IDLE", None, 0, REMOTE)) == Verdict(
        records.CANCELLED, records.IDLE_TIMEOUT
    )


@pytest.mark.parametrize(
    ("holder", "action"),
    [
        (Holder.RELAY, CloseAction.CLOSE_RELAY),
        (Holder.CONN, CloseAction.CLOSE_CONN),
    ],
)
def test_a_close_goes_once_to_c_or_the_relay(holder, action):
    machine = at(Phase.RELAYING)
    assert machine.close(records.MANUAL, holder) is action
    assert machine.close_requested
    assert machine.close_reason == records.MANUAL
    # It is ending: a second close (even an engine stop) changes nothing.
    assert machine.close(None, holder) is CloseAction.IGNORE
    assert machine.close_reason == records.MANUAL


def test_a_close_cancels_a_running_task_each_time_it_is_asked():
    machine = at(Phase.OPENING)
    assert machine.close(None, Holder.TASK) is CloseAction.CANCEL_TASK
    assert not machine.close_requested
    assert machine.close(records.MANUAL, Holder.TASK) is CloseAction.CANCEL_TASK
    assert machine.close_reason == records.MANUAL


def test_a_close_with_nothing_running_or_after_the_end_is_ignored():
    assert at(Phase.HANDSHAKEN).close(records.MANUAL, Holder.NOTHING) is CloseAction.IGNORE
    done = at(Phase.COMPLETED)
    for holder in Holder:
        assert done.close(records.MANUAL, holder) is CloseAction.IGNORE
    assert done.close_reason is None


_events = st.one_of(
    st.just(Started()),
    st.builds(Routed, outbound=st.booleans(), chained=st.booleans()),
    st.just(Dialing()),
    st.just(Dialed()),
    st.just(Relaying()),
    st.just(HookDenied()),
    st.just(Blocked()),
    st.just(Failed(DIAL_FAILURE)),
    st.builds(Closed, dialled=st.booleans()),
    st.builds(Ended, dialled=st.booleans()),
    st.builds(
        RelayEnded,
        cause=st.sampled_from(["DONE", "RESET", "ERROR", "IDLE", "CLOSED", "SHUTDOWN"]),
        side=st.sampled_from([None, "client", "upstream"]),
        errno=st.integers(0, 200),
        remote=st.just(REMOTE),
    ),
)
_closes = st.tuples(st.sampled_from([None, records.MANUAL]), st.sampled_from(list(Holder)))

_ORDER = list(Phase)
_OUTCOMES = {
    records.DIRECT_RELAYED,
    records.CHAINED_RELAYED,
    records.BLOCKED,
    records.FAILED,
    records.CANCELLED,
}


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_events, _closes), max_size=20))
def test_any_event_sequence_moves_forward_and_completes_at_most_once(steps):
    machine = FlowMachine()
    verdicts = []
    for step in steps:
        before = machine.phase
        if type(step) is tuple:  # a close; events are NamedTuples
            machine.close(*step)
            assert machine.phase is before
            continue
        try:
            verdict = machine.handle(step)
        except IllegalTransition:
            assert machine.phase is before
            assert (before, type(step)) not in LEGAL
            continue
        assert LEGAL[(before, type(step))] is machine.phase
        assert _ORDER.index(machine.phase) >= _ORDER.index(before)
        if verdict is not None:
            verdicts.append(verdict)
            assert verdict.outcome in _OUTCOMES
            # A relayed outcome needs an outbound the flow was routed to.
            if verdict.outcome in (records.DIRECT_RELAYED, records.CHAINED_RELAYED):
                assert machine.has_outbound
    assert len(verdicts) == (1 if machine.done else 0)
