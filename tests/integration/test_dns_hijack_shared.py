"""The DNS server (``runtime.dns.listen``) and a TUN's ``dns_hijack`` at once: one
responder, one set of counters, used from two threads (the server's own loop and the
dispatcher's, where the TUN's UDP actor answers hijacked queries). A name resolved on
both loops at the same moment is resolved once per loop, never awaited across loops
(that answered SERVFAIL with a traceback).

The engine runs in a network namespace of its own (tests/helpers/netns.py); dnsmasq in
the "internet" namespace is its upstream, with no cache in the engine, so every query
resolves.
"""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.netns import OTHER_IP, SERVER_IP, Topology, topology
from tests.integration.test_tun_engine import TUN, Engine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def topo() -> Iterator[Topology]:
    with topology() as t:
        yield t


def test_the_server_and_the_hijack_answer_one_name_at_once(topo: Topology, tmp_path: Path):
    dns_ip = topo.dns({"www.example.test": SERVER_IP})
    runtime = {
        "tun": {**TUN, "dns_hijack": True},
        "dns": {
            "servers": [f"udp://{dns_ip}:53"],
            "cache": None,
            "listen": {"address": "127.0.0.1", "port": 0},
        },
    }
    engine = Engine(topo, tmp_path, {"runtime": runtime})
    try:
        port = engine.query("runtime")["dns_server"]["listen_port"]
        # 40 rounds of the same query sent at once to the server (127.0.0.1, not through
        # the TUN) and through the hijack (any address on port 53 goes to the TUN).
        script = textwrap.dedent(
            f"""
            import json, socket, dns.message
            targets = [("127.0.0.1", {port}), ({OTHER_IP!r}, 53)]
            rcodes, addresses = [], set()
            for _ in range(40):
                socks = []
                for t in targets:
                    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                    s.settimeout(5)
                    s.sendto(dns.message.make_query("www.example.test", "A").to_wire(), t)
                    socks.append(s)
                for s in socks:
                    m = dns.message.from_wire(s.recv(4096))
                    rcodes.append(m.rcode())
                    addresses.update(rr.address for rrset in m.answer for rr in rrset)
                    s.close()
            print(json.dumps({{"rcodes": rcodes, "addresses": sorted(addresses)}}))
            """
        )
        out = json.loads(topo.host.run(sys.executable, "-c", script, timeout=60).stdout)
        assert out["rcodes"] == [0] * 80 and out["addresses"] == [SERVER_IP]
        counters = engine.query("runtime")["dns_server"]["counters"]
        # One set of counters: the hijacked queries are in it too.
        assert counters["queries"] == counters["noerror"] == 80
        assert counters["servfail"] == 0
        assert "Traceback" not in engine.output()
    finally:
        engine.stop()
