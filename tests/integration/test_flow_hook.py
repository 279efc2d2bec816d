"""The flow hook (api.flow_hook, docs/flow-hook.md) wired into the engine, end to end.

A real hook process (tests/helpers/flow_hook_server.py) on a real Unix socket, a real
engine, real SOCKS5 and HTTP clients and a real origin: verdicts, labels and a
principal in records and events, fail-open on late answers and on a dead hook (one
``engine.warning`` per outage), answers out of order, inbound selection (unselected
inbounds stay on the C connection path), and ``config.apply`` adding, replacing and
removing the hook.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway import Engine
from tests.conftest import base_config, wait_until
from tests.helpers.flows import STATUS_ONLY, flow_events, proxy_curl
from tests.helpers.servers import http_origin
from tests.helpers.socks import recv_all, socks5_connect

HOOK_SERVER = Path(__file__).resolve().parents[1] / "helpers" / "flow_hook_server.py"
DENY = {"verdict": "deny"}
ALICE = {"verdict": "allow", "principal_key": "alice", "labels": {"team": "red"}}


class HookProcess:
    """The scripted hook as a child process; ``start`` again after ``kill`` is a restart."""

    def __init__(self, path: Path, plan: dict[str, Any]) -> None:
        self.path = path
        self.plan = plan
        self.log = path.with_suffix(".log")
        self.proc: subprocess.Popen[str] | None = None

    def start(self) -> HookProcess:
        """Run it and return once its socket listens."""
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(HOOK_SERVER),
                str(self.path),
                json.dumps(self.plan),
                str(self.log),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "ready"
        return self

    def kill(self) -> None:
        """SIGKILL: the hook dies without closing anything itself."""
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(10)

    def requests(self) -> list[dict[str, Any]]:
        """Every request that reached the hook (all its runs), in arrival order."""
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def hook_dir() -> Iterator[Path]:
    """A directory short enough for an AF_UNIX path (pytest's tmp_path can exceed it)."""
    path = Path(tempfile.mkdtemp(prefix="swh-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def hook(hook_dir: Path) -> Iterator[Callable[[dict[str, Any]], HookProcess]]:
    """Start hook processes with a plan (see flow_hook_server.py); all ended afterwards."""
    started: list[HookProcess] = []

    def _start(plan: dict[str, Any]) -> HookProcess:
        proc = HookProcess(hook_dir / f"hook{len(started)}.sock", plan).start()
        started.append(proc)
        return proc

    yield _start
    for proc in started:
        if proc.proc is not None and proc.proc.poll() is None:
            proc.kill()


@pytest.fixture
def origin2() -> Iterator[tuple[str, int]]:
    """A second HTTP origin: a second allowed target with an answer of its own."""
    with http_origin() as address:
        yield address


def hooked(path: Path, **settings: Any) -> dict[str, Any]:
    """base_config with a flow hook at ``path`` (3 s timeout unless told otherwise)."""
    cfg = base_config()
    cfg["api"]["flow_hook"] = {"path": str(path), "timeout_ms": 3000, **settings}
    return cfg


def fetch(engine: Engine, origin: tuple[str, int], inbound: str = "socks-in") -> bytes:
    """GET / from ``origin`` through a SOCKS5 tunnel of ``inbound``; the whole answer."""
    with socks5_connect(engine.listen_address(inbound), *origin) as sock:
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return recv_all(sock)


def refused(engine: Engine, host: str, port: int = 80) -> int | None:
    """The SOCKS5 reply code refusing a tunnel to ``host``, None if it opened."""
    try:
        socks5_connect(engine.listen_address("socks-in"), host, port).close()
    except ConnectionError as ex:
        return int(str(ex).rsplit(" ", 1)[1])
    return None


def completed_record(engine: Engine, host: str, port: int) -> dict[str, Any]:
    """The flow.completed event of the (only) hooked flow to ``host``:``port``."""
    events = wait_until(
        lambda: [
            e
            for e in flow_events(engine)
            if e["event_type"] == "flow.completed"
            and e["payload"]["record"]["target"]["host"] == host
            and e["payload"]["record"]["target"]["port"] == port
            and e["payload"]["record"]["inbound"]["tag"] != "mixed-in"
        ],
        timeout=5,
        what=f"flow.completed of {host}",
    )
    assert len(events) == 1
    return events[0]


def events_to(engine: Engine, host: str, count: int) -> list[dict[str, Any]] | None:
    """The flow events of flows to ``host``, once there are ``count`` of them."""
    events = [e for e in flow_events(engine) if e["payload"]["record"]["target"]["host"] == host]
    return events if len(events) == count else None


def ended(engine: Engine, count: int) -> list[dict[str, Any]] | None:
    """The flow.completed events, once there are ``count`` of them."""
    events = [e for e in flow_events(engine) if e["event_type"] == "flow.completed"]
    return events if len(events) == count else None


def hook_warnings(engine: Engine) -> list[dict[str, Any]]:
    """The ipc_hook_unreachable warnings so far."""
    events = engine.query("events", {"types": "engine.warning"})["events"]
    return [e for e in events if e["payload"]["code"] == "ipc_hook_unreachable"]


def cstats(engine: Engine) -> dict[str, int]:
    """The C connection path's counters."""
    return engine._core.bridge.conn.stats()


def test_verdicts_labels_principal_and_inbound_selection(
    make_engine: Callable[..., Engine],
    hook: Callable[..., HookProcess],
    origin: tuple[str, int],
    origin2: tuple[str, int],
) -> None:
    mallory = {"verdict": "allow", "principal_key": "mallory"}
    plan = {
        "denied.test": DENY,
        f"127.0.0.1:{origin[1]}": ALICE,
        f"127.0.0.1:{origin2[1]}": mallory,
    }
    proc = hook({"answers": plan})
    cfg = hooked(proc.path, inbound_tags=["socks-in", "http-in"])
    # Rules see the principal the hook gave.
    cfg["rules"] = [{"principal_key": ["mallory"], "action": "block"}]
    engine = make_engine(cfg)

    # Allowed, with a principal and labels: in the listed record while the flow is open.
    with socks5_connect(engine.listen_address("socks-in"), *origin) as sock:
        listed = engine.query("flows", {"principal_key": "alice"})["active_flows"]
        assert [r["labels"] for r in listed] == [{"team": "red"}]
        sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert recv_all(sock).endswith(b"hello from origin\n")
    done = completed_record(engine, "127.0.0.1", origin[1])
    assert done["principal_key"] == "alice" and done["labels"] == {"team": "red"}
    assert done["payload"]["auth"]["principal_key"] == "alice"
    assert done["payload"]["record"]["labels"] == {"team": "red"}
    assert done["payload"]["record"]["result"] == {"outcome": "direct_relayed"}
    flow_id = done["payload"]["flow_id"]
    for event in flow_events(engine, flow_id):
        assert event["principal_key"] == "alice", event["event_type"]
        assert event["payload"]["record"]["labels"] == {"team": "red"}

    # Allowed, but the principal the hook gave is blocked by a rule.
    assert refused(engine, "127.0.0.1", origin2[1]) == 2
    by_rule = completed_record(engine, "127.0.0.1", origin2[1])
    assert by_rule["principal_key"] == "mallory"
    record = by_rule["payload"]["record"]
    assert record["route"]["action"] == "block" and "failure" not in record["result"]
    assert record["route"]["matched_rule"] == {"index": 0, "condition": "principal_key=mallory"}

    # Denied: the refusal of a rule block (SOCKS5 reply 2, HTTP 403), outcome blocked.
    assert refused(engine, "denied.test") == 2
    assert proxy_curl(engine, "http://denied.test/", *STATUS_ONLY).stdout == "403"
    # The client hears the refusal just before flow.completed is emitted.
    denied = wait_until(lambda: events_to(engine, "denied.test", 4), timeout=5, what="denials")
    assert [e["event_type"] for e in denied] == ["flow.started", "flow.completed"] * 2
    for event in denied[1::2]:
        record = event["payload"]["record"]
        assert record["result"]["outcome"] == "blocked"
        assert record["result"]["failure"]["code"] == "hook_denied"
        assert record["result"]["failure"]["stage"] == "hook"
        assert record["route"]["action"] == "pending" and "labels" not in record
        assert event["principal_key"] is None and event["labels"] == {}

    # An inbound the hook does not select: C routes it, the hook never hears of it.
    assert fetch(engine, origin, "mixed-in").endswith(b"hello from origin\n")
    mixed = wait_until(
        lambda: [
            e
            for e in flow_events(engine)
            if e["event_type"] == "flow.completed"
            and e["payload"]["record"]["inbound"]["tag"] == "mixed-in"
        ],
        timeout=5,
        what="the mixed-in flow's end",
    )
    assert mixed[0]["principal_key"] is None and "labels" not in mixed[0]["payload"]["record"]
    asked = proc.requests()
    assert [(r["inbound"], r["host"], r["port"]) for r in asked] == [
        ("socks-in", "127.0.0.1", origin[1]),
        ("socks-in", "127.0.0.1", origin2[1]),
        ("socks-in", "denied.test", 80),
        ("http-in", "denied.test", 80),
    ]
    assert all(r["state"] == "opening" and r["revision"] == 1 for r in asked)
    wait_until(lambda: cstats(engine)["routed"] == 1, timeout=5, what="C routed the mixed-in flow")
    stats = cstats(engine)
    assert (stats["accepted"], stats["deferred"], stats["started"]) == (5, 4, 1)
    counters = engine._core.flow_hook.counters()
    assert (counters["asked"], counters["allowed"], counters["denied"]) == (4, 2, 2)
    assert counters["failed_open"] == 0 and hook_warnings(engine) == []


def test_late_answers_fail_open_with_one_warning(
    make_engine: Callable[..., Engine], hook: Callable[..., HookProcess], origin: tuple[str, int]
) -> None:
    # Every answer about the origin comes 1 s late; the engine waits 200 ms.
    proc = hook({"answers": {"denied.test": DENY}, "delay_s": {f"127.0.0.1:{origin[1]}": 1.0}})
    engine = make_engine(hooked(proc.path, timeout_ms=200))
    for _ in range(2):
        assert fetch(engine, origin).endswith(b"hello from origin\n")
    client = engine._core.flow_hook
    # Both late answers arrived (and were dropped): late answers end no outage.
    wait_until(lambda: client.counters()["late_answers"] == 2, timeout=5, what="late answers")
    warnings = hook_warnings(engine)
    assert len(warnings) == 1
    assert "did not answer within 200 ms" in warnings[0]["payload"]["message"]
    assert client.counters()["failed_open"] == 2
    # An answer in time ends the outage and is obeyed; still the one warning.
    assert refused(engine, "denied.test") == 2
    assert len(hook_warnings(engine)) == 1
    assert [r["host"] for r in proc.requests()] == ["127.0.0.1", "127.0.0.1", "denied.test"]


def test_answers_out_of_order_reach_their_own_flows(
    make_engine: Callable[..., Engine],
    hook: Callable[..., HookProcess],
    origin: tuple[str, int],
    origin2: tuple[str, int],
) -> None:
    first, third = f"127.0.0.1:{origin[1]}", f"127.0.0.1:{origin2[1]}"
    plan = {
        "answers": {
            first: {"verdict": "allow", "labels": {"n": "1"}},
            "second.test": DENY,
            third: {"verdict": "allow", "principal_key": "p3"},
        },
        # Answered together once all three wait, last first.
        "hold": [first, "second.test", third],
    }
    proc = hook(plan)
    engine = make_engine(hooked(proc.path))
    results: dict[str, Any] = {}

    def run(name: str, call: Callable[[], Any]) -> None:
        try:
            results[name] = call()
        except Exception as ex:  # reported by the assertions below
            results[name] = ex

    threads = [
        threading.Thread(target=run, args=("first", lambda: fetch(engine, origin))),
        threading.Thread(target=run, args=("second", lambda: refused(engine, "second.test"))),
        threading.Thread(target=run, args=("third", lambda: fetch(engine, origin2))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    assert results["first"].endswith(b"hello from origin\n"), results
    assert results["second"] == 2, results
    assert results["third"].endswith(b"hello from origin\n"), results
    ends = {
        (e["payload"]["record"]["target"]["port"], e["payload"]["record"]["target"]["host"]): e
        for e in wait_until(lambda: ended(engine, 3), timeout=5, what="three completed flows")
    }
    one, three = ends[(origin[1], "127.0.0.1")], ends[(origin2[1], "127.0.0.1")]
    assert one["payload"]["record"]["labels"] == {"n": "1"} and one["principal_key"] is None
    assert three["principal_key"] == "p3" and "labels" not in three["payload"]["record"]
    assert ends[(80, "second.test")]["payload"]["record"]["result"]["outcome"] == "blocked"
    assert len(proc.requests()) == 3 and hook_warnings(engine) == []


def test_a_dead_hook_fails_open_once_and_a_restarted_one_is_obeyed(
    make_engine: Callable[..., Engine], hook: Callable[..., HookProcess], origin: tuple[str, int]
) -> None:
    proc = hook({"answers": {f"127.0.0.1:{origin[1]}": DENY}})
    engine = make_engine(hooked(proc.path))
    assert refused(engine, *origin) == 2
    proc.kill()
    # Nothing listens now: flows go on as if there were no hook, with one warning.
    for _ in range(3):
        assert fetch(engine, origin).endswith(b"hello from origin\n")
    warnings = hook_warnings(engine)
    assert len(warnings) == 1
    assert "unreachable" in warnings[0]["payload"]["message"]
    proc.start()
    # The engine reconnects (after its backoff) and the verdicts apply again.
    wait_until(lambda: refused(engine, *origin) == 2, timeout=10, what="the hook obeyed again")
    assert len(hook_warnings(engine)) == 1
    # The client hears the refusal just before flow.completed is emitted.
    ends = wait_until(lambda: ended(engine, 5), timeout=5, what="five completed flows")
    outcomes = [e["payload"]["record"]["result"]["outcome"] for e in ends]
    assert outcomes == ["blocked", *["direct_relayed"] * 3, "blocked"]


def test_config_apply_adds_replaces_and_removes_the_hook(
    make_engine: Callable[..., Engine], hook: Callable[..., HookProcess], origin: tuple[str, int]
) -> None:
    proc = hook(
        {"answers": {"denied.test": DENY, "slow.test": DENY}, "delay_s": {"slow.test": 0.5}}
    )
    plain = base_config()
    engine = make_engine(plain)
    assert fetch(engine, origin).endswith(b"hello from origin\n")
    wait_until(lambda: cstats(engine)["routed"] == 1, timeout=5, what="C routed it")

    def apply(doc: dict[str, Any]) -> dict[str, Any]:
        result = engine.execute("config.apply", {"config": doc})
        assert "flow_hook" in result["application_components"]
        assert result["changed_components"] == ["flow_hook"]
        return result

    # Added: the table defers socks-in to Python, which asks the hook.
    apply(hooked(proc.path, timeout_ms=1000))
    first = engine._core.flow_hook
    assert refused(engine, "denied.test") == 2
    assert cstats(engine)["deferred"] == 1

    # Replaced while a flow waits on the first client: that flow still gets its answer.
    waiting: dict[str, Any] = {}
    asking = threading.Thread(target=lambda: waiting.update(reply=refused(engine, "slow.test")))
    asking.start()
    wait_until(lambda: any(r["host"] == "slow.test" for r in proc.requests()), timeout=5)
    apply(hooked(proc.path, timeout_ms=900))
    second = engine._core.flow_hook
    assert second is not first and second.settings.timeout_ms == 900
    asking.join(10)
    assert waiting == {"reply": 2}
    assert refused(engine, "denied.test") == 2
    assert second.counters()["denied"] == 1
    # The replaced client closes once the asks it had are settled (within its timeout).
    wait_until(lambda: not first.connected, timeout=5, what="the first client closed")

    # Removed: no client (the last one had nothing pending: closed at once), and C
    # routes socks-in itself again.
    apply(plain)
    assert engine._core.flow_hook is None and not second.connected
    assert fetch(engine, origin).endswith(b"hello from origin\n")
    wait_until(lambda: cstats(engine)["routed"] == 2, timeout=5, what="C routed it again")
    assert [r["host"] for r in proc.requests()] == ["denied.test", "slow.test", "denied.test"]
    assert hook_warnings(engine) == []


def test_udp_flows_ask_the_hook(
    make_engine: Callable[..., Engine], hook: Callable[..., HookProcess]
) -> None:
    """A SOCKS5 UDP association's destinations are udp flows the hook is asked about:
    an allow's principal and labels reach the record, a deny blocks the destination,
    and ``networks: ["tcp"]`` leaves UDP flows alone."""
    from tests.helpers.udp import Association, UdpEcho

    with UdpEcho() as echo, UdpEcho() as denied:
        proc = hook(
            {"answers": {f"127.0.0.1:{echo.port}": ALICE, f"127.0.0.1:{denied.port}": DENY}}
        )
        engine = make_engine(hooked(proc.path))
        with Association(engine.listen_address("socks-in")) as assoc:
            assoc.send("127.0.0.1", echo.port, b"allowed")
            assert assoc.recv()[2] == b"allowed"
            assoc.send("127.0.0.1", denied.port, b"denied")
            wait_until(lambda: ended(engine, 1), what="the denied flow")
        events = wait_until(lambda: ended(engine, 2), what="both udp flows")
        by_port = {e["payload"]["record"]["target"]["port"]: e for e in events}
        assert by_port[echo.port]["principal_key"] == "alice"
        assert by_port[echo.port]["payload"]["auth"]["principal_key"] == "alice"
        allowed = by_port[echo.port]["payload"]["record"]
        refused_ = by_port[denied.port]["payload"]["record"]
        assert allowed["network"] == "udp" and allowed["result"]["outcome"] == "direct_relayed"
        assert allowed["labels"] == {"team": "red"}
        assert refused_["result"]["outcome"] == "blocked"
        assert refused_["result"]["failure"]["code"] == "hook_denied"
        assert denied.received == 0
        asked = [(r["port"], r["state"], r["revision"]) for r in proc.requests()]
        assert asked == [(echo.port, "opening", 1), (denied.port, "opening", 1)]

        # Only TCP asks now: a UDP flow goes straight to its route.
        tcp_only = hooked(proc.path, networks=["tcp"])
        engine2 = make_engine(tcp_only)
        with Association(engine2.listen_address("socks-in")) as assoc:
            assoc.send("127.0.0.1", denied.port, b"not asked")
            assert assoc.recv()[2] == b"not asked"
        assert len(proc.requests()) == 2
