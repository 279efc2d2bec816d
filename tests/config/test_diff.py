"""spliceway.config.diff: which components two configurations differ in (no engine)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.config import Config, parse_config
from spliceway.config.diff import COMPONENTS, ConfigDiff, Difference, diff

BASE: dict[str, Any] = {
    "inbounds": [
        {"tag": "a", "protocol": "socks5", "listen": {"address": "127.0.0.1", "port": 0}},
        {"tag": "b", "protocol": "http", "listen": {"address": "127.0.0.1", "port": 0}},
    ],
    "outbounds": [
        {"tag": "s5", "protocol": "socks5", "server": "127.0.0.1", "port": 1080},
        {"tag": "h", "protocol": "http", "server": "127.0.0.1", "port": 3128},
    ],
    "outbound_groups": [{"tag": "pick", "kind": "selector", "outbounds": ["s5", "h"]}],
    "rules": [{"domain_suffix": ["example.com"], "outbound": "pick"}],
    "route": {"final": "direct"},
    "api": {"control": {"enabled": False}},
}


def config(**edits: Any) -> Config:
    """BASE with ``edits`` applied: a dotted key path to its new value."""
    doc = copy.deepcopy(BASE)
    for path, value in edits.items():
        *parents, last = path.split("__")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return parse_config(doc)


def test_the_same_document_differs_in_nothing():
    d = diff(config(), config())
    assert d.is_empty()
    assert d.changed == ()
    assert d.inbounds == Difference()


# Each row: a minimal edit and exactly the components it changes.
EDITS = [
    pytest.param(
        {"outbounds": list(reversed(BASE["outbounds"]))}, ("outbounds",), id="outbounds-order"
    ),
    pytest.param(
        {"outbounds": [*BASE["outbounds"], {"tag": "x", "protocol": "block"}]},
        ("outbounds",),
        id="outbound-added",
    ),
    pytest.param(
        {"outbound_groups": [{"tag": "pick", "kind": "selector", "outbounds": ["h", "s5"]}]},
        ("policy_groups",),
        id="group-members",
    ),
    pytest.param(
        {"runtime__latency_test_url": "http://127.0.0.1:1/probe"},
        ("policy_groups", "runtime"),
        id="latency-test-url",
    ),
    pytest.param({"rules": []}, ("routing",), id="rules"),
    pytest.param({"route": {"final": "h"}}, ("routing",), id="route-final"),
    pytest.param({"mode": {"kind": "global", "outbound": "s5"}}, ("routing",), id="mode"),
    pytest.param(
        {"runtime__dns": {"servers": ["udp://127.0.0.1:5353"]}},
        ("dns", "runtime"),
        id="dns",
    ),
    pytest.param({"api__flow_hook": {"path": "/run/hook.sock"}}, ("flow_hook",), id="flow-hook"),
    pytest.param(
        {"api__event_sinks": [{"type": "jsonl", "tag": "j", "path": "/tmp/events.jsonl"}]},
        ("event_dispatcher",),
        id="sinks",
    ),
    pytest.param(
        {"api__dispatcher": {"retry_threshold": 3}}, ("event_dispatcher",), id="dispatcher"
    ),
    pytest.param({"runtime__log_level": "debug"}, ("runtime",), id="runtime-only"),
    pytest.param(
        {"runtime__tun": {"addr": "10.9.0.1/24", "tag": "tun-in"}},
        ("runtime", "tun"),
        id="tun",
    ),
    # A control plane cannot replace itself (reconcile.check_fixed refuses it); the
    # diff has no component for it.
    pytest.param({"api__grpc": {"enabled": True}}, (), id="fixed-parts-are-no-component"),
]


@pytest.mark.parametrize(("edits", "components"), EDITS)
def test_an_edit_changes_exactly_its_components(edits, components):
    old, new = config(), config(**edits)
    assert diff(old, new).changed == components
    # Undoing the edit changes the same components.
    assert diff(new, old).changed == components


def test_inbounds_by_tag_added_changed_removed():
    new = config(
        inbounds=[
            # "a" changed (udp off), "b" removed, "c" added
            {**BASE["inbounds"][0], "udp": False},
            {"tag": "c", "protocol": "mixed", "listen": {"address": "127.0.0.1", "port": 0}},
        ]
    )
    d = diff(config(), new)
    assert d.inbounds == Difference(
        to_add=frozenset({"c"}), to_change=frozenset({"a"}), to_remove=frozenset({"b"})
    )
    assert d.proxy_listeners
    assert d.changed == ("proxy_listeners",)


def test_reordering_inbounds_restarts_no_listener():
    d = diff(config(), config(inbounds=list(reversed(BASE["inbounds"]))))
    assert d.inbounds.is_empty()
    assert d.changed == ()


def test_a_new_idle_timeout_restarts_every_kept_listener():
    d = diff(config(), config(runtime__tcp_idle_timeout_seconds=30))
    assert d.inbounds == Difference(to_change=frozenset({"a", "b"}))
    assert d.changed == ("proxy_listeners", "runtime")


def test_a_new_idle_timeout_without_inbounds_restarts_nothing():
    d = diff(config(inbounds=[]), config(inbounds=[], runtime__tcp_idle_timeout_seconds=30))
    assert d.inbounds.is_empty()
    assert d.changed == ("runtime",)


def test_changed_follows_the_component_order():
    everything = config(
        inbounds=[],
        outbounds=[],
        outbound_groups=[],
        rules=[],
        runtime={"dns": {"servers": ["udp://127.0.0.1"]}, "tun": {"addr": "10.9.0.1", "tag": "t"}},
        api={
            "control": {"enabled": False},
            "flow_hook": {"path": "/h"},
            "event_sinks": [{"type": "jsonl", "tag": "j", "path": "/tmp/events.jsonl"}],
        },
    )
    assert diff(config(), everything).changed == COMPONENTS


def test_the_diff_is_a_value():
    d = diff(config(), config(rules=[]))
    assert d == diff(config(), config(rules=[]))
    assert hash(d) == hash(diff(config(), config(rules=[])))
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.routing = False  # type: ignore[misc]
    assert isinstance(d, ConfigDiff)


@settings(max_examples=60, deadline=None)
@given(
    old=st.lists(st.sampled_from("abcde"), unique=True),
    new=st.lists(st.sampled_from("abcde"), unique=True),
    udp_off=st.sets(st.sampled_from("abcde")),
)
def test_inbound_difference_matches_set_arithmetic(old, new, udp_off):
    def doc(tags, flipped):
        return [
            {
                "tag": t,
                "protocol": "socks5",
                "listen": {"address": "127.0.0.1", "port": 0},
                "udp": t not in flipped,
            }
            for t in tags
        ]

    d = diff(config(inbounds=doc(old, set())), config(inbounds=doc(new, udp_off)))
    assert d.inbounds.to_add == frozenset(new) - frozenset(old)
    assert d.inbounds.to_remove == frozenset(old) - frozenset(new)
    assert d.inbounds.to_change == frozenset(old) & frozenset(new) & frozenset(udp_off)
    assert d.proxy_listeners == (set(old) != set(new) or bool(set(old) & set(new) & udp_off))
