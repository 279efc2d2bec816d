"""The names the documentation uses are the names the code has, both ways.

Every configuration key, command, event type, ``engine.warning`` code and CLI subcommand
the code has is documented; every one the hand-written pages and the README name
(in backticks, or as a ``spliceway <subcommand>`` command line) exists. The generated
references (configuration.md, commands.md, events.md) are held to the code by
tests/tools/test_docgen.py; this catches the prose that drifts beside them: a key renamed, a
command removed, a subcommand promised that never came.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spliceway.cli import main as cli
from spliceway.config import config_schema
from spliceway.control.commands import COMMANDS
from spliceway.events.catalogue import ENGINE_WARNING_CODES, EVENT_CATALOGUE

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
GENERATED = {"configuration.md", "commands.md", "events.md"}
#: The hand-written pages: the README and every docs page not generated whole.
PROSE = [ROOT / "README.md"] + [p for p in sorted(DOCS.glob("*.md")) if p.name not in GENERATED]

#: Dotted names in the prose under a configuration, command or event namespace that are
#: none of those, each with what it is instead.
NOT_CONFIG_COMMAND_OR_EVENT = {
    "engine.execute": "Engine.execute, the embedding API's method",
    "route.selection_chain": "a flow record field",
    "stats.udp_upstream": "a field of the stats query's result",
}

_DOTTED = re.compile(
    r"`([a-z_][a-z0-9_]*(?:\[[^\]`]*\])?(?:\.[a-z0-9_*]+(?:\[[^\]`]*\])?)+)`"
)
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _config_paths() -> set[str]:
    """Every key path of the configuration document (``api.ipc.path``,
    ``inbounds.listen.port``: list items and variants flattened)."""
    schema = config_schema()
    defs = schema.get("$defs", {})
    paths: set[str] = set()

    def walk(node: dict[str, Any], prefix: str, seen: tuple[str, ...]) -> None:
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            if name not in seen:
                walk(defs[name], prefix, (*seen, name))
            return
        for key in ("anyOf", "oneOf", "allOf"):
            for sub in node.get(key, []):
                walk(sub, prefix, seen)
        if isinstance(node.get("items"), dict):
            walk(node["items"], prefix, seen)
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{prefix}.*", seen)
        for key, value in node.get("properties", {}).items():
            path = f"{prefix}.{key}" if prefix else key
            paths.add(path)
            walk(value, path, seen)

    walk(schema, "", ())
    return paths


CONFIG_PATHS = _config_paths()
EVENTS = set(EVENT_CATALOGUE)
NAMESPACES = {p.split(".")[0] for p in CONFIG_PATHS} | {
    name.split(".")[0] for name in EVENTS | set(COMMANDS)
}


def _subcommands() -> set[str]:
    parser = cli._parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return set(action.choices)
    raise AssertionError("the CLI has no subcommands")


SUBCOMMANDS = _subcommands()


def _normalised(name: str) -> str:
    """``inbounds[0].listen.port`` and ``inbounds[].listen`` name schema paths without the
    index."""
    return re.sub(r"\[[^\]]*\]", "", name)


def _dotted_names(page: Path) -> Iterator[tuple[int, str]]:
    text = page.read_text("utf-8")
    for match in _DOTTED.finditer(text):
        yield text.count("\n", 0, match.start()) + 1, match.group(1)


@pytest.mark.parametrize("page", PROSE, ids=lambda p: p.name)
def test_every_dotted_name_the_prose_uses_exists(page: Path) -> None:
    unknown = []
    for line, name in _dotted_names(page):
        plain = _normalised(name)
        if plain.split(".")[0] not in NAMESPACES or name in NOT_CONFIG_COMMAND_OR_EVENT:
            continue
        if plain in CONFIG_PATHS or plain in COMMANDS or plain in EVENTS:
            continue
        unknown.append(f"{page.name}:{line}: `{name}`")
    assert unknown == [], "no such configuration key, command or event type"


def test_the_exceptions_are_still_used_and_still_not_real_names() -> None:
    used = {name for page in PROSE for _, name in _dotted_names(page)}
    for name in NOT_CONFIG_COMMAND_OR_EVENT:
        assert name in used, f"{name} is no longer in the docs: drop it from the exceptions"
        assert name not in CONFIG_PATHS | set(COMMANDS) | EVENTS


def _command_lines(page: Path) -> Iterator[tuple[int, str]]:
    """The subcommand of every ``spliceway ...`` command line: in a backtick span, or a
    line of a code block, that starts with it (after a ``$`` prompt or a ``&&``)."""
    text = page.read_text("utf-8")
    spans = [(m.start(), m.group(1)) for m in re.finditer(r"`(spliceway [^`\n]+)`", text)]
    for block in _FENCE.finditer(text):
        offset = block.start()
        for raw in block.group(0).splitlines():
            for part in re.split(r"&&|\|", raw):
                command = part.strip().removeprefix("$ ").strip()
                if command.startswith("spliceway "):
                    spans.append((offset, command))
            offset += len(raw) + 1
    for start, command in spans:
        words = [w for w in command.split()[1:] if not w.startswith("-")]
        # --ipc PATH takes a value: the subcommand follows it.
        if "--ipc" in command.split() and words:
            words = words[1:]
        if words:
            yield text.count("\n", 0, start) + 1, words[0]


@pytest.mark.parametrize("page", [*PROSE, *(DOCS / n for n in sorted(GENERATED))], ids=str)
def test_every_subcommand_the_docs_run_exists(page: Path) -> None:
    unknown = [f"{page.name}:{line}: spliceway {word}" for line, word in _command_lines(page)]
    assert [u for u in unknown if u.rsplit(" ", 1)[1] not in SUBCOMMANDS] == []


def test_every_subcommand_is_documented_in_running_md() -> None:
    text = (DOCS / "running.md").read_text("utf-8")
    assert {s for s in SUBCOMMANDS if f"`spliceway {s}" not in text} == set()


def test_every_configuration_key_is_documented() -> None:
    text = (DOCS / "configuration.md").read_text("utf-8")
    # The reference writes list items as `inbounds[].listen`; a path is documented when
    # its normalised form names a row.
    documented = {_normalised(m) for m in re.findall(r"^\| `([^`]+)` \|", text, re.MULTILINE)}
    missing = {p for p in CONFIG_PATHS if "*" not in p and p not in documented}
    assert missing == set()


def test_every_command_event_and_warning_code_is_documented() -> None:
    commands = (DOCS / "commands.md").read_text("utf-8")
    events = (DOCS / "events.md").read_text("utf-8")
    assert {c for c in COMMANDS if f"## `{c}`" not in commands} == set()
    assert {e for e in EVENTS if f"### `{e}`" not in events} == set()
    assert {w for w in ENGINE_WARNING_CODES if f"`{w}`" not in events} == set()
