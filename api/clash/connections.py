"""Flows as mihomo's connections: ``GET``/``DELETE /connections`` and the snapshot the
``/connections`` WebSocket sends (mihomo's ``tunnel/statistic`` ``Snapshot``).

Each active flow's latest record (``ControlPlane.flow_records``) becomes one
``TrackerInfo``: ``id`` is the flow id (stable for the flow's life, so a dashboard that
diffs snapshots sees one connection grow and then vanish), ``upload``/``download`` its
payload bytes as of the record's last sample (``runtime.stats_interval_ms``), ``chains``
the selection chain leaf first as mihomo's ``Chain`` is, ``rule``/``rulePayload`` the
matched rule in mihomo's words (:func:`rule_type_and_payload`), ``metadata.type`` what
the client spoke (``inbound.client_protocol``: ``HTTPS`` for a ``CONNECT``, ``HTTP`` for a
forwarded request, on a mixed inbound too), ``dnsMode`` ``fake-ip`` for a target mapped
back from a fake-ip address (``target.fake_ip``), ``inboundUser`` the flow's principal.

Cost: a snapshot is built once per tick and shared by every subscriber (see
:mod:`.streams`). Records are immutable once published (each revision is a new dict),
so :class:`SnapshotBuilder` keeps each flow's encoded ``TrackerInfo`` until its record
object changes: an idle flow costs an identity check and a join per tick, and only the
flows whose counters moved are mapped and encoded again.
"""

from __future__ import annotations

import logging
import operator
import os
import socket
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from spliceway.api.clash.context import ClashContext
from spliceway.api.clash.mapping import GLOBAL, camel_case, rfc3339, rule_type_and_payload
from spliceway.api.plane import ControlPlane
from spliceway.errors import ApiError
from spliceway.events.log import Subscription

__all__ = [
    "CLIENT_TYPES",
    "INBOUND_TYPES",
    "SnapshotBuilder",
    "close_all_flows",
    "close_flow",
    "connection_routes",
    "rss_bytes",
    "tracker_info",
]

logger = logging.getLogger(__name__)

#: What the client spoke (the record's ``inbound.client_protocol``) -> mihomo's
#: ``metadata.type`` (``constant.Type``): its http listener says ``HTTPS`` for a
#: ``CONNECT`` tunnel and ``HTTP`` for a request it forwards, on a mixed one too.
CLIENT_TYPES: dict[str, str] = {
    "socks5": "Socks5",
    "http": "HTTP",
    "http_connect": "HTTPS",
    "tun": "Tun",
}

#: Inbound protocol -> ``metadata.type``, for a record without ``client_protocol`` (one
#: an older version wrote): a mixed inbound's then keeps a name of its own.
INBOUND_TYPES: dict[str, str] = {
    "socks5": "Socks5",
    "http": "HTTP",
    "mixed": "Mixed",
    "tun": "Tun",
}

#: mihomo's ``TrackerInfo`` and ``Metadata`` keys that spliceway has no value for: the
#: constant part of every connection's metadata.
_NO_GEO: dict[str, Any] = {
    "sourceGeoIP": None,
    "destinationGeoIP": None,
    "sourceIPASN": "",
    "destinationIPASN": "",
}

#: Flows closed at once by ``DELETE /connections`` (each close is one actor ask).
CLOSE_WORKERS = 8

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _flow_rule(route: Mapping[str, Any]) -> tuple[str, str]:
    """``(rule, rulePayload)``: mihomo's tracker has no rule in modes global and direct
    (both ``""``) and the final ``MATCH`` rule when no rule matched in mode rule."""
    if route.get("mode") != "rule":
        return "", ""
    matched = route.get("matched_rule")
    return rule_type_and_payload(matched["condition"] if matched else "")


def _chains(record: Mapping[str, Any]) -> list[str]:
    """Leaf first, the route's target last (mihomo's ``Chain``); mode global's flows are
    ``GLOBAL``'s, as mihomo dials them through its ``GLOBAL`` selector."""
    route = record["route"]
    walked = route.get("selection_chain") or ()
    chain = list(reversed(walked))
    if not chain:
        outbound = record["path"].get("outbound")
        if outbound is not None:
            chain = [outbound["tag"]]
        elif route.get("target"):
            chain = [route["target"]]
    if route.get("mode") == "global":
        chain.append(GLOBAL)
    return chain


def _is_address(host: str) -> bool:
    # inet_pton, not ipaddress: this runs for every new flow of a snapshot, and most
    # targets are names starting with a letter, which need no parse at all.
    if not host or not (host[0].isdigit() or ":" in host):
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        socket.inet_pton(family, host)
    except OSError:
        return False
    return True


def _client_type(inbound: Mapping[str, Any]) -> str:
    spoken = inbound.get("client_protocol")
    if spoken is not None:
        return CLIENT_TYPES.get(spoken) or camel_case(spoken)
    return INBOUND_TYPES.get(inbound["protocol"]) or camel_case(inbound["protocol"])


def tracker_info(
    record: Mapping[str, Any], listeners: Mapping[str, tuple[str, int]]
) -> dict[str, Any]:
    """mihomo's ``TrackerInfo`` for one FlowRecord, keys in mihomo's order.

    ``listeners`` maps an inbound tag to its bound ``(address, port)`` (``inboundIP``,
    ``inboundPort``). Pure.
    """
    target, source, path = record["target"], record["source"], record["path"]
    inbound = record["inbound"]
    host = target["host"]
    if _is_address(host):
        name, destination_ip = "", host
    else:
        name, destination_ip = host, target.get("resolved_ip", "")
    outbound = path.get("outbound")
    remote = path.get("remote")
    if outbound is not None and outbound["protocol"] == "direct" and "resolved_ip" in target:
        remote_destination = target["resolved_ip"]
    elif remote is not None and _is_address(remote["host"]):
        remote_destination = remote["host"]
    else:
        remote_destination = destination_ip
    listen_ip, listen_port = listeners.get(inbound["tag"], ("", 0))
    chains = _chains(record)
    rule, payload = _flow_rule(record["route"])
    traffic = record["traffic"]
    return {
        "id": record["flow_id"],
        "metadata": {
            "network": record["network"],
            "type": _client_type(inbound),
            "sourceIP": source["ip"],
            "destinationIP": destination_ip,
            **_NO_GEO,
            "sourcePort": str(source["port"]),
            "destinationPort": str(target["port"]),
            "inboundIP": listen_ip,
            "inboundPort": str(listen_port) if listen_port else "",
            "inboundName": inbound["tag"],
            # mihomo's is the user name; the principal is the flow's identity here (the
            # user's principal_key, or the flow hook's).
            "inboundUser": record.get("principal_key", ""),
            "rematchName": "",
            "host": name,
            "dnsMode": "fake-ip" if "fake_ip" in target else "normal",
            "uid": 0,
            "process": source.get("process_name", ""),
            "processPath": source.get("process_path", ""),
            "specialProxy": "",
            "specialRules": "",
            "remoteDestination": remote_destination,
            "dscp": 0,
            "sniffHost": target.get("sniffed_host", ""),
        },
        "upload": traffic["bytes_up"],
        "download": traffic["bytes_down"],
        "start": rfc3339(record["timing"]["started_at_unix_ms"]),
        "chains": chains,
        "providerChains": [""] * len(chains),
        "rule": rule,
        "rulePayload": payload,
    }


def rss_bytes() -> int:
    """This process's resident set size in bytes (0 where ``/proc`` cannot tell)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE_SIZE
    except (OSError, ValueError, IndexError):
        return 0


def listener_map(plane: ControlPlane) -> dict[str, tuple[str, int]]:
    """Inbound tag -> bound ``(address, port)``, from the ``config`` query."""
    listeners = plane.run_query("config").get("listeners") or ()
    return {item["tag"]: (item["listen_address"], item["listen_port"]) for item in listeners}


#: A ``stats.sampled`` event younger than this gives the totals; older (a long
#: ``runtime.stats_interval_ms``, or none yet), the ``stats`` query is run instead.
SAMPLE_MAX_AGE_S = 2.0
#: ``stats.sampled`` events queued for a builder that nobody asks (then it resubscribes).
_SAMPLES_PENDING = 64

#: TrackerInfo's keys after ``upload`` and ``download``, in mihomo's order.
_TAIL_KEYS = ("start", "chains", "providerChains", "rule", "rulePayload")


@dataclass(slots=True)
class _Encoded:
    """One flow's encoded TrackerInfo: ``data``, made from ``record``; ``head`` (``id``
    and ``metadata``) and ``tail`` (from ``start``) depend only on ``key``, the
    record's target, route and path (its inbound, source and principal never change)."""

    record: Mapping[str, Any]
    data: bytes
    key: tuple[Any, ...]
    head: bytes
    tail: bytes


class SnapshotBuilder:
    """Builds mihomo's connections snapshot from a running engine, as JSON bytes.

    Blocking (queries and mapping): call it from a worker thread, never the event loop.
    Thread-safe: one lock around a build, so two intervals ticking together share one.
    """

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self._lock = threading.Lock()
        #: flow_id -> its encoded TrackerInfo and what it was made from.
        self._cache: dict[str, _Encoded] = {}
        self._listeners: dict[str, tuple[str, int]] = {}
        #: The records and the ``connections`` bytes of the last encode (an unchanged
        #: flow table reuses them whole).
        self._records: list[Mapping[str, Any]] = []
        self._connections = b"null"
        self._up = 0
        self._down = 0
        self._totals_at = -1e9
        self._built_at = 0.0
        self._last = b""
        #: The engine's ``stats.sampled`` feed while streams want totals.
        self._samples: Subscription | None = None
        #: ``(occurred_at_unix_ms, bytes_up, bytes_down)`` of the newest one.
        self._sample: tuple[int, int, int] | None = None

    def _read_samples(self) -> None:
        """Take the newest ``stats.sampled`` (the sampler's totals, read by the engine
        once per ``runtime.stats_interval_ms`` anyway); call under the lock."""
        sub = self._samples
        if sub is None or sub.closed:
            if sub is not None:
                sub.close()
            sub = self._samples = self._plane.log.subscribe(
                ["stats.sampled"], max_pending=_SAMPLES_PENDING
            )
        envelopes = sub.get_many(0, _SAMPLES_PENDING)
        if envelopes:
            newest = envelopes[-1]
            payload = newest["payload"]
            self._sample = (
                int(newest["occurred_at_unix_ms"]),
                int(payload["bytes_up"]),
                int(payload["bytes_down"]),
            )

    def release(self) -> None:
        """Stop following ``stats.sampled`` (the hub's last stream ended)."""
        with self._lock:
            if self._samples is not None:
                self._samples.close()
                self._samples = None
            self._sample = None

    def _fresh_sample(self) -> tuple[int, int, int] | None:
        """The newest sample if it is younger than :data:`SAMPLE_MAX_AGE_S`."""
        self._read_samples()
        sample = self._sample
        if sample is None or time.time() * 1000 - sample[0] > SAMPLE_MAX_AGE_S * 1000:
            return None
        return sample

    def totals(self, max_age: float = 0.0) -> tuple[int, int]:
        """``(uploadTotal, downloadTotal)``: the engine's lifetime payload bytes, held so
        that they never go backwards; read now, or the last reading if it is younger
        than ``max_age`` seconds. With ``max_age``, the engine's last ``stats.sampled``
        serves when it is fresh: the ``stats`` query reads every open flow's counters,
        tens of milliseconds with the GIL held at 10,000 flows."""
        with self._lock:
            if max_age:
                if time.monotonic() - self._totals_at < max_age:
                    return self._up, self._down
                sample = self._fresh_sample()
                if sample is not None:
                    return self._hold(sample[1], sample[2])
        stats = self._plane.run_query("stats")
        with self._lock:
            return self._hold(int(stats["bytes_up"]), int(stats["bytes_down"]))

    def _hold(self, up: int, down: int) -> tuple[int, int]:
        self._up = max(self._up, up)
        self._down = max(self._down, down)
        self._totals_at = time.monotonic()
        return self._up, self._down

    def sample(self) -> tuple[int, int, int] | None:
        """``(occurred_at_unix_ms, upTotal, downTotal)`` of the engine's newest
        ``stats.sampled`` (totals held as :meth:`totals` holds them), or None when none is
        younger than :data:`SAMPLE_MAX_AGE_S`."""
        with self._lock:
            sample = self._fresh_sample()
            if sample is None:
                return None
            up, down = self._hold(sample[1], sample[2])
            return sample[0], up, down

    def encode(
        self,
        records: Iterable[Mapping[str, Any]],
        listeners: Mapping[str, tuple[str, int]],
        totals: tuple[int, int],
        memory: int,
    ) -> bytes:
        """The snapshot of ``records`` (active ones only, as mihomo lists connections
        once dialled) as one JSON line.

        A flow whose record object is the one of the last build reuses its bytes; one
        whose record changed only in its counters (a traffic sample: ``target``,
        ``route`` and ``path`` equal) reuses the encoded rest around new numbers; only
        a flow new or re-routed is mapped again.
        """
        if listeners != self._listeners:
            self._listeners = dict(listeners)
            self._cache = {}
            self._records = []
        records = records if isinstance(records, list) else list(records)
        last = self._records
        if len(records) != len(last) or not all(map(operator.is_, records, last)):
            self._connections = self._encode_records(records)
            self._records = records
        up, down = totals
        return b'{"downloadTotal":%d,"uploadTotal":%d,"connections":%s,"memory":%d}\n' % (
            down,
            up,
            self._connections,
            memory,
        )

    def _encode_records(self, records: list[Mapping[str, Any]]) -> bytes:
        old = self._cache
        cache: dict[str, _Encoded] = {}
        parts: list[bytes] = []
        append = parts.append
        for record in records:
            if record["state"] != "active":
                continue
            flow_id = record["flow_id"]
            hit = old.get(flow_id)
            if hit is None or hit.record is not record:
                hit = self._encode_one(record, hit)
            cache[flow_id] = hit
            append(hit.data)
        self._cache = cache
        return b"[" + b",".join(parts) + b"]" if parts else b"null"

    def _encode_one(self, record: Mapping[str, Any], old: _Encoded | None) -> _Encoded:
        key = (record["target"], record["route"], record["path"])
        if old is not None and old.key == key:
            head, tail = old.head, old.tail
        else:
            info = tracker_info(record, self._listeners)
            head = orjson.dumps({"id": info["id"], "metadata": info["metadata"]})[:-1]
            rest = {k: info[k] for k in _TAIL_KEYS}
            tail = b"," + orjson.dumps(rest)[1:]
        traffic = record["traffic"]
        counts = b',"upload":%d,"download":%d' % (traffic["bytes_up"], traffic["bytes_down"])
        return _Encoded(record, head + counts + tail, key, head, tail)

    def build(self, max_age: float = 0.0, totals_max_age: float = 0.0) -> bytes:
        """A snapshot of now, or the last one if it is younger than ``max_age`` seconds
        (two intervals that tick together share one build); its totals may be as old as
        ``totals_max_age`` (a stream's ticks: the flows' own counters are as old as the
        engine's last sample anyway)."""
        with self._lock:
            if max_age and self._last and time.monotonic() - self._built_at < max_age:
                return self._last
        listeners = listener_map(self._plane)
        totals = self.totals(totals_max_age)
        with self._lock:
            data = self.encode(self._plane.flow_records(), listeners, totals, rss_bytes())
            self._built_at = time.monotonic()
            self._last = data
            return data


def close_flow(plane: ControlPlane, flow_id: str) -> bool:
    """Close one flow through ``flows.close`` (so it emits what any transport's close
    does); False when it was not open (mihomo answers 204 all the same)."""
    try:
        plane.execute("flows.close", {"flow_id": flow_id}, transport="clash")
    except ApiError as ex:
        if ex.code == "not_found":
            return False
        raise
    return True


def close_all_flows(plane: ControlPlane, flow_ids: Sequence[str]) -> int:
    """Close every flow of ``flow_ids``, :data:`CLOSE_WORKERS` at a time (each close
    waits for its flow's actor); returns how many were open. Blocking."""
    if not flow_ids:
        return 0
    with ThreadPoolExecutor(CLOSE_WORKERS, thread_name_prefix="clash-close") as pool:
        return sum(pool.map(lambda flow_id: close_flow(plane, flow_id), flow_ids))


def connection_routes(ctx: ClashContext, builder: SnapshotBuilder) -> list[BaseRoute]:
    """``GET /connections`` (one snapshot; the WebSocket is :mod:`.streams`'),
    ``DELETE /connections`` and ``DELETE /connections/{id}``. An engine error is left
    to the app's handler (:func:`.guard.exception_handlers`), which answers it in
    mihomo's shape."""
    plane = ctx.plane

    async def snapshot(request: Request) -> Response:
        # mihomo ignores ``interval`` without an upgrade: a plain GET is one snapshot.
        data = await run_in_threadpool(builder.build)
        return Response(data, media_type="application/json")

    async def close_all(request: Request) -> Response:
        ids = [r["flow_id"] for r in await run_in_threadpool(plane.flow_records)]
        await run_in_threadpool(close_all_flows, plane, ids)
        return Response(status_code=204)

    async def close_one(request: Request) -> Response:
        try:
            await run_in_threadpool(close_flow, plane, request.path_params["id"])
        except ApiError as ex:
            # mihomo answers 204 for any id it has no connection for, malformed ones too.
            if ex.code != "invalid_argument":
                raise
        return Response(status_code=204)

    return [
        Route("/connections", snapshot, methods=["GET"]),
        Route("/connections", close_all, methods=["DELETE"]),
        Route("/connections/{id:path}", close_one, methods=["DELETE"]),
    ]
