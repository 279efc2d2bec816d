"""A Generation is built whole by one function, frozen, and replaced, never mutated."""

from __future__ import annotations

import dataclasses

import pytest

from spliceway.config import parse_config
from spliceway.engine.assembly import build_routing
from spliceway.engine.generation import ActiveInbound, Generation, InboundSpec, build_generation
from spliceway.engine.runtime import RouteState
from tests.conftest import base_config


def _generation(serial: int = 1, on_publish: object = None) -> Generation:
    doc = base_config(
        outbound_groups=[{"tag": "pick", "kind": "selector", "outbounds": ["direct", "block"]}],
        runtime={"tcp_idle_timeout_seconds": 42},
    )
    config = parse_config(doc)
    return build_generation(serial, config, build_routing(config), (), on_publish)  # type: ignore[arg-type]


def test_a_generation_holds_what_its_configuration_defines() -> None:
    g = _generation(7)
    assert g.serial == 7
    assert g.tcp_idle_timeout_ms == 42_000
    assert g.resolver is g.parts.resolver
    assert g.outbounds is g.parts.outbounds
    assert set(g.outbounds) >= {"direct", "block"}
    assert g.route_state is g.parts.route_state
    assert [v.tag for v in g.policies.views()] == ["pick"]
    assert g.active_inbounds == ()


def test_a_generation_is_frozen() -> None:
    g = _generation()
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.config = g.config  # type: ignore[misc]


def test_its_policy_table_reports_every_publish() -> None:
    published: list[str] = []
    g = _generation(on_publish=lambda: published.append("table"))
    view = g.policies.get("pick")
    assert view is not None
    g.policies.publish(dataclasses.replace(view, selected="block"))
    assert published == ["table"]
    assert g.policies.resolve("pick")[-1] == "block"


def test_a_new_routing_state_is_a_new_generation_over_the_same_tables() -> None:
    g = _generation(1)
    state = RouteState("direct", None, g.route_state.final, g.route_state.ruleset)
    h = g.with_route_state(2, state)
    assert (h.serial, h.route_state) == (2, state)
    assert h.outbounds is g.outbounds and h.policies is g.policies and h.config is g.config
    assert g.route_state.mode == "rule"  # the previous generation is untouched


def test_the_listeners_a_start_bound_complete_the_same_generation() -> None:
    g = _generation(3)
    spec = InboundSpec.of(0, g.config.inbounds[0])
    h = g.with_active_inbounds((ActiveInbound(spec, ("127.0.0.1", 1080)),))
    assert h.serial == 3
    assert [a.spec.tag for a in h.active_inbounds] == [g.config.inbounds[0].tag]
