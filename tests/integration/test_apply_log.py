"""Every configuration a command applies writes one INFO line naming its transport and
the changed components: over IPC (``spliceway reload``), gRPC and ``Engine.execute``."""

from __future__ import annotations

import json
import logging
import subprocess
from pathlib import Path
from typing import Any

import pytest

from spliceway import Engine
from spliceway.errors import ApiError
from tests.conftest import base_config
from tests.helpers.program import SPLICEWAY

LOGGER = "spliceway.control.commands"


def applied_lines(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    """(level, message) of the config-applied records captured so far."""
    return [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == LOGGER and r.getMessage().startswith("configuration applied")
    ]


def test_a_reload_over_ipc_logs_one_line_with_the_changed_components(
    tmp_path: Path, sock_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    doc = base_config(api={"control": {"enabled": False}, "ipc": {"path": str(sock_path)}})
    source = tmp_path / "config.json"
    source.write_text(json.dumps(doc))
    engine = Engine(doc, config_path=str(source)).start()
    try:
        new = tmp_path / "new.json"
        new.write_text(json.dumps({**doc, "rules": [{"port": ["9"], "action": "block"}]}))
        argv = [*SPLICEWAY, "--ipc", str(sock_path), "reload", str(new)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        assert done.returncode == 0, done.stderr
        assert applied_lines(caplog) == [
            (
                logging.INFO,
                "configuration applied: method=config.apply transport=ipc "
                "persistence=source_file changed=routing",
            )
        ]
    finally:
        engine.stop()


def test_engine_execute_logs_applies_and_not_refusals(
    make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    doc = base_config()
    engine = make_engine(doc)
    changed = {
        **doc,
        "outbounds": [*doc["outbounds"], {"tag": "d2", "protocol": "direct"}],
        "runtime": {"stats_interval_ms": 300},
    }
    engine.execute("config.apply_runtime", {"config": changed})
    engine.execute("config.apply_runtime", {"config": changed})  # the same again: nothing
    with pytest.raises(ApiError):
        engine.execute("config.apply_runtime", {"config": {**doc, "mode": "nonsense"}})
    assert applied_lines(caplog) == [
        (
            logging.INFO,
            "configuration applied: method=config.apply_runtime transport=embedded "
            "persistence=runtime_only changed=outbounds,runtime",
        ),
        (
            logging.INFO,
            "configuration applied: method=config.apply_runtime transport=embedded "
            "persistence=runtime_only changed=-",
        ),
    ]


def test_an_apply_over_grpc_names_grpc(
    make_engine: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    grpc = pytest.importorskip("grpc")
    from spliceway.api.grpc_gen import control_pb2, control_pb2_grpc

    caplog.set_level(logging.INFO, logger=LOGGER)
    monkeypatch.setenv("APPLY_LOG_KEY", "k" * 32)
    doc = base_config()
    doc["api"]["control"] = {"listen": {"port": 0}, "api_key_env": "APPLY_LOG_KEY"}
    doc["api"]["grpc"] = {"enabled": True}
    engine = make_engine(doc)
    new = {**doc, "mode": {"kind": "direct"}}
    with grpc.insecure_channel(engine._transports.grpc.target) as channel:
        stub = control_pb2_grpc.ControlStub(channel)
        request = control_pb2.CommandRequest(
            id="c-1", method="config.apply_runtime", params={"config": new}
        )
        reply = stub.Execute(request, metadata=(("authorization", "Bearer " + "k" * 32),))
        assert reply.ok, reply
    assert applied_lines(caplog) == [
        (
            logging.INFO,
            "configuration applied: method=config.apply_runtime transport=grpc "
            "persistence=runtime_only changed=routing",
        )
    ]


def test_an_apply_over_http_names_http(
    make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    import urllib.request

    caplog.set_level(logging.INFO, logger=LOGGER)
    doc = base_config()
    doc["api"]["control"] = {"listen": {"port": 0}, "api_key_env": None}
    engine = make_engine(doc)
    new = {**doc, "mode": {"kind": "direct"}}
    body = json.dumps({"method": "config.apply_runtime", "params": {"config": new}}).encode()
    request = urllib.request.Request(
        f"{engine.control_url}/api/v1/commands",
        data=body,
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as reply:
        assert reply.status == 200
        assert json.loads(reply.read())["ok"] is True
    assert applied_lines(caplog) == [
        (
            logging.INFO,
            "configuration applied: method=config.apply_runtime transport=http "
            "persistence=runtime_only changed=routing",
        )
    ]
