"""The route publisher compiles every C table from one engine generation, never a mix.

``RoutePublisher.publish`` runs on the dispatcher (reloads, ``mode.set``, group changes)
and on the process-lookup worker thread (this host's addresses changed). A reload
publishes a new generation while a publish on the worker may be compiling: each table
must still be compiled from the rules, the routing state and the outbounds of one
generation, which its Python mirror (what C got, with the epoch C's records name)
records by serial.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import pytest
from mmdb_writer import MMDBWriter
from netaddr import IPSet

from spliceway import Engine
from spliceway.engine import assembly
from spliceway.engine.generation import Generation
from spliceway.engine.route_publish import Mirror
from spliceway.routing import geodata
from tests.conftest import base_config, wait_until
from tests.helpers.flows import completed
from tests.helpers.servers import EchoServer

#: Reloads per test: each installs a new generation (bounded; about 2 s in all).
RELOADS = 30
#: Publishes the worker-side thread may make while the reloads run (bounded loop).
MAX_PUBLISHES = 200_000


def _document(name: str) -> dict[str, Any]:
    """A configuration whose one rule routes to an outbound only it defines."""
    return base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            {"tag": "block", "protocol": "block"},
            # A proxy C dials itself: the table holds it as a target of its own.
            {"tag": f"up-{name}", "protocol": "socks5", "server": "127.0.0.1", "port": 9},
        ],
        rules=[{"domain_suffix": [f"{name}.example"], "outbound": f"up-{name}"}],
    )


def _assert_of_one_generation(mirror: Mirror, g: Generation) -> None:
    """The table of ``mirror`` holds ``g``'s rules, routing state and outbounds only."""
    assert mirror.outbounds is g.outbounds
    assert mirror.routes.ruleset is g.route_state.ruleset
    # The targets were resolved against the same outbounds the rules name.
    ruled = {d.target for d in mirror.routes.rule_decisions if d.action == "route"}
    assert ruled == {r.outbound for r in g.config.rules}
    for tag, chain in zip(mirror.routes.targets, mirror.chains, strict=True):
        assert chain[-1] in g.outbounds, (tag, chain)


def test_every_table_published_during_reloads_belongs_to_one_generation() -> None:
    documents = [_document("a"), _document("b")]
    with Engine(documents[0]) as engine:
        core = engine.core
        generations: dict[int, Generation] = {core.generation.serial: core.generation}
        stop = threading.Event()
        published = 0

        def publish_like_the_lookup_worker() -> None:
            # What ProcessLookup's worker runs when this host's addresses change.
            nonlocal published
            for _ in range(MAX_PUBLISHES):
                if stop.is_set():
                    return
                core.routes.publish()
                published += 1

        worker = threading.Thread(target=publish_like_the_lookup_worker, name="spliceway-proc")
        worker.start()
        try:
            for n in range(RELOADS):
                result = engine.execute("config.apply_runtime", {"config": documents[(n + 1) % 2]})
                assert result["applied"] is True
                g = core.generation
                generations[g.serial] = g
        finally:
            stop.set()
            worker.join(10)
        assert not worker.is_alive()
        assert published > 0
        assert len(generations) == RELOADS + 1
        seen: set[int] = set()
        for epoch in range(1, core.routes.epoch + 1):
            mirror = core.routes.mirror(epoch)
            assert mirror.routes.epoch == epoch
            g = generations.get(mirror.generation)
            assert g is not None, f"table {epoch} names generation {mirror.generation}"
            _assert_of_one_generation(mirror, g)
            seen.add(mirror.generation)
        # Every generation got its table (the publish after each install).
        assert seen == set(generations)
        # The table C routes by now is the last generation's.
        assert core.routes.mirror(core.routes.epoch).generation == core.generation.serial


def test_mode_set_publishes_a_generation_of_its_own() -> None:
    with Engine(_document("a")) as engine:
        core = engine.core
        before = core.generation
        engine.execute("mode.set", {"mode": "direct"})
        after = core.generation
        assert after.serial > before.serial
        assert after.route_state.mode == "direct"
        # The same tables under the new routing state.
        assert after.outbounds is before.outbounds and after.policies is before.policies
        mirror = core.routes.mirror(core.routes.epoch)
        assert mirror.generation == after.serial
        _assert_of_one_generation(mirror, after)


# -- rule sets and geodata in the C table --------------------------------------------

_WIRED = "rule_sets" in getattr(assembly.RoutingParts, "__dataclass_fields__", {})


def _geo_files(tmp: Path) -> tuple[str, str]:
    """A country .mmdb calling 127.0.0.0/8 "XX" and a geosite.dat with list "site"."""
    writer = MMDBWriter(ip_version=6, ipv4_compatible=True, database_type="GeoLite2-Country")
    writer.insert_network(IPSet(["127.0.0.0/8"]), {"country": {"iso_code": "XX"}})
    mmdb = tmp / "country.mmdb"
    writer.to_db_file(str(mmdb))
    sites = geodata.GeoSiteListMessage()
    entry = sites.entry.add(country_code="site")
    entry.domain.add(type=2, value="site.test")  # a name and every name below it
    dat = tmp / "geosite.dat"
    dat.write_bytes(sites.SerializeToString())
    return str(mmdb), str(dat)


def _through(engine: Engine, port: int, host: str) -> bytes:
    """A SOCKS5 CONNECT to 127.0.0.1:port whose first bytes name ``host`` (sniffed);
    what comes back until the engine or the echo closes."""
    with socket.create_connection(engine.listen_address("socks-in"), timeout=10) as s:
        s.sendall(b"\x05\x01\x00")
        assert s.recv(2) == b"\x05\x00"
        s.sendall(b"\x05\x01\x00\x01" + socket.inet_aton("127.0.0.1") + port.to_bytes(2, "big"))
        reply = s.recv(10)
        request = f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
        if reply[1] != 0:
            return b""
        got = b""
        try:
            s.sendall(request)
            s.shutdown(socket.SHUT_WR)
            while chunk := s.recv(65536):
                got += chunk
        except OSError:
            return b""  # blocked after sniffing: the engine resets the client
        return got


@pytest.mark.skipif(not _WIRED, reason="needs the engine to load rule sets (issue 29 wiring)")
def test_rule_sets_and_geodata_route_in_c(tmp_path: Path) -> None:
    """Rules over a rule set, a GeoSite list and a GeoIP country (in a logical rule):
    every flow is decided by the C table (none deferred to Python), as routing decides."""
    ads = tmp_path / "ads.txt"
    ads.write_text("+.ads.test\nexact.test\n")
    mmdb, dat = _geo_files(tmp_path)
    with EchoServer() as echo:
        cfg = base_config(
            outbounds=[
                {"tag": "direct", "protocol": "direct"},
                {"tag": "block", "protocol": "block"},
                {"tag": "d1", "protocol": "direct"},
                {"tag": "d2", "protocol": "direct"},
            ],
            providers={
                "rules": {"ads": {"path": str(ads), "behavior": "domain", "format": "text"}}
            },
            rules=[
                {"rule_set": ["ads"], "action": "block"},
                {"geosite": ["site"], "outbound": "d1"},
                {
                    "type": "logical",
                    "mode": "and",
                    "rules": [{"geoip": ["xx"], "no_resolve": True}, {"port": echo.port}],
                    "outbound": "d2",
                },
            ],
        )
        cfg["runtime"]["geodata"] = {"geoip_path": mmdb, "geosite_path": dat}
        cfg["inbounds"] = [ib | {"sniff_timeout_ms": 10_000} for ib in cfg["inbounds"]]
        with Engine(cfg) as engine:
            hosts = ["www.ads.test", "a.site.test", "other.test", "EXACT.test"]
            for host in hosts:
                got = _through(engine, echo.port, host)
                assert (got == b"") == host.lower().endswith(("ads.test", "exact.test")), host
            done = completed(engine, len(hosts))
            records = [e["payload"]["record"] for e in done]
            by_host = {r["target"].get("sniffed_host"): r for r in records}
            stats = engine._core.bridge.conn.stats()
            wait_until(
                lambda: engine._core.bridge.conn.stats()["started"] == len(hosts),
                timeout=5,
                what=f"C started every flow, have {stats}",
            )
            assert engine._core.bridge.conn.stats()["deferred"] == 0
    rules = {h: (r["route"]["matched_rule"] or {}).get("index") for h, r in by_host.items()}
    assert rules == {"www.ads.test": 0, "exact.test": 0, "a.site.test": 1, "other.test": 2}
    assert by_host["a.site.test"]["route"]["target"] == "d1"
    assert by_host["other.test"]["route"]["target"] == "d2"
