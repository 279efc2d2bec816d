"""``spliceway connector state|dead-letters``: the outbox read offline, or asked of the engine
holding it over IPC, as a user runs it."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import base_config
from tests.helpers.program import SPLICEWAY
from tests.helpers.sinks import jsonl as jsonl_sink
from tests.helpers.upstreams import refused_port


def _sink_config(tmp_path, **dispatcher) -> tuple[dict, str]:
    cfg = base_config()
    cfg["api"].update(
        {
            "event_sinks": [
                # Nothing listens there: every event stays pending.
                {
                    "type": "webhook",
                    "tag": "central",
                    "url": f"http://127.0.0.1:{refused_port()}/h",
                },
                {"type": "jsonl", "tag": "audit", "path": str(tmp_path / "audit.jsonl")},
            ],
            "outbox_path": str(tmp_path / "outbox"),
            "outbox_min_free_bytes": 0,
            "outbox_min_free_percent": 0,
            "dispatcher": {"backoff_initial_ms": 50, "backoff_max_ms": 100, **dispatcher},
        }
    )
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    return cfg, str(path)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SPLICEWAY, *args], capture_output=True, text=True, timeout=30, check=False
    )


def test_state_counts_the_backlog_an_engine_left(tmp_path, make_engine):
    cfg, path = _sink_config(tmp_path)
    engine = make_engine(cfg)
    engine.stop()
    done = _cli("connector", "state", "--json", path)
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    assert state["outbox_path"] == str(tmp_path / "outbox")
    sinks = {s["name"]: s for s in state["sinks"]}
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    # engine.started, engine.stopped and any stats.sampled in between: all still pending
    # for the webhook; the JSONL sink wrote them all and has nothing pending.
    assert sinks["central"]["pending"] == len(lines) >= 2
    assert sinks["audit"]["pending"] == 0
    assert sinks["central"]["dead_letters"] == 0
    assert sinks["central"]["outbox_storage"]["write_blocked"] is False
    assert sinks["central"]["outbox_recovery"]["state"] == "clean"
    table = _cli("connector", "state", path)
    assert table.returncode == 0
    assert "central" in table.stdout and "webhook" in table.stdout


def test_state_refuses_while_an_engine_holds_the_outbox(tmp_path, make_engine):
    cfg, path = _sink_config(tmp_path)
    make_engine(cfg)
    done = _cli("connector", "state", "--json", path)
    assert done.returncode == 1
    assert "conflict" in done.stderr and "in use by a running spliceway" in done.stderr


def test_state_without_an_outbox_is_an_error(tmp_path):
    cfg = base_config()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    done = _cli("connector", "state", "--json", str(path))
    assert done.returncode == 1
    assert "not_found" in done.stderr and "api.outbox_path" in done.stderr


@pytest.mark.parametrize("policy", ["dead_letter", "retry_forever"])
def test_dead_letters_are_listed_with_their_reason(tmp_path, make_engine, policy):
    from tests.helpers.receiver import Receiver, Reply

    with Receiver() as rx:
        rx.default = Reply(status=400)
        cfg, path = _sink_config(tmp_path, on_exhausted=policy, retry_threshold=2)
        cfg["api"]["event_sinks"][0]["url"] = rx.url
        cfg["api"]["event_sinks"][0]["events"] = ["engine.started"]
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        engine = make_engine(cfg)
        rx.wait_for(1)
        engine.stop()
        # A 400 is never retried, under either policy.
        assert len(rx.requests) == 1
    done = _cli("connector", "dead-letters", "--json", path)
    assert done.returncode == 0, done.stderr
    letters = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(letters) == 1
    (letter,) = letters
    assert letter["sink"] == "central"
    assert letter["event_type"] == "engine.started"
    assert letter["status"] == 400
    assert letter["attempts"] == 1
    assert letter["envelope"]["event_id"] == letter["event_id"]
    assert json.loads(rx.requests[0].body) == letter["envelope"]


def test_state_reports_a_sink_a_reload_removed(tmp_path):
    from spliceway import Engine

    cfg, path = _sink_config(tmp_path)
    with Engine.from_file(path) as engine:
        cfg["api"]["event_sinks"] = cfg["api"]["event_sinks"][1:]  # "central" removed
        engine.execute("config.apply", {"config": cfg})
    done = _cli("connector", "state", "--json", path)
    assert done.returncode == 0, done.stderr
    sinks = {s["name"]: s for s in json.loads(done.stdout)["sinks"]}
    assert sinks["audit"]["configured"] is True
    # Its undelivered events (engine.started at least) stay on disk and are counted.
    assert sinks["central"]["configured"] is False
    assert sinks["central"]["type"] is None
    assert sinks["central"]["pending"] >= 1
    table = _cli("connector", "state", path)
    assert table.returncode == 0, table.stderr
    assert any(line.split()[:2] == ["central", "removed"] for line in table.stdout.splitlines())


def test_state_of_a_running_engine_comes_over_ipc_removed_sinks_included(tmp_path, sock_path):
    """While an engine holds the outbox, ``connector state FILE`` asks it over the IPC
    socket FILE configures: live counts, and a sink a reload removed with its backlog."""
    from spliceway import Engine

    cfg, path = _sink_config(tmp_path)
    cfg["api"]["ipc"] = {"enabled": True, "path": str(sock_path)}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with Engine.from_file(path) as engine:
        cfg["api"]["event_sinks"] = cfg["api"]["event_sinks"][1:]  # "central" removed
        engine.execute("config.apply", {"config": cfg})
        done = _cli("connector", "state", "--json", path)
        assert done.returncode == 0, done.stderr
        state = json.loads(done.stdout)
        assert (state["source"], state["outbox_path"]) == ("engine", str(tmp_path / "outbox"))
        sinks = {s["name"]: s for s in state["sinks"]}
        assert list(sinks) == ["audit", "central"]
        live = engine.query("sinks")["sinks"][0]
        assert sinks["audit"]["configured"] is True and sinks["audit"]["type"] == "jsonl"
        assert 1 <= sinks["audit"]["total_delivered"] <= live["total_delivered"]  # live counts
        assert sinks["audit"]["outbox_storage"]["write_blocked"] is False
        # Its undelivered events (engine.started at least) stay on disk and are counted.
        assert (sinks["central"]["configured"], sinks["central"]["type"]) == (False, None)
        assert sinks["central"]["pending"] >= 1
        assert sinks["central"]["outbox_recovery"]["state"] == "clean"
        table = _cli("connector", "state", path)
        assert table.returncode == 0, table.stderr
        lines = table.stdout.splitlines()
        assert lines[0] == f"outbox {tmp_path / 'outbox'} (from the running engine)"
        rows = {line.split()[0]: line.split() for line in lines[2:]}
        assert rows["central"][1:3] == ["removed", str(sinks["central"]["pending"])]
        assert rows["audit"][1] == "jsonl"
        # Another engine's socket (--ipc wins over the file's): refused, not misreported.
        other_cfg = base_config()
        other_cfg["api"]["ipc"] = {"enabled": True, "path": str(sock_path.parent / "o.sock")}
        other_cfg["api"]["event_sinks"] = [jsonl_sink("o", tmp_path / "o.jsonl")]
        other_cfg["api"]["outbox_path"] = str(tmp_path / "other-outbox")
        with Engine(other_cfg):
            wrong = _cli("--ipc", str(sock_path.parent / "o.sock"), "connector", "state", path)
        assert wrong.returncode == 1
        assert wrong.stderr.startswith("spliceway: conflict: ")
        assert f"uses the outbox at {tmp_path / 'other-outbox'}" in wrong.stderr
