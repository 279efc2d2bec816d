"""The FlowRecord: one revision of a flow, as events, queries and sinks carry it.

``spliceway.flows.records.FlowState.render`` builds it (typed as :class:`FlowRecord`),
the OpenAPI component ``FlowRecord`` and the record table of docs/events.md are
generated from it (``spliceway.shapes.schema``). Descriptions are the docs' text.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import Field
from typing_extensions import TypedDict

from spliceway.shapes.schema import OPAQUE, UNIX_MS_MARK, Ref

Count = Annotated[int, Field(ge=0)]
Port = Annotated[int, Field(ge=0, le=65535)]
UnixMs = Annotated[int, Field(ge=0), UNIX_MS_MARK]
NonEmpty = Annotated[str, Field(min_length=1)]

FlowStateName = Literal["opening", "active", "completed"]
ClientProtocol = Literal["socks5", "http", "http_connect", "tun"]
Network = Literal["tcp", "udp"]
ModeKind = Literal["rule", "global", "direct"]
RouteAction = Literal["pending", "route", "block"]
Outcome = Literal[
    "direct_relayed", "chained_relayed", "blocked", "failed", "cancelled", "engine_crashed"
]


class MatchedRule(TypedDict):
    """The rule that matched a flow (component ``MatchedRule``)."""

    index: Count
    condition: str


class Inbound(TypedDict):
    """``inbound``."""

    tag: Annotated[str, Field(description="Its tag.")]
    protocol: Annotated[
        str, Field(description="Its protocol: `socks5`, `http`, `mixed`, or `tun`.")
    ]
    client_protocol: NotRequired[
        Annotated[
            ClientProtocol,
            Field(
                description="What the client spoke, whatever the inbound offers (a `mixed` "
                "one both): `socks5` (CONNECT, and each destination of a UDP association), "
                "`http` (an absolute-URI request forwarded), `http_connect` (an HTTP "
                "`CONNECT` tunnel) or `tun`. Present in every record this build writes; "
                "absent from records written before it (a sink's older lines)."
            ),
        ]
    ]


class Source(TypedDict):
    """``source``."""

    ip: Annotated[str, Field(description="Client IP address.")]
    port: Annotated[Port, Field(description="Client port.")]
    process_id: NotRequired[
        Annotated[
            int,
            Field(
                ge=1,
                description="Process id of the client, when it runs on this host and was "
                "found (`runtime.process_lookup`).",
            ),
        ]
    ]
    process_name: NotRequired[
        Annotated[
            str,
            Field(
                description="Base name of that process's executable (`curl`); present with "
                "`process_id`."
            ),
        ]
    ]
    process_path: NotRequired[
        Annotated[
            str,
            Field(description="Path of that process's executable; present when it could be read."),
        ]
    ]


class Target(TypedDict):
    """``target``."""

    host: Annotated[
        str,
        Field(
            description="Host name or IP address the client asked for, canonically: any "
            "spelling of an address as that address (`2130706433` as `127.0.0.1`), a name "
            "without a trailing dot (see docs/routing.md)."
        ),
    ]
    port: Annotated[Port, Field(description="Port the client asked for.")]
    resolved_ip: NotRequired[
        Annotated[
            str,
            Field(
                description="The address a `direct` outbound connected to; present once the "
                "flow is relayed directly."
            ),
        ]
    ]
    sniffed_host: NotRequired[
        Annotated[
            str,
            Field(
                description="TLS SNI or HTTP Host seen in the client's first bytes; present "
                "when sniffing found one."
            ),
        ]
    ]
    fake_ip: NotRequired[
        Annotated[
            str,
            Field(
                description="The fake-ip address the client dialled (`runtime.dns.answer` "
                "`fake_ip`), which the engine mapped back to the name in `host`; present "
                "only then."
            ),
        ]
    ]


class Route(TypedDict):
    """``route``."""

    mode: Annotated[
        ModeKind,
        Ref("ModeKind"),
        Field(description="Routing mode that decided: `rule`, `global` or `direct`."),
    ]
    action: Annotated[
        RouteAction, Field(description="`pending` (not decided yet), `route` or `block`.")
    ]
    target: Annotated[str | None, Field(description="Outbound or group the decision named.")]
    matched_rule: Annotated[
        Annotated[MatchedRule, Ref("MatchedRule")] | None,
        Field(
            description="`{index, condition}` of the rule that matched (`index` from 0, "
            "`condition` such as `domain_suffix=example.com,port=443`); `null` when no rule "
            "did (`route.final`, or modes `global`/`direct`)."
        ),
    ]
    selection_chain: Annotated[
        list[str],
        Field(
            description="Tags walked from the route target down to the outbound used, groups "
            'first (`["proxy", "auto", "hop-a"]`); empty until routed.'
        ),
    ]


class OutboundRef(TypedDict):
    """``path.outbound``: the outbound a flow used."""

    tag: str
    protocol: str


class Remote(TypedDict):
    """``path.remote``: the peer the engine connected to."""

    host: str
    port: Port | None


class Path(TypedDict):
    """``path``."""

    outbound: Annotated[
        OutboundRef | None,
        Field(
            description="`{tag, protocol}` of the outbound used (a relay group's protocol is "
            "`relay`)."
        ),
    ]
    remote: Annotated[
        Remote | None,
        Field(
            description="`{host, port}` of the peer the engine connected to: the target, or "
            "the first proxy."
        ),
    ]
    relay_chain: Annotated[
        list[str], Field(description="Hops of a relay group, in order; else empty.")
    ]


class TrafficCounts(TypedDict):
    """``traffic``."""

    bytes_up: Annotated[Count, Field(description="Client payload bytes sent towards the target.")]
    bytes_down: Annotated[Count, Field(description="Payload bytes delivered to the client.")]
    inbound_rx_bytes: Annotated[
        Count, Field(description="Bytes read from the client, handshake included.")
    ]
    inbound_tx_bytes: Annotated[
        Count, Field(description="Bytes written to the client, replies included.")
    ]
    outbound_rx_bytes: Annotated[
        Count,
        Field(
            description="Bytes read from the upstream, proxy handshakes (and encryption) included."
        ),
    ]
    outbound_tx_bytes: Annotated[
        Count,
        Field(
            description="Bytes written to the upstream, proxy handshakes (and encryption) included."
        ),
    ]
    packets_up: Annotated[Count | None, Field(description="Always `null` for TCP.")]
    packets_down: Annotated[Count | None, Field(description="Always `null` for TCP.")]


class Throughput(TypedDict):
    """``throughput``."""

    upload_bps: Annotated[Count, Field(description="Bits per second towards the target.")]
    download_bps: Annotated[Count, Field(description="Bits per second towards the client.")]
    sampled_at_unix_ms: Annotated[UnixMs | None, Field(description="When they were measured.")]


class Timing(TypedDict):
    """``timing``."""

    started_at_unix_ms: Annotated[UnixMs, Field(description="When the handshake completed.")]
    last_activity_at_unix_ms: Annotated[UnixMs, Field(description="Last time a byte moved.")]
    ended_at_unix_ms: NotRequired[
        Annotated[UnixMs, Field(description="When it ended; once completed.")]
    ]
    duration_ms: NotRequired[
        Annotated[Count, Field(description="End minus start; once completed.")]
    ]


class FailureRemote(TypedDict):
    """``result.failure.remote``."""

    host: str | None
    port: NotRequired[Port | None]


class FailureDoc(TypedDict):
    """``result.failure``."""

    stage: Annotated[str, Field(description="Where it failed: one of the stages below.")]
    code: Annotated[str, Field(description="What failed: one of the codes below.")]
    message: Annotated[str, Field(description="The same in words, for people.")]
    remote: NotRequired[
        Annotated[
            FailureRemote,
            OPAQUE,
            Field(
                description="`{host, port?}` of the peer that failed (the target, or a proxy), "
                "when known."
            ),
        ]
    ]


class Result(TypedDict):
    """``result``."""

    outcome: Annotated[Outcome, Field(description="One of the outcomes below.")]
    close_reason: NotRequired[
        Annotated[str, Field(description="One of the close reasons below, when one applies.")]
    ]
    failure: NotRequired[Annotated[FailureDoc, Field(description="Why a failed flow failed.")]]


class FlowRecord(TypedDict):
    """A flow (FlowRecord); result only once completed."""

    flow_id: Annotated[
        NonEmpty, Field(description="Identifier of the flow, unique within one engine start.")
    ]
    revision: Annotated[
        int,
        Field(
            ge=1,
            description="1 for the first record of a flow, one more for each later record; a "
            "consumer keeps the highest.",
        ),
    ]
    state: Annotated[
        FlowStateName,
        Field(
            description="`opening` (handshake done, not relaying yet), `active` (relaying) or "
            "`completed`."
        ),
    ]
    network: Annotated[
        Network,
        Field(
            description="`tcp` or `udp` (one flow per UDP association and destination, or per "
            "TUN session)."
        ),
    ]
    inbound: Annotated[Inbound, Field(description="The inbound the client connected to.")]
    source: Annotated[Source, Field(description="The client's end of the connection.")]
    target: Annotated[Target, Field(description="What the client asked for.")]
    route: Annotated[Route, Field(description="How the flow was routed.")]
    path: Annotated[Path, Field(description="How the upstream was reached.")]
    traffic: Annotated[TrafficCounts, Field(description="Byte counters.")]
    throughput: Annotated[Throughput, Field(description="Rates over the last sampling interval.")]
    timing: Annotated[
        Timing,
        Field(
            description="When things happened.",
            json_schema_extra={
                "dependentRequired": {
                    "ended_at_unix_ms": ["duration_ms"],
                    "duration_ms": ["ended_at_unix_ms"],
                }
            },
        ),
    ]
    principal_key: NotRequired[
        Annotated[
            NonEmpty,
            Field(
                description="The flow's principal (as the envelope's `principal_key`): the "
                "authenticated user's key (`inbounds[].users`), or the one the flow hook "
                "gave (`api.flow_hook`); present only when it has one."
            ),
        ]
    ]
    labels: NotRequired[
        Annotated[
            dict[str, str],
            Field(
                description="The labels the flow hook gave the flow (`api.flow_hook`); present "
                "only then."
            ),
        ]
    ]
    result: NotRequired[
        Annotated[
            Result,
            Field(description="How it ended; present exactly when `state` is `completed`."),
        ]
    ]


#: What the OpenAPI component adds to the generated object: ``result`` (and the end of
#: ``timing``) exactly when the flow is completed.
FLOW_RECORD_CONDITIONS: dict[str, Any] = {
    "if": {"properties": {"state": {"const": "completed"}}, "required": ["state"]},
    "then": {
        "required": ["result"],
        "properties": {"timing": {"required": ["ended_at_unix_ms", "duration_ms"]}},
    },
    "else": {"not": {"required": ["result"]}},
}
