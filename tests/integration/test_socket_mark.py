"""The engine's socket mark on the sockets it dials itself, observed through routing.

A socket's mark cannot be read from another process, so each test builds the
host/internet namespaces (tests/helpers/netns.py) and splits the host's routing by
mark, as a TUN's auto_route does (its first rule sends marked packets around the TUN):

- ``ip rule fwmark 0x5357 lookup 100``: table 100 reaches ``SERVER_IP`` and
  ``DNS_IP`` through the gateway and has ``SERVER_IP_B`` unreachable;
- the main table has ``SERVER_IP`` and ``DNS_IP`` unreachable and reaches
  ``SERVER_IP_B`` by its default route.

So a connection to ``SERVER_IP`` succeeds only on a marked socket and one to
``SERVER_IP_B`` only on an unmarked one. The engine runs in the host namespace in a
process of its own (tests/helpers/mark_engine.py), its mark set as the TUN
controller sets it (:func:`spliceway.support.socket_mark.set_mark`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from spliceway.tun.options import ENGINE_MARK
from tests.helpers.netns import (
    DNS_IP,
    GATEWAY_IP,
    SERVER_IP,
    SERVER_IP_B,
    Netns,
    Topology,
    read_lines,
    topology,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

TABLE = "100"
MARK = hex(ENGINE_MARK)
#: Where each address is reachable from (see the module docstring).
MARKED_ONLY = SERVER_IP
UNMARKED_ONLY = SERVER_IP_B


def split_by_mark(topo: Topology) -> None:
    """Route ``SERVER_IP`` and ``DNS_IP`` only for marked packets, ``SERVER_IP_B`` only
    for unmarked ones."""
    h = topo.host
    for addr in (MARKED_ONLY, DNS_IP):
        h.run("ip", "route", "add", "unreachable", f"{addr}/32")
        h.run("ip", "route", "add", f"{addr}/32", "via", GATEWAY_IP, "dev", topo.host_if,
              "table", TABLE)  # fmt: skip
    h.run("ip", "route", "add", "unreachable", f"{UNMARKED_ONLY}/32", "table", TABLE)
    h.run("ip", "rule", "add", "fwmark", MARK, "lookup", TABLE, "priority", "100")
    # Answers from SERVER_IP come back unmarked; a reverse-path check would look them up
    # in main (unreachable) and drop them.
    for conf in ("all", "default", topo.host_if):
        h.run("sysctl", "-qw", f"net.ipv4.conf.{conf}.rp_filter=0")
    # The split itself, before any engine: the kernel's own answer.
    assert "No route to host" in h.route_get(MARKED_ONLY)
    assert "via " + GATEWAY_IP in h.route_get(MARKED_ONLY, "mark", MARK)
    assert "via " + GATEWAY_IP in h.route_get(UNMARKED_ONLY)
    assert "No route to host" in h.route_get(UNMARKED_ONLY, "mark", MARK)


class EngineProc:
    """tests/helpers/mark_engine.py in a namespace: commands in, JSON answers out."""

    def __init__(self, ns: Netns, config: dict[str, Any], *extra: str) -> None:
        self.proc = ns.popen(
            sys.executable, "-m", "tests.helpers.mark_engine", json.dumps(config), *extra,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        first = json.loads(read_lines(self.proc, r"^\{.*", timeout=30).group(0))
        assert "ready" in first, first
        self.ready = first["ready"]

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"engine exited on {command!r}"
        return json.loads(line)

    def reaches(self, ip: str, port: int) -> bool:
        """A SOCKS5 CONNECT to ``ip:port`` through the engine gets its echo."""
        answer = self.ask(f"socks {ip} {port}")
        if answer["echo"]:
            return True
        # C's failure to connect: SOCKS5 "host unreachable", as the route says.
        assert answer["reply"] == 4, answer
        return False

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("exit\n")
        self.proc.stdin.close()
        assert self.proc.wait(timeout=20) == 0


def engine_config(**runtime: Any) -> dict[str, Any]:
    return {
        "inbounds": [
            {
                "tag": "socks-in",
                "protocol": "socks5",
                "listen": {"address": "127.0.0.1", "port": 0},
                "sniff": False,
            }
        ],
        "outbounds": [{"tag": "direct", "protocol": "direct"}],
        "runtime": {"stats_interval_ms": 60_000, **runtime},
        "api": {"control": {"enabled": False}, "ipc": {"enabled": False}},
    }


@pytest.fixture
def topo() -> Iterator[Topology]:
    with topology() as t:
        split_by_mark(t)
        yield t


def dnsmasq(topo: Topology) -> None:
    """dnsmasq on ``DNS_IP``:53 in the internet namespace, authoritative for
    ``marked.test``: A 10.9.0.1, AAAA fd00:9::1, MX ``mail.marked.test``."""
    topo.internet.popen(
        "dnsmasq", "--keep-in-foreground", "--no-resolv", "--no-hosts",
        "--conf-file=/dev/null", "--pid-file", "--user=root", "--bind-interfaces",
        f"--listen-address={DNS_IP}", "--port=53",
        "--host-record=marked.test,10.9.0.1,fd00:9::1", "--mx-host=marked.test,mail.marked.test,10",
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    assert wait_until(lambda: f"{DNS_IP}:53 " in topo.internet.run("ss", "-lnt").stdout)
    assert wait_until(lambda: f"{DNS_IP}:53 " in topo.internet.run("ss", "-lnu").stdout)


def c_counters(engine: EngineProc) -> dict[str, int]:
    stats = engine.ask("stats")
    return {k: stats[k] for k in ("deferred", "routed", "ended", "mark_failed")}


def assert_c_counters(engine: EngineProc, **expected: int) -> None:
    """C's counters are ``expected`` once settled: C counts a flow ended when its loop
    sees the client's close, which can come just after the test read the echo."""
    last: dict[str, int] = {}

    def settled() -> bool:
        last.update(c_counters(engine))
        return last == expected

    if not wait_until(settled, 5):
        assert last == expected  # shows what differs


def test_c_path_marks_its_upstream_sockets_as_the_mark_changes(topo: Topology) -> None:
    port = topo.serve("echo")
    engine = EngineProc(topo.host, engine_config())
    try:
        # No TUN (mark 0): the upstream socket is unmarked and takes the main table.
        assert engine.reaches(UNMARKED_ONLY, port)
        assert not engine.reaches(MARKED_ONLY, port)
        # Every one of them dialled by C, none by Python (the outbounds mark their own).
        assert_c_counters(engine, deferred=0, routed=1, ended=1, mark_failed=0)

        assert engine.ask(f"mark {MARK}") == {"mark": ENGINE_MARK}
        assert engine.reaches(MARKED_ONLY, port)
        assert not engine.reaches(UNMARKED_ONLY, port)

        assert engine.ask("mark 0") == {"mark": 0}
        assert engine.reaches(UNMARKED_ONLY, port)
        assert not engine.reaches(MARKED_ONLY, port)
        assert_c_counters(engine, deferred=0, routed=3, ended=3, mark_failed=0)
    finally:
        engine.close()


def test_c_path_takes_the_mark_set_before_the_engine_started(topo: Topology) -> None:
    port = topo.serve("echo")
    engine = EngineProc(topo.host, engine_config(), "--mark", MARK)
    try:
        assert engine.reaches(MARKED_ONLY, port)
        assert not engine.reaches(UNMARKED_ONLY, port)
        assert_c_counters(engine, deferred=0, routed=1, ended=1, mark_failed=0)
    finally:
        engine.close()


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_dns_queries_to_servers_carry_the_mark(topo: Topology, transport: str) -> None:
    """The resolver's blocking and asyncio queries and the DNS server's forwarded ones
    reach a server routed only for marked packets once the mark is set."""
    dnsmasq(topo)
    dns = {
        "servers": [f"{transport}://{DNS_IP}:53"],
        "cache": None,  # every lookup asks the server
        "listen": {"address": "127.0.0.1", "port": 0},
    }
    engine = EngineProc(topo.host, engine_config(dns=dns))
    try:
        # Unmarked, the server is unreachable: every path fails at once.
        assert "error" in engine.ask("resolve marked.test")
        assert engine.ask("dns marked.test A")["rcode"] == "SERVFAIL"
        assert engine.ask("dns marked.test MX")["rcode"] == "SERVFAIL"

        engine.ask(f"mark {MARK}")
        assert engine.ask("resolve marked.test") == {"addresses": ["10.9.0.1", "fd00:9::1"]}
        a = engine.ask("dns marked.test A")  # the resolver's asyncio path
        assert a["rcode"] == "NOERROR" and "10.9.0.1" in a["answer"][0], a
        mx = engine.ask("dns marked.test MX")  # forwarded by the DNS server
        assert mx["rcode"] == "NOERROR" and "mail.marked.test" in mx["answer"][0], mx

        engine.ask("mark 0")
        assert "error" in engine.ask("resolve marked.test")
    finally:
        engine.close()
