"""The TUN's host side in network namespaces: device, auto_route, strict_route, dns_hijack,
the engine's socket mark, egress status, and cleanup after stop, failure and kill -9.

Each test builds a "host" namespace linked to an "internet" one (tests/helpers/netns.py)
and runs the TUN controller in the host namespace in a separate process
(tests/helpers/tun_holder.py) that also reads the device: with no packet loop
attached, a packet routed into the TUN shows up in the holder's capture, so "goes into
the TUN" is observed on real packets, not only in ``ip route get``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest

from spliceway.tun.options import ENGINE_MARK, RULE_PRIORITY_BASE
from tests.helpers.netns import (
    DNS_IP,
    GATEWAY_IP,
    OTHER_IP,
    SERVER_IP,
    SERVER_IP6,
    SERVER_IP_B,
    Netns,
    Topology,
    read_lines,
    topology,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


class Holder:
    """A tun_holder process in a namespace: start it, send commands, read JSON answers."""

    def __init__(self, ns: Netns, params: dict[str, Any], *extra: str, state_dir: str) -> None:
        self.proc = ns.popen(
            sys.executable, "-m", "tests.helpers.tun_holder", json.dumps(params),
            "--state-dir", state_dir, *extra,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        self.first = json.loads(read_lines(self.proc, r"^\{.*", timeout=30).group(0))

    @property
    def started(self) -> dict[str, Any]:
        assert "ready" in self.first, self.first
        return self.first

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"holder exited on {command!r}"
        return json.loads(line)

    def packets(self) -> list[list]:
        return self.ask("packets")["packets"]

    def stop(self) -> None:
        assert self.ask("stop") == {"stopped": True}
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)


@pytest.fixture
def topo() -> Iterator[Topology]:
    with topology() as t:
        yield t


@pytest.fixture
def state_dir(tmp_path) -> str:
    return str(tmp_path / "state")


def _hold(topo: Topology, state_dir: str, *extra: str, **params: Any) -> Holder:
    doc = {"addr": "198.18.0.1/15", "tag": "tun-in", **params}
    return Holder(topo.host, doc, *extra, state_dir=state_dir)


def _udp_probe(ns: Netns, host: str, port: int) -> None:
    """Send one UDP datagram from ``ns`` (an unbound socket, as any application's)."""
    family = "AF_INET6" if ":" in host else "AF_INET"
    ns.run(
        sys.executable,
        "-c",
        f"import socket; s = socket.socket(socket.{family}, socket.SOCK_DGRAM); "
        f"s.sendto(b'probe', ({host!r}, {port}))",
        check=False,
    )


def _seen(holder: Holder, dst: str, dport: int | None = None) -> bool:
    return wait_until(
        lambda: any(p[3] == dst and (dport is None or p[4] == dport) for p in holder.packets()),
        timeout=3,
    )


def _blocked(answer: str) -> bool:
    """``ip route get`` refused: an unreachable route or rule (IPv4 says "No route to host")."""
    text = answer.lower()
    return "unreachable" in text or "no route to host" in text


def _tun_dev(answer: str, name: str) -> bool:
    return f"dev {name} " in answer + " "


# ---------------------------------------------------------------------------


def test_device_has_the_addresses_mtu_and_is_up(topo: Topology, state_dir: str) -> None:
    holder = _hold(
        topo, state_dir, name="swtest0", secondary_addr="fd00:5357::1/64", mtu=9000,
        auto_route=False,
    )  # fmt: skip
    status = holder.started["ready"]
    assert status["name"] == "swtest0"
    assert status["addresses"] == ["198.18.0.1/15", "fd00:5357::1/64"]
    assert status["mtu"] == 9000
    assert status["running"] is True and status["healthy"] is True
    (link,) = topo.host.ip_json("addr", "show", "dev", "swtest0")
    assert link["mtu"] == 9000
    assert "UP" in link["flags"]
    addrs = {(a["local"], a["prefixlen"]) for a in link["addr_info"] if a["scope"] == "global"}
    assert addrs == {("198.18.0.1", 15), ("fd00:5357::1", 64)}
    # A TUN device (no link layer), not something else named like one.
    assert link["link_type"] == "none"
    holder.stop()


def test_mtu_defaults_to_network_mtu_and_ipv6_defaults_in(topo: Topology, state_dir: str) -> None:
    holder = _hold(topo, state_dir, addr="10.77.0.1", auto_route=False)
    status = holder.started["ready"]
    # A bare IPv4 address takes the default mask 255.255.255.0; dual_stack adds the
    # default IPv6 address; the MTU is runtime.network.mtu's default.
    assert status["addresses"] == ["10.77.0.1/24", "fdfe:dcba:9876::1/126"]
    assert status["mtu"] == 1500
    assert status["address_family_policy"] == "dual_stack"
    holder.stop()


def test_auto_route_captures_the_default_route_and_leaves_the_lan(
    topo: Topology, state_dir: str
) -> None:
    holder = _hold(topo, state_dir)
    name = holder.started["name"]
    assert _tun_dev(topo.host.route_get(SERVER_IP), name)
    assert _tun_dev(topo.host.route_get(SERVER_IP6), name)
    # The host's more specific (LAN) route still wins over the TUN's default route.
    assert f"dev {topo.host_if}" in topo.host.route_get(GATEWAY_IP)
    # A real packet from an unbound socket goes into the device, sourced from the TUN.
    _udp_probe(topo.host, SERVER_IP, 5555)
    assert _seen(holder, SERVER_IP, 5555)
    assert any(p[2] == "198.18.0.1" for p in holder.packets() if p[3] == SERVER_IP)
    _udp_probe(topo.host, SERVER_IP6, 5556)
    assert _seen(holder, SERVER_IP6, 5556)
    holder.stop()


def test_include_and_exclude_cidrs(topo: Topology, state_dir: str) -> None:
    holder = _hold(
        topo, state_dir, include_cidrs=["203.0.113.0/24"], exclude_cidrs=["203.0.113.128/25"],
        dns_hijack=False,
    )  # fmt: skip
    name = holder.started["name"]
    assert holder.started["ready"]["include_cidrs"] == ["203.0.113.0/24"]
    assert holder.started["ready"]["exclude_cidrs"] == ["203.0.113.128/25"]
    assert _tun_dev(topo.host.route_get(SERVER_IP), name)
    # Inside the include, inside the exclude: the host's own route.
    assert f"dev {topo.host_if}" in topo.host.route_get(SERVER_IP_B)
    # Outside the include: untouched.
    assert f"dev {topo.host_if}" in topo.host.route_get(OTHER_IP)
    # include_cidrs names no IPv6 network: IPv6 is not captured by destination.
    assert not _tun_dev(topo.host.route_get(SERVER_IP6), name)

    _udp_probe(topo.host, SERVER_IP, 6001)
    _udp_probe(topo.host, SERVER_IP_B, 6002)
    _udp_probe(topo.host, OTHER_IP, 6003)
    assert _seen(holder, SERVER_IP, 6001)
    time.sleep(0.3)
    dsts = {p[3] for p in holder.packets()}
    assert SERVER_IP_B not in dsts and OTHER_IP not in dsts
    holder.stop()


def test_marked_sockets_bypass_the_tun(topo: Topology, state_dir: str) -> None:
    port = topo.serve("http")
    holder = _hold(topo, state_dir)
    name = holder.started["name"]
    assert f"dev {topo.host_if}" in topo.host.route_get(SERVER_IP, "mark", hex(ENGINE_MARK))
    assert f"dev {topo.host_if}" in topo.host.route_get(SERVER_IP6, "mark", hex(ENGINE_MARK))
    assert _tun_dev(topo.host.route_get(SERVER_IP, "mark", "0x1"), name)
    # The engine's own dials (outbounds.open_tcp, the webhook client's create_connection)
    # carry the mark the controller switched on: they reach the server through the veth.
    answer = holder.ask(f"connect {SERVER_IP} {port}")
    assert answer == {"connected": True, "reply": "HTTP/1.1 200 OK"}, answer
    answer = holder.ask(f"connect {SERVER_IP6} {port}")
    assert answer == {"connected": True, "reply": "HTTP/1.1 200 OK"}, answer
    answer = holder.ask(f"webhook-connect {SERVER_IP} {port}")
    assert answer == {"connected": True, "reply": "HTTP/1.1 200 OK"}, answer
    # An ordinary (unmarked) client's SYN goes into the TUN, where no stack answers it.
    done = topo.host.run(
        "curl", "-sS", "--max-time", "1", f"http://{SERVER_IP}:{port}/", check=False
    )
    assert done.returncode != 0
    assert _seen(holder, SERVER_IP, port)
    holder.stop()


def test_strict_route_blocks_the_family_the_tun_lacks(topo: Topology, state_dir: str) -> None:
    holder = _hold(topo, state_dir, dual_stack=False)
    assert holder.started["ready"]["addresses"] == ["198.18.0.1/15"]
    assert holder.started["ready"]["strict_route"] is True
    assert _blocked(topo.host.route_get(SERVER_IP6))
    done = topo.host.run(
        "curl", "-sS", "--max-time", "2", f"http://[{SERVER_IP6}]:80/", check=False
    )
    assert "unreachable" in done.stderr.lower() or done.returncode == 7, done.stderr
    holder.stop()

    # Without strict_route the family the TUN lacks takes the host's route: a leak,
    # asserted so the contrast above means something.
    holder = _hold(topo, state_dir, dual_stack=False, strict_route=False)
    assert f"dev {topo.host_if}" in topo.host.route_get(SERVER_IP6)
    holder.stop()


def test_strict_route_blocks_the_captured_family_when_the_tun_is_down(
    topo: Topology, state_dir: str
) -> None:
    holder = _hold(topo, state_dir)
    name = holder.started["name"]
    topo.host.run("ip", "link", "set", name, "down")
    for target in (SERVER_IP, SERVER_IP6):
        answer = topo.host.route_get(target)
        assert topo.host_if not in answer, answer
        assert _blocked(answer), answer
    # The controller notices (netlink) and reports it.
    assert wait_until(lambda: holder.ask("status")["status"]["healthy"] is False)
    assert "down" in holder.ask("status")["status"]["last_error"]
    holder.stop()

    holder = _hold(topo, state_dir, strict_route=False)
    name = holder.started["name"]
    topo.host.run("ip", "link", "set", name, "down")
    assert f"dev {topo.host_if}" in topo.host.route_get(SERVER_IP)
    holder.stop()


def test_dns_hijack_routes_port_53_into_the_tun(topo: Topology, state_dir: str) -> None:
    topo.dns({"example.test": SERVER_IP})
    # include_cidrs leaves the DNS server's address out, and the gateway is on the LAN:
    # port 53 still goes into the TUN, other ports do not.
    holder = _hold(topo, state_dir, include_cidrs=["192.0.2.0/24"])
    name = holder.started["name"]
    for dst in (DNS_IP, GATEWAY_IP):
        assert _tun_dev(topo.host.route_get(dst, "ipproto", "udp", "dport", "53"), name)
        assert _tun_dev(topo.host.route_get(dst, "ipproto", "tcp", "dport", "53"), name)
        assert not _tun_dev(topo.host.route_get(dst, "ipproto", "udp", "dport", "54"), name)
    done = topo.host.run(
        "dig", f"@{DNS_IP}", "example.test", "+tries=1", "+time=1", "+short", check=False
    )
    assert SERVER_IP not in done.stdout  # nobody answers inside the TUN in this test
    assert _seen(holder, DNS_IP, 53)
    holder.stop()

    # Without dns_hijack the same query reaches the internet's DNS server.
    holder = _hold(topo, state_dir, include_cidrs=["192.0.2.0/24"], dns_hijack=False)
    done = topo.host.run(
        "dig", f"@{DNS_IP}", "example.test", "+tries=2", "+time=1", "+short", check=False
    )
    assert done.stdout.strip() == SERVER_IP, done
    holder.stop()


def test_stop_removes_every_route_rule_and_address(topo: Topology, state_dir: str) -> None:
    before = topo.host.snapshot()
    holder = _hold(
        topo, state_dir, secondary_addr="fd00:5357::1/64", include_cidrs=["203.0.113.0/24"],
        exclude_cidrs=["203.0.113.128/25", "2001:db8:100::/64"],
    )  # fmt: skip
    during = topo.host.snapshot()
    assert during["rules4"] != before["rules4"] and during["routes6"] != before["routes6"]
    assert str(RULE_PRIORITY_BASE) in during["rules6"]
    holder.stop()
    assert topo.host.snapshot() == before
    assert not os.listdir(state_dir)


def test_failed_start_leaves_nothing(topo: Topology, state_dir: str) -> None:
    before = topo.host.snapshot()
    holder = _hold(topo, state_dir, "--fail-after-routes")
    assert "error" in holder.first and "refused" in holder.first["error"]["message"]
    holder.proc.wait(timeout=10)
    assert topo.host.snapshot() == before


def test_kill_9_then_a_new_start_leaves_nothing(topo: Topology, state_dir: str) -> None:
    before = topo.host.snapshot()
    holder = _hold(topo, state_dir, dual_stack=False)
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(timeout=10)
    # The device went with its fd; the rules (and strict_route's unreachable routes)
    # outlive the process: IPv6 stays blocked, the kill switch strict_route promises.
    left = topo.host.snapshot()
    assert str(RULE_PRIORITY_BASE) in left["rules4"]
    assert _blocked(topo.host.route_get(SERVER_IP6))

    holder = _hold(topo, state_dir)
    assert holder.started["ready"]["running"] is True
    holder.stop()
    assert topo.host.snapshot() == before


def test_kill_9_then_the_sweep_command_leaves_nothing(topo: Topology, state_dir: str) -> None:
    before = topo.host.snapshot()
    holder = _hold(topo, state_dir, include_cidrs=["203.0.113.0/24"])
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(timeout=10)
    assert topo.host.snapshot() != before
    done = topo.host.run(
        sys.executable, "-m", "spliceway.tun.routing", "sweep", "--state-dir", state_dir
    )
    assert "removed" in done.stdout
    assert topo.host.snapshot() == before


def test_a_second_tun_in_the_namespace_is_a_conflict(topo: Topology, state_dir: str) -> None:
    first = _hold(topo, state_dir)
    second = _hold(topo, state_dir, addr="10.88.0.1/24")
    assert second.first["error"]["code"] == "conflict", second.first
    second.proc.wait(timeout=10)
    # The first one's rules are intact.
    assert _tun_dev(topo.host.route_get(SERVER_IP), first.started["name"])
    first.stop()


def test_without_cap_net_admin_the_start_is_refused(topo: Topology, state_dir: str) -> None:
    if not os.path.exists("/usr/bin/setpriv"):
        pytest.skip("setpriv (util-linux) is not installed")
    doc = json.dumps({"addr": "198.18.0.1/15", "tag": "tun-in"})
    cmd = topo.host.python("-m", "tests.helpers.tun_holder", doc, "--state-dir", state_dir)
    # Drop CAP_NET_ADMIN from every set (still root otherwise).
    cmd = [*cmd[:4], "setpriv", "--inh-caps=-net_admin", "--bounding-set=-net_admin", *cmd[4:]]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, input="")
    answer = json.loads(done.stdout.splitlines()[0])
    assert answer["error"]["code"] == "insufficient_os_privilege", answer
    assert "CAP_NET_ADMIN" in answer["error"]["message"]


def test_status_reports_the_egress_and_counts_its_changes(topo: Topology, state_dir: str) -> None:
    holder = _hold(topo, state_dir)
    status = holder.started["ready"]
    assert status["egress_interface"] == topo.host_if
    assert status["egress_interface_v4"] == topo.host_if
    assert status["egress_interface_v6"] == topo.host_if
    assert status["ipv4_egress"] == {"availability": "available", "interface": topo.host_if}
    assert status["network_generation"] == 0
    assert status["managed_by_config"] is False

    def current() -> dict[str, Any]:
        return holder.ask("status")["status"]

    topo.host.run("ip", "route", "del", "default")
    assert wait_until(lambda: current()["ipv4_egress"]["availability"] == "unavailable")
    status = current()
    assert status["ipv4_egress"]["reason"] == "no default route"
    assert status["network_generation"] == 1
    assert status["ipv6_egress"]["availability"] == "available"
    topo.host.run("ip", "route", "add", "default", "via", GATEWAY_IP)
    assert wait_until(lambda: current()["ipv4_egress"]["availability"] == "available")
    assert current()["network_generation"] == 2

    topo.host.run("ip", "link", "set", topo.host_if, "down")
    assert wait_until(lambda: current()["ipv6_egress"]["availability"] == "unavailable")
    holder.stop()


def test_engine_start_sweep_lifts_the_kill_switch(topo: Topology, state_dir: str) -> None:
    before = topo.host.snapshot()
    holder = _hold(topo, state_dir)
    code = (
        "import sys; from spliceway.tun.routing import sweep_if_recorded; "
        f"r = sweep_if_recorded({state_dir!r}); print('none' if r is None else 'swept')"
    )
    # While the owner runs, an engine starting next to it touches nothing.
    assert topo.host.run(sys.executable, "-c", code).stdout.strip() == "none"
    holder.proc.send_signal(signal.SIGKILL)
    holder.proc.wait(timeout=10)
    assert _blocked(topo.host.route_get(SERVER_IP))  # strict_route's kill switch
    assert topo.host.run(sys.executable, "-c", code).stdout.strip() == "swept"
    assert topo.host.snapshot() == before
    assert topo.host.run(sys.executable, "-c", code).stdout.strip() == "none"
