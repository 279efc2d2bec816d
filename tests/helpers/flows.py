"""Driving a test engine from outside: curl through its inbounds, and its flow events."""

from __future__ import annotations

import subprocess
from typing import Any

from spliceway.flows.records import FlowState
from tests.conftest import base_config

#: The fields of ``flow_state()``'s flow unless it is told others.
_FLOW = {
    "flow_id": "ab12-7",
    "inbound_tag": "mixed-in",
    "inbound_protocol": "mixed",
    "source_ip": "127.0.0.1",
    "source_port": 50000,
    "started_at_unix_ms": 1_000,
    "mode": "rule",
    "target_host": "example.com",
    "target_port": 443,
}


def flow_state(**fields: Any) -> FlowState:
    """A rule-mode flow from 127.0.0.1 to example.com:443 that started at 1,000 ms, its
    ``fields`` (any of FlowState's) told otherwise."""
    return FlowState(**(_FLOW | fields))


def curl(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """Run curl (10 s transfer limit) and capture its output as text."""
    return subprocess.run(
        ["curl", "-sS", "--max-time", "10", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def socks_curl(
    engine: Any, url: str, *args: str, inbound: str = "socks-in"
) -> subprocess.CompletedProcess[str]:
    """curl ``url`` through the engine's SOCKS5 (or mixed) ``inbound``; the engine resolves."""
    return curl("--socks5-hostname", "{}:{}".format(*engine.listen_address(inbound)), *args, url)


def proxy_curl(
    engine: Any, url: str, *args: str, inbound: str = "http-in"
) -> subprocess.CompletedProcess[str]:
    """curl ``url`` with the engine's HTTP (or mixed) ``inbound`` as its proxy."""
    return curl("-x", "http://{}:{}".format(*engine.listen_address(inbound)), *args, url)


#: curl arguments that discard the body and print only the status code.
STATUS_ONLY = ("-o", "/dev/null", "-w", "%{http_code}")


def socks_fetch(engine: Any, origin: tuple[str, int], size: int) -> tuple[int, int, int]:
    """curl ``/bytes/{size}`` from ``origin`` through the engine's socks-in inbound.

    Asserts a 200 with ``size`` body bytes; returns ``(header, body, request)`` byte
    counts as curl saw them, for exact comparison with the flow's record.
    """
    result = socks_curl(
        engine,
        f"http://127.0.0.1:{origin[1]}/bytes/{size}",
        "-o",
        "/dev/null",
        "-w",
        "%{http_code} %{size_download} %{size_header} %{size_request}",
    )
    assert result.returncode == 0, result.stderr
    code, body, header, request = map(int, result.stdout.split())
    assert (code, body) == (200, size)
    return header, body, request


def completed_events(sub, count: int = 1) -> list[dict]:
    """The next ``count`` flow.completed events of a subscription."""
    out = []
    for event in sub:
        if event["event_type"] == "flow.completed":
            out.append(event)
            if len(out) == count:
                return out
    raise AssertionError(f"only {len(out)} of {count} flow.completed events arrived")


def completed(engine: Any, count: int = 1) -> list[dict]:
    """The first ``count`` flow.completed events of ``engine`` since it started."""
    with engine.subscribe(["flow.completed"], since=0, timeout=5) as sub:
        return completed_events(sub, count)


def flow_events(engine: Any, flow_id: str | None = None) -> list[dict]:
    """The flow.* events in ``engine``'s ring (of one flow, when given), in order."""
    return [
        e
        for e in engine.query("events")["events"]
        if e["event_type"].startswith("flow.")
        and (flow_id is None or e["payload"]["record"]["flow_id"] == flow_id)
    ]


def in_start_order(engine: Any, done: list[dict]) -> list[dict]:
    """flow.completed events ``done`` sorted by when their flows started (a relayed flow
    may complete after a later, refused one)."""
    started = [
        e["payload"]["flow_id"] for e in flow_events(engine) if e["event_type"] == "flow.started"
    ]
    return sorted(done, key=lambda e: started.index(e["payload"]["flow_id"]))


def engine_via(make_engine: Any, outbound: dict[str, Any]) -> Any:
    """An engine (direct plus ``outbound``) that routes every flow to ``outbound``."""
    cfg = base_config(
        outbounds=[{"tag": "direct", "protocol": "direct"}, outbound],
        route={"final": outbound["tag"]},
    )
    return make_engine(cfg)
