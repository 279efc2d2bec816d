"""Proxy providers' outbounds merged into a configuration: members, filters, tags."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from spliceway.config import parse_config
from spliceway.providers.materialise import materialise
from spliceway.providers.subscription import ProxyContent, ProxyEntry


def _socks(port: int) -> dict[str, Any]:
    return {"protocol": "socks5", "server": "127.0.0.1", "port": port}


def _content(*names: str, protocol: str = "socks5") -> ProxyContent:
    entries = []
    for i, name in enumerate(names):
        outbound: dict[str, Any] = _socks(1000 + i)
        if protocol == "shadowsocks":
            outbound = {**outbound, "protocol": "shadowsocks", "password": "x"}
        entries.append(ProxyEntry(name, outbound))
    return ProxyContent("clash", tuple(entries))


def _config(**extra: Any) -> Any:
    doc: dict[str, Any] = {
        "outbounds": [
            {"tag": "hk", "protocol": "socks5", "server": "127.0.0.1", "port": 9},
            {"tag": "block", "protocol": "block"},
        ],
        "providers": {
            "proxies": {
                "a": {"url": "https://a.example/sub"},
                "b": {"path": "/srv/b.yaml"},
            }
        },
        "outbound_groups": [
            {"tag": "pick", "kind": "selector", "outbounds": ["hk"], "providers": ["b", "a"]},
            {"tag": "auto", "kind": "url_test", "providers": ["a"]},
        ],
    }
    doc.update(extra)
    return parse_config(doc)


def test_members_are_inline_first_then_each_provider_in_the_groups_order() -> None:
    merged = materialise(_config(), {"a": _content("a1", "a2"), "b": _content("b1")})
    config = merged.config
    assert config.find_group("pick").outbounds == ("hk", "b1", "a1", "a2")
    assert config.find_group("auto").outbounds == ("a1", "a2")
    # Provider outbounds follow the configuration's own, in providers' order.
    assert config.outbound_tags() == ("hk", "block", "a1", "a2", "b1", "direct")
    assert config.find_outbound("a2").port == 1001
    assert dict(merged.origins) == {"a1": "a", "a2": "a", "b1": "b"}
    assert merged.members["a"].tags == ("a1", "a2")
    # The selector's default stays its first inline member.
    assert config.find_group("pick").default == "hk"


def test_without_content_a_group_is_empty_and_the_configuration_still_valid() -> None:
    merged = materialise(_config(), {})
    assert merged.config.find_group("auto").outbounds == ()
    assert merged.config.find_group("pick").outbounds == ("hk",)
    assert merged.members["a"].tags == () and merged.members["b"].tags == ()
    assert dict(merged.origins) == {}


def test_a_configuration_without_providers_is_returned_as_it_is() -> None:
    config = parse_config({"outbounds": [{"tag": "x", "protocol": "block"}]})
    assert materialise(config, {}).config is config


def test_filter_then_exclude_filter_on_the_name_before_the_override() -> None:
    config = _config(
        providers={
            "proxies": {
                "a": {
                    "url": "https://a.example/sub",
                    "filter": ["^HK", "Japan"],
                    "exclude_filter": ["slow"],
                    "override": {"name_prefix": "[a] ", "name_suffix": " *"},
                },
                "b": {"path": "/b"},
            }
        }
    )
    names = ("Japan 2", "HK 1", "HK slow", "US 1", "xHK", "HK 3")
    merged = materialise(config, {"a": _content(*names)})
    # mihomo's order: every match of the first expression, then the second's.
    assert merged.config.find_group("auto").outbounds == (
        "[a] HK 1 *",
        "[a] HK 3 *",
        "[a] Japan 2 *",
    )
    assert merged.members["a"].filtered_out == ("HK slow", "US 1", "xHK")


def test_taken_tags_are_renamed_deterministically_and_reported() -> None:
    # "hk" is an inline outbound, "pick" a group, "direct" the built-in; "x" comes twice
    # (once from each provider), and "x (a)" is taken by a's own proxy of that name.
    contents = {
        "a": _content("hk", "pick", "direct", "x", "x (a)"),
        "b": _content("x", "hk"),
    }
    config = _config()
    first = materialise(config, contents)
    second = materialise(config, contents)
    assert first.config == second.config
    a_tags = first.members["a"].tags
    assert a_tags == ("hk (a)", "pick (a)", "direct (a)", "x", "x (a)")
    assert first.members["a"].renamed == (
        ("hk", "hk (a)"),
        ("pick", "pick (a)"),
        ("direct", "direct (a)"),
    )
    assert first.members["b"].tags == ("x (b)", "hk (b)")
    assert first.members["b"].renamed == (("x", "x (b)"), ("hk", "hk (b)"))
    # a's "x (a)" came after "x": had a's own "x (a)" come first, "x (a)" would be "#2".
    again = materialise(config, {"a": _content("x (a)", "x"), "b": _content("x", "x (a)")})
    assert again.members["a"].tags == ("x (a)", "x")
    assert again.members["b"].tags == ("x (b)", "x (a) (b)")
    repeated = materialise(
        _config(providers={"proxies": {"a": {"url": "https://a/"}, "b": {"path": "/b"}}}),
        {"a": _content("hk", "hk (a)")},
    )
    assert repeated.members["a"].tags == ("hk (a)", "hk (a) (a)")
    triple = materialise(config, {"a": _content("hk (a)", "hk")})
    # "hk" wants "hk (a)", which "hk (a)" took: the next free one is "#2".
    assert triple.members["a"].tags == ("hk (a)", "hk (a) #2")


def test_override_sets_every_outbounds_connect_timeout() -> None:
    config = _config(
        providers={
            "proxies": {
                "a": {"url": "https://a/", "override": {"connect_timeout_ms": 1234}},
                "b": {"path": "/b"},
            }
        }
    )
    merged = materialise(config, {"a": _content("a1"), "b": _content("b1")})
    assert merged.config.find_outbound("a1").connect_timeout_ms == 1234
    assert merged.config.find_outbound("b1").connect_timeout_ms == 5000


def test_a_selector_default_among_provider_members() -> None:
    doc_groups = [
        {"tag": "pick", "kind": "selector", "providers": ["a"], "default": "a2"},
        {"tag": "gone", "kind": "selector", "providers": ["a"], "default": "nowhere"},
        {"tag": "auto", "kind": "url_test", "providers": ["a"]},
    ]
    config = _config(outbound_groups=doc_groups)
    merged = materialise(config, {"a": _content("a1", "a2")})
    assert merged.config.find_group("pick").default == "a2"
    assert merged.config.find_group("gone").default == "a1"  # not there: the first member
    empty = materialise(config, {})
    assert empty.config.find_group("pick").default is None


def test_a_relay_takes_provider_hops_it_can_dial() -> None:
    config = _config(
        outbound_groups=[{"tag": "chain", "kind": "relay", "outbounds": ["hk"], "providers": ["a"]}]
    )
    mixed = ProxyContent(
        "clash",
        (
            ProxyEntry("s1", _socks(1)),
            ProxyEntry("blk", {"protocol": "block"}),
            ProxyEntry("ss", {**_socks(2), "protocol": "shadowsocks", "password": "x"}),
            ProxyEntry("s2", _socks(3)),
        ),
    )
    merged = materialise(config, {"a": mixed})
    assert merged.config.find_group("chain").outbounds == ("hk", "s1", "ss")
    assert merged.members["a"].left_out == (
        ("chain", "blk", "a block outbound cannot be a relay hop"),
        ("chain", "s2", "a relay has no hop after a shadowsocks hop"),
    )
    # A relay whose every hop comes from a provider with none is empty, and valid.
    empty = _config(outbound_groups=[{"tag": "chain", "kind": "relay", "providers": ["a"]}])
    assert materialise(empty, {}).config.find_group("chain").outbounds == ()


@pytest.mark.parametrize("kind", ["selector", "url_test", "fallback", "load_balance", "relay"])
def test_every_group_kind_takes_providers(kind: str) -> None:
    config = _config(outbound_groups=[{"tag": "g", "kind": kind, "providers": ["a", "b"]}])
    merged = materialise(config, {"a": _content("a1"), "b": _content("b1")})
    assert merged.config.find_group("g").outbounds == ("a1", "b1")


_NAMES = st.text(st.sampled_from("ab (#2)"), min_size=1, max_size=6)


@given(st.lists(_NAMES, max_size=8, unique=True), st.lists(_NAMES, max_size=8, unique=True))
def test_merged_tags_are_unique_and_the_document_validates(a: list[str], b: list[str]) -> None:
    config = _config()
    merged = materialise(config, {"a": _content(*a), "b": _content(*b)})
    tags = merged.config.outbound_tags() + merged.config.group_tags()
    assert len(tags) == len(set(tags))
    assert len(merged.origins) == len(a) + len(b)
    assert merged.config == materialise(config, {"a": _content(*a), "b": _content(*b)}).config


def _grouped(group: dict[str, Any], **providers: Any) -> Any:
    spec = {name: {"path": f"/srv/{name}.yaml", **extra} for name, extra in providers.items()}
    return _config(providers={"proxies": spec}, outbound_groups=[{"tag": "g", **group}])


def test_a_group_filter_keeps_provider_members_in_filter_order_and_not_inline_ones() -> None:
    config = _grouped(
        {"kind": "selector", "outbounds": ["hk", "block"], "providers": ["a"], "filter": ["HK"]},
        a={},
    )
    merged = materialise(config, {"a": _content("US 1", "HK 1", "xHK 2")})
    # Inline members stay (mihomo filters only what providers give).
    assert merged.config.find_group("g").outbounds == ("hk", "block", "HK 1", "xHK 2")
    # Every provider outbound is still an outbound of the configuration, and its origin kept.
    assert "US 1" in merged.config.outbound_tags()
    assert merged.origins["HK 1"] == "a"
    assert merged.members["a"].tags == ("US 1", "HK 1", "xHK 2")


def test_one_expression_orders_each_provider_on_its_own() -> None:
    config = _grouped(
        {"kind": "selector", "providers": ["a", "b"], "filter": ["JP|HK"]}, a={}, b={}
    )
    merged = materialise(config, {"a": _content("JP a", "HK a"), "b": _content("HK b", "JP b")})
    assert merged.config.find_group("g").outbounds == ("JP a", "HK a", "HK b", "JP b")


def test_several_expressions_over_several_sources_order_every_member() -> None:
    # mihomo: each provider filtered in expression order, then (two sources or more, two
    # expressions or more) every member in expression order, inline ones none matches last.
    config = _grouped(
        {
            "kind": "selector",
            "outbounds": ["hk", "block"],
            "providers": ["a", "b"],
            "filter": ["HK", "^JP|hk"],
        },
        a={},
        b={},
    )
    merged = materialise(
        config, {"a": _content("JP a", "HK a", "US a"), "b": _content("JP b", "HK b")}
    )
    assert merged.config.find_group("g").outbounds == (
        "HK a",
        "HK b",
        "hk",
        "JP a",
        "JP b",
        "block",
    )


def test_several_expressions_over_one_provider_keep_its_filter_order() -> None:
    config = _grouped({"kind": "url_test", "providers": ["a"], "filter": ["HK", "JP"]}, a={})
    merged = materialise(config, {"a": _content("JP 1", "HK 1", "JP 2", "HK 2")})
    assert merged.config.find_group("g").outbounds == ("HK 1", "HK 2", "JP 1", "JP 2")


def test_group_exclude_filter_drops_inline_and_provider_members() -> None:
    config = _grouped(
        {
            "kind": "selector",
            "outbounds": ["hk", "block"],
            "providers": ["a"],
            "exclude_filter": ["^(hk|\\[a\\] slow.*)$"],
            "default": "hk",
        },
        a={"override": {"name_prefix": "[a] "}},
    )
    merged = materialise(config, {"a": _content("fast", "slow 1")})
    group = merged.config.find_group("g")
    # The provider's outbound is matched by its name with the override's prefix.
    assert group.outbounds == ("block", "[a] fast")
    assert group.default == "block"  # its default was dropped: the first member


def test_provider_filters_apply_before_the_groups() -> None:
    config = _grouped(
        {"kind": "fallback", "providers": ["a"], "filter": ["1"], "exclude_filter": ["JP"]},
        a={"exclude_filter": ["HK 1"]},
    )
    merged = materialise(config, {"a": _content("HK 1", "JP 1", "US 1", "US 2")})
    assert merged.config.find_group("g").outbounds == ("US 1",)
    assert merged.members["a"].filtered_out == ("HK 1",)


def test_two_groups_filter_one_provider_differently() -> None:
    doc_groups = [
        {"tag": "hk-only", "kind": "url_test", "providers": ["a"], "filter": ["HK"]},
        {"tag": "jp-only", "kind": "selector", "providers": ["a"], "filter": ["JP"]},
        {"tag": "all", "kind": "selector", "providers": ["a"]},
    ]
    config = _config(outbound_groups=doc_groups)
    merged = materialise(config, {"a": _content("HK 1", "JP 1", "HK 2")})
    assert merged.config.find_group("hk-only").outbounds == ("HK 1", "HK 2")
    assert merged.config.find_group("jp-only").outbounds == ("JP 1",)
    assert merged.config.find_group("all").outbounds == ("HK 1", "JP 1", "HK 2")
    # One copy of the provider's outbounds, each once.
    assert merged.config.outbound_tags().count("HK 1") == 1


def test_a_group_filtered_to_nothing_is_empty_as_an_empty_provider() -> None:
    config = _grouped({"kind": "url_test", "providers": ["a"], "filter": ["nothing"]}, a={})
    merged = materialise(config, {"a": _content("HK 1")})
    assert merged.config.find_group("g").outbounds == ()
    sel = _grouped({"kind": "selector", "providers": ["a"], "exclude_filter": ["."]}, a={})
    assert materialise(sel, {"a": _content("HK 1")}).config.find_group("g").default is None


def test_a_relay_filters_before_taking_hops() -> None:
    config = _grouped(
        {"kind": "relay", "outbounds": ["hk"], "providers": ["a"], "exclude_filter": ["^s1$"]},
        a={},
    )
    merged = materialise(config, {"a": _content("s1", "s2")})
    assert merged.config.find_group("g").outbounds == ("hk", "s2")


def test_exclude_filter_on_a_group_without_providers() -> None:
    config = _config(
        providers={},
        outbound_groups=[
            {
                "tag": "g",
                "kind": "selector",
                "outbounds": ["hk", "block"],
                "exclude_filter": ["^h"],
            },
            {"tag": "f", "kind": "fallback", "outbounds": ["hk", "block"], "filter": ["block"]},
        ],
    )
    merged = materialise(config, {})
    assert merged.config.find_group("g").outbounds == ("block",)
    # A filter without providers changes nothing (mihomo filters only providers' members).
    assert merged.config.find_group("f").outbounds == ("hk", "block")


def test_a_selector_starts_on_the_first_member_after_its_filter() -> None:
    # Two expressions over inline and provider members: mihomo's first member is B1, and
    # the selector starts there (mihomo's selector starts on its first member).
    config = _grouped(
        {"kind": "selector", "outbounds": ["hk"], "providers": ["a"], "filter": ["B1", "HK"]},
        a={},
    )
    assert config.find_group("g").default is None
    merged = materialise(config, {"a": _content("HK 1", "B1")})
    group = merged.config.find_group("g")
    assert group.outbounds == ("B1", "HK 1", "hk")
    assert group.default == "B1"
