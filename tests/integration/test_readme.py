"""The README as a new user follows it: its two commands, and its examples start as written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spliceway import Engine
from spliceway.config import parse_config
from tests.helpers.program import SPLICEWAY, running, wait_for_line, write_config

README = Path(__file__).resolve().parents[2] / "README.md"
TEXT = README.read_text("utf-8")


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", TEXT, re.S)


def complete_configs() -> list[dict[str, Any]]:
    """Every ``json`` block that is a whole configuration (fragments are not JSON objects)."""
    out = []
    for block in blocks("json"):
        try:
            doc = json.loads(block)
        except json.JSONDecodeError:
            continue
        out.append(doc)
    return out


def free_ports(doc: Any) -> Any:
    """The document with every listen port 0, so a test never collides with a real engine."""
    if isinstance(doc, dict):
        return {
            k: ({**v, "port": 0} if k == "listen" and isinstance(v, dict) else free_ports(v))
            for k, v in doc.items()
        }
    if isinstance(doc, list):
        return [free_ports(v) for v in doc]
    return doc


def test_readme_opens_with_exactly_the_two_commands() -> None:
    first = blocks("sh")[0]
    assert first.strip().splitlines() == [
        "pip install . && spliceway run",
        "pip install -e '.[test]' && python -m pytest",
    ]
    assert TEXT.index("```sh") < TEXT.index("\n## ")


def test_readme_has_complete_configurations() -> None:
    assert complete_configs(), "the README lost its example configuration"


@pytest.mark.parametrize("doc", complete_configs())
def test_readme_configuration_starts_as_written(doc, monkeypatch) -> None:
    # A new user's shell has no key variable set.
    monkeypatch.delenv("SPLICEWAY_API_KEY", raising=False)
    doc = free_ports(doc)
    # The control API's default port (9090) is a running engine's; this one gets its own.
    control = doc.setdefault("api", {}).setdefault("control", {})
    control.setdefault("listen", {})["port"] = 0
    engine = Engine(doc)
    engine.start()
    try:
        assert engine.query("health")["healthy"] is True
    finally:
        engine.stop()


def test_readme_sink_fragment_fits_in_api(tmp_path) -> None:
    fragment = next(b for b in blocks("json") if b.lstrip().startswith('"event_sinks"'))
    api = json.loads("{" + fragment + "}")
    api["outbox_path"] = str(tmp_path / "outbox")
    jsonl = next(sink for sink in api["event_sinks"] if sink["type"] == "jsonl")
    jsonl["path"] = str(tmp_path / "events.jsonl")
    parse_config({"api": {**api, "control": {"enabled": False}}})


def test_readme_embedding_example_runs() -> None:
    code = next(b for b in blocks("python") if "from spliceway import Engine" in b)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.splitlines()[:2]
    assert re.fullmatch(r"\('127\.0\.0\.1', \d+\)", first)
    assert "'total_started': 0" in second


def _run(argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``argv`` to completion (60 s at most) in ``env``, its output captured as text."""
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)


def test_readme_embedding_example_runs_beside_a_running_engine(tmp_path) -> None:
    """A user's ``spliceway run`` holds the per-user default IPC socket; the README's
    embedded engine (no ``api.ipc`` in its configuration) leaves it alone, and a second
    ``spliceway run`` still gets the clear conflict. The default directory is moved to
    ``tmp_path`` through ``XDG_RUNTIME_DIR``, so a real engine of this user is untouched."""
    runtime_dir = tmp_path / "xdg"
    runtime_dir.mkdir(mode=0o700)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(runtime_dir)}
    socket_path = runtime_dir / "spliceway" / "control.sock"
    doc = {
        "inbounds": [{"tag": "in", "protocol": "socks5", "listen": {"port": 0}}],
        "api": {"control": {"enabled": False}},
    }
    first = tmp_path / "first"
    first.mkdir()
    with running(write_config(first, doc), env=env) as proc:
        assert wait_for_line(proc, r"IPC socket listening on (\S+)").group(1) == str(socket_path)
        code = next(b for b in blocks("python") if "from spliceway import Engine" in b)
        embedded = _run([sys.executable, "-c", code], env)
        assert embedded.returncode == 0, embedded.stderr
        assert re.fullmatch(r"\('127\.0\.0\.1', \d+\)", embedded.stdout.splitlines()[0])
        second = _run([*SPLICEWAY, "run", "-c", write_config(tmp_path, doc)], env)
        assert second.returncode == 2, second.stderr
        assert "conflict" in second.stderr
        assert str(socket_path) in second.stderr
        assert f"pid {proc.pid}" in second.stderr or str(proc.pid) in second.stderr
        # The first engine still answers on its socket.
        status = _run([*SPLICEWAY, "status", "--json"], env)
        assert status.returncode == 0, status.stderr
        assert json.loads(status.stdout)["health"]["healthy"] is True
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    assert not socket_path.exists()


def test_embedded_engine_serves_ipc_only_when_asked(tmp_path, monkeypatch) -> None:
    runtime_dir = tmp_path / "xdg"
    runtime_dir.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime_dir))
    default_socket = runtime_dir / "spliceway" / "control.sock"
    inbound = [{"tag": "in", "protocol": "socks5", "listen": {"port": 0}}]
    with Engine({"inbounds": inbound, "api": {"control": {"enabled": False}}}) as engine:
        assert engine.core.config.api.ipc.enabled is False
        assert not default_socket.exists()
    asked = {"inbounds": inbound, "api": {"control": {"enabled": False}, "ipc": {"enabled": True}}}
    with Engine(asked) as engine:
        assert engine.core.config.api.ipc.enabled is True
        assert default_socket.is_socket()
    own = tmp_path / "own.sock"
    named = {"inbounds": inbound, "api": {"control": {"enabled": False}, "ipc": {"path": str(own)}}}
    with Engine(named):
        assert own.is_socket()
        assert not default_socket.exists()
