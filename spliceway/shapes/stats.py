"""Cumulative counters: the stats resource (``GET /api/v1/stats``, ``runtime.stats``)
and the ``stats.sampled`` payload, with the ``udp_upstream`` counters.

The OpenAPI component ``Stats`` and the ``stats.sampled`` table of docs/events.md are
generated from :class:`Stats`; ``UDP_COUNTERS`` (the names the engine counts under)
from :class:`UdpUpstreamCounters`.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field
from typing_extensions import TypedDict

from spliceway.shapes.flow import Count
from spliceway.shapes.schema import keys


class UdpUpstreamCounters(TypedDict):
    """``udp_upstream``: what the UDP relays did since start (the leading fields of the C
    relay's ``UdpStats``, plus what Python's upstreams count)."""

    active_associations: Annotated[Count, Field(description="Upstream associations open now.")]
    created_associations: Annotated[
        Count, Field(description="Upstream associations opened since start.")
    ]
    reused_associations: Annotated[
        Count,
        Field(description="New destinations that used an upstream association already open."),
    ]
    closed_associations: Annotated[
        Count,
        Field(
            description="Upstream associations closed (idle, or their client association ended)."
        ),
    ]
    idle_timeouts: Annotated[
        Count,
        Field(
            description="Upstream associations closed because every destination on them was "
            "idle for `runtime.udp_upstream_idle_timeout_seconds`."
        ),
    ]
    dropped_associations: Annotated[
        Count,
        Field(
            description="Client UDP ASSOCIATE requests refused because the engine could not "
            "open their relay socket."
        ),
    ]
    failed_association_attempts: Annotated[
        Count, Field(description="Upstream associations that could not be opened.")
    ]
    send_failures: Annotated[
        Count,
        Field(description="Datagrams a socket refused to send (towards a target or the client)."),
    ]
    recv_failures: Annotated[
        Count, Field(description="Failed reads on a relay or upstream socket.")
    ]
    packets_sent: Annotated[Count, Field(description="Datagrams sent to targets.")]
    packets_received: Annotated[
        Count, Field(description="Datagrams received from targets and relayed to clients.")
    ]


#: The ``udp_upstream`` counters, in order.
UDP_COUNTERS: tuple[str, ...] = keys(UdpUpstreamCounters)


class Stats(TypedDict):
    """Cumulative counters."""

    active_sessions: Annotated[Count, Field(description="Flows open now.")]
    total_started: Annotated[Count, Field(description="Flows started since the engine started.")]
    completed_sessions: Annotated[
        Count, Field(description="Flows completed, whatever their outcome.")
    ]
    failed_sessions: Annotated[Count, Field(description="Flows completed with outcome `failed`.")]
    blocked_sessions: Annotated[Count, Field(description="Flows completed with outcome `blocked`.")]
    direct_sessions: Annotated[Count, Field(description="Flows relayed by a `direct` outbound.")]
    chained_sessions: Annotated[
        Count, Field(description="Flows relayed through an upstream proxy.")
    ]
    bytes_up: Annotated[
        Count, Field(description="Payload bytes towards targets, open flows included.")
    ]
    bytes_down: Annotated[
        Count, Field(description="Payload bytes towards clients, open flows included.")
    ]
    udp_upstream: Annotated[
        UdpUpstreamCounters,
        Field(
            description="UDP counters. An *upstream association* is the upstream UDP socket a "
            "SOCKS5 UDP association uses for one outbound; every destination routed there "
            "shares it."
        ),
    ]
