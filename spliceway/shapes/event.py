"""The event envelope every event travels in (docs/events.md, ``message Event`` of
``api/proto/spliceway/v1/control.proto``).

``spliceway.events.log.EventLog.emit`` builds it; the OpenAPI component
``EventEnvelope`` (before its per-type payload conditions) and the envelope table of
docs/events.md are generated from :class:`Envelope`. A test checks the proto's
``message Event`` against it, field by field.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import Field
from typing_extensions import TypedDict

from spliceway.shapes.flow import Count, NonEmpty, UnixMs
from spliceway.shapes.schema import Ref

#: The envelope's ``schema_id``: the version of this envelope.
SCHEMA_ID: Final = "service.event.v1"


class Envelope(TypedDict):
    """An event; flow events carry the FlowRecord."""

    schema_id: Annotated[
        Literal["service.event.v1"],
        Field(description="Always `service.event.v1`: the version of this envelope."),
    ]
    event_id: Annotated[
        NonEmpty,
        Field(
            description="Opaque identifier, unique across engine restarts; sinks deliver an "
            "event again with the same `event_id`, so receivers de-duplicate by it."
        ),
    ]
    event_type: Annotated[str, Ref("EventType"), Field(description="One of the types below.")]
    occurred_at_unix_ms: Annotated[
        UnixMs, Field(description="When it happened (a flow's end for `flow.completed`).")
    ]
    source_id: Annotated[
        str | None,
        Field(
            description="The webhook sink's `source_id` in what that sink delivers; `null` "
            "everywhere else."
        ),
    ]
    sequence: Annotated[
        Count,
        Field(
            description="Position in the event ring: 1 for the first event after each engine "
            "start, then one more per event. A `flow.snapshot` carries the sequence of the "
            "event before it (its watermark) instead of a new one."
        ),
    ]
    principal_key: Annotated[
        str | None,
        Field(
            description="The principal of a flow event: the authenticated user (see "
            "`inbounds[].users`), or the one the flow hook gave (`api.flow_hook`); `null` "
            "otherwise."
        ),
    ]
    labels: Annotated[
        dict[str, str],
        Field(
            description="The labels the flow hook gave a flow, on that flow's events; empty "
            "otherwise."
        ),
    ]
    payload: Annotated[dict[str, Any], Field(description="The type's own fields, listed below.")]
