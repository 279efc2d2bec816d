"""The per-flow log line: fixed key order, logfmt quoting, level by outcome."""

from __future__ import annotations

import logging

import pytest

from spliceway.flows import log as flowlog
from spliceway.flows import records
from spliceway.flows.records import Failure, FlowState
from tests.helpers.flows import flow_state


def completed(**changes) -> FlowState:
    state = flow_state(
        outbound_tag="direct",
        ended_at_unix_ms=1_012,
        outcome=records.DIRECT_RELAYED,
    )
    for key, value in changes.items():
        setattr(state, key, value)
    return state


def test_relayed_flow_line_has_every_key_in_order() -> None:
    state = completed()
    state.traffic.bytes_up, state.traffic.bytes_down = 100, 2048
    assert flowlog.line(state) == (
        "flow=ab12-7 outcome=direct_relayed network=tcp inbound=mixed-in source=127.0.0.1:50000 "
        "target=example.com:443 outbound=direct up=100 down=2048 duration_ms=12"
    )
    assert flowlog.level_for(state) == logging.DEBUG


def test_failed_flow_line_names_stage_code_and_quotes_the_message() -> None:
    state = completed(
        outcome=records.FAILED,
        close_reason=records.UPSTREAM_ERROR,
        outbound_tag="hop-a",
        failure=Failure("connect", "connection_refused", 'refused by "hop-a" at 10.0.0.1'),
    )
    assert flowlog.line(state).endswith(
        "outbound=hop-a up=0 down=0 duration_ms=12 close_reason=upstream_error "
        'stage=connect code=connection_refused error="refused by \\"hop-a\\" at 10.0.0.1"'
    )
    assert flowlog.level_for(state) == logging.INFO


@pytest.mark.parametrize(
    ("rule", "shown"), [({"index": 3, "condition": "x"}, "3"), (None, "final")]
)
def test_blocked_flow_line_names_the_rule(rule, shown) -> None:
    state = completed(outcome=records.BLOCKED, outbound_tag=None, matched_rule=rule)
    assert flowlog.line(state).endswith(f"outbound=- up=0 down=0 duration_ms=12 rule={shown}")
    assert flowlog.level_for(state) == logging.INFO


def test_a_udp_flow_says_so() -> None:
    state = completed(network="udp", flow_id="ab12-u3")
    assert flowlog.line(state).startswith("flow=ab12-u3 outcome=direct_relayed network=udp ")


def test_ipv6_endpoints_are_bracketed_and_spaces_quoted() -> None:
    state = completed(source_ip="::1", target_host="2001:db8::1", inbound_tag="in tag")
    line = flowlog.line(state)
    assert 'inbound="in tag" source=[::1]:50000 target=[2001:db8::1]:443' in line


def test_control_characters_from_the_client_are_escaped_never_raw() -> None:
    state = completed(target_host="a\rb\x1b[31m\u2028c\nd")
    line = flowlog.line(state)
    assert 'target="a\\x0db\\x1b[31m\\u2028c\\nd:443"' in line
    assert line.isprintable()
