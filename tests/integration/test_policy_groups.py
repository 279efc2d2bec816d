"""Policy groups end to end: real upstream proxies (microsocks, tinyproxy) behind counting
forwarders, a local HTTP origin as both the probe URL and the fetched target, and curl or a
plain SOCKS5 client through the engine's inbound.

A member is "killed" by closing its forwarder: connections to it are then refused, while the
upstream process keeps serving the other members.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import pytest

from spliceway import ApiError
from spliceway.control.diagnostics import NO_FIXED_SERVER
from spliceway.protocols import socks5
from spliceway.routing.policy import GroupView, MemberHealth, PolicyTable
from tests.api.conftest import control_config
from tests.conftest import base_config, wait_until
from tests.helpers.flows import STATUS_ONLY, socks_curl, socks_fetch
from tests.helpers.servers import SilentPeer
from tests.helpers.socks import socks5_connect
from tests.helpers.upstreams import CountingForwarder, microsocks, refused_port, tinyproxy

# -- upstreams ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def socks_ports() -> Iterator[tuple[int, int]]:
    """Two microsocks instances on 127.0.0.1 for the whole module; tests kill a member
    by closing its forwarder, never the shared process."""
    with microsocks() as one, microsocks() as two:
        yield one, two


@pytest.fixture(scope="module")
def tinyproxy_port(tmp_path_factory) -> Iterator[int]:
    with tinyproxy(tmp_path_factory.mktemp("tinyproxy")) as port:
        yield port


@pytest.fixture
def forwarders(socks_ports) -> Iterator[tuple[CountingForwarder, CountingForwarder]]:
    """A counting forwarder in front of each microsocks."""
    with (
        CountingForwarder(("127.0.0.1", socks_ports[0])) as a,
        CountingForwarder(("127.0.0.1", socks_ports[1])) as b,
    ):
        yield a, b


@dataclass
class Counts:
    connections: int
    bytes_up: int
    bytes_down: int


def counts(fwd: CountingForwarder) -> Counts:
    return Counts(fwd.connections, fwd.bytes_up, fwd.bytes_down)


# -- engines ------------------------------------------------------------------------


def socks_out(tag: str, port: int, **extra: Any) -> dict[str, Any]:
    return {"tag": tag, "protocol": "socks5", "server": "127.0.0.1", "port": port, **extra}


def probe_url(origin: tuple[str, int]) -> str:
    return f"http://127.0.0.1:{origin[1]}/generate_204"


def group_engine(
    make_engine,
    outbounds: list[dict[str, Any]],
    groups: list[dict[str, Any]],
    final: str,
    **runtime: Any,
) -> Any:
    cfg = base_config(
        outbounds=[{"tag": "direct", "protocol": "direct"}, *outbounds],
        outbound_groups=groups,
        route={"final": final},
    )
    cfg["runtime"].update(runtime)
    return make_engine(cfg)


def pair_engine(make_engine, origin, forwarders, tag: str, kind: str, **group: Any) -> Any:
    """An engine whose final route is the probed group ``tag`` of ``kind`` over ``a``
    and ``b`` (socks5 through the two ``forwarders``), probing ``origin`` (``group``:
    more of the group's settings)."""
    fa, fb = forwarders
    return group_engine(
        make_engine,
        [socks_out("a", fa.port), socks_out("b", fb.port)],
        [{"tag": tag, "kind": kind, "outbounds": ["a", "b"], "url": probe_url(origin), **group}],
        tag,
    )


def events(engine, event_type: str, tag: str | None = None) -> list[dict[str, Any]]:
    """Events of ``event_type`` in the engine's ring (of one policy, when given)."""
    return [
        e
        for e in engine.query("events")["events"]
        if e["event_type"] == event_type and (tag is None or e["payload"]["policy_tag"] == tag)
    ]


def wait_round(engine, tag: str, trigger: str, after: int = 0, timeout: float = 8) -> dict:
    """The payload of the first ``policy.probe.completed`` of ``tag`` with ``trigger``
    whose sequence is above ``after``."""

    def found() -> dict | None:
        for e in events(engine, "policy.probe.completed", tag):
            if e["sequence"] > after and e["payload"]["trigger"] == trigger:
                return e["payload"]
        return None

    return wait_until(found, timeout)


def last_sequence(engine) -> int:
    return engine.query("events")["events"][-1]["sequence"]


def completed_records(engine) -> list[dict[str, Any]]:
    return [e["payload"]["record"] for e in events(engine, "flow.completed")]


def fetch(engine, origin, path: str = "/bytes/20000", *, ok: bool = True) -> dict[str, Any]:
    """curl ``path`` from the origin through the engine's SOCKS5 inbound; the flow's record."""
    before = len(completed_records(engine))
    result = socks_curl(engine, f"http://127.0.0.1:{origin[1]}{path}", *STATUS_ONLY)
    assert (result.returncode == 0) == ok, (result.returncode, result.stderr)
    if ok:
        assert result.stdout == "200"
    records = wait_until(lambda: completed_records(engine)[before:], timeout=5)
    assert len(records) == 1
    return records[0]


def went_through(fwd: CountingForwarder, before: Counts, record: dict[str, Any]) -> None:
    """Exactly this flow crossed ``fwd`` since ``before``: one connection and its bytes."""
    traffic = record["traffic"]

    def settled() -> bool:
        now = counts(fwd)
        return (
            now.connections - before.connections == 1
            and now.bytes_up - before.bytes_up == traffic["outbound_tx_bytes"]
            and now.bytes_down - before.bytes_down == traffic["outbound_rx_bytes"]
        )

    wait_until(settled, timeout=5)


def api_error(engine, method: str, params: dict[str, Any]) -> ApiError:
    with pytest.raises(ApiError) as info:
        engine.execute(method, params)
    return info.value


# -- selector -----------------------------------------------------------------------


def test_selector_select_changes_the_route(make_engine, origin, forwarders):
    fa, fb = forwarders
    engine = group_engine(
        make_engine,
        [socks_out("a", fa.port), socks_out("b", fb.port)],
        [{"tag": "proxy", "kind": "selector", "outbounds": ["a", "b"]}],
        "proxy",
    )
    assert engine.query("policy", {"policy_tag": "proxy"})["selected"] == "a"
    before_a, before_b = counts(fa), counts(fb)
    record = fetch(engine, origin)
    assert record["route"]["selection_chain"] == ["proxy", "a"]
    assert record["path"]["outbound"] == {"tag": "a", "protocol": "socks5"}
    assert record["result"]["outcome"] == "chained_relayed"
    went_through(fa, before_a, record)
    assert counts(fb) == before_b

    answer = engine.execute("policies.select", {"policy_tag": "proxy", "target_tag": "b"})
    assert answer == {"policy_tag": "proxy", "selected": "b"}
    (selected,) = events(engine, "policy.selected", "proxy")
    assert selected["payload"] == {
        "policy_tag": "proxy",
        "policy_kind": "selector",
        "selected": "b",
        "previous": "a",
        "action": "select",
        "fixed": None,
    }
    snap = engine.query("policy", {"policy_tag": "proxy"})
    assert snap["selected"] == "b"
    assert snap["effective_chains"] == [["proxy", "b"]]

    before_a, before_b = counts(fa), counts(fb)
    record = fetch(engine, origin)
    assert record["route"]["selection_chain"] == ["proxy", "b"]
    assert record["path"]["outbound"] == {"tag": "b", "protocol": "socks5"}
    went_through(fb, before_b, record)
    assert counts(fa) == before_a

    # Selecting the current member again is no error and says so.
    engine.execute("policies.select", {"policy_tag": "proxy", "target_tag": "b"})
    assert events(engine, "policy.selected", "proxy")[-1]["payload"]["previous"] == "b"


def test_policy_command_errors(make_engine, origin):
    dead = refused_port()
    engine = group_engine(
        make_engine,
        [socks_out("dead", dead)],
        [
            {"tag": "proxy", "kind": "selector", "outbounds": ["direct", "auto"]},
            {"tag": "auto", "kind": "url_test", "outbounds": ["direct", "dead"]},
            {"tag": "fb", "kind": "fallback", "outbounds": ["direct", "dead"]},
            {"tag": "chain", "kind": "relay", "outbounds": ["dead"]},
            {"tag": "lb", "kind": "load_balance", "outbounds": ["direct", "dead"]},
        ],
        "proxy",
        latency_test_url=probe_url(origin),
    )
    select = "policies.select"
    err = api_error(engine, select, {"policy_tag": "nope", "target_tag": "direct"})
    assert err.code == "not_found"
    err = api_error(engine, select, {"policy_tag": "chain", "target_tag": "dead"})
    assert err.code == "not_found"  # a relay is no policy
    err = api_error(engine, select, {"policy_tag": "proxy", "target_tag": "dead"})
    assert (err.code, err.field_path) == ("invalid_argument", "params.target_tag")
    err = api_error(engine, select, {"policy_tag": "proxy", "target_tag": "nope"})
    assert (err.code, err.field_path) == ("invalid_argument", "params.target_tag")
    # A url_test or fallback group can be pinned (mihomo's fixed), a load_balance not.
    err = api_error(engine, select, {"policy_tag": "lb", "target_tag": "direct"})
    assert err.code == "invalid_argument"
    assert err.field_path == "params.policy_tag"
    err = api_error(engine, select, {"policy_tag": "auto", "target_tag": "proxy"})
    assert (err.code, err.field_path) == ("invalid_argument", "params.target_tag")
    for tag in ("proxy", "lb"):
        err = api_error(engine, "policies.unfix", {"policy_tag": tag})
        assert (err.code, err.field_path) == ("invalid_argument", "params.policy_tag"), tag
    for tag in ("chain", "nope"):
        err = api_error(engine, "policies.unfix", {"policy_tag": tag})
        assert err.code == "not_found", tag
    err = api_error(engine, select, {"policy_tag": "proxy"})
    assert (err.code, err.field_path) == ("invalid_argument", "params.target_tag")
    for tag in ("fb", "proxy", "chain", "lb", "nope"):
        err = api_error(engine, "policies.probe", {"policy_tag": tag})
        assert err.code == "not_found", tag
    # Nothing failed half way: no selection changed, no event was emitted.
    assert engine.query("policy", {"policy_tag": "proxy"})["selected"] == "direct"
    assert events(engine, "policy.selected") == []
    err = api_error(engine, "diagnostics.probe_outbound", {"target_tag": "nope"})
    assert err.code == "not_found"
    with pytest.raises(ApiError) as info:
        engine.query("policy", {"policy_tag": "chain"})
    assert info.value.code == "not_found"


def test_selector_selects_a_nested_group_without_expanding_it(make_engine, origin, forwarders):
    fx, fy = forwarders
    engine = group_engine(
        make_engine,
        [socks_out("hop-x", fx.port), socks_out("hop-y", fy.port)],
        [
            {"tag": "proxy", "kind": "selector", "outbounds": ["direct", "auto"]},
            {
                "tag": "auto",
                "kind": "url_test",
                "outbounds": ["hop-x", "hop-y"],
                "url": probe_url(origin),
                "tolerance_ms": 10000,  # the first member stays unless it dies
            },
        ],
        "proxy",
    )
    wait_round(engine, "auto", "startup")
    assert engine.execute("policies.select", {"policy_tag": "proxy", "target_tag": "auto"}) == {
        "policy_tag": "proxy",
        "selected": "auto",
    }
    snap = engine.query("policy", {"policy_tag": "proxy"})
    assert snap["selected"] == "auto"
    assert snap["effective_chains"] == [["proxy", "auto", "hop-x"]]
    assert snap["latency_ms"] == engine.query("policy", {"policy_tag": "auto"})["latency_ms"]
    assert snap["latency_ms"] > 0

    before = counts(fx)
    record = fetch(engine, origin)
    assert record["route"]["target"] == "proxy"
    assert record["route"]["selection_chain"] == ["proxy", "auto", "hop-x"]
    assert record["path"]["outbound"] == {"tag": "hop-x", "protocol": "socks5"}
    went_through(fx, before, record)
    (done,) = events(engine, "flow.completed")
    assert done["payload"]["policy"] == "proxy"


# -- url_test -----------------------------------------------------------------------


def test_url_test_fails_over_after_a_manual_probe(make_engine, origin, forwarders):
    fa, fb = forwarders
    engine = pair_engine(make_engine, origin, forwarders, "auto", "url_test", tolerance_ms=10000)
    startup = wait_round(engine, "auto", "startup")
    assert startup["url"] == probe_url(origin)
    assert startup["selected"] == "a"
    assert [m["target_tag"] for m in startup["members"]] == ["a", "b"]
    for m in startup["members"]:
        assert m["healthy"] is True and m["error"] is None
        assert 0 < m["latency_ms"] < 5000
    assert startup["completed_at_unix_ms"] - startup["started_at_unix_ms"] == startup["duration_ms"]
    snap = engine.query("policy", {"policy_tag": "auto"})
    assert snap["selected"] == "a"
    assert snap["last_checked_unix_ms"] == startup["completed_at_unix_ms"]
    assert [(m["member_tag"], m["latency_ms"]) for m in snap["url_test_members"]] == [
        (m["target_tag"], m["latency_ms"]) for m in startup["members"]
    ]
    assert snap["latency_ms"] == startup["members"][0]["latency_ms"]
    # Each probe was one connection through its member's upstream.
    assert (fa.connections, fb.connections) == (1, 1)

    fa.close()  # member a's upstream goes away
    mark = last_sequence(engine)
    assert engine.execute("policies.probe", {"policy_tag": "auto"}) == {
        "policy_tag": "auto",
        "probe_triggered": True,
    }
    manual = wait_round(engine, "auto", "manual", after=mark)
    a, b = manual["members"]
    assert (a["target_tag"], a["healthy"], a["latency_ms"]) == ("a", False, None)
    assert "refused" in a["error"].lower()
    assert b["healthy"] is True and b["latency_ms"] > 0
    assert manual["selected"] == "b"
    snap = engine.query("policy", {"policy_tag": "auto"})
    assert snap["selected"] == "b"
    assert snap["url_test_members"][0]["last_error"] == a["error"]
    assert snap["effective_chains"] == [["auto", "b"]]

    before = counts(fb)
    record = fetch(engine, origin)
    assert record["route"]["selection_chain"] == ["auto", "b"]
    went_through(fb, before, record)


def test_url_test_pin_routes_flows_and_unfix_returns_to_the_fastest(
    make_engine, origin, forwarders
):
    """policies.select on a url_test group pins the member (mihomo's fixed): flows take
    it while it is healthy; a dead pinned member gives way and takes over again once it
    is healthy; policies.unfix drops the pin. Each change is one policy.selected."""
    fb = forwarders[1]
    engine = pair_engine(make_engine, origin, forwarders, "auto", "url_test", tolerance_ms=10000)
    wait_round(engine, "auto", "startup")
    assert engine.query("policy", {"policy_tag": "auto"})["fixed"] is None

    answer = engine.execute("policies.select", {"policy_tag": "auto", "target_tag": "b"})
    assert answer == {"policy_tag": "auto", "selected": "b", "fixed": "b"}
    snap = engine.query("policy", {"policy_tag": "auto"})
    assert (snap["selected"], snap["fixed"]) == ("b", "b")
    (pin,) = events(engine, "policy.selected", "auto")
    assert pin["payload"] == {
        "policy_tag": "auto",
        "policy_kind": "url_test",
        "selected": "b",
        "previous": "a",
        "action": "fix",
        "fixed": "b",
    }
    before = counts(fb)
    record = fetch(engine, origin)
    assert record["route"]["selection_chain"] == ["auto", "b"]
    went_through(fb, before, record)
    # Probe rounds do not move a healthy pin (tolerance or not).
    mark = last_sequence(engine)
    engine.execute("policies.probe", {"policy_tag": "auto"})
    assert wait_round(engine, "auto", "manual", after=mark)["selected"] == "b"

    # The pinned member's upstream goes away: the group uses a, the pin stays.
    fb.close()
    mark = last_sequence(engine)
    engine.execute("policies.probe", {"policy_tag": "auto"})
    assert wait_round(engine, "auto", "manual", after=mark)["selected"] == "a"
    snap = engine.query("policy", {"policy_tag": "auto"})
    assert (snap["selected"], snap["fixed"]) == ("a", "b")

    answer = engine.execute("policies.unfix", {"policy_tag": "auto"})
    assert answer == {"policy_tag": "auto", "selected": "a", "fixed": None, "previous_fixed": "b"}
    unpin = events(engine, "policy.selected", "auto")[-1]["payload"]
    assert (unpin["action"], unpin["fixed"], unpin["selected"]) == ("unfix", None, "a")
    assert engine.query("policy", {"policy_tag": "auto"})["fixed"] is None
    # Unfixing an unpinned group is no error and emits nothing.
    count = len(events(engine, "policy.selected", "auto"))
    again = engine.execute("policies.unfix", {"policy_tag": "auto"})
    assert again["previous_fixed"] is None
    assert len(events(engine, "policy.selected", "auto")) == count


def test_fallback_pin_is_dropped_when_found_dead(make_engine, origin, forwarders):
    fb = forwarders[1]
    engine = pair_engine(make_engine, origin, forwarders, "fb", "fallback")
    wait_round(engine, "fb", "startup")
    engine.execute("policies.select", {"policy_tag": "fb", "target_tag": "b"})
    snap = engine.query("policy", {"policy_tag": "fb"})
    assert (snap["selected"], snap["fixed"]) == ("b", "b")
    before = counts(fb)
    went_through(fb, before, fetch(engine, origin))

    fb.close()
    mark = last_sequence(engine)
    # fallback rounds start on a dial failure too: a flow through b fails and b is
    # marked down at once, which drops the pin (fallback.go findAliveProxy).
    fetch(engine, origin, ok=False)
    wait_round(engine, "fb", "dial_failure", after=mark)
    snap = engine.query("policy", {"policy_tag": "fb"})
    assert (snap["selected"], snap["fixed"]) == ("a", None)


def test_policies_probe_is_refused_while_a_round_runs(make_engine, origin):
    with SilentPeer() as silent:
        engine = group_engine(
            make_engine,
            # The slow member's handshake hangs until its connect timeout ends the round.
            [socks_out("slow", silent.address[1], connect_timeout_ms=1000)],
            [
                {
                    "tag": "auto",
                    "kind": "url_test",
                    "outbounds": ["direct", "slow"],
                    "url": probe_url(origin),
                }
            ],
            "auto",
        )
        started = time.monotonic()
        # The startup round is still waiting for the slow member. (Right after start():
        # this also checks start() returned only once the group actors existed.)
        assert not engine.execute("policies.probe", {"policy_tag": "auto"})["probe_triggered"]
        startup = wait_round(engine, "auto", "startup", timeout=5)
        direct, slow = startup["members"]
        assert direct["healthy"] is True
        assert (slow["healthy"], slow["latency_ms"]) == (False, None)
        assert "timed out" in slow["error"]
        assert startup["duration_ms"] >= 900
        assert startup["selected"] == "direct"

        mark = last_sequence(engine)
        assert engine.execute("policies.probe", {"policy_tag": "auto"})["probe_triggered"]
        assert not engine.execute("policies.probe", {"policy_tag": "auto"})["probe_triggered"]
        wait_round(engine, "auto", "manual", after=mark, timeout=5)
        rounds = events(engine, "policy.probe.completed", "auto")
        assert [r["payload"]["trigger"] for r in rounds] == ["startup", "manual"]
        assert time.monotonic() - started < 5


def test_engine_stops_promptly_during_a_probe_round(make_engine, origin):
    with SilentPeer() as silent:
        engine = group_engine(
            make_engine,
            [socks_out("slow", silent.address[1])],  # would hang the round for 5 s
            [
                {
                    "tag": "auto",
                    "kind": "url_test",
                    "outbounds": ["direct", "slow"],
                    "url": probe_url(origin),
                }
            ],
            "auto",
        )
        wait_until(lambda: silent.conns)  # the round is under way
        started = time.monotonic()
        engine.stop()
        assert time.monotonic() - started < 2
    assert not engine.running


def test_url_test_probes_again_every_interval(make_engine, origin):
    engine = group_engine(
        make_engine,
        [],
        [
            {
                "tag": "auto",
                "kind": "url_test",
                "outbounds": ["direct"],
                "url": probe_url(origin),
                "interval_seconds": 1,
            }
        ],
        "auto",
    )
    startup = wait_round(engine, "auto", "startup", timeout=2)
    scheduled = wait_round(engine, "auto", "scheduled", timeout=3)
    assert scheduled["members"][0]["healthy"] is True
    assert scheduled["started_at_unix_ms"] - startup["started_at_unix_ms"] >= 900
    snap = engine.query("policy", {"policy_tag": "auto"})
    assert snap["interval_seconds"] == 1
    assert snap["last_checked_unix_ms"] >= scheduled["completed_at_unix_ms"]


# -- fallback -----------------------------------------------------------------------


def test_fallback_moves_on_after_a_dial_failure(make_engine, origin, forwarders):
    fa, fb = forwarders
    with SilentPeer() as silent:
        engine = group_engine(
            make_engine,
            [
                socks_out("a", fa.port),
                socks_out("b", fb.port),
                # Keeps every round open ~1 s, so "at once" is observable.
                socks_out("slow", silent.address[1], connect_timeout_ms=1000),
            ],
            [{"tag": "fb", "kind": "fallback", "outbounds": ["a", "b", "slow"]}],
            "fb",
            latency_test_url=probe_url(origin),  # no url on the group: the runtime's
        )
        startup = wait_round(engine, "fb", "startup", timeout=5)
        assert startup["url"] == probe_url(origin)
        assert startup["selected"] == "a"
        assert [m["healthy"] for m in startup["members"]] == [True, True, False]
        before = counts(fa)
        record = fetch(engine, origin)
        assert record["route"]["selection_chain"] == ["fb", "a"]
        went_through(fa, before, record)

        fa.close()
        mark = last_sequence(engine)
        failed = fetch(engine, origin, ok=False)
        assert failed["route"]["selection_chain"] == ["fb", "a"]
        assert failed["result"]["outcome"] == "failed"
        assert failed["result"]["failure"]["code"] == "connection_refused"
        # Marked down at once, while the dial_failure round still waits for "slow"...
        wait_until(lambda: engine.query("policy", {"policy_tag": "fb"})["selected"] == "b", 0.5)
        snap = engine.query("policy", {"policy_tag": "fb"})
        down = snap["url_test_members"][0]
        assert (down["healthy"], down["latency_ms"]) == (False, None)
        assert down["last_error"] == failed["result"]["failure"]["message"]
        # ...so the very next flow already takes the second member.
        record = fetch(engine, origin)
        assert record["route"]["selection_chain"] == ["fb", "b"]
        assert record["result"]["outcome"] == "chained_relayed"
        assert not [e for e in events(engine, "policy.probe.completed") if e["sequence"] > mark]

        retry = wait_round(engine, "fb", "dial_failure", after=mark, timeout=3)
        assert retry["selected"] == "b"
        assert [(m["target_tag"], m["healthy"]) for m in retry["members"]] == [
            ("a", False),
            ("b", True),
            ("slow", False),
        ]
        assert "refused" in retry["members"][0]["error"].lower()

    before = counts(fb)
    record = fetch(engine, origin)
    assert record["route"]["selection_chain"] == ["fb", "b"]
    went_through(fb, before, record)
    snap = engine.query("policy", {"policy_tag": "fb"})
    assert [m["healthy"] for m in snap["url_test_members"]] == [False, True, False]
    assert snap["effective_chains"] == [["fb", "b"]]


# -- relay --------------------------------------------------------------------------


def test_relay_chain_microsocks_then_tinyproxy(make_engine, origin, socks_ports, tinyproxy_port):
    size = 50_000
    with (
        CountingForwarder(("127.0.0.1", socks_ports[0])) as fa,
        CountingForwarder(("127.0.0.1", tinyproxy_port)) as fb,
    ):
        engine = group_engine(
            make_engine,
            [
                socks_out("hop-a", fa.port),
                {"tag": "hop-b", "protocol": "http", "server": "127.0.0.1", "port": fb.port},
            ],
            [
                {"tag": "proxy", "kind": "selector", "outbounds": ["chain", "direct"]},
                {"tag": "chain", "kind": "relay", "outbounds": ["hop-a", "hop-b"]},
            ],
            "proxy",
        )
        header, body, request = socks_fetch(engine, origin, size)
        (record,) = wait_until(lambda: completed_records(engine))
        traffic = record["traffic"]
        assert (traffic["bytes_down"], traffic["bytes_up"]) == (header + body, request)
        assert record["result"]["outcome"] == "chained_relayed"
        assert record["route"]["selection_chain"] == ["proxy", "chain"]
        assert record["path"]["outbound"] == {"tag": "chain", "protocol": "relay"}
        assert record["path"]["relay_chain"] == ["hop-a", "hop-b"]
        assert record["path"]["remote"] == {"host": "127.0.0.1", "port": fb.port}
        # The whole outbound stream crossed the first hop; the second hop saw it minus
        # the first hop's own SOCKS5 handshake (greeting + CONNECT to hop-b, 2 + 10 back).
        socks_tx = len(socks5.client_greeting(False)) + len(
            socks5.client_connect("127.0.0.1", fb.port)
        )
        wait_until(
            lambda: (
                (fa.bytes_up, fa.bytes_down)
                == (traffic["outbound_tx_bytes"], traffic["outbound_rx_bytes"])
                and (fb.bytes_up, fb.bytes_down)
                == (traffic["outbound_tx_bytes"] - socks_tx, traffic["outbound_rx_bytes"] - 12)
            ),
            timeout=5,
        )
        assert (fa.connections, fb.connections) == (1, 1)
        assert fb.bytes_down > header + body  # tinyproxy's CONNECT answer came back too

    groups = {g["tag"]: g for g in engine.query("config")["outbound_groups"]}
    assert groups["chain"]["effective_chains"] == [["hop-a", "hop-b"]]
    assert groups["proxy"]["effective_chains"] == [["proxy", "chain"]]
    assert "chain" not in {p["tag"] for p in engine.query("policies")["policies"]}
    assert engine.query("stats")["chained_sessions"] == 1


def test_relay_with_a_dead_hop_is_a_dead_fallback_member(make_engine, origin, socks_ports):
    with CountingForwarder(("127.0.0.1", socks_ports[0])) as fa:
        engine = group_engine(
            make_engine,
            [socks_out("hop-a", fa.port), socks_out("hop-dead", refused_port())],
            [
                {"tag": "fb", "kind": "fallback", "outbounds": ["chain", "direct"]},
                {"tag": "chain", "kind": "relay", "outbounds": ["hop-a", "hop-dead"]},
            ],
            "fb",
            latency_test_url=probe_url(origin),
        )
        startup = wait_round(engine, "fb", "startup")
    chain, direct = startup["members"]
    assert chain["healthy"] is False and chain["error"]  # hop-a could not reach hop-dead
    assert direct["healthy"] is True
    assert startup["selected"] == "direct"
    record = fetch(engine, origin)
    assert record["route"]["selection_chain"] == ["fb", "direct"]
    assert record["result"]["outcome"] == "direct_relayed"


# -- load_balance -------------------------------------------------------------------


def test_load_balance_round_robin_alternates(make_engine, origin, forwarders):
    fa, fb = forwarders
    engine = pair_engine(make_engine, origin, forwarders, "lb", "load_balance")
    wait_round(engine, "lb", "startup")
    start = counts(fa), counts(fb)
    tags = []
    for fwd in (fa, fb, fa, fb):
        before = counts(fwd)
        record = fetch(engine, origin, "/bytes/1000")
        tags.append(record["path"]["outbound"]["tag"])
        went_through(fwd, before, record)
    assert tags == ["a", "b", "a", "b"]
    assert (fa.connections, fb.connections) == (start[0].connections + 2, start[1].connections + 2)
    snap = engine.query("policy", {"policy_tag": "lb"})
    assert snap["strategy"] == "round_robin"
    assert snap["effective_chains"] == [["lb", "a"], ["lb", "b"]]


def _hrw_member(host: str, members: tuple[str, ...]) -> str:
    """Which member the pure rule gives ``host`` (the engine must agree)."""
    healthy = MemberHealth(True, None, None, None)
    view = GroupView(
        tag="lb",
        kind="load_balance",
        members=members,
        selected=None,
        health=MappingProxyType(dict.fromkeys(members, healthy)),
        strategy="consistent_hashing",
    )
    return PolicyTable([view]).resolve("lb", host)[-1]


def _socks_open(engine, host: str, port: int) -> bool:
    """Open a tunnel through the engine; True when it succeeded."""
    try:
        socks5_connect(engine.listen_address("socks-in"), host, port, timeout=5).close()
    except ConnectionError:
        return False
    return True


def test_load_balance_consistent_hashing(make_engine, origin, forwarders, socks_ports):
    fa, fb = forwarders
    with CountingForwarder(("127.0.0.1", socks_ports[0])) as fc:
        fwd = {"a": fa, "b": fb, "c": fc}
        engine = group_engine(
            make_engine,
            [socks_out(tag, f.port) for tag, f in fwd.items()],
            [
                {
                    "tag": "lb",
                    "kind": "load_balance",
                    "outbounds": ["a", "b", "c"],
                    "strategy": "consistent_hashing",
                    "url": probe_url(origin),
                }
            ],
            "lb",
        )
        wait_round(engine, "lb", "startup")
        # Other loopback addresses have no listener: the upstream refuses them, which fails
        # the flow without blaming the member, yet the record shows which member carried it.
        hosts = ["127.0.0.1", *(f"127.0.0.{i}" for i in range(2, 12))]
        expected = {h: _hrw_member(h, ("a", "b", "c")) for h in hosts}
        assert set(expected.values()) == {"a", "b", "c"}

        def carriers(rounds: int) -> dict[str, set[str]]:
            already = len(completed_records(engine))
            for _ in range(rounds):
                for host in hosts:
                    assert _socks_open(engine, host, origin[1]) == (host == "127.0.0.1")
            total = already + rounds * len(hosts)
            wait_until(lambda: len(completed_records(engine)) == total, timeout=5)
            records = completed_records(engine)[already:]
            seen: dict[str, set[str]] = {}
            for r in records:
                seen.setdefault(r["target"]["host"], set()).add(r["path"]["outbound"]["tag"])
            return seen

        assert carriers(2) == {h: {m} for h, m in expected.items()}
        snap = engine.query("policy", {"policy_tag": "lb"})
        assert all(m["healthy"] for m in snap["url_test_members"])  # refusals blame no one

        # The member 127.0.0.1 hashes to dies: one failed flow marks it down, then its
        # share, and only its share, moves to the others.
        victim = expected["127.0.0.1"]
        rest = tuple(m for m in ("a", "b", "c") if m != victim)
        fwd[victim].close()
        mark = last_sequence(engine)
        record = fetch(engine, origin, ok=False)
        assert record["path"]["outbound"]["tag"] == victim
        assert record["route"]["selection_chain"] == ["lb", victim]
        wait_round(engine, "lb", "dial_failure", after=mark, timeout=3)
        snap = engine.query("policy", {"policy_tag": "lb"})
        assert [m["member_tag"] for m in snap["url_test_members"] if not m["healthy"]] == [victim]
        assert snap["effective_chains"] == [["lb", m] for m in rest]

        after = carriers(1)
        for host, member in expected.items():
            moved_to = member if member != victim else _hrw_member(host, rest)
            assert after[host] == {moved_to}, host
        assert after["127.0.0.1"] != {victim}
        survivor = next(iter(after["127.0.0.1"]))
        before = counts(fwd[survivor])
        record = fetch(engine, origin)
        assert record["path"]["outbound"]["tag"] == survivor
        went_through(fwd[survivor], before, record)


# -- diagnostics --------------------------------------------------------------------


def test_probe_outbound_and_probe_target(make_engine, origin, forwarders):
    fa, _ = forwarders
    dead = refused_port()
    engine = group_engine(
        make_engine,
        [socks_out("up", fa.port), socks_out("dead", dead)],
        [
            {"tag": "proxy", "kind": "selector", "outbounds": ["up", "dead"]},
            {"tag": "chain", "kind": "relay", "outbounds": ["up"]},
        ],
        "proxy",
    )
    url = probe_url(origin)
    before = counts(fa)
    ok = engine.execute("diagnostics.probe_outbound", {"target_tag": "up", "url": url})
    assert ok == {
        "target_tag": "up",
        "url": url,
        "via": "through_proxy",
        "reachable": True,
        "latency_ms": ok["latency_ms"],
        "status": ok["status"],
        "timed_out": False,
    }
    assert 0 < ok["latency_ms"] < 5000
    assert fa.connections == before.connections + 1  # really through the upstream

    # A group probes through its current choice.
    via_group = engine.execute("diagnostics.probe_outbound", {"target_tag": "proxy", "url": url})
    assert (via_group["target_tag"], via_group["reachable"]) == ("proxy", True)
    via_chain = engine.execute("diagnostics.probe_outbound", {"target_tag": "chain", "url": url})
    assert via_chain["reachable"] is True

    down = engine.execute("diagnostics.probe_outbound", {"target_tag": "dead", "url": url})
    assert (down["reachable"], down["latency_ms"]) == (False, None)
    assert "refused" in down["error"].lower()

    for bad in (
        "ftp://127.0.0.1/",
        "http:///x",
        "http://exämple.test/",
        "http://h/a b",
        "http://h:0/",
    ):
        err = api_error(engine, "diagnostics.probe_outbound", {"target_tag": "up", "url": bad})
        assert (err.code, err.field_path) == ("invalid_argument", "params.url"), bad
    err = api_error(engine, "diagnostics.probe_outbound", {"target_tag": "nope", "url": url})
    assert err.code == "not_found"

    for tag in ("chain", "proxy"):
        answer = engine.execute("diagnostics.probe_target", {"target_tag": tag})
        assert answer["reachable"] is False and answer["latency_ms"] is None
        assert answer["error"] == NO_FIXED_SERVER
    reach = engine.execute("diagnostics.probe_target", {"target_tag": "up"})
    assert (reach["reachable"], reach["server"], reach["port"]) == (True, "127.0.0.1", fa.port)
    unreach = engine.execute("diagnostics.probe_target", {"target_tag": "dead"})
    assert unreach["reachable"] is False and "refused" in unreach["error"].lower()


def test_probe_outbound_prefers_the_runtime_latency_url(make_engine, origin):
    runtime_url = probe_url(origin)
    engine = group_engine(make_engine, [], [], "direct", latency_test_url=runtime_url)
    # params.url names a port nothing listens on: were it used, the probe would fail.
    asked = f"http://127.0.0.1:{refused_port()}/elsewhere"
    answer = engine.execute("diagnostics.probe_outbound", {"target_tag": "direct", "url": asked})
    assert (answer["url"], answer["reachable"]) == (runtime_url, True)
    answer = engine.execute("diagnostics.probe_outbound", {"target_tag": "direct"})
    assert answer["url"] == runtime_url
    # A malformed url is still reported, though the runtime's would have won.
    err = api_error(
        engine, "diagnostics.probe_outbound", {"target_tag": "direct", "url": "ftp://x/"}
    )
    assert (err.code, err.field_path) == ("invalid_argument", "params.url")


# -- HTTP control API ---------------------------------------------------------------


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as ex:
        return ex.code, json.loads(ex.read())


def test_policies_over_http_match_engine_query(make_engine, origin, forwarders):
    fa, fb = forwarders
    cfg = base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            socks_out("a", fa.port),
            socks_out("b", fb.port),
        ],
        outbound_groups=[
            {"tag": "proxy", "kind": "selector", "outbounds": ["auto", "lb", "direct"]},
            {"tag": "auto", "kind": "url_test", "outbounds": ["a", "b"]},
            {"tag": "fb", "kind": "fallback", "outbounds": ["b", "a"]},
            {"tag": "lb", "kind": "load_balance", "outbounds": ["a", "b"]},
            {"tag": "chain", "kind": "relay", "outbounds": ["a", "b"]},
        ],
        route={"final": "proxy"},
        api=control_config()["api"],
    )
    cfg["runtime"]["latency_test_url"] = probe_url(origin)
    engine = make_engine(cfg)
    for tag in ("auto", "fb", "lb"):
        wait_round(engine, tag, "startup")
    base = f"{engine.control_url}/api/v1"

    status, body = _get(f"{base}/policies")
    assert status == 200 and body["ok"] is True
    assert body["result"] == engine.query("policies")
    assert [p["tag"] for p in body["result"]["policies"]] == ["proxy", "auto", "fb", "lb"]
    for tag in ("proxy", "auto", "fb", "lb"):
        status, body = _get(f"{base}/policies/{tag}")
        assert status == 200
        assert body["result"] == engine.query("policy", {"policy_tag": tag})
    assert engine.query("policy", {"policy_tag": "auto"})["url"] == probe_url(origin)
    for missing in ("chain", "nope", "a"):
        status, body = _get(f"{base}/policies/{missing}")
        assert status == 404 and body["error"]["code"] == "not_found", missing
