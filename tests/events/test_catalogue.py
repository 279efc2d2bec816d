"""The event catalogue matches what a real engine emits, field for field.

An engine runs in-process with a socks5 inbound, a url_test group and a selector;
real flows go through it to local servers (relayed, updated while bytes move, closed
by command, blocked by a rule, failed on a closed port), and every event it emits
is checked against the catalogue: required fields present, no field undocumented,
values of the documented JSON type. engine.warning comes from the real program on
SIGHUP.
"""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from spliceway.api.openapi import openapi_document
from spliceway.config import EVENT_TYPES
from spliceway.events.catalogue import (
    CLOSE_REASONS,
    ENVELOPE_FIELDS,
    EVENT_CATALOGUE,
    FLOW_RECORD_FIELDS,
    OUTCOMES,
    PayloadField,
)
from spliceway.flows import records
from tests.conftest import base_config, wait_until
from tests.helpers.flows import socks_fetch
from tests.helpers.program import environ_without, running, wait_for_line, write_config
from tests.helpers.servers import EchoServer
from tests.helpers.socks import socks5_connect
from tests.helpers.upstreams import refused_port

_PY_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "list": (list,),
    "FlowRecord": (dict,),
}


def _type_ok(value: Any, words: str) -> bool:
    """Whether ``value`` has one of the JSON types ``words`` names ("integer or null")."""
    for alternative in words.split(" or "):
        first = alternative.split()[0]
        if first == "null":
            if value is None:
                return True
            continue
        is_bool_as_number = first in ("integer", "number") and isinstance(value, bool)
        if not is_bool_as_number and isinstance(value, _PY_TYPES.get(first, ())):
            return True
    return False


def problems(obj: dict[str, Any], fields: tuple[PayloadField, ...], prefix: str = "") -> list[str]:
    """What in ``obj`` disagrees with ``fields`` (key paths under ``prefix``)."""
    level = {
        f.name[len(prefix) :]: f
        for f in fields
        if f.name.startswith(prefix) and "." not in f.name[len(prefix) :]
    }
    found = [f"undocumented {prefix}{key}" for key in obj.keys() - level.keys()]
    found += [f"missing {prefix}{k}" for k, f in level.items() if f.required and k not in obj]
    for key, value in obj.items():
        field = level.get(key)
        if field is None:
            continue
        name = prefix + key
        if not _type_ok(value, field.type):
            found.append(f"{name}: {value!r} is not {field.type}")
        elif field.type == "FlowRecord":
            found += [f"{name}: {p}" for p in problems(value, FLOW_RECORD_FIELDS)]
        elif field.type == "list of FlowRecord":
            for item in value:
                found += [f"{name}[]: {p}" for p in problems(item, FLOW_RECORD_FIELDS)]
        elif isinstance(value, dict) and any(f.name.startswith(f"{name}.") for f in fields):
            found += problems(value, fields, f"{name}.")
        elif isinstance(value, list) and any(f.name.startswith(f"{name}[].") for f in fields):
            for item in value:
                found += problems(item, fields, f"{name}[].")
    return found


def check_event(envelope: dict[str, Any]) -> list[str]:
    """Every disagreement of one envelope with the catalogue."""
    out = problems(envelope, ENVELOPE_FIELDS)
    entry = EVENT_CATALOGUE.get(envelope["event_type"])
    if entry is None:
        return [*out, f"event type {envelope['event_type']} is not in the catalogue"]
    if not entry.emitted:
        out.append(f"{entry.name} is documented as not emitted by this build")
    return out + [f"{entry.name}: {p}" for p in problems(envelope["payload"], entry.fields)]


# ---------------------------------------------------------------------------
# The catalogue itself
# ---------------------------------------------------------------------------


def test_event_types_are_the_catalogue():
    assert frozenset(EVENT_CATALOGUE) == EVENT_TYPES
    assert len(EVENT_CATALOGUE) == 16
    document = openapi_document()
    assert set(document["components"]["schemas"]["EventType"]["enum"]) == EVENT_TYPES


def test_catalogue_entries_are_complete():
    for entry in EVENT_CATALOGUE.values():
        names = [f.name for f in entry.fields]
        assert len(names) == len(set(names)), entry.name
        assert bool(entry.fields) == entry.emitted, entry.name
        assert entry.when and entry.frequency, entry.name
        for field in entry.fields:
            assert field.description, (entry.name, field.name)
            parent = field.name.rsplit(".", 1)[0].removesuffix("[]")
            assert "." not in field.name or parent in names, (entry.name, field.name)
    not_built = {name for name, e in EVENT_CATALOGUE.items() if not e.emitted}
    assert not_built == set()


def test_outcomes_and_close_reasons_are_the_records():
    assert set(OUTCOMES) == {
        records.DIRECT_RELAYED,
        records.CHAINED_RELAYED,
        records.BLOCKED,
        records.FAILED,
        records.CANCELLED,
        records.ENGINE_CRASHED,
    }
    assert set(CLOSE_REASONS) == {records.MANUAL, records.IDLE_TIMEOUT, records.UPSTREAM_ERROR}


def _schema_paths(schema: dict[str, Any], documented: set[str], prefix: str = "") -> set[str]:
    """Key paths of an OpenAPI object schema, opened where the catalogue documents more."""
    out = set()
    for key, prop in schema.get("properties", {}).items():
        name = prefix + key
        out.add(name)
        if "properties" in prop and any(d.startswith(f"{name}.") for d in documented):
            out |= _schema_paths(prop, documented, f"{name}.")
    return out


def test_flow_record_fields_match_the_openapi_document():
    record = openapi_document()["components"]["schemas"]["FlowRecord"]
    documented = {f.name for f in FLOW_RECORD_FIELDS}
    assert _schema_paths(record, documented) == documented


# ---------------------------------------------------------------------------
# A real engine
# ---------------------------------------------------------------------------


def _exchange(sock: socket.socket, rounds: int, pause: float) -> None:
    for _ in range(rounds):
        sock.sendall(b"x" * 4096)
        got = 0
        while got < 4096:
            got += len(sock.recv(65536))
        time.sleep(pause)


def test_every_emitted_payload_matches_the_catalogue(make_engine, origin):
    closed = refused_port()
    config = base_config(
        outbounds=[
            {"tag": "direct", "protocol": "direct"},
            {"tag": "block", "protocol": "block"},
            {"tag": "dead-hop", "protocol": "socks5", "server": "127.0.0.1", "port": closed},
        ],
        outbound_groups=[
            {"tag": "fastest", "kind": "url_test", "outbounds": ["direct", "dead-hop"]},
            {"tag": "pick", "kind": "selector", "outbounds": ["direct", "dead-hop"]},
        ],
        rules=[{"domain": "blocked.test", "action": "block"}],
    )
    config["runtime"]["latency_test_url"] = f"http://127.0.0.1:{origin[1]}/"
    # Without sniffing, a failed dial is answered as a SOCKS5 error before any success.
    config["inbounds"][0]["sniff"] = False
    engine = make_engine(config)
    sub = engine.subscribe(since=0, snapshot=True, timeout=10)
    proxy = engine.listen_address("socks-in")

    socks_fetch(engine, origin, 1000)  # direct_relayed
    with pytest.raises(ConnectionError, match="socks reply 2"):
        socks5_connect(proxy, "blocked.test", 80)  # blocked by the rule
    with pytest.raises(ConnectionError, match="socks reply 5"):
        socks5_connect(proxy, "127.0.0.1", closed)  # failed: connection refused
    engine.execute("policies.select", {"policy_tag": "pick", "target_tag": "dead-hop"})

    with EchoServer() as echo, socks5_connect(proxy, "127.0.0.1", echo.port) as tunnel:
        # Bytes moving across sampling intervals give flow.updated events.
        _exchange(tunnel, rounds=6, pause=0.1)
        wait_until(
            lambda: engine.query("events", {"types": "flow.updated"})["events"],
            what="a flow.updated event",
        )
        with engine.subscribe(["flow.snapshot"], snapshot=True, timeout=5) as watcher:
            snapshot = watcher.get(timeout=5)
        (open_flow,) = engine.query("flows")["active_flows"]
        engine.execute("flows.close", {"flow_id": open_flow["flow_id"]})  # cancelled, manual
        wait_until(lambda: not engine.query("flows")["active_flows"], what="the close")
    wait_until(
        lambda: engine.query("events", {"types": "policy.probe.completed"})["events"],
        what="a probe round",
    )
    engine.execute("config.apply_runtime", {"config": config})  # config.changed
    engine.stop()
    events = list(sub)

    assert snapshot is not None and snapshot["event_type"] == "flow.snapshot"
    assert [r["state"] for r in snapshot["payload"]["records"]] == ["active"]
    failures = [p for e in [*events, snapshot] for p in check_event(e)]
    assert failures == []

    seen = {e["event_type"] for e in events}
    # engine.warning: the SIGHUP test below; ipc.*: tests/api/test_ipc.py checks them
    # against the catalogue with check_event.
    # provider.*: tests/engine/test_providers.py checks them with check_event.
    elsewhere = {
        "engine.warning",
        "ipc.connected",
        "ipc.disconnected",
        "provider.updated",
        "provider.failed",
    }
    assert seen >= {name for name, e in EVENT_CATALOGUE.items() if e.emitted} - elsewhere
    outcomes = [
        e["payload"]["record"]["result"]["outcome"]
        for e in events
        if e["event_type"] == "flow.completed"
    ]
    assert sorted(outcomes) == ["blocked", "cancelled", "direct_relayed", "failed"]
    assert events[-1]["event_type"] == "engine.stopped"


def test_engine_warning_payload_from_the_program(tmp_path):
    config = base_config()
    config["api"]["control"] = {"listen": {"port": 0}, "api_key_env": None}
    path = write_config(tmp_path, config)
    with running(path, environ_without("SPLICEWAY_API_KEY")) as proc:
        base = wait_for_line(proc, r"control API listening on (http://\S+)/api/v1/").group(1)
        Path(path).write_text("{not json")  # the reload fails: a warning, the config is kept
        proc.send_signal(signal.SIGHUP)
        wait_for_line(proc, r"WARNING spliceway: reload of \S+ failed: invalid_argument")
        url = f"{base}/api/v1/events?types=engine.warning"

        def warnings() -> list[dict[str, Any]]:
            with urllib.request.urlopen(url, timeout=10) as response:
                return json.load(response)["result"]["events"]

        # The warning is logged first, then emitted.
        (warning,) = wait_until(warnings, what="the engine.warning event")
        assert check_event(warning) == []
        assert warning["payload"]["code"] == "reload_failed"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
