"""The engine's TUN inbound, end to end, in network namespaces the tests create.

Each test builds a "host" namespace linked to an "internet" one (tests/helpers/netns.py)
and runs a real engine (``python -m spliceway run``) in the host namespace, with a TUN
from ``runtime.tun`` or ``tun.start``. Clients in the host namespace (curl, wget, dig,
a Python socket) have no proxy settings: the TUN's routes capture their traffic, and
each connection must come out as a flow with its real destination, routed by the rules
and relayed by the engine to the servers in the internet namespace. The test talks to
the engine over its IPC socket (a path on disk, reachable from any namespace).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway.cli.ipc_client import IpcClient
from spliceway.errors import ApiError
from tests.helpers.netns import (
    OTHER_IP,
    SERVER_IP,
    SERVER_IP6,
    SERVER_IP_B,
    Topology,
    topology,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

TUN = {"addr": "172.19.0.1/30", "tag": "tun-in", "dns_hijack": False}
TUN4 = "172.19.0.1"


class Engine:
    """A spliceway engine process in the host namespace, driven over IPC."""

    def __init__(self, topo: Topology, home: Path, config: dict[str, Any]) -> None:
        self.topo = topo
        self.home = home
        self.ipc = str(home / "ipc.sock")
        doc = {
            "inbounds": [],
            "route": {"final": "direct"},
            "api": {"control": {"enabled": False}, "ipc": {"path": self.ipc}},
            **config,
        }
        path = home / "config.json"
        path.write_text(json.dumps(doc))
        self.log = open(home / "engine.log", "ab")  # noqa: SIM115 - closed in stop()
        env = {**os.environ, "XDG_RUNTIME_DIR": str(home / "run")}
        self.proc = topo.host.popen(
            sys.executable, "-m", "spliceway", "run", "--config", str(path),
            stdout=self.log, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        assert wait_until(self._answers, timeout=30), self.output()

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the engine exited: {self.output()}")
        try:
            self.query("health")
        except ApiError:
            return False
        return True

    def output(self) -> str:
        return (self.home / "engine.log").read_text(errors="replace")[-4000:]

    def query(self, name: str, params: dict[str, Any] | None = None) -> Any:
        with IpcClient(self.ipc, timeout=20) as c:
            return c.query(name, params)

    def command(self, method: str, params: dict[str, Any] | None = None) -> Any:
        with IpcClient(self.ipc, timeout=30) as c:
            return c.command(method, params)

    def completed(self, n: int = 1, timeout: float = 10) -> list[dict[str, Any]]:
        """The first ``n`` flow.completed records (waits for them)."""
        got: list[dict[str, Any]] = []

        def enough() -> bool:
            nonlocal got
            events = self.query("events", {"types": "flow.completed"})["events"]
            got = [e["payload"]["record"] for e in events]
            return len(got) >= n

        assert wait_until(enough, timeout=timeout), got
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=30)
        self.log.close()

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()


@pytest.fixture
def topo() -> Iterator[Topology]:
    with topology() as t:
        yield t


def _client(topo: Topology, host: str, port: int, size: int) -> dict[str, Any]:
    """A plain socket client in the host namespace: sends ``size`` random bytes to an
    echo server and reads them back; its local address and whether they matched."""
    script = textwrap.dedent(
        f"""
        import hashlib, json, os, socket, threading
        data = os.urandom({size})
        c = socket.create_connection(({host!r}, {port}), timeout=30)
        t = threading.Thread(target=lambda: (c.sendall(data), c.shutdown(socket.SHUT_WR)))
        t.start()
        got = bytearray()
        while chunk := c.recv(1 << 20):
            got += chunk
        t.join()
        print(json.dumps({{"local": c.getsockname()[:2], "same": got == data, "n": len(got)}}))
        """
    )
    out = topo.host.run(sys.executable, "-c", script, timeout=60)
    return json.loads(out.stdout)


# ---------------------------------------------------------------------------
# TCP through the TUN
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("version", [4, 6])
def test_a_large_transfer_is_one_flow_with_its_real_destination(
    topo: Topology, tmp_path: Path, version: int
) -> None:
    port = topo.serve("echo")
    engine = Engine(topo, tmp_path, {"runtime": {"tun": TUN}})
    try:
        target = SERVER_IP if version == 4 else SERVER_IP6
        size = 8 << 20
        result = _client(topo, target, port, size)
        assert result["same"] and result["n"] == size
        (record,) = engine.completed()
        assert record["inbound"] == {"tag": "tun-in", "protocol": "tun", "client_protocol": "tun"}
        assert record["network"] == "tcp"
        assert (record["target"]["host"], record["target"]["port"]) == (target, port)
        assert [record["source"]["ip"], record["source"]["port"]] == result["local"]
        assert record["route"]["target"] == "direct"
        assert record["result"]["outcome"] == "direct_relayed"
        traffic = record["traffic"]
        assert traffic["bytes_up"] == traffic["bytes_down"] == size
        assert traffic["inbound_rx_bytes"] == traffic["outbound_tx_bytes"] == size
    finally:
        engine.stop()


def test_curl_without_proxy_settings_gets_the_page(topo: Topology, tmp_path: Path) -> None:
    port = topo.serve("http")
    engine = Engine(topo, tmp_path, {"runtime": {"tun": TUN}})
    try:
        url = f"http://{SERVER_IP}:{port}/hello"
        res = topo.host.run("curl", "-sS", "--max-time", "10", "-o", "/dev/null",
                            "-w", "%{http_code} %{size_download} %{local_ip}", url)  # fmt: skip
        code, size, local = res.stdout.split()
        assert code == "200" and int(size) > 0
        (record,) = engine.completed()
        assert record["target"]["host"] == SERVER_IP and record["target"]["port"] == port
        assert record["source"]["ip"] == local == TUN4
        assert record["target"]["sniffed_host"] == f"{SERVER_IP}"
        assert record["traffic"]["bytes_down"] >= int(size)
        status = engine.query("tun_status")
        assert status["running"] is True and status["managed_by_config"] is True
        assert status["tag"] == "tun-in" and status["addr"] == TUN["addr"]
    finally:
        engine.stop()


def test_rules_route_tun_flows_by_ip_and_by_process(topo: Topology, tmp_path: Path) -> None:
    port = topo.serve("http")
    rules = [
        {"ip_cidr": [f"{SERVER_IP_B}/32"], "action": "block"},
        {"process_name": ["wget"], "action": "block"},
    ]
    engine = Engine(topo, tmp_path, {"runtime": {"tun": TUN}, "rules": rules})
    try:
        curl = ["curl", "-sS", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}"]
        ok = topo.host.run(*curl, f"http://{SERVER_IP}:{port}/", check=False)
        assert ok.stdout == "200", ok.stderr
        blocked = topo.host.run(*curl, f"http://{SERVER_IP_B}:{port}/", check=False)
        assert blocked.returncode != 0 and blocked.stdout == "000"
        wget = topo.host.run("wget", "-q", "-T", "10", "-t", "1", "-O", "/dev/null",
                             f"http://{SERVER_IP}:{port}/", check=False)  # fmt: skip
        assert wget.returncode != 0
        records = engine.completed(3)
        by_target = {(r["target"]["host"], r["source"].get("process_name")): r for r in records}
        good = by_target[(SERVER_IP, "curl")]
        assert good["result"]["outcome"] == "direct_relayed"
        assert good["source"]["process_path"].endswith("/curl")
        # C blocks it by rule 0 before a process condition is reached: no lookup.
        (ip_blocked,) = [r for r in records if r["target"]["host"] == SERVER_IP_B]
        assert ip_blocked["result"]["outcome"] == "blocked"
        assert ip_blocked["route"]["matched_rule"]["index"] == 0
        wget_blocked = by_target[(SERVER_IP, "wget")]
        assert wget_blocked["result"]["outcome"] == "blocked"
        assert wget_blocked["route"]["matched_rule"]["index"] == 1
    finally:
        engine.stop()


# ---------------------------------------------------------------------------
# control: tun.start / tun.stop / config, and cleanup
# ---------------------------------------------------------------------------


def test_tun_start_and_stop_leave_the_namespace_as_it_was(topo: Topology, tmp_path: Path) -> None:
    port = topo.serve("echo")
    engine = Engine(topo, tmp_path, {})
    try:
        before = topo.host.snapshot()
        assert engine.query("tun_status")["running"] is False
        assert engine.command("tun.start", {**TUN, "strict_route": True}) == {"accepted": True}
        status = engine.query("tun_status")
        assert status["running"] is True and status["managed_by_config"] is False
        assert status["strict_route"] is True and status["dual_stack"] is True
        with pytest.raises(ApiError) as again:
            engine.command("tun.start", TUN)
        assert again.value.code == "conflict"
        assert _client(topo, SERVER_IP, port, 1000)["same"]
        (record,) = engine.completed()
        assert record["inbound"]["protocol"] == "tun"
        # A connection still open when the TUN goes: its flow ends with it.
        idle = topo.host.popen(
            sys.executable, "-c",
            f"import socket; c = socket.create_connection(({SERVER_IP!r}, {port})); "
            "c.settimeout(60); print('up', flush=True); c.recv(1)",
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        assert idle.stdout is not None and idle.stdout.readline() == "up\n"
        assert wait_until(lambda: len(engine.query("flows")["active_flows"]) == 1)
        assert engine.command("tun.stop", {}) == {"accepted": True}
        ended = engine.completed(2)[1]
        assert ended["inbound"] == {"tag": "tun-in", "protocol": "tun", "client_protocol": "tun"}
        assert engine.query("flows")["active_flows"] == []
        assert topo.host.snapshot() == before
        assert engine.query("tun_status") == {
            "running": False, "name": None, "addr": None, "tag": None,
        }  # fmt: skip
        assert engine.command("tun.stop", {}) == {"accepted": False}
    finally:
        engine.stop()
    assert topo.host.snapshot() == before


def test_a_configured_tun_refuses_the_commands_and_follows_config_apply(
    topo: Topology, tmp_path: Path
) -> None:
    port = topo.serve("echo")
    before = topo.host.snapshot()
    engine = Engine(topo, tmp_path, {"runtime": {"tun": TUN}})
    try:
        for method, params in (("tun.start", TUN), ("tun.stop", {})):
            with pytest.raises(ApiError) as refused:
                engine.command(method, params)
            assert refused.value.code == "conflict", method
        doc = json.loads((tmp_path / "config.json").read_text())
        doc["runtime"] = {}
        result = engine.command("config.apply_runtime", {"config": doc})
        assert "tun" in result["changed_components"]
        assert engine.query("tun_status")["running"] is False
        assert topo.host.snapshot() == before
        doc["runtime"] = {"tun": {**TUN, "tag": "tun-b"}}
        engine.command("config.apply_runtime", {"config": doc})
        assert engine.query("tun_status")["tag"] == "tun-b"
        assert _client(topo, SERVER_IP, port, 1000)["same"]
        (record,) = engine.completed()
        assert record["inbound"] == {"tag": "tun-b", "protocol": "tun", "client_protocol": "tun"}
    finally:
        engine.stop()
    assert topo.host.snapshot() == before


def test_kill_9_then_a_restart_leaves_nothing_behind(topo: Topology, tmp_path: Path) -> None:
    before = topo.host.snapshot()
    engine = Engine(topo, tmp_path, {"runtime": {"tun": {**TUN, "strict_route": True}}})
    engine.kill9()
    # What the dead engine added is still there (routes outlive their process) ...
    assert topo.host.snapshot()["rules4"] != before["rules4"]
    # ... until the next engine starts, TUN or not.
    (tmp_path / "ipc.sock").unlink(missing_ok=True)
    engine = Engine(topo, tmp_path, {})
    try:
        after = topo.host.snapshot()
        assert {k: after[k] for k in ("rules4", "rules6", "routes4", "routes6")} == {
            k: before[k] for k in ("rules4", "rules6", "routes4", "routes6")
        }
    finally:
        engine.stop()
    assert topo.host.snapshot() == before


@pytest.mark.parametrize("strict", [True, False])
def test_strict_route_keeps_the_uncaptured_family_from_leaking(
    topo: Topology, tmp_path: Path, strict: bool
) -> None:
    port = topo.serve("http")
    tun = {**TUN, "dual_stack": False, "strict_route": strict}  # IPv4 only
    engine = Engine(topo, tmp_path, {"runtime": {"tun": tun}})
    try:
        curl = ["curl", "-sS", "--max-time", "5", "-o", "/dev/null", "-w", "%{http_code}"]
        v6 = topo.host.run(*curl, f"http://[{SERVER_IP6}]:{port}/", check=False)
        v4 = topo.host.run(*curl, f"http://{SERVER_IP}:{port}/", check=False)
        assert v4.stdout == "200"
        if strict:
            # Not captured, and not let around the TUN either: unreachable.
            assert v6.returncode != 0 and v6.stdout == "000"
        else:
            assert v6.stdout == "200"  # around the TUN, straight out
        # Only the captured connection is a flow.
        (record,) = engine.completed()
        assert record["target"]["host"] == SERVER_IP
        assert engine.query("tun_status")["strict_route"] is strict
    finally:
        engine.stop()


# ---------------------------------------------------------------------------
# DNS hijack, fake-ip and domain rules
# ---------------------------------------------------------------------------

NAMES = {"www.example.test": SERVER_IP, "blocked.example.test": SERVER_IP_B}


def _dig(topo: Topology, name: str, *extra: str) -> list[str]:
    # Any address will do: dns_hijack answers every query to port 53 itself.
    out = topo.host.run("dig", "+short", "+time=3", "+tries=1", *extra,
                        f"@{OTHER_IP}", name, check=False)  # fmt: skip
    return out.stdout.split()


@pytest.mark.parametrize("transport", ["udp", "tcp"])
def test_dig_is_answered_through_dns_hijack(topo: Topology, tmp_path: Path, transport: str) -> None:
    dns_ip = topo.dns(NAMES)
    runtime = {
        "tun": {**TUN, "dns_hijack": True},
        "dns": {"servers": [f"udp://{dns_ip}:53"], "cache": None},
    }
    engine = Engine(topo, tmp_path, {"runtime": runtime})
    try:
        extra = ("+tcp",) if transport == "tcp" else ()
        assert _dig(topo, "www.example.test", *extra) == [SERVER_IP]
        assert _dig(topo, "blocked.example.test", *extra) == [SERVER_IP_B]
        # Hijacked queries are answered, not relayed: no flows.
        assert engine.query("events", {"types": "flow.started"})["events"] == []
    finally:
        engine.stop()


def test_fake_ip_flows_carry_their_domain_and_obey_domain_rules(
    topo: Topology, tmp_path: Path
) -> None:
    port = topo.serve("http")
    dns_ip = topo.dns(NAMES)
    runtime = {
        "tun": {**TUN, "dns_hijack": True},
        "dns": {"servers": [f"udp://{dns_ip}:53"], "answer": {"type": "fake_ip"}},
    }
    rules = [{"domain": ["blocked.example.test"], "action": "block"}]
    engine = Engine(topo, tmp_path, {"runtime": runtime, "rules": rules})
    try:
        (fake,) = _dig(topo, "www.example.test")
        (fake_b,) = _dig(topo, "blocked.example.test")
        assert fake.startswith("198.1") and fake != fake_b and SERVER_IP not in (fake, fake_b)
        curl = ["curl", "-sS", "--max-time", "10", "-o", "/dev/null", "-w", "%{http_code}"]
        ok = topo.host.run(*curl, "--resolve", f"www.example.test:{port}:{fake}",
                           f"http://www.example.test:{port}/", check=False)  # fmt: skip
        assert ok.stdout == "200", ok.stderr
        no = topo.host.run(*curl, "--resolve", f"blocked.example.test:{port}:{fake_b}",
                           f"http://blocked.example.test:{port}/", check=False)  # fmt: skip
        assert no.returncode != 0
        records = {r["target"]["host"]: r for r in engine.completed(2)}
        good = records["www.example.test"]
        assert good["result"]["outcome"] == "direct_relayed"
        assert good["target"]["port"] == port
        assert good["target"]["resolved_ip"] == SERVER_IP  # dialled by its real address
        assert good["inbound"] == {"tag": "tun-in", "protocol": "tun", "client_protocol": "tun"}
        blocked = records["blocked.example.test"]
        assert blocked["result"]["outcome"] == "blocked"
        assert blocked["route"]["matched_rule"]["index"] == 0
    finally:
        engine.stop()


def test_udp_round_trips_through_the_tun(topo: Topology, tmp_path: Path) -> None:
    port = topo.serve("udp-echo")
    engine = Engine(topo, tmp_path, {"runtime": {"tun": TUN}})
    try:
        script = textwrap.dedent(
            f"""
            import json, os, socket
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(5)
            s.connect(({SERVER_IP!r}, {port}))
            sizes, ok = [1, 100, 1200, 1400], 0
            for n in sizes:
                data = os.urandom(n)
                s.send(data)
                ok += s.recv(65535) == data
            print(json.dumps({{"ok": ok, "local": s.getsockname()}}))
            """
        )
        result = json.loads(topo.host.run(sys.executable, "-c", script).stdout)
        assert result["ok"] == 4
        flows = engine.query("flows")["active_flows"]
        (flow,) = [f for f in flows if f["network"] == "udp"]
        assert flow["inbound"] == {"tag": "tun-in", "protocol": "tun", "client_protocol": "tun"}
        assert (flow["target"]["host"], flow["target"]["port"]) == (SERVER_IP, port)
        assert [flow["source"]["ip"], flow["source"]["port"]] == result["local"]
        engine.command("flows.close", {"flow_id": flow["flow_id"]})
        (record,) = engine.completed()
        traffic = record["traffic"]
        assert traffic["packets_up"] == traffic["packets_down"] == 4
        assert traffic["bytes_up"] == traffic["bytes_down"] == 1 + 100 + 1200 + 1400
    finally:
        engine.stop()
