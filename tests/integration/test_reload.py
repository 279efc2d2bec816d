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
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from spliceway import Engine
from spliceway.api.openapi import command_component, openapi_document
from spliceway.errors import ApiError
from tests.conftest import base_config, wait_until
from tests.helpers.flows import STATUS_ONLY, proxy_curl, socks_curl
from tests.helpers.proc import command_request
from tests.helpers.program import SPLICEWAY, environ_without
from tests.helpers.servers import EchoServer
from tests.helpers.sinks import jsonl
from tests.helpers.socks import recv_exact, socks5_connect
from tests.helpers.upstreams import refused_port

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


def test_a_relaying_flow_keeps_its_path_when_its_inbound_goes_and_its_target_is_blocked(
    tmp_path: Path,
) -> None:
    """An open SOCKS5 tunnel echoing bytes, then an apply that removes the tunnel's inbound
    and blocks its target: the tunnel goes on relaying on the path it was given, while a
    new flow to the same target is blocked at once."""
    doc = reload_config(tmp_path)
    doc["inbounds"].append({"tag": "old-in", "protocol": "socks5", "listen": {"port": 0}})
    with Engine(doc) as engine, EchoServer() as echo:
        tunnel = socks5_connect(engine.listen_address("old-in"), "127.0.0.1", echo.port)
        try:
            tunnel.sendall(b"before")
            assert recv_exact(tunnel, 6) == b"before"
            # The C path's ROUTED record reaches Python after the bytes can already flow:
            # compare against the routed record, not a snapshot still "pending".
            (flow,) = wait_until(
                lambda: [
                    f
                    for f in engine.query("flows")["active_flows"]
                    if f["route"]["action"] != "pending"
                ],
                10,
                "the tunnel's flow routed",
            )
            doc["inbounds"] = [i for i in doc["inbounds"] if i["tag"] != "old-in"]
            doc["rules"] = [
                {"ip_cidr": ["127.0.0.1/32"], "port": [str(echo.port)], "action": "block"}
            ]
            result = apply(engine, doc)
            assert result["changed_components"] == ["proxy_listeners", "routing"]
            with pytest.raises(ConnectionError, match="socks reply"):
                socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", echo.port)
            for n in range(3):
                tunnel.sendall(b"after-%d" % n)
                assert recv_exact(tunnel, 7) == b"after-%d" % n
            now = engine.query("flow", {"flow_id": flow["flow_id"]})
            assert now["state"] == "active" and now["inbound"]["tag"] == "old-in"
            assert (now["route"], now["path"]["outbound"]) == (
                flow["route"],
                flow["path"]["outbound"],
            )
        finally:
            tunnel.close()

        def completed() -> list[dict[str, Any]]:
            events = engine.query("events", {"types": "flow.completed"})["events"]
            return [e for e in events if e["payload"]["record"]["flow_id"] == flow["flow_id"]]

        (done,) = wait_until(completed, what="the tunnel's flow.completed")
        record = done["payload"]["record"]
        assert record["traffic"]["bytes_up"] == record["traffic"]["bytes_down"] == 6 + 3 * 7
        stats = engine.query("stats")
        assert stats["blocked_sessions"] == 1 and stats["failed_sessions"] == 0


def test_config_apply_over_http_persists_and_refuses_an_api_control_change(
    tmp_path: Path,
) -> None:
    """POST /api/v1/commands config.apply: 200 with the result; an api.control change is
    409 conflict, with nothing applied and the file untouched."""
    doc = reload_config(tmp_path)
    doc["api"]["control"] = {
        "enabled": True,
        "listen": {"address": "127.0.0.1", "port": 0},
        "api_key_env": None,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with Engine.from_file(path) as engine:
        doc["inbounds"].append({"tag": "extra", "protocol": "socks5", "listen": {"port": 0}})
        status, body = _post_command(engine, "config.apply", {"config": doc})
        assert status == 200, body
        assert body["ok"] is True
        result = body["result"]
        assert (result["applied"], result["reconciled"]) == (True, True)
        assert result["persistence"] == "source_file"
        assert {"proxy_listeners", "event_dispatcher"} <= set(result["application_components"])
        assert json.loads(path.read_text()) == doc
        assert engine.listen_address("extra")[1] > 0
        before = path.read_bytes()
        moved = copy.deepcopy(doc)
        moved["api"]["control"]["listen"]["port"] = free_port()
        moved["rules"] = [{"domain": ["x.test"], "action": "block"}]
        status, body = _post_command(engine, "config.apply", {"config": moved})
        assert status == 409, body
        assert (body["ok"], body["error"]["code"]) == (False, "conflict")
        assert body["error"]["field_path"] == "config.api.control"
        assert path.read_bytes() == before
        assert not engine.core.config.rules


def _post_command(engine: Engine, method: str, params: dict[str, Any]) -> tuple[int, Any]:
    request = command_request(engine.control_url, method, params)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as ex:
        return ex.code, json.loads(ex.read())


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
        assert f"rolled back: the previous configuration is running and {path} is unchanged" in (
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
    """A big document written again and again, between applies that fail, the engine
    killed at varied moments: the file always parses as one of the two documents that
    applied, never as the one that failed."""
    from spliceway.cli.ipc_client import IpcClient

    small = reload_config(tmp_path)
    small["api"]["ipc"] = {"enabled": True, "path": f"/tmp/sw-k9-{os.getpid()}.sock"}
    big = copy.deepcopy(small)
    big["rules"] = [
        {"domain_suffix": [f"host{n}.example"], "outbound": "direct"} for n in range(3000)
    ]
    failing = copy.deepcopy(small)
    (tmp_path / "a-file").write_text("")  # a file where the sink needs a directory
    failing["api"]["event_sinks"] = [jsonl("broken", tmp_path / "a-file" / "x.jsonl")]
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
            applier = threading.Thread(target=_apply_forever, args=(client, small, big, failing))
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
    os.unlink(small["api"]["ipc"]["path"] + ".lock")  # a killed engine leaves its lock file


def _connect(client_class: Any, path: str) -> Any:
    try:
        return client_class(path)
    except ApiError:
        return None


def _apply_forever(client: Any, *docs: dict[str, Any]) -> None:
    for n in range(1000):
        try:
            client.command("config.apply", {"config": docs[n % len(docs)]})
        except ApiError as ex:
            if "cannot start" not in ex.message:  # the failing document's refusal
                return  # the engine is gone


def test_the_file_never_holds_a_configuration_that_did_not_apply(tmp_path: Path) -> None:
    """The file is replaced only once the new configuration runs. Here the apply fails
    after a sink that cannot deliver was retired (its grace keeps the apply busy for a
    while): the file, watched all along, only ever holds the previous document."""
    doc = reload_config(tmp_path)
    url = f"http://127.0.0.1:{refused_port()}/"
    doc["api"]["event_sinks"] = [{"type": "webhook", "tag": "stuck", "url": url}]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    with Engine.from_file(path) as engine:
        bad = copy.deepcopy(doc)
        (tmp_path / "a-file").write_text("")
        bad["api"]["event_sinks"] = [jsonl("broken", tmp_path / "a-file" / "x.jsonl")]
        seen: set[bytes] = set()
        done = threading.Event()

        def watch() -> None:
            while not done.is_set():
                seen.add(path.read_bytes())
                done.wait(0.002)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            started = time.monotonic()
            with pytest.raises(ApiError) as info:
                engine.execute("config.apply", {"config": bad})
            took = time.monotonic() - started
        finally:
            done.set()
            watcher.join()
        assert took > 0.3  # the window the watcher looked through
        assert seen == {before}
        assert "sink 'broken' cannot start" in info.value.message
        assert f"rolled back: the previous configuration is running and {path} is unchanged" in (
            info.value.message
        )
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []  # staged, removed
        assert [s["name"] for s in engine.query("sinks")["sinks"]] == ["stuck"]
        # A good apply still writes the file, once it runs.
        doc["rules"] = [{"domain": ["x.test"], "action": "block"}]
        assert apply(engine, doc)["persistence"] == "source_file"
        assert json.loads(path.read_text()) == doc


def test_a_file_that_cannot_be_replaced_after_the_install_puts_the_previous_one_back(
    tmp_path: Path,
) -> None:
    """The file is renamed over only after the install; when that rename fails (here the
    path became a directory) the previous configuration is installed again."""
    doc = reload_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with Engine.from_file(path) as engine:
        path.unlink()
        path.mkdir()  # the rename of the staged file over it fails
        new = copy.deepcopy(doc)
        new["inbounds"].append({"tag": "extra", "protocol": "socks5", "listen": {"port": 0}})
        new["rules"] = [{"domain": ["x.test"], "action": "block"}]
        with pytest.raises(ApiError) as info:
            engine.execute("config.apply", {"config": new})
        assert info.value.code == "internal"
        assert info.value.message.startswith(f"cannot write {path}: Is a directory; ")
        assert info.value.message.endswith(
            "rolled back: the previous configuration is running and the file is unchanged"
        )
        assert [i.tag for i in engine.core.inbounds] == ["socks-in", "http-in", "mixed-in"]
        assert not engine.core.config.rules
        assert engine.query("events", {"types": "config.changed"})["events"] == []
        assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []


def test_an_install_not_confirmed_in_time_never_claims_a_rollback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dispatcher busy beyond the install timeout: the apply fails saying the new
    configuration may still be installed (the dispatcher does install it once free), not
    that it was rolled back; the file keeps the previous document."""
    from spliceway.engine import reconcile

    monkeypatch.setattr(reconcile, "INSTALL_TIMEOUT_S", 0.3)
    doc = reload_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    with Engine.from_file(path) as engine:
        busy = threading.Event()
        engine.core.dispatcher.call_soon(busy.wait, 10)  # the dispatcher is stuck
        new = copy.deepcopy(doc)
        new["rules"] = [{"domain": ["x.test"], "action": "block"}]
        try:
            with pytest.raises(ApiError) as info:
                engine.execute("config.apply", {"config": new})
        finally:
            busy.set()
        message = info.value.message
        assert info.value.code == "internal"
        assert "did not confirm installing the new configuration within 0.3 s" in message
        assert "it may still be installed, or not" in message
        assert "rolled back" not in message
        assert f"{path} is unchanged" in message
        assert path.read_bytes() == before
        wait_until(lambda: len(engine.core.config.rules) == 1, what="the late install")


def test_config_apply_keeps_the_previous_file_as_prev(tmp_path: Path) -> None:
    """The user's own file, comments and all, survives an apply as ``<file>.prev``, byte
    for byte and with its mode; the next apply replaces ``.prev`` with what the first one
    wrote (one generation); a refused apply touches neither file."""
    doc = reload_config(tmp_path)
    path = tmp_path / "config.json"
    original = json.dumps(doc, indent=4).encode() + b"\n\n"  # the user's formatting
    path.write_bytes(original)
    path.chmod(0o640)
    prev = tmp_path / "config.json.prev"
    with Engine.from_file(path) as engine:
        first = copy.deepcopy(doc)
        first["rules"] = [{"domain": ["one.test"], "action": "block"}]
        assert apply(engine, first)["persistence"] == "source_file"
        assert prev.read_bytes() == original
        assert (prev.stat().st_mode & 0o777) == 0o640
        assert json.loads(path.read_text()) == first
        written = path.read_bytes()
        second = copy.deepcopy(doc)
        second["rules"] = [{"domain": ["two.test"], "action": "block"}]
        apply(engine, second)
        assert prev.read_bytes() == written
        bad = copy.deepcopy(doc)
        bad["api"]["control"] = {"enabled": True, "listen": {"port": 0}}
        with pytest.raises(ApiError):
            engine.execute("config.apply", {"config": bad})
        assert prev.read_bytes() == written
        assert json.loads(path.read_text()) == second
        assert sorted(n for n in os.listdir(tmp_path) if "config" in n) == [
            "config.json",
            "config.json.prev",
        ]


def test_a_yaml_file_keeps_its_comments_in_prev(tmp_path: Path) -> None:
    import yaml  # the test extra has it: a YAML source file is part of the contract
    doc = reload_config(tmp_path)
    path = tmp_path / "config.yaml"
    original = b"# my proxy, edited by hand\n" + yaml.safe_dump(doc).encode()
    path.write_bytes(original)
    with Engine.from_file(path) as engine:
        doc["rules"] = [{"domain": ["one.test"], "action": "block"}]
        apply(engine, doc)
    assert (tmp_path / "config.yaml.prev").read_bytes() == original
    assert b"# my proxy" not in path.read_bytes()
    assert yaml.safe_load(path.read_bytes()) == doc


def test_reload_help_says_what_is_written_where() -> None:
    result = subprocess.run(
        [*SPLICEWAY, "reload", "--help"], capture_output=True, text=True, timeout=30, check=True
    )
    text = " ".join(result.stdout.split())
    assert "FILE is only read" in text
    assert "comments and formatting are not kept" in text
    assert "<source file>.prev" in text


@pytest.mark.parametrize("method", ["config.apply", "config.apply_runtime"])
def test_apply_results_are_the_documented_shape(tmp_path: Path, method: str) -> None:
    """The result is exactly the OpenAPI component (closed objects), which docs/commands.md
    is generated from: a field the engine sends and the document omits fails here."""
    document = openapi_document()
    schema = {
        **document["components"]["schemas"][command_component(method, "Result")],
        "components": document["components"],
    }
    doc = reload_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    with Engine.from_file(path) as engine:
        doc["rules"] = [{"domain": ["x.test"], "action": "block"}]
        result = apply(engine, doc, method)
    assert result["changed_components"] == ["routing"]
    jsonschema.Draft202012Validator(schema).validate(result)


def test_a_symlinked_source_file_stays_a_link_to_the_applied_file(tmp_path: Path) -> None:
    doc = reload_config(tmp_path)
    real = tmp_path / "real"
    real.mkdir()
    target = real / "config.json"
    original = json.dumps(doc, indent=2).encode()
    target.write_bytes(original)
    link = tmp_path / "config.json"
    link.symlink_to(target)
    with Engine.from_file(link) as engine:
        doc["rules"] = [{"domain": ["x.test"], "action": "block"}]
        apply(engine, doc)
    assert link.is_symlink() and link.resolve() == target
    assert json.loads(target.read_text()) == doc
    assert (real / "config.json.prev").read_bytes() == original
    assert not (tmp_path / "config.json.prev").exists()


def test_a_prev_that_cannot_be_replaced_is_named_and_rolled_back(tmp_path: Path) -> None:
    doc = reload_config(tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    before = path.read_bytes()
    prev = tmp_path / "config.json.prev"
    prev.mkdir()
    (prev / "keep").write_text("")  # a directory rename cannot replace
    with Engine.from_file(path) as engine:
        new = copy.deepcopy(doc)
        new["rules"] = [{"domain": ["x.test"], "action": "block"}]
        with pytest.raises(ApiError) as info:
            engine.execute("config.apply", {"config": new})
        assert info.value.message.startswith(f"cannot write {prev}: ")
        assert "rolled back: the previous configuration is running" in info.value.message
        assert not engine.core.config.rules
    assert path.read_bytes() == before
    assert [n for n in os.listdir(tmp_path) if n.endswith(".tmp")] == []
