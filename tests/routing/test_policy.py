"""spliceway.routing.policy, the pure parts: selection rules, chains, snapshots, probe URLs."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from spliceway.config import parse_config
from spliceway.routing import policy
from spliceway.routing.policy import (
    DEFAULT_PROBE_URL,
    GroupView,
    MemberHealth,
    PolicyTable,
    choose,
    initial_view,
    mark_down,
    parse_expected_status,
    parse_probe_url,
    pinned,
    probe_url_for,
    status_allowed,
    with_health,
)

UNKNOWN = MemberHealth()  # before the first round: healthy, latency unknown
DEAD = MemberHealth(False, None, 1, "connect to 127.0.0.1:1 failed: Connection refused")


def up(ms: float) -> MemberHealth:
    return MemberHealth(True, ms, 1, None)


def view(
    kind: str,
    members: list[str],
    health: dict[str, MemberHealth] | None = None,
    *,
    tag: str | None = None,
    selected: str | None = None,
    tolerance_ms: int | None = 50,
    strategy: str | None = None,
) -> GroupView:
    all_health = dict.fromkeys(members, UNKNOWN) | (health or {})
    return GroupView(
        tag=tag or kind,
        kind=kind,
        members=tuple(members),
        selected=selected,
        health=MappingProxyType(all_health),
        url="http://127.0.0.1:9/" if kind in policy.PROBING_KINDS else None,
        interval_seconds=300 if kind in policy.PROBING_KINDS else None,
        tolerance_ms=tolerance_ms if kind == "url_test" else None,
        strategy=strategy,
    )


def url_test(health: dict[str, MemberHealth], members=("a", "b", "c"), tolerance_ms=50):
    return view("url_test", list(members), health, tolerance_ms=tolerance_ms)


# -- url_test -----------------------------------------------------------------------


def test_url_test_keeps_current_within_tolerance():
    v = url_test({"a": up(140), "b": up(100), "c": up(300)})
    assert choose(v, "a") == "a"  # 40 ms slower than the best: not worth a switch


def test_url_test_tolerance_boundary_is_inclusive():
    v = url_test({"a": up(150), "b": up(100), "c": up(300)})
    assert choose(v, "a") == "a"  # exactly tolerance_ms slower still keeps it
    v = url_test({"a": up(150.001), "b": up(100), "c": up(300)})
    assert choose(v, "a") == "b"


def test_url_test_switches_beyond_tolerance():
    v = url_test({"a": up(200), "b": up(100), "c": up(120)})
    assert choose(v, "a") == "b"
    assert choose(url_test({"a": up(200), "b": up(100)}, tolerance_ms=0), "a") == "b"


def test_url_test_without_tolerance_takes_any_gain():
    v = view("url_test", ["a", "b"], {"a": up(100.5), "b": up(100)}, tolerance_ms=None)
    assert choose(v, "a") == "b"


def test_url_test_ties_go_to_list_order():
    v = url_test({"a": up(100), "b": up(80), "c": up(80)})
    assert choose(v, None) == "b"
    v = url_test({"a": up(100), "b": up(80), "c": up(80)}, members=("a", "c", "b"))
    assert choose(v, None) == "c"


def test_url_test_no_current_takes_the_fastest():
    assert choose(url_test({"a": up(90), "b": up(10), "c": up(50)}), None) == "b"


def test_url_test_no_measured_member_keeps_current():
    v = url_test({})
    assert choose(v, "b") == "b"
    assert choose(v, None) == "a"  # fresh group: its first member


def test_url_test_no_measured_member_leaves_a_dead_current():
    v = url_test({"a": DEAD})
    assert choose(v, "a") == "b"  # first member not known dead


def test_url_test_all_dead_keeps_current_or_first():
    v = url_test({"a": DEAD, "b": DEAD, "c": DEAD})
    assert choose(v, "c") == "c"  # nothing better to go to
    assert choose(v, None) == "a"


def test_url_test_current_known_dead_moves_to_fastest_healthy():
    v = url_test({"a": DEAD, "b": up(300), "c": up(100)})
    assert choose(v, "a") == "c"


def test_url_test_unmeasured_current_gives_way_to_a_measured_member():
    v = url_test({"b": up(500)})  # a and c healthy but never measured
    assert choose(v, "a") == "b"


def test_url_test_dead_members_do_not_count_as_fastest():
    v = url_test({"a": up(200), "b": MemberHealth(False, 1.0, 1, "reset"), "c": up(190)})
    assert choose(v, "a") == "a"
    assert choose(v, None) == "c"


# -- fallback -----------------------------------------------------------------------


def test_fallback_first_healthy_in_order():
    v = view("fallback", ["a", "b", "c"], {"a": DEAD, "b": up(500), "c": up(1)})
    assert choose(v, None) == "b"
    assert choose(v, "c") == "b"  # the current choice does not matter, order does


def test_fallback_unmeasured_counts_as_healthy():
    assert choose(view("fallback", ["a", "b"]), None) == "a"


def test_fallback_all_dead_uses_first():
    v = view("fallback", ["a", "b"], {"a": DEAD, "b": DEAD})
    assert choose(v, "b") == "a"


@pytest.mark.parametrize("kind", ["selector", "relay", "load_balance"])
def test_choose_is_none_for_kinds_without_a_rule(kind):
    assert choose(view(kind, ["a", "b"]), "a") is None


def test_with_health_reselects_and_stamps_time():
    v = view("fallback", ["a", "b"], selected="a")
    after = with_health(v, {"a": DEAD, "b": up(12)}, now_ms=1234)
    assert after.selected == "b"
    assert after.last_checked_unix_ms == 1234
    assert v.health["a"] == UNKNOWN  # views are values: the old one is untouched
    u = url_test({"a": up(10), "b": up(11), "c": up(12)})
    u = with_health(GroupView(**{**_fields(u), "selected": "a"}), {"a": DEAD}, 5)
    assert u.selected == "b"


def test_with_health_leaves_selector_and_load_balance_selection_alone():
    sel = view("selector", ["a", "b"], selected="b")
    assert with_health(sel, {"b": DEAD}, 1).selected == "b"
    lb = view("load_balance", ["a", "b"])
    assert with_health(lb, {"a": DEAD}, 1).selected is None


# -- pins (mihomo's fixed) -------------------------------------------------------------


def test_url_test_pin_wins_while_healthy_whatever_the_latency():
    v = pinned(url_test({"a": up(10), "b": up(900), "c": up(20)}), "b")
    assert (v.fixed, v.selected) == ("b", "b")
    # A new round that finds it slower still keeps it.
    v = with_health(v, {"a": up(1), "b": up(2000)}, 5)
    assert (v.fixed, v.selected) == ("b", "b")


def test_url_test_pin_dead_falls_back_to_its_own_choice_and_keeps_the_pin():
    v = pinned(url_test({"a": up(10), "b": up(20), "c": up(30)}), "c")
    v = mark_down(v, "c", "refused", 7)
    assert (v.fixed, v.selected) == ("c", "a")
    v = with_health(v, {"a": up(10), "b": up(20), "c": up(30)}, 8)  # it recovers
    assert (v.fixed, v.selected) == ("c", "c")


def test_url_test_pin_on_a_dead_member_takes_effect_when_it_recovers():
    v = pinned(url_test({"a": up(10), "b": DEAD}), "b")
    assert (v.fixed, v.selected) == ("b", "a")
    v = with_health(v, {"b": up(50)}, 3)
    assert v.selected == "b"


def test_fallback_pin_wins_while_healthy_and_is_dropped_when_found_dead():
    v = pinned(view("fallback", ["a", "b", "c"]), "c")
    assert (v.fixed, v.selected) == ("c", "c")
    v = with_health(v, {"a": up(1), "b": up(1), "c": up(1)}, 2)
    assert v.selected == "c"
    v = with_health(v, {"c": DEAD}, 3)
    assert (v.fixed, v.selected) == (None, "a")
    v = with_health(v, {"c": up(1)}, 4)  # recovering does not bring the pin back
    assert (v.fixed, v.selected) == (None, "a")


def test_fallback_pin_on_a_dead_member_waits_for_the_next_check():
    v = pinned(view("fallback", ["a", "b"], {"b": DEAD}), "b")
    assert (v.fixed, v.selected) == ("b", "a")  # kept until a check finds it dead again
    assert with_health(v, {"b": up(3)}, 2).selected == "b"
    assert with_health(v, {"b": DEAD}, 2).fixed is None


def test_unpinning_returns_to_the_kinds_rule():
    v = pinned(url_test({"a": up(10), "b": up(900)}), "b")
    assert pinned(v, None).selected == "a"
    f = pinned(view("fallback", ["a", "b"]), "b")
    assert (pinned(f, None).fixed, pinned(f, None).selected) == (None, "a")


def test_snapshot_reports_the_pin():
    table = PolicyTable([pinned(url_test({"a": up(1), "b": up(2)}, members=("a", "b")), "b")])
    snap = table.snapshot("url_test")
    assert (snap["fixed"], snap["selected"]) == ("b", "b")


# -- probe results and expected statuses ------------------------------------------------


def test_record_probe_is_the_latest_health_when_newest():
    table = PolicyTable([view("fallback", ["a", "b"], {"a": MemberHealth(True, 5, 100, None)})])
    table.record_probe("a", MemberHealth(False, None, 50, "older"))
    assert table.latest_health()["a"] == (MemberHealth(True, 5, 100, None), "fallback")
    table.record_probe("a", MemberHealth(False, None, 200, "newer"))
    table.record_probe("lonely", MemberHealth(True, 9, 1, None))
    latest = table.latest_health()
    assert latest["a"] == (MemberHealth(False, None, 200, "newer"), None)
    assert latest["lonely"] == (MemberHealth(True, 9, 1, None), None)
    # A group's own view, and so its choice, is untouched.
    assert table.snapshot("fallback")["url_test_members"][0]["healthy"] is True


@pytest.mark.parametrize(
    ("text", "ranges"),
    [
        (None, ()),
        ("", ()),
        (" * ", ()),
        ("204", ((204, 204),)),
        ("200/204", ((200, 200), (204, 204))),
        ("200,204", ((200, 200), (204, 204))),
        ("200-299", ((200, 299),)),
        ("200/204/401-429/501-503", ((200, 200), (204, 204), (401, 429), (501, 503))),
        ("200//204/", ((200, 200), (204, 204))),
    ],
)
def test_parse_expected_status(text, ranges):
    assert parse_expected_status(text) == ranges


@pytest.mark.parametrize(
    "text", ["x", "200-", "-200", "1-2-3", "300-200", "2OO", "/".join(["1"] * 29)]
)
def test_parse_expected_status_rejects(text):
    with pytest.raises(ValueError, match="range"):
        parse_expected_status(text)


def test_status_allowed():
    assert status_allowed((), 599)
    assert status_allowed(((200, 299),), 204) and not status_allowed(((200, 299),), 300)


def test_https_probe_url():
    u = parse_probe_url("https://www.gstatic.com/generate_204")
    assert (u.host, u.port, u.target, u.tls) == ("www.gstatic.com", 443, "/generate_204", True)
    assert b"Host: www.gstatic.com\r\n" in u.head_request()
    assert b"Host: h:8443\r\n" in parse_probe_url("https://h:8443/").head_request()
    assert parse_probe_url("http://h/").tls is False


def test_mark_down_is_immediate_and_forgets_latency():
    v = GroupView(**{**_fields(view("fallback", ["a", "b"], {"a": up(5)})), "selected": "a"})
    after = mark_down(v, "a", "connection refused", now_ms=77)
    assert after.selected == "b"
    assert after.health["a"] == MemberHealth(False, None, 77, "connection refused")
    assert after.last_checked_unix_ms is None  # not a probe round


def _fields(v: GroupView) -> dict:
    return {name: getattr(v, name) for name in GroupView.__slots__}


# -- load_balance -------------------------------------------------------------------


def test_load_balance_candidates_are_the_healthy_members():
    v = view("load_balance", ["a", "b", "c"], {"b": DEAD})
    assert v.candidates() == ("a", "c")
    v = view("load_balance", ["a", "b"], {"a": DEAD, "b": DEAD})
    assert v.candidates() == ("a", "b")  # all dead: spread over all of them


def test_round_robin_alternates_over_healthy_members():
    table = PolicyTable([view("load_balance", ["a", "b"], tag="lb", strategy="round_robin")])
    assert [table.resolve("lb")[-1] for _ in range(5)] == ["a", "b", "a", "b", "a"]
    table.publish(view("load_balance", ["a", "b"], {"a": DEAD}, tag="lb", strategy="round_robin"))
    assert {table.resolve("lb")[-1] for _ in range(4)} == {"b"}
    table.publish(view("load_balance", ["a", "b"], tag="lb", strategy="round_robin"))
    picks = [table.resolve("lb")[-1] for _ in range(4)]
    assert sorted(picks) == ["a", "a", "b", "b"] and picks[0] != picks[1]


def _hashing(members, down=(), strategy="consistent_hashing"):
    health = dict.fromkeys(down, DEAD)
    return PolicyTable([view("load_balance", list(members), health, tag="lb", strategy=strategy)])


def test_consistent_hashing_is_stable_per_host_and_spreads_hosts():
    table = _hashing(["a", "b", "c"])
    hosts = [f"host{i}.example" for i in range(60)]
    first = {h: table.resolve("lb", h, "10.0.0.1")[-1] for h in hosts}
    again = {h: table.resolve("lb", h, f"10.0.0.{i}")[-1] for i, h in enumerate(hosts)}
    assert first == again  # source IP plays no part
    assert set(first.values()) == {"a", "b", "c"}
    # A fresh table (another engine) picks the same: no per-process salt.
    assert {h: _hashing(["a", "b", "c"]).resolve("lb", h)[-1] for h in hosts} == first


def test_sticky_sessions_follow_the_source_ip():
    table = _hashing(["a", "b", "c"], strategy="sticky_sessions")
    sources = [f"192.0.2.{i}" for i in range(60)]
    by_source = {s: table.resolve("lb", "one.example", s)[-1] for s in sources}
    assert set(by_source.values()) == {"a", "b", "c"}
    for s in sources[:10]:
        assert {table.resolve("lb", f"h{i}.example", s)[-1] for i in range(10)} == {by_source[s]}


members_st = st.lists(
    st.text("abcdefghij-", min_size=1, max_size=6), min_size=2, max_size=6, unique=True
)


@settings(max_examples=200, deadline=None)
@given(
    members=members_st, keys=st.lists(st.text(max_size=30), min_size=1, max_size=20), data=st.data()
)
def test_rendezvous_moves_only_the_dead_members_share(members, keys, data):
    dead = data.draw(st.sampled_from(members))
    strategy = data.draw(st.sampled_from(["consistent_hashing", "sticky_sessions"]))
    before, after = _hashing(members, strategy=strategy), _hashing(members, [dead], strategy)
    shuffled = _hashing(data.draw(st.permutations(members)), strategy=strategy)
    for key in keys:
        host, source = (key, "") if strategy == "consistent_hashing" else ("", key)
        was = before.resolve("lb", host, source)[-1]
        now = after.resolve("lb", host, source)[-1]
        assert shuffled.resolve("lb", host, source)[-1] == was  # member order is irrelevant
        if was == dead:
            assert now != dead
        else:
            assert now == was


# -- chains -------------------------------------------------------------------------


def nested_table() -> PolicyTable:
    """proxy (selector) -> auto (url_test) -> x; chain (relay of hop-a, hop-b); lb; fb."""
    return PolicyTable(
        [
            view("selector", ["auto", "chain", "lb", "direct"], tag="proxy", selected="auto"),
            GroupView(
                **{
                    **_fields(view("url_test", ["x", "y"], {"x": up(12.5), "y": up(90)})),
                    "tag": "auto",
                    "selected": "x",
                }
            ),
            view("relay", ["hop-a", "hop-b"], tag="chain"),
            view(
                "load_balance",
                ["auto", "chain", "z"],
                {"z": DEAD},
                tag="lb",
                strategy="round_robin",
            ),
            GroupView(
                **{
                    **_fields(view("fallback", ["x", "y"], {"x": DEAD, "y": up(30)})),
                    "tag": "fb",
                    "selected": "y",
                }
            ),
        ]
    )


def test_resolve_walks_nested_groups_to_a_leaf():
    table = nested_table()
    assert table.resolve("proxy") == ["proxy", "auto", "x"]
    assert table.resolve("auto") == ["auto", "x"]
    assert table.resolve("fb") == ["fb", "y"]
    assert table.resolve("x") == ["x"]  # a plain outbound
    assert table.resolve("direct") == ["direct"]


def test_resolve_stops_at_a_relay():
    table = nested_table()
    assert table.resolve("chain") == ["chain"]
    sel = view("selector", ["chain", "direct"], tag="proxy", selected="chain")
    table.publish(sel)
    assert table.resolve("proxy") == ["proxy", "chain"]


def test_resolve_through_a_nested_load_balance():
    table = nested_table()
    table.publish(view("selector", ["auto", "lb"], tag="proxy", selected="lb"))
    chains = [table.resolve("proxy") for _ in range(3)]
    assert chains == [
        ["proxy", "lb", "auto", "x"],
        ["proxy", "lb", "chain"],
        ["proxy", "lb", "auto", "x"],
    ]


def test_effective_chains_per_kind():
    table = nested_table()
    assert table.effective_chains("proxy") == [["proxy", "auto", "x"]]
    assert table.effective_chains("auto") == [["auto", "x"]]
    assert table.effective_chains("fb") == [["fb", "y"]]
    # one chain per healthy member (z is dead), walked down through member groups
    assert table.effective_chains("lb") == [["lb", "auto", "x"], ["lb", "chain"]]
    assert table.effective_chains("chain") == [["hop-a", "hop-b"]]  # the hops
    assert table.effective_chains("x") == [["x"]]


def test_effective_chains_stop_at_a_nested_load_balance():
    table = nested_table()
    table.publish(view("selector", ["lb", "direct"], tag="proxy", selected="lb"))
    assert table.effective_chains("proxy") == [["proxy", "lb"]]
    assert table.snapshot("lb")["effective_chains"] == [["lb", "auto", "x"], ["lb", "chain"]]
    # showing chains does not move the round robin: the first flow gets the first member
    assert table.resolve("proxy") == ["proxy", "lb", "auto", "x"]


def test_effective_chains_of_load_balance_with_all_members_dead_lists_all():
    table = PolicyTable([view("load_balance", ["a", "b"], {"a": DEAD, "b": DEAD}, tag="lb")])
    assert table.effective_chains("lb") == [["lb", "a"], ["lb", "b"]]


# -- snapshots ----------------------------------------------------------------------

BASE_KEYS = {
    "fixed",
    "tag",
    "kind",
    "outbounds",
    "selected",
    "latency_ms",
    "last_checked_unix_ms",
    "effective_chains",
    "url_test_members",
    "member_health",
}
MEMBER_KEYS = {
    "member_tag",
    "healthy",
    "latency_ms",
    "last_checked_unix_ms",
    "last_error",
    "effective_chains",
}


def test_snapshot_of_a_selector():
    snap = nested_table().snapshot("proxy")
    assert set(snap) == BASE_KEYS
    assert snap["kind"] == "selector"
    assert snap["outbounds"] == ["auto", "chain", "lb", "direct"]
    assert snap["selected"] == "auto"
    assert snap["latency_ms"] == 12.5  # the nested url_test's chosen member
    assert snap["effective_chains"] == [["proxy", "auto", "x"]]
    assert snap["url_test_members"] == []


def test_member_health_is_the_newest_check_by_any_group():
    """A member's health in every group's ``member_health`` is the newest of every probing
    group's own view; a tie goes to the group listed first; unchecked is all null."""
    table = nested_table()
    # x: up at t=1 in auto, dead at t=1 in fb (a tie: auto is listed first).
    proxy = {m["member_tag"]: m for m in table.snapshot("proxy")["member_health"]}
    assert list(proxy) == ["auto", "chain", "lb", "direct"]
    assert proxy["direct"] == {
        "member_tag": "direct",
        "healthy": None,
        "latency_ms": None,
        "last_checked_unix_ms": None,
        "last_error": None,
        "checked_by": None,
    }
    fb = {m["member_tag"]: m for m in table.snapshot("fb")["member_health"]}
    assert (fb["x"]["healthy"], fb["x"]["checked_by"]) == (True, "auto")
    # A later check by fb wins, in auto too (whose own view is unchanged).
    fb_view = table.get("fb")
    assert fb_view is not None
    table.publish(mark_down(fb_view, "x", "refused", 5))
    auto = table.snapshot("auto")
    x = next(m for m in auto["member_health"] if m["member_tag"] == "x")
    assert (x["healthy"], x["last_checked_unix_ms"], x["last_error"], x["checked_by"]) == (
        False,
        5,
        "refused",
        "fb",
    )
    assert auto["url_test_members"][0]["healthy"] is True
    # Non-probing groups (a selector, a relay) record no health of their own.
    assert set(table.latest_health()) == {"x", "y", "z"}


def test_snapshot_of_a_selector_on_a_plain_outbound_has_no_latency():
    table = PolicyTable([view("selector", ["a", "b"], tag="s", selected="b")])
    assert table.snapshot("s")["latency_ms"] is None


def test_snapshot_of_a_url_test():
    snap = nested_table().snapshot("auto")
    assert set(snap) == BASE_KEYS | {"url", "interval_seconds", "tolerance_ms"}
    assert (snap["selected"], snap["latency_ms"], snap["tolerance_ms"]) == ("x", 12.5, 50)
    assert snap["url"] == "http://127.0.0.1:9/"
    assert snap["interval_seconds"] == 300
    x, y = snap["url_test_members"]
    assert set(x) == MEMBER_KEYS
    assert x == {
        "member_tag": "x",
        "healthy": True,
        "latency_ms": 12.5,
        "last_checked_unix_ms": 1,
        "last_error": None,
        "effective_chains": [["x"]],
    }
    assert (y["member_tag"], y["latency_ms"]) == ("y", 90)


def test_snapshot_of_a_fallback_reports_errors():
    snap = nested_table().snapshot("fb")
    assert set(snap) == BASE_KEYS | {"url", "interval_seconds"}
    assert snap["selected"] == "y"
    assert snap["latency_ms"] == 30
    dead = snap["url_test_members"][0]
    assert (dead["healthy"], dead["latency_ms"], dead["last_error"]) == (
        False,
        None,
        DEAD.last_error,
    )


def test_snapshot_of_a_load_balance():
    snap = nested_table().snapshot("lb")
    assert set(snap) == BASE_KEYS | {"url", "interval_seconds", "strategy"}
    assert snap["strategy"] == "round_robin"
    assert snap["selected"] is None and snap["latency_ms"] is None
    assert [m["member_tag"] for m in snap["url_test_members"]] == ["auto", "chain", "z"]
    by_tag = {m["member_tag"]: m for m in snap["url_test_members"]}
    assert by_tag["auto"]["effective_chains"] == [["auto", "x"]]
    assert by_tag["chain"]["effective_chains"] == [["hop-a", "hop-b"]]


def test_snapshot_of_a_relay():
    snap = nested_table().snapshot("chain")
    assert set(snap) == BASE_KEYS
    assert snap["kind"] == "relay"
    assert snap["selected"] is None and snap["latency_ms"] is None
    assert snap["effective_chains"] == [["hop-a", "hop-b"]]
    assert snap["url_test_members"] == []


def test_table_lookup_and_order():
    table = nested_table()
    assert [v.tag for v in table.views()] == ["proxy", "auto", "chain", "lb", "fb"]
    assert "auto" in table and "x" not in table
    assert table.get("x") is None
    table.publish(view("selector", ["auto", "direct"], tag="proxy", selected="direct"))
    assert [v.tag for v in table.views()] == ["proxy", "auto", "chain", "lb", "fb"]
    assert table.get("proxy").selected == "direct"


# -- initial views from a configuration ---------------------------------------------


def test_initial_views_from_config():
    cfg = parse_config(
        {
            "inbounds": [{"tag": "in", "protocol": "socks5", "listen": {"port": 0}}],
            "outbounds": [
                {"tag": "direct", "protocol": "direct"},
                {"tag": "s1", "protocol": "socks5", "server": "127.0.0.1", "port": 1080},
                {"tag": "h1", "protocol": "http", "server": "127.0.0.1", "port": 8080},
            ],
            "outbound_groups": [
                {"tag": "sel", "kind": "selector", "outbounds": ["auto", "direct"]},
                {"tag": "auto", "kind": "url_test", "outbounds": ["h1", "s1"]},
                {"tag": "fb", "kind": "fallback", "outbounds": ["s1", "h1"], "url": "http://a/"},
                {"tag": "lb", "kind": "load_balance", "outbounds": ["s1", "h1"]},
                {"tag": "chain", "kind": "relay", "outbounds": ["s1", "h1"]},
            ],
            "api": {"control": {"enabled": False}, "ipc": {"enabled": False}},
        }
    )
    views = {
        g.tag: initial_view(g, probe_url_for(getattr(g, "url", None), None))
        for g in cfg.outbound_groups
    }
    assert {t: v.selected for t, v in views.items()} == {
        "sel": "auto",  # default: the first member
        "auto": "h1",  # before any probe: the first member
        "fb": "s1",
        "lb": None,
        "chain": None,
    }
    assert views["fb"].url == "http://a/"
    assert views["auto"].url == DEFAULT_PROBE_URL
    assert views["sel"].url is None and views["chain"].url is None
    assert views["auto"].tolerance_ms == 50 and views["auto"].interval_seconds == 300
    assert views["lb"].strategy == "round_robin"
    assert all(h == UNKNOWN for v in views.values() for h in v.health.values())
    assert [v.probing for v in views.values()] == [False, True, True, True, False]


def test_probe_url_precedence():
    assert probe_url_for("http://group/", "http://runtime/") == "http://group/"
    assert probe_url_for(None, "http://runtime/") == "http://runtime/"
    assert probe_url_for(None, None) == DEFAULT_PROBE_URL


# -- probe URLs ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "host", "port", "target"),
    [
        ("http://example.com", "example.com", 80, "/"),
        ("http://www.gstatic.com/generate_204", "www.gstatic.com", 80, "/generate_204"),
        ("http://127.0.0.1:8080/x", "127.0.0.1", 8080, "/x"),
        ("HTTP://Example.COM/a?b=c&d", "example.com", 80, "/a?b=c&d"),
        ("http://h/p?q=1#frag", "h", 80, "/p?q=1"),  # the fragment is not sent
        ("http://[::1]:81/", "::1", 81, "/"),
        ("http://h:65535/%C3%BC", "h", 65535, "/%C3%BC"),
    ],
)
def test_parse_probe_url_accepts(url, host, port, target):
    parsed = parse_probe_url(url)
    assert (parsed.url, parsed.host, parsed.port, parsed.target) == (url, host, port, target)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://example.com/", "only http://"),
        ("example.com/path", "only http://"),
        ("//example.com/", "only http://"),
        ("http://", "no host"),
        ("http:///generate_204", "no host"),
        ("http://:80/", "no host"),
        ("http://exa mple.com/", "whitespace"),
        ("http://example.com/a b", "whitespace"),
        ("http://example.com/\tx", "whitespace"),
        ("http://example.com/x\r\nX-Evil: 1", "whitespace"),
        ("http://exämple.com/", "ASCII"),
        ("http://example.com/ü", "ASCII"),
        ("http://example.com:99999/", "not a valid URL"),
        ("http://example.com:http/", "not a valid URL"),
        ("http://[::1/", "not a valid URL"),
        ("http://example.com:0/", "port 0"),  # was read as "no port" and probed port 80
    ],
)
def test_parse_probe_url_rejects(url, why):
    with pytest.raises(ValueError, match=why):
        parse_probe_url(url)


def test_head_request():
    assert parse_probe_url("http://example.com/generate_204").head_request() == (
        b"HEAD /generate_204 HTTP/1.1\r\nHost: example.com\r\n"
        b"User-Agent: spliceway-probe\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )
    assert b"Host: 127.0.0.1:8080\r\n" in parse_probe_url("http://127.0.0.1:8080/").head_request()
    assert b"Host: [::1]:81\r\n" in parse_probe_url("http://[::1]:81/").head_request()
    assert parse_probe_url("http://h/a?b=1").head_request().startswith(b"HEAD /a?b=1 HTTP/1.1\r\n")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40))
def test_parse_probe_url_never_raises_anything_but_value_error(tail):
    for url in (tail, "http://" + tail, "http://h/" + tail):
        try:
            parsed = parse_probe_url(url)
        except ValueError:
            continue
        head = parsed.head_request()  # an accepted URL always makes a sendable request
        assert head.startswith(b"HEAD /") and head.count(b"\r\n\r\n") == 1
        assert 0 < parsed.port <= 65535 and parsed.host
