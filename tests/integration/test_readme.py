"""The README as a new user follows it: its two commands, and its examples start as written."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spliceway import Engine
from spliceway.config import parse_config

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
    engine = Engine(free_ports(doc))
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
