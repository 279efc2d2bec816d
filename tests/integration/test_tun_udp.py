"""The TUN's UDP sessions as flows (actors/tun_udp.py) and its DNS hijack, on a real TUN.

Topology (tests/helpers/netns.py): a "host" namespace joined to an "internet" one by a
veth pair; the servers sit on the internet namespace's loopback (203.0.113.10,
2001:db8:100::10). In the host namespace the test adds a TUN ``swu0`` (172.19.0.1/30,
fdfe:dcba:9877::1/126) and a policy rule sending every *unmarked* packet for the
captured prefixes (203.0.113.0/24, 2001:db8:100::/64 and the fake-ip range
198.18.0.0/15) into it, as ``auto_route`` would, while sockets carrying the engine's
mark (``spliceway.support.socket_mark``) take the main table, out through the veth.

A real engine runs in this process, started from a thread inside the host namespace
(its dispatcher and every socket it makes live there); the test starts the packet
loop (:class:`~spliceway.native.tun.TunStack`) on the TUN and a
:class:`~actors.tun_udp.TunUdpActor` on the engine's flow dependencies, as the TUN
inbound does. Clients are sockets made inside the host namespace, and ``dig``.
Skipped, with the reason, only where namespaces or a TUN cannot be made.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pykka
import pytest

from spliceway.actors.tun_udp import TunUdpActor, TunUdpCounters, TunUdpStats
from spliceway.actors.udp import SampleUdp
from spliceway.dns.server import DnsResponder
from spliceway.engine.core import InboundSpec
from spliceway.events.log import now_ms
from spliceway.flows.inbound import Users
from spliceway.native.tun import TunStack
from spliceway.support import socket_mark as mark
from spliceway.tun.dns_hijack import TunDnsTcp
from tests.conftest import base_config, wait_until
from tests.helpers.netns import (
    SERVER_IP,
    SERVER_IP6,
    Topology,
    netns_unavailable,
    read_lines,
    topology,
)
from tests.helpers.netns_tun import IFF_NO_PI, IFF_TUN, TUNSETIFF, entered

_WHY = netns_unavailable()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=f"network namespaces: {_WHY}"),
    pytest.mark.timeout(60),
]

DEV = "swu0"
TUN_ADDRS = ["172.19.0.1/30", "fdfe:dcba:9877::1/126"]
CLIENT_IP = {4: "172.19.0.1", 6: "fdfe:dcba:9877::1"}
CAPTURED = ["203.0.113.0/24", "198.18.0.0/15", "2001:db8:100::/64"]
SERVER = {4: SERVER_IP, 6: SERVER_IP6}
#: Any address in the captured prefixes: nothing listens there, the hijack answers.
NOWHERE = {4: "203.0.113.99", 6: "2001:db8:100::99"}
MARK = 0x5701
TABLE = "2601"

_IFF_TUN_NO_PI = IFF_TUN | IFF_NO_PI


_ECHO = textwrap.dedent(
    """
    import select, socket, sys
    socks = []
    for family, addr in ((socket.AF_INET, sys.argv[1]), (socket.AF_INET6, sys.argv[2])):
        s = socket.socket(family, socket.SOCK_DGRAM)
        s.bind((addr, socks[0].getsockname()[1] if socks else 0))
        socks.append(s)
    print("ready", socks[0].getsockname()[1], flush=True)
    while True:
        for s in select.select(socks, [], [])[0]:
            data, peer = s.recvfrom(65535)
            s.sendto(data, peer)
    """
)


def udp_echo(topo: Topology) -> int:
    """A UDP echo server on the server addresses themselves (not a wildcard: its
    replies come from the address asked, as a connected socket expects); its port."""
    proc = topo.internet.popen(
        sys.executable, "-c", _ECHO, SERVER_IP, SERVER_IP6, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    return int(read_lines(proc, r"ready (\d+)").group(1))


@dataclass
class Tun:
    """The TUN, the stack, the engine and the actor of one test."""

    topo: Topology
    engine: Any
    stack: TunStack
    fd: int
    responder: DnsResponder
    counters: TunUdpCounters = field(default_factory=TunUdpCounters)
    actor: pykka.ActorRef[Any] | None = None
    dns_tcp: TunDnsTcp | None = None

    @property
    def core(self) -> Any:
        return self.engine.core

    def start_actor(self, *, dns: bool = False, idle: float = 30.0) -> None:
        core = self.core
        spec = InboundSpec(99, "tun-in", "tun", False, 0, Users(None))
        self.actor = TunUdpActor.start(
            core.flow_deps, lambda: core.resolver, spec, self.stack,
            self.responder if dns else None, idle, counters=self.counters,
        )  # fmt: skip

    def client(self, version: int) -> socket.socket:
        with entered(self.topo.host.name):
            c = socket.socket(
                socket.AF_INET if version == 4 else socket.AF_INET6, socket.SOCK_DGRAM
            )
        c.settimeout(5)
        return c

    def events(self, kind: str) -> list[dict[str, Any]]:
        return [e["payload"] for e in self.engine.query("events", {"types": kind})["events"]]

    def wait_events(self, kind: str, n: int, timeout: float = 10) -> list[dict[str, Any]]:
        return wait_until(
            lambda: (got := self.events(kind)) and len(got) >= n and got, timeout, f"{n} {kind}"
        )

    def close(self) -> None:
        if self.actor is not None:
            with contextlib.suppress(pykka.ActorDeadError):
                self.actor.stop(timeout=10)
        if self.dns_tcp is not None:
            self.dns_tcp.stop()
        self.stack.stop()
        os.close(self.fd)


def _open_tun(topo: Topology) -> int:
    host = topo.host
    with entered(host.name):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", DEV.encode(), _IFF_TUN_NO_PI))
        except BaseException:
            os.close(fd)
            raise
    host.run("ip", "link", "set", DEV, "mtu", "1500", "up")
    for addr in TUN_ADDRS:
        host.run("ip", "addr", "add", addr, "dev", DEV, *(["nodad"] if ":" in addr else []))
    for prefix in CAPTURED:
        fam = "-6" if ":" in prefix else "-4"
        host.run("ip", fam, "route", "add", prefix, "dev", DEV, "table", TABLE)
    for fam in ("-4", "-6"):
        host.run("ip", fam, "rule", "add", "not", "fwmark", hex(MARK), "lookup", TABLE,
                 "pref", "100")  # fmt: skip
    for key in (f"net.ipv4.conf.{DEV}.rp_filter", "net.ipv4.conf.all.rp_filter"):
        host.run("sysctl", "-q", "-w", f"{key}=0")
    return fd


@pytest.fixture
def make_tun(make_engine) -> Iterator[Callable[..., Tun]]:
    """``make_tun(config, **stack_options)``: the topology, an engine in its host
    namespace, the TUN and its running stack (the actor is started by the test)."""
    made: list[Tun] = []
    with contextlib.ExitStack() as stack_of_cleanups:

        def make(config: dict[str, Any] | None = None, **stack_kw: Any) -> Tun:
            topo = stack_of_cleanups.enter_context(topology())
            fd = _open_tun(topo)
            cfg = config if config is not None else base_config()
            cfg.setdefault("runtime", {}).setdefault("dns", {"answer": {"type": "fake_ip"}})
            with entered(topo.host.name):
                engine = make_engine(cfg)
                stack = TunStack(fd, TUN_ADDRS, 1500, **stack_kw)
                stack.start()
            core = engine.core
            responder = DnsResponder(lambda: core.resolver, lambda: core.dns.pool)
            made.append(Tun(topo, engine, stack, fd, responder))
            return made[-1]

        mark.set_mark(MARK)
        try:
            yield make
        finally:
            for tun in made:
                tun.close()
            mark.set_mark(0)


def _echo_round_trips(c: socket.socket, dst: tuple[str, int], payloads: list[bytes]) -> None:
    for payload in payloads:
        c.sendto(payload, dst)
        data, peer = c.recvfrom(65535)
        assert data == payload and (peer[0], peer[1]) == dst


@pytest.mark.parametrize("v", [4, 6])
def test_direct_round_trips_are_exact_and_recorded(make_tun, v: int) -> None:
    tun = make_tun()
    port = udp_echo(tun.topo)
    tun.start_actor()
    c = tun.client(v)
    payloads = [b"x", b"", os.urandom(1200), os.urandom(37)]
    _echo_round_trips(c, (SERVER[v], port), payloads)
    (active,) = tun.engine.query("flows")["active_flows"]
    assert active["inbound"] == {"tag": "tun-in", "protocol": "tun", "client_protocol": "tun"}
    assert active["state"] == "active" and active["network"] == "udp"
    (started,) = tun.wait_events("flow.started", 1)
    source = {"ip": CLIENT_IP[v], "port": c.getsockname()[1]}
    assert started["record"]["source"] == source
    assert started["record"]["target"] == {"host": SERVER[v], "port": port}
    assert started["inbound"] == {"tag": "tun-in", "protocol": "tun", "client_protocol": "tun"}
    (routed,) = tun.wait_events("flow.routed", 1)
    assert routed["record"]["path"]["outbound"] == {"tag": "direct", "protocol": "direct"}
    # The actor stops (as with the TUN): an ordinary end, with every count.
    assert tun.actor is not None
    tun.actor.stop(timeout=10)
    (done,) = tun.wait_events("flow.completed", 1)
    record = done["record"]
    assert record["inbound"] == {"tag": "tun-in", "protocol": "tun", "client_protocol": "tun"}
    assert record["source"] == source and record["network"] == "udp"
    assert record["target"] == {"host": SERVER[v], "port": port, "resolved_ip": SERVER[v]}
    assert record["result"] == {"outcome": "direct_relayed"}
    size = sum(map(len, payloads))
    assert record["traffic"] == {
        "bytes_up": size,
        "bytes_down": size,
        "inbound_rx_bytes": size,
        "inbound_tx_bytes": size,
        "outbound_rx_bytes": size,
        "outbound_tx_bytes": size,
        "packets_up": 4,
        "packets_down": 4,
    }
    st = tun.stack.stats()
    assert (st["udp_datagrams_in"], st["udp_datagrams_out"]) == (4, 4)
    snap = tun.counters.snapshot()
    assert (snap["flows"], snap["datagrams_relayed"], snap["replies"]) == (1, 4, 4)
    assert snap["datagrams_dropped"] == snap["unknown_sessions"] == snap["errors"] == 0
    assert tun.engine.query("flows")["active_flows"] == []


def test_a_block_rule_by_ip_cidr_drops_and_the_flow_is_blocked(make_tun) -> None:
    rules = [{"ip_cidr": ["203.0.113.77/32"], "network": "udp", "action": "block"}]
    tun = make_tun(base_config(rules=rules))
    port = udp_echo(tun.topo)
    tun.start_actor()
    c = tun.client(4)
    for i in range(3):
        c.sendto(b"drop %d" % i, ("203.0.113.77", 9))
    (done,) = tun.wait_events("flow.completed", 1)
    record = done["record"]
    assert record["result"]["outcome"] == "blocked"
    assert record["route"]["matched_rule"]["index"] == 0
    assert record["target"] == {"host": "203.0.113.77", "port": 9}
    wait_until(lambda: tun.counters.datagrams_dropped == 3, what="3 datagrams dropped")
    c.settimeout(0.3)
    with pytest.raises(TimeoutError):
        c.recvfrom(100)
    # One flow for the sender, however many datagrams; other destinations still relay.
    c.settimeout(5)
    _echo_round_trips(c, (SERVER_IP, port), [b"still fine"])
    assert len(tun.events("flow.started")) == 2
    assert tun.engine.query("stats")["blocked_sessions"] == 1


@pytest.mark.parametrize("who", ["stack", "actor"])
def test_an_idle_session_ends_with_exact_counts(make_tun, who: str) -> None:
    """The stack's idle end (its own counts) or the actor's idle timeout (it closes the
    session in the stack): close reason idle_timeout either way; the next datagram of
    the same socket is a new flow."""
    tun = make_tun(udp_idle_timeout=0.4 if who == "stack" else 60)
    port = udp_echo(tun.topo)
    tun.start_actor(idle=0.4 if who == "actor" else 60)
    c = tun.client(4)
    _echo_round_trips(c, (SERVER_IP, port), [b"a" * 10, b"b" * 20])
    (done,) = tun.wait_events("flow.completed", 1)
    record = done["record"]
    assert record["result"] == {"outcome": "direct_relayed", "close_reason": "idle_timeout"}
    t = record["traffic"]
    assert (t["packets_up"], t["packets_down"], t["bytes_up"], t["bytes_down"]) == (2, 2, 30, 30)
    assert (t["inbound_rx_bytes"], t["inbound_tx_bytes"]) == (30, 30)
    wait_until(lambda: tun.stack.stats()["udp_active"] == 0, what="the session gone")
    assert tun.engine.query("stats")["udp_upstream"]["idle_timeouts"] >= 1
    _echo_round_trips(c, (SERVER_IP, port), [b"again"])
    assert len(tun.events("flow.started")) == 2
    assert tun.counters.unknown_sessions == 0


def test_flows_close_and_stats_ticks(make_tun) -> None:
    """A stats tick (SampleUdp) publishes flow.updated with live counts; flows.close
    ends the flow (cancelled, manual) and its session in the stack."""
    tun = make_tun()
    port = udp_echo(tun.topo)
    tun.start_actor()
    c = tun.client(4)
    _echo_round_trips(c, (SERVER_IP, port), [b"12345678"] * 3)
    assert tun.actor is not None
    tun.actor.tell(SampleUdp(now_ms()))
    (updated,) = tun.wait_events("flow.updated", 1)
    assert (updated["bytes_up"], updated["bytes_down"]) == (24, 24)
    assert updated["record"]["traffic"]["packets_down"] == 3
    tun.actor.tell(SampleUdp(now_ms()))  # nothing moved: no new revision
    (flow,) = tun.engine.query("flows")["active_flows"]
    assert flow["traffic"]["bytes_up"] == 24
    assert tun.engine.execute("flows.close", {"flow_id": flow["flow_id"]})["closed"] is True
    (done,) = tun.wait_events("flow.completed", 1)
    assert done["record"]["result"] == {"outcome": "cancelled", "close_reason": "manual"}
    assert done["record"]["traffic"]["packets_up"] == 3
    wait_until(lambda: tun.stack.stats()["udp_active"] == 0, what="the session closed")
    assert len(tun.events("flow.updated")) == 1 and tun.counters.unknown_sessions == 0
    _echo_round_trips(c, (SERVER_IP, port), [b"new flow"])
    assert len(tun.events("flow.started")) == 2


def test_an_unreachable_port_is_counted_and_sending_goes_on(make_tun) -> None:
    """The target answers with ICMP port unreachable: read (or met by the next send)
    on the flow's connected socket, counted, and every datagram still goes out."""
    tun = make_tun()
    tun.start_actor()
    c = tun.client(4)
    c.sendto(b"anyone?", (SERVER_IP, 9))
    wait_until(lambda: tun.counters.upstream_errors >= 1, what="the ICMP error")
    c.sendto(b"still?", (SERVER_IP, 9))
    wait_until(lambda: tun.counters.datagrams_relayed == 2, what="both sent")
    assert tun.counters.errors == 0 and tun.counters.datagrams_dropped == 0


def test_a_record_of_a_session_the_actor_never_saw_is_counted(make_tun) -> None:
    tun = make_tun()
    port = udp_echo(tun.topo)
    c = tun.client(4)
    c.sendto(b"before", (SERVER_IP, port))
    first = wait_until(lambda: tun.stack.records(), what="the first record")
    assert first[0].new_session
    tun.start_actor()  # the session's first datagram is gone: it still becomes a flow
    _echo_round_trips(c, (SERVER_IP, port), [b"after"])
    assert tun.counters.unknown_sessions == 1
    (started,) = tun.wait_events("flow.started", 1)
    assert started["record"]["source"]["port"] == c.getsockname()[1]


def test_a_fake_ip_destination_is_its_domain(make_tun) -> None:
    rules = [{"domain": ["blocked.test"], "network": "udp", "action": "block"}]
    tun = make_tun(base_config(rules=rules))
    tun.start_actor()
    fake = tun.core.dns.pool.lookup("blocked.test")
    tun.client(4).sendto(b"x", (fake, 7))
    (done,) = tun.wait_events("flow.completed", 1)
    # The name is the target; the address the client dialled is kept beside it.
    assert done["record"]["target"] == {"host": "blocked.test", "port": 7, "fake_ip": fake}
    assert done["record"]["result"]["outcome"] == "blocked"


def test_shadowsocks_outbound_relays_tun_udp(make_tun) -> None:
    cfg = base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            {
                "tag": "ss",
                "protocol": "shadowsocks",
                "server": SERVER_IP,
                "port": 8388,
                "method": "aes-256-gcm",
                "password": "pw",
            },
        ],
        route={"final": "ss"},
    )
    tun = make_tun(cfg)
    port = udp_echo(tun.topo)
    tun.topo.internet.popen(
        "ss-server", "-s", SERVER_IP, "-p", "8388", "-k", "pw", "-m", "aes-256-gcm", "-u",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_until(lambda: ":8388 " in tun.topo.internet.run("ss", "-lnu").stdout, what="ss-server")
    tun.start_actor()
    c = tun.client(4)
    payloads = [b"sealed %d" % n for n in range(3)]
    _echo_round_trips(c, (SERVER_IP, port), payloads)
    other = tun.client(4)  # another client socket: its own upstream association
    _echo_round_trips(other, (SERVER_IP, port), [b"second client"])
    assert tun.actor is not None
    tun.actor.stop(timeout=10)
    records = {d["record"]["source"]["port"]: d["record"] for d in tun.wait_events(
        "flow.completed", 2)}  # fmt: skip
    record = records[c.getsockname()[1]]
    assert record["result"]["outcome"] == "chained_relayed"
    assert record["path"]["outbound"] == {"tag": "ss", "protocol": "shadowsocks"}
    t = record["traffic"]
    size = sum(map(len, payloads))
    assert (t["packets_up"], t["packets_down"]) == (3, 3)
    assert t["bytes_up"] == t["bytes_down"] == size
    # salt (32) + sealed IPv4 address (7) + payload + tag (16) per packet, each way
    assert t["outbound_tx_bytes"] == t["outbound_rx_bytes"] == size + 3 * (32 + 7 + 16)
    udp = tun.engine.query("stats")["udp_upstream"]
    assert udp["created_associations"] == 2 and udp["active_associations"] == 0


# ---------------------------------------------------------------------------
# DNS hijack
# ---------------------------------------------------------------------------


def _dig(tun: Tun, server: str, name: str, *extra: str) -> str:
    res = tun.topo.host.run("dig", f"@{server}", name, "A", "+short", "+tries=1", "+time=3",
                            *extra, check=False)  # fmt: skip
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.strip()


@pytest.mark.parametrize("v", [4, 6])
def test_dig_over_udp_is_answered_by_the_responder(make_tun, v: int) -> None:
    tun = make_tun()
    tun.start_actor(dns=True)
    answer = _dig(tun, NOWHERE[v], f"name{v}.test")
    assert tun.core.dns.pool.domain_of(answer) == f"name{v}.test"  # a fake-ip answer
    snap = tun.counters.snapshot()
    assert (snap["dns_queries"], snap["dns_answers"], snap["dns_malformed"]) == (1, 1, 0)
    assert snap["flows"] == 0 and tun.events("flow.started") == []
    assert tun.responder.counters.queries == 1
    # Answered: the session is closed at once, not left for the idle timer.
    wait_until(lambda: tun.stack.stats()["udp_active"] == 0, what="the DNS session closed")
    assert tun.counters.unknown_sessions == 0


@pytest.mark.parametrize("v", [4, 6])
def test_dig_over_tcp_is_answered_through_the_dns_listener(make_tun, v: int) -> None:
    tun = make_tun(dns_tcp=True)
    tun.dns_tcp = TunDnsTcp(
        tun.responder, list(tun.stack.dns_listeners.values()), tun.core.dispatcher
    )
    tun.dns_tcp.start()
    answer = _dig(tun, NOWHERE[v], f"tcp{v}.test", "+tcp")
    assert tun.core.dns.pool.domain_of(answer) == f"tcp{v}.test"
    assert tun.responder.counters.tcp_queries == 1 and tun.dns_tcp.connections == 1
    st = tun.stack.stats()
    assert st["tcp_created"] == 1 and st["drop_no_session"] == 0


def test_malformed_dns_is_counted_and_harmless(make_tun) -> None:
    tun = make_tun()
    tun.start_actor(dns=True)
    c = tun.client(4)
    dst = (NOWHERE[4], 53)
    c.sendto(b"\x12", dst)  # shorter than a header: dropped
    c.sendto(b"\xab\xcd\x81\x80" + bytes(8), dst)  # a response (QR set): dropped
    c.sendto(b"\xab\xcd\x01\x00\x00\x01\x00\x00\x00\x00\x00\x00\xff\xff", dst)  # FORMERR
    data, peer = c.recvfrom(512)
    assert (peer[0], peer[1]) == dst
    assert data[:2] == b"\xab\xcd" and data[2] & 0x80 and data[3] & 0x0F == 1
    wait_until(lambda: tun.counters.dns_malformed == 3, what="3 malformed queries")
    assert tun.counters.dns_queries == 3 and tun.counters.errors == 0
    assert _dig(tun, NOWHERE[4], "fine.test")  # still answering
    assert tun.counters.dns_answers == 2


def test_actor_stats_ask(make_tun) -> None:
    tun = make_tun()
    tun.start_actor(dns=True)
    assert tun.actor is not None
    stats = tun.actor.ask(TunUdpStats(), timeout=5)
    assert stats["open_flows"] == 0 and stats["dns_queries"] == 0


def test_engine_stop_completes_open_tun_flows(make_tun) -> None:
    """The engine's stop ends the actor through its flows (StopFlow), each completing
    once, as any flow does at shutdown."""
    tun = make_tun()
    port = udp_echo(tun.topo)
    tun.start_actor()
    _echo_round_trips(tun.client(4), (SERVER_IP, port), [b"open"])
    tun.wait_events("flow.routed", 1)
    log = tun.core.log
    tun.engine.stop()
    (done,) = log.latest_of_type("flow.completed", 10)
    assert done["payload"]["record"]["result"] == {"outcome": "direct_relayed"}
    assert tun.actor is not None and tun.actor.actor_stopped.is_set()
    assert not tun.core.flow_actors


def test_a_refused_session_is_routed_again_after_the_hold(make_tun) -> None:
    """A blocked sender's datagrams are dropped for the hold (at most the idle timeout),
    then its session is freed and its next datagram is a new flow, routed by the rules
    of that moment: here the block rule is gone by then."""
    cfg = base_config(rules=[{"ip_cidr": [f"{SERVER_IP}/32"], "network": "udp", "action": "block"}])
    tun = make_tun(cfg)
    port = udp_echo(tun.topo)
    tun.start_actor(idle=0.5)
    c = tun.client(4)
    c.sendto(b"blocked", (SERVER_IP, port))
    (done,) = tun.wait_events("flow.completed", 1)
    assert done["record"]["result"]["outcome"] == "blocked"
    cfg["rules"] = []
    tun.engine.execute("config.apply_runtime", {"config": cfg})
    c.settimeout(0.1)

    def echoed() -> bool:
        c.sendto(b"again", (SERVER_IP, port))
        try:
            return c.recvfrom(100)[0] == b"again"
        except TimeoutError:
            return False

    wait_until(echoed, timeout=10, what="the session routed again")
    outcomes = [e["record"]["result"]["outcome"] for e in tun.wait_events("flow.completed", 1)]
    started = tun.events("flow.started")
    assert outcomes[0] == "blocked" and len(started) == 2
