"""A UDP flow's record and events, shared by the actors that own UDP flows (SOCKS5 UDP
associations in ``actors/udp.py``, the TUN's sessions in ``actors/tun_udp.py``).

Each actor keeps its own per-destination state; these functions are the part that is
the same for every UDP flow: how the record ends and is counted, and how it is listed
and announced.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from spliceway import records
from spliceway.events import now_ms
from spliceway.runtime import FlowEntry

if TYPE_CHECKING:
    from spliceway.actors.flow import FlowDeps


def complete(
    deps: FlowDeps,
    actor_ref: Any,
    s: records.FlowState,
    outcome: str | None,
    failure: records.Failure | None,
    *,
    chained: bool,
) -> None:
    """End the record (``outcome`` None: relayed, through a proxy when ``chained``),
    count it in the engine's totals, and publish ``flow.completed``."""
    s.state = "completed"
    s.outcome = outcome or (records.CHAINED_RELAYED if chained else records.DIRECT_RELAYED)
    s.failure = failure
    if failure is not None and outcome == records.FAILED:
        s.close_reason = records.UPSTREAM_ERROR
    s.ended_at_unix_ms = max(now_ms(), s.started_at_unix_ms)
    deps.counters.count_completed(s)
    publish(deps, actor_ref, s, "flow.completed", occurred=s.ended_at_unix_ms)


def publish(
    deps: FlowDeps,
    actor_ref: Any,
    s: records.FlowState,
    event_type: str,
    occurred: int | None = None,
) -> None:
    """A lifecycle event with the record's next revision; listed while open."""
    s.revision += 1
    record = s.render()
    if s.state == "completed":
        deps.flows.remove(s.flow_id)
    else:
        deps.flows.put(s.flow_id, FlowEntry(actor_ref, record, s.inbound_tag, s.principal_key))
    deps.log.emit(
        event_type,
        records.lifecycle_payload(s, record),
        principal_key=s.principal_key,
        occurred_at_unix_ms=occurred,
    )


def publish_updated(deps: FlowDeps, actor_ref: Any, s: records.FlowState) -> None:
    """``flow.updated`` with the record's next revision (counts moved)."""
    s.revision += 1
    record = s.render()
    deps.flows.put(s.flow_id, FlowEntry(actor_ref, record, s.inbound_tag, s.principal_key))
    deps.log.emit("flow.updated", records.updated_payload(s, record), principal_key=s.principal_key)
