"""One event sink's status: an item of ``GET /api/v1/sinks``
(``spliceway.connector.service.sink_status`` builds it).

The OpenAPI component ``Sink`` is generated from :class:`SinkStatus`.
"""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict

from spliceway.shapes.flow import Count, UnixMs


class OutboxRecovery(TypedDict):
    """``outbox_recovery``: the outbox's state when it was opened, and what repairing it took."""

    state: Literal["clean", "repaired"]
    recovered_records: Count
    lost_records: Count
    damaged_regions: Count
    truncated_bytes: Count
    damaged_ledger_slots: Count
    unreadable_segments: Count
    errors: list[str]


class OutboxStorage(TypedDict):
    """The outbox's file system: space left, and whether writes are blocked for want of it."""

    available_bytes: Count
    total_bytes: Count
    reserve_bytes: Count
    maintenance_reserve_bytes: Count
    write_blocked: bool


class Delivery(TypedDict):
    """What the sink is delivering now (present while it has work)."""

    in_flight: Count
    retry_pending: Count
    ack_retry_pending: Count
    durable_pending: Count
    next_retry_at_unix_ms: UnixMs | None


class SinkStatus(TypedDict):
    """One event sink's delivery state. Extensions: type, total_dead_lettered,
    total_discarded, dead_letters (kept on disk now), cursor_sequence (the last event-log
    sequence this sink has taken in)."""

    name: str
    type: Literal["webhook", "jsonl", "nats"]
    pending: Count
    total_delivered: Count
    total_failed: Count
    total_dead_lettered: Count
    total_discarded: Count
    dead_letters: Count
    replay_gaps: Count
    cursor_sequence: Count
    last_success_at_unix_ms: UnixMs | None
    last_failure_at_unix_ms: UnixMs | None
    last_error: str | None
    outbox_recovery: Annotated[
        OutboxRecovery,
        Field(description="What opening the outbox found; counts are of this start."),
    ]
    outbox_storage: NotRequired[OutboxStorage]
    delivery: NotRequired[Delivery]
