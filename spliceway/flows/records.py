"""FlowRecords and the flow event payloads built from them (docs/events.md).

A ``FlowState`` is the mutable state a FlowActor owns; ``render`` turns it into
the immutable record dict that events and queries carry, of the shape
``spliceway.shapes.flow.FlowRecord`` declares (the OpenAPI component and the docs'
table are generated from that declaration). Everything here is pure: no sockets,
no clock except the timestamps passed in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from spliceway.shapes.flow import (
        ClientProtocol,
        FailureDoc,
        FlowRecord,
        Inbound,
        Remote,
        Source,
        Target,
        Timing,
        TrafficCounts,
    )

#: Outcomes of a completed flow (docs/events.md, "Outcomes").
DIRECT_RELAYED = "direct_relayed"
CHAINED_RELAYED = "chained_relayed"
BLOCKED = "blocked"
FAILED = "failed"
CANCELLED = "cancelled"
#: Completed at the next start: the engine was killed or crashed while the flow was open.
ENGINE_CRASHED = "engine_crashed"

#: Standard close reasons.
MANUAL = "manual"
IDLE_TIMEOUT = "idle_timeout"
UPSTREAM_ERROR = "upstream_error"


@dataclass(slots=True)
class Traffic:
    """Byte counters of a flow; the four boundary counters include handshakes."""

    bytes_up: int = 0
    bytes_down: int = 0
    inbound_rx_bytes: int = 0
    inbound_tx_bytes: int = 0
    outbound_rx_bytes: int = 0
    outbound_tx_bytes: int = 0
    #: The upstream side carries ciphertext (shadowsocks): user bytes going up are
    #: what the relay read from the client, not what it wrote to the upstream.
    sealed: bool = False
    #: Datagrams each way (UDP flows; None for TCP, which has no packet counts).
    packets_up: int | None = None
    packets_down: int | None = None

    def copy(self, *, sealed: bool) -> Traffic:
        """These counts, with ``sealed`` set (what ``dataclasses.replace`` does, cheaper)."""
        return Traffic(
            self.bytes_up,
            self.bytes_down,
            self.inbound_rx_bytes,
            self.inbound_tx_bytes,
            self.outbound_rx_bytes,
            self.outbound_tx_bytes,
            sealed,
        )

    def with_relay(self, c: Any) -> Traffic:
        """These counts (taken at hand-off) plus what the relay moved since (``relay.Counters``).

        The client socket is the inbound boundary and the upstream socket the
        outbound one; relayed user bytes are what the relay wrote to each side.
        """
        bytes_up, bytes_down = self.payload_with_relay(c)
        return Traffic(
            bytes_up=bytes_up,
            bytes_down=bytes_down,
            inbound_rx_bytes=self.inbound_rx_bytes + c.client_rx,
            inbound_tx_bytes=self.inbound_tx_bytes + c.client_tx,
            outbound_rx_bytes=self.outbound_rx_bytes + c.upstream_rx,
            outbound_tx_bytes=self.outbound_tx_bytes + c.upstream_tx,
            sealed=self.sealed,
        )

    def payload_with_relay(self, c: Any) -> tuple[int, int]:
        """``(bytes_up, bytes_down)`` of :meth:`with_relay`, without building it (the stats
        views sum these over every open flow)."""
        return (
            self.bytes_up + (c.client_rx if self.sealed else c.upstream_tx),
            self.bytes_down + c.client_tx,
        )

    def to_dict(self) -> TrafficCounts:
        """Render as the record's ``traffic`` object (TCP has no packet counts)."""
        return {
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "inbound_rx_bytes": self.inbound_rx_bytes,
            "inbound_tx_bytes": self.inbound_tx_bytes,
            "outbound_rx_bytes": self.outbound_rx_bytes,
            "outbound_tx_bytes": self.outbound_tx_bytes,
            "packets_up": self.packets_up,
            "packets_down": self.packets_down,
        }


@dataclass(slots=True)
class Failure:
    """Why a flow failed: the stage, a stable code, a message, the remote if known."""

    stage: str
    code: str
    message: str
    remote: dict[str, Any] | None = None

    def to_dict(self) -> FailureDoc:
        """Render as ``result.failure``."""
        out: FailureDoc = {"stage": self.stage, "code": self.code, "message": self.message}
        if self.remote is not None:
            out["remote"] = cast("Any", self.remote)
        return out


#: A flow the flow hook denied (outcome blocked).
HOOK_DENIED = Failure("hook", "hook_denied", "the flow hook denied the flow")
#: A flow the engine completed at its next start (outcome engine_crashed).
ENGINE_CRASHED_FAILURE = Failure(
    "internal",
    "engine_crashed",
    "the engine stopped (killed or crashed) before the flow completed; it was completed "
    "at the engine's next start with the bytes last reported for it",
)


@dataclass(slots=True)
class FlowState:
    """Everything a FlowActor knows about its flow; rendered into FlowRecords."""

    flow_id: str
    inbound_tag: str
    inbound_protocol: str
    source_ip: str
    source_port: int
    started_at_unix_ms: int
    mode: str
    network: str = "tcp"
    #: What the client spoke (``inbound.client_protocol``): ``socks5``, ``http``
    #: (forwarded), ``http_connect`` or ``tun``; None only in a state rebuilt from a
    #: record an older version wrote.
    client_protocol: ClientProtocol | None = None
    revision: int = 0
    state: str = "opening"
    target_host: str = ""
    target_port: int = 0
    resolved_ip: str | None = None
    sniffed_host: str | None = None
    #: The fake-ip address the client dialled, when ``target_host`` is its mapped name.
    fake_ip: str | None = None
    principal_key: str | None = None
    auth_scheme: str | None = None
    #: The local client process (``runtime.process_lookup``), when one was found.
    process_id: int | None = None
    process_name: str | None = None
    process_path: str | None = None
    #: The flow hook's labels (an allow that carried some), else None.
    labels: dict[str, str] | None = None
    route_action: str = "pending"
    route_target: str | None = None
    matched_rule: dict[str, Any] | None = None
    selection_chain: list[str] = field(default_factory=list)
    outbound_tag: str | None = None
    outbound_protocol: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    relay_chain: list[str] = field(default_factory=list)
    traffic: Traffic = field(default_factory=Traffic)
    upload_bps: int = 0
    download_bps: int = 0
    sampled_at_unix_ms: int | None = None
    last_activity_at_unix_ms: int = 0
    ended_at_unix_ms: int | None = None
    outcome: str | None = None
    close_reason: str | None = None
    failure: Failure | None = None
    _fixed: tuple[Inbound, Source] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def set_process(self, pid: int, name: str | None, path: str | None) -> None:
        """The local client process behind the flow (its ``source.process_*``)."""
        self.process_id, self.process_name, self.process_path = pid, name, path
        self._fixed = None  # the source object changes from the next revision on

    def render(self) -> FlowRecord:
        """The FlowRecord (docs/events.md) for the current revision."""
        target: Target = {"host": self.target_host, "port": self.target_port}
        if self.resolved_ip is not None:
            target["resolved_ip"] = self.resolved_ip
        if self.sniffed_host is not None:
            target["sniffed_host"] = self.sniffed_host
        if self.fake_ip is not None:
            target["fake_ip"] = self.fake_ip
        timing: Timing = {
            "started_at_unix_ms": self.started_at_unix_ms,
            "last_activity_at_unix_ms": self.last_activity_at_unix_ms,
        }
        if self.ended_at_unix_ms is not None:
            timing["ended_at_unix_ms"] = self.ended_at_unix_ms
            timing["duration_ms"] = self.ended_at_unix_ms - self.started_at_unix_ms
        outbound = (
            {"tag": self.outbound_tag, "protocol": self.outbound_protocol}
            if self.outbound_tag is not None
            else None
        )
        remote: Remote | None = (
            {"host": self.remote_host, "port": self.remote_port}
            if self.remote_host is not None
            else None
        )
        fixed = self._fixed
        if fixed is None:
            # What never changes after the start: one pair of dicts for every revision
            # (records are immutable once published, so sharing them is safe).
            source: Source = {"ip": self.source_ip, "port": self.source_port}
            if self.process_id is not None:
                source["process_id"] = self.process_id
            if self.process_name is not None:
                source["process_name"] = self.process_name
            if self.process_path is not None:
                source["process_path"] = self.process_path
            inbound: Inbound = {"tag": self.inbound_tag, "protocol": self.inbound_protocol}
            if self.client_protocol is not None:
                inbound["client_protocol"] = self.client_protocol
            fixed = self._fixed = (inbound, source)
        record: dict[str, Any] = {
            "flow_id": self.flow_id,
            "revision": self.revision,
            "state": self.state,
            "network": self.network,
            "inbound": fixed[0],
            "source": fixed[1],
            "target": target,
            "route": {
                "mode": self.mode,
                "action": self.route_action,
                "target": self.route_target,
                "matched_rule": self.matched_rule,
                "selection_chain": list(self.selection_chain),
            },
            "path": {"outbound": outbound, "remote": remote, "relay_chain": list(self.relay_chain)},
            "traffic": self.traffic.to_dict(),
            "throughput": {
                "upload_bps": self.upload_bps,
                "download_bps": self.download_bps,
                "sampled_at_unix_ms": self.sampled_at_unix_ms,
            },
            "timing": timing,
        }
        if self.principal_key is not None:
            record["principal_key"] = self.principal_key
        if self.labels is not None:
            record["labels"] = self.labels
        if self.state == "completed":
            result: dict[str, Any] = {"outcome": self.outcome}
            if self.close_reason is not None:
                result["close_reason"] = self.close_reason
            if self.failure is not None:
                result["failure"] = self.failure.to_dict()
            record["result"] = result
        # The record's str fields (state, mode, ...) hold the model's Literal values. Not
        # a cast() or a validation: render runs per flow revision, and a call costs ~4%.
        return record  # type: ignore[return-value]


def lifecycle_payload(state: FlowState, record: FlowRecord) -> dict[str, Any]:
    """Payload of flow.started / flow.routed / flow.completed: legacy fields plus record.

    ``record`` is ``state.render()``; the fields both carry are the record's own objects.
    """
    traffic: dict[str, Any] = {
        "bytes_up": state.traffic.bytes_up,
        "bytes_down": state.traffic.bytes_down,
        "packets_up": state.traffic.packets_up,
        "packets_down": state.traffic.packets_down,
    }
    timing: dict[str, Any] = {
        "started_at_unix_ms": state.started_at_unix_ms,
        "ended_at_unix_ms": state.ended_at_unix_ms,
        "duration_ms": (
            state.ended_at_unix_ms - state.started_at_unix_ms
            if state.ended_at_unix_ms is not None
            else None
        ),
    }
    payload: dict[str, Any] = {
        "flow_id": state.flow_id,
        "network": state.network,
        "inbound": record["inbound"],
        "auth": {
            "scheme": state.auth_scheme,
            "principal_key": state.principal_key,
            "attributes": {},
        },
        "target": {"host": state.target_host, "port": state.target_port},
        "route": {"mode": state.mode, "target": state.route_target},
        "policy": state.selection_chain[0] if len(state.selection_chain) > 1 else None,
        "outbound": record["path"]["outbound"],
        "traffic": traffic,
        "timing": timing,
        "outcome": state.outcome,
        "record": record,
    }
    if state.state == "completed":
        t = state.traffic
        traffic["inbound_rx_bytes"] = t.inbound_rx_bytes
        traffic["inbound_tx_bytes"] = t.inbound_tx_bytes
        traffic["outbound_rx_bytes"] = t.outbound_rx_bytes
        traffic["outbound_tx_bytes"] = t.outbound_tx_bytes
        if state.close_reason is not None:
            payload["close_reason"] = state.close_reason
    return payload


def updated_payload(state: FlowState, record: FlowRecord) -> dict[str, Any]:
    """Payload of flow.updated (docs/events.md)."""
    t = state.traffic
    return {
        "flow_id": state.flow_id,
        "network": state.network,
        "inbound_tag": state.inbound_tag,
        "outbound_tag": state.outbound_tag,
        "bytes_up": t.bytes_up,
        "bytes_down": t.bytes_down,
        "inbound_rx_bytes": t.inbound_rx_bytes,
        "inbound_tx_bytes": t.inbound_tx_bytes,
        "outbound_rx_bytes": t.outbound_rx_bytes,
        "outbound_tx_bytes": t.outbound_tx_bytes,
        "throughput_up_bps": state.upload_bps,
        "throughput_down_bps": state.download_bps,
        "snapshot_at_unix_ms": state.sampled_at_unix_ms,
        "record": record,
    }


def state_from_record(record: FlowRecord, auth_scheme: str | None = None) -> FlowState:
    """The FlowState a FlowRecord (``render``'s output, as events carry it) was rendered
    from, as far as the record tells (``auth_scheme`` is not in it, nor ``principal_key``
    in a record an older version wrote)."""
    inbound, source, target = record["inbound"], record["source"], record["target"]
    route, path, timing = record["route"], record["path"], record["timing"]
    t, throughput = record["traffic"], record["throughput"]
    outbound, remote = path.get("outbound"), path.get("remote")
    return FlowState(
        flow_id=record["flow_id"],
        inbound_tag=inbound["tag"],
        inbound_protocol=inbound["protocol"],
        source_ip=source["ip"],
        source_port=source["port"],
        started_at_unix_ms=timing["started_at_unix_ms"],
        mode=route["mode"],
        network=record["network"],
        client_protocol=inbound.get("client_protocol"),
        revision=record["revision"],
        state=record["state"],
        target_host=target["host"],
        target_port=target["port"],
        resolved_ip=target.get("resolved_ip"),
        sniffed_host=target.get("sniffed_host"),
        fake_ip=target.get("fake_ip"),
        principal_key=record.get("principal_key"),
        auth_scheme=auth_scheme,
        process_id=source.get("process_id"),
        process_name=source.get("process_name"),
        process_path=source.get("process_path"),
        labels=record.get("labels"),
        route_action=route["action"],
        route_target=route["target"],
        matched_rule=cast("dict[str, Any] | None", route["matched_rule"]),
        selection_chain=list(route["selection_chain"]),
        outbound_tag=outbound["tag"] if outbound else None,
        outbound_protocol=outbound["protocol"] if outbound else None,
        remote_host=remote["host"] if remote else None,
        remote_port=remote["port"] if remote else None,
        relay_chain=list(path["relay_chain"]),
        traffic=Traffic(
            bytes_up=t["bytes_up"],
            bytes_down=t["bytes_down"],
            inbound_rx_bytes=t["inbound_rx_bytes"],
            inbound_tx_bytes=t["inbound_tx_bytes"],
            outbound_rx_bytes=t["outbound_rx_bytes"],
            outbound_tx_bytes=t["outbound_tx_bytes"],
            packets_up=t.get("packets_up"),
            packets_down=t.get("packets_down"),
        ),
        upload_bps=throughput["upload_bps"],
        download_bps=throughput["download_bps"],
        sampled_at_unix_ms=throughput["sampled_at_unix_ms"],
        last_activity_at_unix_ms=timing["last_activity_at_unix_ms"],
    )


@dataclass(frozen=True, slots=True)
class Completion:
    """A flow.completed event to emit: its payload and envelope fields."""

    payload: dict[str, Any]
    principal_key: str | None
    labels: dict[str, str] | None
    occurred_at_unix_ms: int
    #: The completed state (for the flow's log line).
    state: FlowState


def crashed_completion(envelopes: list[dict[str, Any]]) -> Completion:
    """The flow.completed (outcome ``engine_crashed``) of a flow a killed engine left open,
    from the flow events a sink kept of it (``flow.started``/``flow.routed``/``flow.updated``
    envelopes, any order; ValueError/KeyError/TypeError when none is one).

    The record is the newest one known (highest revision), completed one revision later:
    its bytes are the last reported, and it ends at the last moment the engine is known
    to have seen the flow (its last activity, last sample, or last event).
    """
    newest: dict[str, Any] | None = None
    auth: dict[str, Any] | None = None
    principal_key: str | None = None
    labels: dict[str, str] | None = None
    last_seen = 0
    for env in envelopes:
        # The flow's principal and labels, from whichever event carried them.
        principal_key = env.get("principal_key") or principal_key
        labels = env.get("labels") or labels
        payload = env["payload"]
        record = payload["record"]
        if newest is None or record["revision"] >= newest["payload"]["record"]["revision"]:
            newest = env
        if "auth" in payload:  # flow.started/flow.routed (flow.updated has none)
            auth = payload["auth"]
        last_seen = max(last_seen, int(env["occurred_at_unix_ms"]))
    if newest is None:
        raise ValueError("no flow event")
    record = newest["payload"]["record"]
    state = state_from_record(record, auth["scheme"] if auth else None)
    if auth is not None and auth.get("principal_key"):
        principal_key = auth["principal_key"]
    principal_key = principal_key or state.principal_key
    state.principal_key = principal_key
    state.revision += 1
    state.state = "completed"
    ended = max(
        last_seen,
        state.started_at_unix_ms,
        state.last_activity_at_unix_ms,
        state.sampled_at_unix_ms or 0,
    )
    state.ended_at_unix_ms = ended
    state.outcome = ENGINE_CRASHED
    state.failure = ENGINE_CRASHED_FAILURE
    return Completion(lifecycle_payload(state, state.render()), principal_key, labels, ended, state)
