"""Driving a test engine from outside: curl through its inbounds, and its flow events."""

from __future__ import annotations

import subprocess
from typing import Any


def curl(*args: str, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """Run curl (10 s transfer limit) and capture its output as text."""
    return subprocess.run(
        ["curl", "-sS", "--max-time", "10", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


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
