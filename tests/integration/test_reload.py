"""config.apply / config.apply_runtime on a running engine: live, whole, or not at all.

Real listeners, real clients (curl and the C load generator through the C fast
path), a real file on disk, and a real ``kill -9`` in the middle of applies.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway import Engine
from spliceway.errors import ApiError
from tests.conftest import base_config, wait_until
from tests.helpers.flows import STATUS_ONLY, proxy_curl, socks_curl
from tests.helpers.program import SPLICEWAY, environ_without
from tests.helpers.sinks import jsonl

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def ctools(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The C load generator and its origin server, built for this module."""
    out = tmp_path_factory.mktemp("ctools")
    tools = {}
    for name in ("loadgen", "tinyserver"):
        exe = out / name
        subprocess.run(
            ["cc", "-O2", "-pthread", "-o", str(exe), str(BENCH / f"{name}.c")], check=True
        )
        tools[name] = exe
    return tools


@pytest.fixture
def tinyserver(ctools: dict[str, Path]) -> Iterator[int]:
    """A tinyserver rate listener (read 100 bytes, answer 1024, close); its port."""
    proc = subprocess.Popen(
        [str(ctools["tinyserver"]), "--rate", "0", "--max-seconds", "120"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())["rate"]
    finally:
        proc.terminate()
        proc.wait(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def refused(address: tuple[str, int]) -> bool:
    """Whether nothing listens at ``address`` (a free port can connect to itself: TCP
    simultaneous open, when the kernel picks the target port as the source port)."""
    try:
        with socket.create_connection(address, timeout=2) as s:
            return s.getsockname() == s.getpeername()
    except ConnectionRefusedError:
        return True


def reload_config(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    doc = base_config(**overrides)
    doc["outbound_groups"] = [
        {"tag": "keep", "kind": "selector", "outbounds": ["direct", "block"]},
        {"tag": "reset", "kind": "selector", "outbounds": ["direct", "block"]},
    ]
    doc["route"] = {"final": "keep"}
    doc["api"]["outbox_path"] = str(tmp_path / "outbox")
    return doc


def apply(engine: Engine, doc: dict[str, Any], method: str = "config.apply") -> dict[str, Any]:
    result = engine.execute(method, {"config": doc})
    assert result["applied"] is True and result["reconciled"] is True
    return result


def test_applies_under_live_traffic_fail_no_flow_and_hold_at_once(
    tmp_path: Path, ctools: dict[str, Path], tinyserver: int, origin: tuple[str, int]
) -> None:
    doc = reload_config(tmp_path)
    doc["inbounds"].append({"tag": "old-in", "protocol": "socks5", "listen": {"port": 0}})
    doc["inbounds"].append({"tag": "moving", "protocol": "http", "listen": {"port": 0}})
    doc["api"]["event_sinks"] = [jsonl("s1", tmp_path / "s1.jsonl")]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    engine = Engine.from_file(path).start()
    try:
        engine.execute("policies.select", {"policy_tag": "keep", "target_tag": "direct"})
        socks = "{}:{}".format(*engine.listen_address("socks-in"))
        load = subprocess.Popen(
            [
                str(ctools["loadgen"]),
                *("rate", "--target", f"127.0.0.1:{tinyserver}", "--socks", socks),
                *("--rate", "300", "--conc", "64", "--duration", "6", "--timeout-ms", "5000"),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        curled: list[str] = []
        stop = threading.Event()

        def curl_loop() -> None:
            url = f"http://127.0.0.1:{origin[1]}/"
            while not stop.is_set():
                curled.append(proxy_curl(engine, url, *STATUS_ONLY).stdout)

        curler = threading.Thread(target=curl_loop)
        curler.start()
        try:
            wait_until(lambda: len(curled) >= 3, what="curl traffic")

            # Add a listener: it serves at once.
            doc["inbounds"].append({"tag": "new-in", "protocol": "socks5", "listen": {"port": 0}})
            result = apply(engine, doc)
            assert result["persistence"] == "source_file"
            assert result["changed_components"] == ["proxy_listeners"]
            assert "event_dispatcher" in result["application_components"]
            fetched = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/", inbound="new-in")
            assert fetched.stdout == "hello from origin\n", fetched.stderr

            # Remove one: its port refuses at once.
            gone = engine.listen_address("old-in")
            doc["inbounds"] = [i for i in doc["inbounds"] if i["tag"] != "old-in"]
            apply(engine, doc)
            assert refused(gone)
            with pytest.raises(ApiError, match="no inbound 'old-in'"):
                engine.listen_address("old-in")

            # Move a port: the new one serves, the old one refuses.
            before = engine.listen_address("moving")
            port = free_port()
            next(i for i in doc["inbounds"] if i["tag"] == "moving")["listen"]["port"] = port
            apply(engine, doc)
            assert engine.listen_address("moving") == ("127.0.0.1", port)
            assert refused(before)
            status = proxy_curl(
                engine, f"http://127.0.0.1:{origin[1]}/", *STATUS_ONLY, inbound="moving"
            )
            assert status.stdout == "200"

            # Change the inbound under load (same address): its socket carries over.
            loaded = next(i for i in doc["inbounds"] if i["tag"] == "socks-in")
            loaded["sniff_timeout_ms"] = 250
            result = apply(engine, doc)
            assert result["changed_components"] == ["proxy_listeners"]
            assert "{}:{}".format(*engine.listen_address("socks-in")) == socks

            # Change rules: the origin's port is blocked for new flows at once.
            stop.set()
            curler.join()
            doc["rules"] = [
                {"ip_cidr": ["127.0.0.1/32"], "port": [str(origin[1])], "action": "block"}
            ]
            result = apply(engine, doc)
            assert result["changed_components"] == ["routing"]
            status = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/", inbound="new-in")
            assert status.returncode == 97, status.stderr
            doc["rules"] = []

            # Change groups: "keep" is unchanged and keeps its selection, "reset" changed.
            engine.execute("policies.select", {"policy_tag": "reset", "target_tag": "block"})
            doc["outbound_groups"][1]["outbounds"] = ["block", "direct"]
            doc["outbound_groups"].append(
                {"tag": "added", "kind": "selector", "outbounds": ["direct"]}
            )
            result = apply(engine, doc)
            assert result["changed_components"] == ["policy_groups", "routing"]
            policies = {p["tag"]: p for p in engine.query("policies")["policies"]}
            assert policies["keep"]["selected"] == "direct"
            assert policies["reset"]["selected"] == "block"  # its new default: first member
            assert policies["reset"]["outbounds"] == ["block", "direct"]
            assert policies["added"]["selected"] == "direct"

            # Add a sink and remove one: the new one takes events from now on.
            doc["api"]["event_sinks"] = [jsonl("s2", tmp_path / "s2.jsonl")]
            result = apply(engine, doc)
            assert result["changed_components"] == ["event_dispatcher"]
            assert [s["name"] for s in engine.query("sinks")["sinks"]] == ["s2"]
        finally:
            stop.set()
            curler.join()
            out, _ = load.communicate(timeout=60)
        report = json.loads(out)
        assert report["count"] >= 900, report
        assert report["unfinished"] == 0, report
        assert sum(report["errors"].values()) == 0, report
        assert set(curled) == {"200"}, curled
        wait_until(lambda: engine.query("stats")["active_sessions"] == 0, what="flows done")
        stats = engine.query("stats")
        assert stats["failed_sessions"] == 0, stats
        # The blocked curl is the only blocked flow.
        assert stats["blocked_sessions"] == 1, stats

        # s2 takes events from its apply on (the apply's own config.changed among them);
        # s1 got all before, and its outbox stays on disk.
        def s2_types() -> list[str]:
            s2 = tmp_path / "s2.jsonl"
            lines = s2.read_text().splitlines() if s2.exists() else []
            return [json.loads(line)["event_type"] for line in lines]

        wait_until(lambda: "config.changed" in s2_types(), what="s2's config.changed")
        assert s2_types().count("config.changed") == 1
        assert "engine.started" not in s2_types()
        s1 = [
            json.loads(line)["event_type"]
            for line in (tmp_path / "s1.jsonl").read_text().splitlines()
        ]
        assert s1.count("config.changed") == 6
        assert (tmp_path / "outbox" / "sinks" / "t-s1").is_dir()
        assert json.loads(path.read_text()) == doc
    finally:
        engine.stop()


def test_a_taken_port_rolls_back_and_old_listeners_still_serve(
    tmp_path: Path, origin: tuple[str, int]
) -> None:
    doc = reload_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    with Engine.from_file(path) as engine, socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        bad = copy.deepcopy(doc)
        bad["inbounds"][1]["listen"]["port"] = taken.getsockname()[1]
        bad["inbounds"].append({"tag": "extra", "protocol": "socks5", "listen": {"port": 0}})
        with pytest.raises(ApiError) as info:
            engine.execute("config.apply", {"config": bad})
        assert info.value.code == "internal"
        assert "Address already in use" in info.value.message
        assert "nothing was applied: the previous configuration is running" in info.value.message
        assert path.read_bytes() == before
        assert [i.tag for i in engine.core.inbounds] == ["socks-in", "http-in", "mixed-in"]
        for inbound in ("socks-in", "mixed-in"):
            fetched = socks_curl(engine, f"http://127.0.0.1:{origin[1]}/", inbound=inbound)
            assert fetched.stdout == "hello from origin\n", fetched.stderr
        status = proxy_curl(engine, f"http://127.0.0.1:{origin[1]}/", *STATUS_ONLY)
        assert status.stdout == "200"
        assert engine.query("events", {"types": "config.changed"})["events"] == []


def test_a_sink_that_cannot_open_restores_the_file_and_the_running_sinks(
    tmp_path: Path, origin: tuple[str, int]
) -> None:
    doc = reload_config(tmp_path)
    doc["api"]["event_sinks"] = [jsonl("kept", tmp_path / "kept.jsonl")]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    with Engine.from_file(path) as engine:
        bad = copy.deepcopy(doc)
        # A new listener too: it must not survive the rollback.
        bad["inbounds"].append({"tag": "extra", "protocol": "socks5", "listen": {"port": 0}})
        (tmp_path / "a-file").write_text("")  # a file where the sink needs a directory
        bad["api"]["event_sinks"] = [jsonl("broken", tmp_path / "a-file" / "x.jsonl")]
        with pytest.raises(ApiError) as info:
            engine.execute("config.apply", {"config": bad})
        assert info.value.code == "internal"
        assert "sink 'broken' cannot start" in info.value.message
        assert f"rolled back: the previous configuration is running and {path} is restored" in (
            info.value.message
        )
        assert path.read_bytes() == before
        assert [i.tag for i in engine.core.inbounds] == ["socks-in", "http-in", "mixed-in"]
        assert [s["name"] for s in engine.query("sinks")["sinks"]] == ["kept"]
        # The restored sink still delivers.
        socks_curl(engine, f"http://127.0.0.1:{origin[1]}/")
        wait_until(
            lambda: "flow.completed" in (tmp_path / "kept.jsonl").read_text(),
            what="the kept sink's delivery",
        )


def test_apply_runtime_leaves_the_file_and_emits_config_changed(tmp_path: Path) -> None:
    doc = reload_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    with Engine.from_file(path) as engine:
        sub = engine.subscribe(["config.changed"], timeout=10)
        changed = copy.deepcopy(doc)
        changed["runtime"]["tcp_idle_timeout_seconds"] = 30
        result = apply(engine, changed, "config.apply_runtime")
        assert result["persistence"] == "runtime_only"
        assert result["changed_components"] == ["proxy_listeners", "runtime"]
        assert path.read_bytes() == before
        event = sub.get(timeout=10)
        assert event is not None
        assert event["payload"]["trigger"] == "config.apply_runtime"
        assert event["payload"]["persistence"] == "runtime_only"
        assert engine.core.config.runtime.tcp_idle_timeout_seconds == 30
        assert engine.core.tcp_idle_timeout_ms == 30_000
        # The same document again changes nothing, and still reports reconciled.
        assert apply(engine, changed, "config.apply_runtime")["changed_components"] == []


def test_invalid_and_fixed_sections_are_refused_with_nothing_applied(tmp_path: Path) -> None:
    doc = reload_config(tmp_path)
    doc["api"]["event_sinks"] = [jsonl("j", tmp_path / "j.jsonl")]  # the outbox is open
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    with Engine.from_file(path) as engine:
        bad = copy.deepcopy(doc)
        bad["rules"] = [{"domain": ["x.test"], "outbound": "nowhere"}]
        with pytest.raises(ApiError) as info:
            engine.execute("config.apply", {"config": bad})
        assert info.value.code == "invalid_argument"
        assert info.value.details[0].field_path == "rules[0].outbound"
        bad = copy.deepcopy(doc)
        bad["api"]["control"] = {"enabled": True, "listen": {"port": 0}, "api_key_env": None}
        with pytest.raises(ApiError) as info:
            engine.execute("config.apply", {"config": bad})
        assert info.value.code == "conflict"
        assert info.value.field_path == "config.api.control"
        bad = copy.deepcopy(doc)
        bad["api"]["outbox_path"] = str(tmp_path / "elsewhere")
        with pytest.raises(ApiError) as info:
            engine.execute("config.apply_runtime", {"config": bad})
        assert info.value.code == "conflict"
        assert path.read_bytes() == before
        assert engine.query("events", {"types": "config.changed"})["events"] == []


def test_mode_set_at_runtime_outlives_an_apply_that_keeps_the_mode_section(
    tmp_path: Path,
) -> None:
    doc = reload_config(tmp_path)
    with Engine(doc) as engine:
        engine.execute("mode.set", {"mode": "global", "outbound": "block"})
        doc["rules"] = [{"domain": ["x.test"], "action": "block"}]
        result = apply(engine, doc)
        assert result["persistence"] == "runtime_only"  # no source file
        assert engine.query("config")["mode"] == {"kind": "global", "outbound": "block"}
        doc["mode"] = {"kind": "direct"}
        apply(engine, doc)
        assert engine.query("config")["mode"] == {"kind": "direct", "outbound": None}


def test_concurrent_applies_are_serialised(tmp_path: Path) -> None:
    doc = reload_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with Engine.from_file(path) as engine:
        docs = []
        for n in range(4):
            d = copy.deepcopy(doc)
            d["inbounds"].append({"tag": f"extra-{n}", "protocol": "socks5", "listen": {"port": 0}})
            docs.append(d)
        errors: list[BaseException] = []

        def run(d: dict[str, Any]) -> None:
            try:
                apply(engine, d)
            except BaseException as ex:
                errors.append(ex)

        threads = [threading.Thread(target=run, args=(d,)) for d in docs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        final = json.loads(path.read_text())
        assert final in docs
        assert [i.tag for i in engine.core.inbounds] == [i["tag"] for i in final["inbounds"]]
        assert len(engine.query("events", {"types": "config.changed"})["events"]) == 4


def test_kill_9_during_applies_leaves_the_old_or_the_new_file(tmp_path: Path) -> None:
    """A big document written again and again, the engine killed at varied moments: the
    file always parses as one of the two documents."""
    from spliceway.ipc_client import IpcClient

    small = reload_config(tmp_path)
    small["api"]["ipc"] = {"enabled": True, "path": f"/tmp/sw-k9-{os.getpid()}.sock"}
    big = copy.deepcopy(small)
    big["rules"] = [
        {"domain_suffix": [f"host{n}.example"], "outbound": "direct"} for n in range(3000)
    ]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(small))
    env = environ_without("SPLICEWAY_API_KEY")
    for kill_after in (0.05, 0.15, 0.3, 0.6):
        proc = subprocess.Popen(
            [*SPLICEWAY, "run", "-c", str(path)],
            stderr=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            env=env,
        )
        try:
            client = wait_until(
                lambda: _connect(IpcClient, small["api"]["ipc"]["path"]), what="the IPC socket"
            )
            applier = threading.Thread(target=_apply_forever, args=(client, small, big))
            applier.start()
            time.sleep(kill_after)  # the moment of the kill is the point of the test
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            applier.join(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        # A temporary file a kill interrupted may be left beside it; the file is whole.
        assert json.loads(path.read_text()) in (small, big)
    os.unlink(small["api"]["ipc"]["path"])


def _connect(client_class: Any, path: str) -> Any:
    try:
        return client_class(path)
    except ApiError:
        return None


def _apply_forever(client: Any, a: dict[str, Any], b: dict[str, Any]) -> None:
    for n in range(1000):
        try:
            client.command("config.apply", {"config": (a, b)[n % 2]})
        except (OSError, ValueError, ApiError):
            return
