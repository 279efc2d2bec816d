"""The one log line of a completed flow (docs/running.md, "Per-flow log lines").

Exactly one line per flow, TCP or UDP (a UDP flow is one destination of an
association or a TUN session), on logger ``spliceway.flow`` when the flow completes:
at ``info`` for flows that failed or were blocked (what an operator looks for
when "the connection does not work"), at ``debug`` for every other flow. The
line is logfmt, keys in a fixed order, so ``grep``, ``awk`` and log shippers
read it without a parser of their own::

    flow=3f2a9c1e-17 outcome=failed network=tcp inbound=mixed-in source=127.0.0.1:53422
    target=example.com:443 outbound=hop-a up=0 down=0 duration_ms=12
    close_reason=upstream_error stage=connect code=connection_refused error="..."

(one line in the log). ``rule=`` follows for a blocked flow: the index of the rule
that blocked it, or ``final`` when no rule matched.
"""

from __future__ import annotations

import logging

from spliceway.flows.records import BLOCKED, FAILED, FlowState

logger = logging.getLogger("spliceway.flow")

_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:/[]@,+*")


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n"}


def _hex(c: str) -> str:
    code = ord(c)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _value(raw: object) -> str:
    text = "-" if raw is None or raw == "" else str(raw)
    if all(c in _PLAIN for c in text):
        return text
    # A target host is whatever the client sent: control characters (a forged second
    # log line, a terminal escape) are written as escapes, never raw.
    escaped = "".join(_ESCAPES.get(c) or (c if c.isprintable() else _hex(c)) for c in text)
    return f'"{escaped}"'


def _endpoint(host: str, port: int | None) -> str:
    host = f"[{host}]" if ":" in host else host
    return f"{host}:{port}" if port is not None else host


def level_for(state: FlowState) -> int:
    """``INFO`` for a failed or blocked flow, ``DEBUG`` for any other."""
    return logging.INFO if state.outcome in (FAILED, BLOCKED) else logging.DEBUG


def line(state: FlowState) -> str:
    """The logfmt line of a completed flow."""
    duration = (
        state.ended_at_unix_ms - state.started_at_unix_ms
        if state.ended_at_unix_ms is not None
        else None
    )
    fields: list[tuple[str, object]] = [
        ("flow", state.flow_id),
        ("outcome", state.outcome),
        ("network", state.network),
        ("inbound", state.inbound_tag),
        ("source", _endpoint(state.source_ip, state.source_port)),
        ("target", _endpoint(state.target_host, state.target_port)),
        ("outbound", state.outbound_tag),
        ("up", state.traffic.bytes_up),
        ("down", state.traffic.bytes_down),
        ("duration_ms", duration),
    ]
    if state.close_reason is not None:
        fields.append(("close_reason", state.close_reason))
    if state.outcome == BLOCKED:
        rule = state.matched_rule
        fields.append(("rule", rule["index"] if rule is not None else "final"))
    failure = state.failure
    if failure is not None:
        fields += [("stage", failure.stage), ("code", failure.code), ("error", failure.message)]
    return " ".join(f"{key}={_value(value)}" for key, value in fields)


def log_completed(state: FlowState) -> None:
    """Write the flow's line at its level (nothing is formatted when that level is off)."""
    level = level_for(state)
    if logger.isEnabledFor(level):
        logger.log(level, "%s", line(state))
