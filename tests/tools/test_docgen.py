"""docs/ is what the code generates now, and every relative link in it leads somewhere."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import jsonschema
import pytest

from spliceway.config import Config, config_schema, default_config, parse_config
from spliceway.control.commands import COMMANDS
from spliceway.tools import docgen

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = sorted(DOCS.glob("*.md"))
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown page."""
    anchors: set[str] = set()
    for line in _FENCE.sub("", text).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if not match:
            continue
        base = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        anchor, n = base, 0
        while anchor in anchors:
            n += 1
            anchor = f"{base}-{n}"
        anchors.add(anchor)
    return anchors


def test_docs_are_what_the_code_generates():
    stale = docgen.stale_docs(DOCS)
    assert stale == [], f"run python -m spliceway.tools.docgen: {[p.name for p in stale]} are stale"


def test_check_names_a_stale_page(tmp_path, capsys):
    copy = tmp_path / "docs"
    shutil.copytree(DOCS, copy)
    assert docgen.main(["--check", "--docs", str(copy)]) == 0
    (copy / "events.md").write_text("outdated\n")
    assert docgen.main(["--check", "--docs", str(copy)]) == 1
    assert "events.md" in capsys.readouterr().err
    assert docgen.main(["--docs", str(copy)]) == 0
    assert docgen.main(["--check", "--docs", str(copy)]) == 0


def test_the_pages_exist():
    names = {p.name for p in PAGES}
    assert names >= {
        "README.md",
        "running.md",
        "configuration.md",
        "commands.md",
        "events.md",
        "http-api.md",
        "security.md",
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in _LINK.findall(_FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue  # absolute URL
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and anchor not in github_anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading #{anchor} in {file.name}")
    assert broken == []


def test_github_anchor_rules():
    text = "# `inbounds[].listen`\n## `outbounds[]` — `protocol`: `socks5`\n## A b\n## A b\n"
    assert github_anchors(text) == {
        "inboundslisten",
        "outbounds--protocol-socks5",
        "a-b",
        "a-b-1",
    }
    assert docgen.slug("`diagnostics.trace_route`") == "diagnosticstrace_route"


def test_every_config_key_has_a_description():
    schema = Config.model_json_schema()
    objects = {"Config": schema, **schema["$defs"]}
    missing = [
        f"{name}.{key}"
        for name, obj in objects.items()
        for key, prop in obj.get("properties", {}).items()
        if not prop.get("description")
    ]
    assert missing == []


def test_every_command_is_documented():
    for command in COMMANDS.values():
        assert command.summary, command.method
        for name, field in command.params.model_fields.items():
            assert field.description, f"{command.method} params.{name}"
        for code, when in command.errors:
            assert code in docgen.HTTP_STATUS and when, command.method
        # The example is valid params for the command.
        command.params.model_validate(command.example)


def test_the_schema_and_the_example():
    schema = config_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    for document in (docgen.CONFIG_EXAMPLE, default_config().to_dict()):
        parse_config(document)
        assert list(validator.iter_errors(document)) == []
