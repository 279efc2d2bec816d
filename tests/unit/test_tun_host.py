"""The TUN's host side without a kernel: parameters, the routing plan, privilege, the mark."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from spliceway.errors import ApiError
from spliceway.support import socket_mark as mark
from spliceway.tun.device import has_cap_net_admin
from spliceway.tun.egress import Egress, FamilyEgress
from spliceway.tun.options import (
    DEFAULT_INET4,
    DEFAULT_INET6,
    ENGINE_MARK,
    RULE_PRIORITY_BASE,
    resolve_tun_options,
)
from spliceway.tun.routing import build_plan


def _opts(**params):
    return resolve_tun_options({"addr": "198.18.0.1/15", "tag": "t", **params})


# -- parameters -----------------------------------------------------------------------


def test_defaults_of_4_4() -> None:
    o = resolve_tun_options({"addr": "10.1.0.1", "tag": "t"}, network_mtu=9000)
    assert o.inet4 == ipaddress.ip_interface("10.1.0.1/24")  # mask 255.255.255.0
    assert o.inet6 == ipaddress.ip_interface(DEFAULT_INET6)  # dual_stack true
    assert o.mtu == 9000  # runtime.network.mtu
    assert (o.auto_route, o.dual_stack, o.strict_route, o.dns_hijack) == (True,) * 4
    assert o.name == "swtun%d"
    assert o.inet4_peer == ipaddress.ip_address("10.1.0.2")


def test_mask_applies_to_a_bare_ipv4_and_cidr_wins() -> None:
    assert _opts(addr="10.1.0.1", mask="255.255.0.0").inet4.network.prefixlen == 16
    assert _opts(addr="10.1.0.1/20", mask="255.255.0.0").inet4.network.prefixlen == 20


def test_ipv6_addr_gets_a_default_ipv4_and_secondary_is_used() -> None:
    o = _opts(addr="fd00::1/64")
    assert o.inet4 == ipaddress.ip_interface(DEFAULT_INET4)
    o = _opts(secondary_addr="fd00:1::1/64", mtu=1280)
    assert o.inet6 == ipaddress.ip_interface("fd00:1::1/64")
    assert o.mtu == 1280


def test_dual_stack_false_captures_one_family() -> None:
    o = _opts(dual_stack=False)
    assert o.inet6 is None and o.address_family_policy == "ipv4_only"


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"addr": None}, "addr"),
        ({"addr": "not-an-ip"}, "addr"),
        ({"tag": ""}, "tag"),
        ({"addr": "10.0.0.1/31"}, "addr"),  # no room for the second address
        ({"addr": "10.0.0.254/24"}, "addr"),  # A + 1 is the broadcast address
        ({"mask": "255.0.255.0"}, "mask"),
        ({"mtu": 67}, "mtu"),
        ({"mtu": 1000}, "mtu"),  # IPv6 captured: at least 1280
        ({"mtu": True}, "mtu"),
        ({"secondary_addr": "10.9.0.1/24"}, "secondary_addr"),  # same family
        ({"secondary_addr": "fd00::1/64", "dual_stack": False}, "secondary_addr"),
        ({"include_cidrs": ["10.0.0.0/33"]}, "include_cidrs[0]"),
        ({"exclude_cidrs": "10.0.0.0/8"}, "exclude_cidrs"),
        ({"auto_route": "yes"}, "auto_route"),
        ({"name": "a-name-far-too-long"}, "name"),
        ({"name": "a/b"}, "name"),
    ],
)
def test_invalid_parameters_name_their_field(params, field) -> None:
    with pytest.raises(ApiError) as caught:
        _opts(**params)
    assert caught.value.code == "invalid_argument"
    assert caught.value.field_path == field


def test_mtu_below_1280_is_fine_without_ipv6() -> None:
    assert _opts(mtu=576, dual_stack=False).mtu == 576


# -- the routing plan --------------------------------------------------------------------


def _rules(o, family: int) -> list[str]:
    return [r.describe() for r in build_plan(o, "tun0").rules if r.family == family]


def test_plan_default_capture() -> None:
    o = _opts(secondary_addr="fd00::1/64")
    p = RULE_PRIORITY_BASE
    assert _rules(o, 4) == [
        f"(v4) {p}: from all fwmark {hex(ENGINE_MARK)} goto {p + 19}",
        f"(v4) {p + 1}: from all iif tun0 goto {p + 19}",
        f"(v4) {p + 2}: from all ipproto udp dport 53 lookup 21336",
        f"(v4) {p + 2}: from all ipproto tcp dport 53 lookup 21336",
        f"(v4) {p + 5}: from all to 198.18.0.0/15 lookup 21335",
        f"(v4) {p + 6}: from all lookup 21335 suppress_prefixlength 0",
        f"(v4) {p + 7}: from all lookup main suppress_prefixlength 0",
        f"(v4) {p + 8}: not from all iif lo lookup 21335",
        f"(v4) {p + 8}: from 0.0.0.0/32 iif lo lookup 21335",
        f"(v4) {p + 8}: from 198.18.0.0/15 iif lo lookup 21335",
        f"(v4) {p + 19}: from all nop",
    ]
    assert _rules(o, 6)[-5:] == [
        f"(v6) {p + 8}: from fd00::/64 iif lo lookup 21335",
        f"(v6) {p + 9}: from ::/1 iif lo goto {p + 19}",
        f"(v6) {p + 9}: from 8000::/1 iif lo goto {p + 19}",
        f"(v6) {p + 10}: from all lookup 21335",
        f"(v6) {p + 19}: from all nop",
    ]
    routes = [r.describe() for r in build_plan(o, "tun0").routes]
    assert "(v4) 0.0.0.0/0 dev <tun> table 21335" in routes
    assert "(v4) unreachable 0.0.0.0/0 table 21335 metric 4294967040" in routes  # strict
    assert "(v6) ::/0 dev <tun> table 21336" in routes  # dns_hijack's table
    # Every priority lies in the swept range.
    assert all(p <= r.priority < p + 20 for r in build_plan(o, "tun0").rules)


def test_plan_include_exclude_strict_and_no_dns() -> None:
    o = _opts(
        dual_stack=False,
        include_cidrs=["203.0.113.0/24"],
        exclude_cidrs=["203.0.113.128/25", "2001:db8::/32"],
        dns_hijack=False,
    )
    plan = build_plan(o, "tun0")
    routes = [r.describe() for r in plan.routes]
    assert routes == [
        "(v4) 198.18.0.0/15 dev <tun> table 21335",
        "(v4) 203.0.113.0/24 dev <tun> table 21335",
        "(v4) unreachable 203.0.113.0/24 table 21335 metric 4294967040",
    ]
    text = [r.describe() for r in plan.rules]
    assert not any("dport 53" in t for t in text)
    p = RULE_PRIORITY_BASE
    assert f"(v4) {p + 3}: from all to 203.0.113.128/25 goto {p + 19}" in text
    # An excluded network of the family the TUN lacks stays reachable too: its rule
    # comes before strict_route's unreachable one.
    assert f"(v6) {p + 3}: from all to 2001:db8::/32 goto {p + 19}" in text
    assert f"(v6) {p + 4}: from all unreachable" in text


def test_plan_without_strict_route_has_no_unreachable() -> None:
    plan = build_plan(_opts(dual_stack=False, strict_route=False), "tun0")
    assert not any(r.kind == "unreachable" for r in plan.routes)
    assert not any(r.action == "unreachable" for r in plan.rules)


def test_plan_without_auto_route_is_empty() -> None:
    plan = build_plan(_opts(auto_route=False), "tun0")
    assert plan.routes == () and plan.rules == ()


# -- privilege, mark, egress -------------------------------------------------------------


def test_cap_net_admin_is_read_from_capeff(tmp_path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tx\nCapEff:\t0000000000001000\n")
    assert has_cap_net_admin(str(status)) is True
    status.write_text("Name:\tx\nCapEff:\t0000000000000fff\n")
    assert has_cap_net_admin(str(status)) is False
    assert has_cap_net_admin(str(tmp_path / "missing")) is False


def test_apply_mark_does_nothing_without_a_tun() -> None:
    mark.set_mark(0)
    with socket.socket() as s:
        mark.apply_mark(s)  # no privilege needed, nothing set
        if has_cap_net_admin():
            assert s.getsockopt(socket.SOL_SOCKET, mark.SO_MARK) == 0


def test_apply_mark_marks_while_a_tun_runs() -> None:
    if not has_cap_net_admin():
        pytest.skip("SO_MARK needs CAP_NET_ADMIN")
    mark.set_mark(ENGINE_MARK)
    try:
        with socket.socket() as s:
            mark.apply_mark(s)
            assert s.getsockopt(socket.SOL_SOCKET, mark.SO_MARK) == ENGINE_MARK
            mark.apply_mark(s.fileno())
    finally:
        mark.set_mark(0)


def test_egress_status_fields() -> None:
    e = Egress(FamilyEgress("available", "eth0"), FamilyEgress("unavailable", reason="no route"))
    assert e.status_fields() == {
        "egress_interface": "eth0",
        "egress_interface_v4": "eth0",
        "egress_interface_v6": None,
        "ipv4_egress": {"availability": "available", "interface": "eth0"},
        "ipv6_egress": {"availability": "unavailable", "reason": "no route"},
    }
    assert Egress().v4.to_dict() == {"availability": "unknown"}


def test_mark_subscribers_follow_changes_and_are_held_weakly() -> None:
    seen: list[int] = []

    class Part:
        def set_mark(self, value: int) -> None:
            seen.append(value)

    part = Part()
    mark.subscribe(part.set_mark)
    mark.set_mark(7)
    mark.set_mark(0)
    assert seen == [0, 7, 0]
    del part  # dropped without unsubscribing: no longer called, not kept alive
    import gc

    gc.collect()
    mark.set_mark(9)
    mark.set_mark(0)
    assert seen == [0, 7, 0]
    calls: list[int] = []
    unsubscribe = mark.subscribe(calls.append)
    mark.set_mark(1)
    unsubscribe()
    mark.set_mark(0)
    assert calls == [0, 1]
