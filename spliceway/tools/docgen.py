"""Generate the reference parts of ``docs/`` from the code that knows the answers.

``python -m spliceway.tools.docgen`` rewrites ``docs/configuration.md`` (from the
configuration models' JSON Schema), ``docs/commands.md`` (from the command table
and the OpenAPI document), ``docs/events.md`` (from the event catalogue) and the
marked blocks of the hand-written pages (error codes and endpoints in
``docs/http-api.md``, permissions in ``docs/security.md``).
``python -m spliceway.tools.docgen --check`` rewrites nothing: it exits 1 naming every
file that differs from what the code generates now.

Everything but :func:`main` is a pure function from tables and models to Markdown.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from spliceway.api.limits import Limits
from spliceway.api.openapi import command_component, openapi_document
from spliceway.api.sse import KEEPALIVE_S
from spliceway.config import Runtime
from spliceway.control.commands import COMMANDS, PERMISSIONS, Command
from spliceway.control.queries import EVENTS_LIMIT_MAX
from spliceway.errors import HTTP_STATUS
from spliceway.events.catalogue import (
    CLOSE_REASONS,
    ENGINE_WARNING_CODES,
    ENVELOPE_FIELDS,
    EVENT_CATALOGUE,
    FAILURE_CODES,
    FAILURE_STAGES,
    FLOW_RECORD_FIELDS,
    OUTCOMES,
    PayloadField,
)
from spliceway.tools.configdoc import CONFIG_EXAMPLE, render_configuration
from spliceway.tools.markdown import (
    NOTICE,
    Schema,
    cell,
    code,
    one_line,
    resolve,
    slug,
    table,
    words,
)

__all__ = [
    "CONFIG_EXAMPLE",
    "expected_docs",
    "fill_blocks",
    "main",
    "render_commands",
    "render_configuration",
    "render_endpoints",
    "render_error_codes",
    "render_events",
    "render_permissions",
    "stale_docs",
]

#: The repository's docs/ (the default of ``--docs``).
DOCS_DIR = Path(__file__).resolve().parents[2] / "docs"
API_URL = "http://127.0.0.1:9090"


# ---------------------------------------------------------------------------
# docs/commands.md
# ---------------------------------------------------------------------------

_COMMANDS_INTRO = """\
# Command reference

{notice}

Commands change the engine or run diagnostics. One table serves every way in:

- **HTTP:** `POST /api/v1/commands` with the JSON body
  `{{"id": <optional>, "method": ..., "params": {{...}}}}` and the header
  `Content-Type: application/json` (`curl --json` sets it; without it the answer
  is 415). The answer is the envelope `{{"api_id", "id", "ok", "result" | "error"}}`
  described in [http-api.md](http-api.md); `id` is echoed back.
- **Python:** `engine.execute(method, params)` on a running `spliceway.Engine` returns
  the `result` object or raises `spliceway.ApiError` with the same `code`, `message`
  and `field_path`. It holds every permission.

Every command checks, in this order: the method exists (else `invalid_argument`,
`field_path` `method`), `params` is an object (else `invalid_argument`, `params`), the
caller's key holds the command's permission (else `permission_denied`), the
parameters are valid: no unknown key, every required one present, each of its type,
without conversion (`"80"` is not a port; else `invalid_argument` with `field_path`
`params.<name>`). A command that this build does not have then answers 501
`unsupported`, naming what is missing; any other answers 409 `conflict` while the
engine is stopping (a control connection opened before the stop can still send one).
`GET /api/v1/capabilities` lists every command with `available`.

The examples use the admin key from `SPLICEWAY_API_KEY`; leave the header out when the
control API has no key.

| Command | Permission | Available | What it does |
|---|---|---|---|
{overview}
"""


def _param_rows(command: Command) -> list[list[str]]:
    schema = command.params.model_json_schema()
    defs = schema.get("$defs", {})
    required = schema.get("required", ())
    rows = []
    for name, prop in schema.get("properties", {}).items():
        default = "**required**" if name in required else code(prop.get("default"))
        kind = words(prop, defs, lambda n: "object")
        rows.append([f"`{name}`", kind, default, prop.get("description", "")])
    return rows


def _result_rows(schema: Schema, defs: dict[str, Schema], prefix: str = "") -> list[list[str]]:
    """One row per result field; objects and lists of objects are opened."""
    schema = resolve(schema, defs)
    rows = []
    required = schema.get("required", ())
    for name, prop in schema.get("properties", {}).items():
        path = f"{prefix}{name}"
        target = resolve(prop, defs)
        presence = "always" if name in required else "when it applies"
        items = resolve(target.get("items", {}), defs) if target.get("type") == "array" else {}
        if target.get("type") == "object" and "properties" in target:
            rows.append([f"`{path}`", "object", presence])
            rows += _result_rows(target, defs, f"{path}.")
        elif "properties" in items:
            rows.append([f"`{path}`", "list of object", presence])
            rows += _result_rows(items, defs, f"{path}[].")
        else:
            rows.append(
                [f"`{path}`", words(prop, defs, lambda n: words(defs[n], defs, str)), presence]
            )
    return rows


def _result_text(method: str, components: dict[str, Schema]) -> str:
    schema = components[command_component(method, "Result")]
    variants = schema.get("oneOf")
    header = ("Field", "Type", "Present")
    if not variants:
        return table(header, _result_rows(schema, components))
    parts = []
    for variant in variants:
        parts.append(one_line(variant.get("description")) or "One form:")
        parts.append(table(header, _result_rows(variant, components)))
    return "\n\n".join(parts)


def _error_rows(command: Command) -> list[list[str]]:
    rows = [
        [
            "`invalid_argument`",
            "400",
            "A parameter is unknown, missing or of the wrong type (`field_path` `params.<name>`).",
        ],
        ["`permission_denied`", "403", _lacking(command.permission)],
    ]
    rows += [[f"`{code}`", str(HTTP_STATUS[code]), when] for code, when in command.errors]
    if command.missing is not None:
        rows.append(
            ["`unsupported`", "501", f"Always, once the params are valid: needs {command.missing}."]
        )
    else:
        rows.append(["`conflict`", "409", "The engine is stopping."])
    return rows


def _lacking(permission: str) -> str:
    if permission == "admin":
        return "The caller's key lacks the `admin` permission."
    return f"The caller's key holds neither `{permission}` nor `admin`."


def _command_section(command: Command, components: dict[str, Schema]) -> str:
    method = command.method
    available = "yes" if command.missing is None else f"no: needs {command.missing}"
    params = _param_rows(command)
    body = json.dumps({"method": method, "params": command.example}, ensure_ascii=False)
    python_args = json.dumps(command.example, ensure_ascii=False)
    python_args = re.sub(r"\b(true|false|null)\b", lambda m: _PY[m.group(1)], python_args)
    lines = [
        f"## `{method}`",
        command.summary,
        f"- **Permission:** `{command.permission}`\n- **Available in this build:** {available}",
        "**Parameters**",
        table(("Name", "Type", "Default", "Description"), params) if params else "None: `{}`.",
        "**Result**",
        _result_text(method, components),
        "**Errors**",
        table(("Code", "HTTP", "When"), _error_rows(command)),
        "**Example**",
        "```sh\n"
        f'curl -H "Authorization: Bearer $SPLICEWAY_API_KEY" \\\n'
        f"  --json '{body}' \\\n"
        f"  {API_URL}/api/v1/commands\n```",
        f"```python\nengine.execute({json.dumps(method)}, {python_args})\n```",
    ]
    return "\n\n".join(lines)


_PY = {"true": "True", "false": "False", "null": "None"}


def render_commands() -> str:
    """``docs/commands.md``: every command with permission, parameters, result, errors."""
    components = openapi_document()["components"]["schemas"]
    overview = "\n".join(
        f"| [`{c.method}`](#{slug(c.method)}) | `{c.permission}` | "
        f"{'yes' if c.missing is None else 'no'} | {cell(c.summary)} |"
        for c in COMMANDS.values()
    )
    head = _COMMANDS_INTRO.format(notice=NOTICE, overview=overview)
    sections = [_command_section(c, components) for c in COMMANDS.values()]
    return head + "\n" + "\n\n".join(sections) + "\n"


# ---------------------------------------------------------------------------
# docs/events.md
# ---------------------------------------------------------------------------

_EVENTS_INTRO = """\
# Event reference

{notice}

The engine reports what happens as events: flows starting, being routed, moving
bytes and ending; policy groups choosing members; periodic statistics; the engine
starting and stopping. Every event is one JSON object, the *envelope*, with the
type's own fields in `payload`. Events enter a ring of the last
`runtime.event_ring_capacity` events ({ring} by default), numbered by `sequence`.
"""

_EVENTS_CONSUMING = """\
## Consuming events

### Server-Sent Events: `GET /api/v1/events/stream`

```sh
curl -N -H "Authorization: Bearer $SPLICEWAY_API_KEY" \\
  "{url}/api/v1/events/stream?types=flow.started,flow.completed"
```

- Each frame is `id: <sequence>`, `event: <event_type>`, `data: <envelope JSON>`.
- `types`: comma-separated allow-list (`*` or absent: every type); an unknown type is
  400 `invalid_argument`.
- **Resume:** `since=<sequence>`, or the `Last-Event-ID` header browsers' `EventSource`
  sends on reconnect (`since` wins), first replays the ring's events after that
  sequence (the *catch-up*). A `since` ahead of the engine's latest sequence (the engine
  restarted, sequences begin at 1 again) replays the whole ring; a gap (events already
  dropped from the ring) is announced by a comment line.
- **Live phase:** it starts with a `flow.snapshot` of every open flow when `types`
  includes a flow type. Its `id` is its watermark: the latest sequence at that moment,
  so a client that reconnects with the last id it saw continues exactly after what it
  has, without gaps or duplicates.
- A comment line (`: keep-alive`) every {keepalive:g} s keeps idle connections open through
  proxies.
- At most {streams} streams at once per engine; one more is answered 429 `rate_limited`.
- **`engine.stopped` is the last frame of every open stream**, whatever its `types`
  filter; then the response ends. A stream that ends without it lost its connection.
- A client that falls far behind (twice the ring capacity) is disconnected; it resumes
  with `Last-Event-ID`.

### The ring: `GET /api/v1/events`

Returns `{{"events": [...], "oldest_sequence", "latest_sequence", "capacity"}}`. Parameters:
`types` (comma-separated allow-list, as above), `since` (only events with a greater
`sequence`) and `limit` (at most this many, 1..{events_max}), oldest first, so a client pages
forward with `since` = the last sequence it got. `oldest_sequence` and
`latest_sequence` describe the whole ring. `flow.snapshot` is never in the ring.

### In Python: `engine.subscribe()`

```python
for event in engine.subscribe(["flow.completed"], since=0, snapshot=False, timeout=5):
    print(event["sequence"], event["payload"]["record"]["result"]["outcome"])
```

`types` as above; `since` replays the ring first; `snapshot=True` starts the live
phase with a `flow.snapshot`; iteration ends when no event came for `timeout` seconds
or when the engine stops. A subscriber never slows the engine: one that falls 65536
events behind is closed (`overflowed`).

### Sinks

`api.event_sinks` deliver events without a client connected (see
[configuration.md](configuration.md#api)):

- `webhook`: one `POST` per event, the envelope as the JSON body, with the sink's
  `source_id` stamped in and its `headers` added (use them for the receiver to
  authenticate the engine). A 2xx acknowledges; 429, 5xx and network errors are
  retried with backoff; other statuses are refused at once (`api.dispatcher`).
- `jsonl`: one envelope per line appended to a file.

Sinks take events from the ring, never `flow.snapshot`. Delivery is **at least
once**: with `api.outbox_path` every event is written to disk before it is sent and
removed only after it was acknowledged, so after a crash or a restart unacknowledged
events are sent again with the same `event_id` and the same bytes. Receivers
de-duplicate by `event_id`. `GET /api/v1/sinks` and `spliceway connector state FILE`
show each sink's backlog.

**A crash completes every started flow.** A flow open when the engine is killed (or
crashes) never gets its `flow.completed` from that run. At the next start, right after
`engine.started` and before any new flow, the engine emits one `flow.completed` with
outcome `engine_crashed` for each flow that some sink's outbox shows started and not
completed: a well-formed completed record built from the newest record any sink was
given (`flow.started`, `flow.routed` or `flow.updated`: route, path and the bytes last
reported), one revision later, ending at the last moment the flow was seen, with
`result.failure` `internal`/`engine_crashed`. Each sink receives it only for the flows
*its* outbox shows open, so a sink that had already taken the real `flow.completed`
before the crash gets no second one; a crash during this recovery leaves the flows not
yet written to a sink's outbox open there, and the start after completes those. It goes
through the ring like any event (streams see it) and each sink's outbox, so it is
delivered as durably as the rest. Sinks take events one after the other, so a kill can
land after one sink took a flow's real `flow.completed` and before another did: the
other then gets that same event (same `event_id`, its own `source_id`) from the first
one's outbox, as a redelivery, not a crash completion, while the outbox still holds
it. What this needs and leaves out:

- `api.outbox_path`: without an outbox nothing of a run survives it, and there is
  nothing to complete (an SSE client sees the stream end without `engine.stopped`).
- A sink is owed completions only if its `events` select `flow.completed` and some
  event of the flow (`flow.started`, `flow.routed` or `flow.updated`): a sink of
  `flow.completed` alone was never told the flow existed and gets none.
- Each sink that selects `flow.completed` keeps the newest event of each open flow in
  memory and, before it deletes acknowledged segments of its outbox, writes them to a
  checkpoint (`flows` in its outbox directory): only when the segments free at least
  as many bytes as it writes, so segments may stay a little longer. On a full disk the
  segments go without it, and a flow started in them is not completed after a crash.
- A sink a reload removed is completed at the first start that configures it again.
- Flow ids are unique across starts (a random prefix per start, redrawn if it matches
  a flow being completed), so a completed flow's id is never reused.
"""


def _payload_rows(fields: Sequence[PayloadField]) -> list[list[str]]:
    rows = []
    for f in fields:
        kind = f.type.replace("FlowRecord", "[FlowRecord](#the-flowrecord)")
        required = "" if f.required else " *(optional)*"
        rows.append([f"`{f.name}`", kind, f.description + required])
    return rows


def _described(values: dict[str, str], title: str) -> str:
    return table((title, "Meaning"), [[f"`{k}`", v] for k, v in values.items()])


def render_events() -> str:
    """``docs/events.md``: the envelope, every event type's payload, the flow record."""
    header = ("Field", "Type", "Meaning")
    overview = table(
        ("Type", "Emitted by this build", "How often"),
        [
            [f"[`{e.name}`](#{slug(e.name)})", "yes" if e.emitted else "no", e.frequency]
            for e in EVENT_CATALOGUE.values()
        ],
    )
    parts = [
        _EVENTS_INTRO.format(
            notice=NOTICE, ring=Runtime.model_fields["event_ring_capacity"].default
        ),
        "## The envelope",
        table(header, _payload_rows(ENVELOPE_FIELDS)),
        "## Event types",
        overview,
    ]
    for event in EVENT_CATALOGUE.values():
        parts += [
            f"### `{event.name}`",
            f"- **When:** {event.when}\n- **How often:** {event.frequency}\n"
            f"- **Emitted by this build:** {'yes' if event.emitted else 'no'}",
        ]
        if event.fields:
            parts.append(table(header, _payload_rows(event.fields)))
        else:
            parts.append("Its payload is not defined yet.")
        if event.name == "engine.warning":
            parts.append(_described(ENGINE_WARNING_CODES, "Code"))
    parts += [
        "## The FlowRecord",
        "Every flow event carries the flow's whole record (`record`), and `GET "
        "/api/v1/flows` lists the records of open flows. A record is immutable: each "
        "change is a new record with a higher `revision`.",
        table(header, _payload_rows(FLOW_RECORD_FIELDS)),
        "### Outcomes",
        _described(OUTCOMES, "`result.outcome`"),
        "### Close reasons",
        _described(CLOSE_REASONS, "`result.close_reason`"),
        "### Failures",
        _described(FAILURE_STAGES, "`result.failure.stage`"),
        _described(FAILURE_CODES, "`result.failure.code`"),
        _EVENTS_CONSUMING.format(
            url=API_URL,
            keepalive=KEEPALIVE_S,
            streams=Limits().sse_streams,
            events_max=EVENTS_LIMIT_MAX,
        ),
    ]
    return "\n\n".join(p.rstrip("\n") for p in parts) + "\n"


# ---------------------------------------------------------------------------
# Blocks inside hand-written pages
# ---------------------------------------------------------------------------


def render_error_codes() -> str:
    """The error codes with their HTTP statuses (``docs/http-api.md``)."""
    rows = [[f"`{code}`", str(status)] for code, status in HTTP_STATUS.items()]
    rows += [
        ["`unsupported`", "405 (the path does not answer this method; see `Allow`)"],
        ["`invalid_argument`", "413 (a request body over 16 MiB, refused before it is read)"],
        ["`invalid_argument`", "415 (`POST /api/v1/commands` without a JSON content type)"],
    ]
    return table(("Code", "HTTP status"), rows)


def render_endpoints() -> str:
    """Every endpoint of the OpenAPI document with its parameters (``docs/http-api.md``)."""
    rows = []
    for path, item in openapi_document()["paths"].items():
        for method, op in item.items():
            if method not in ("get", "post"):
                continue
            params = [*item.get("parameters", ()), *op.get("parameters", ())]
            text = "<br>".join(
                f"`{p['name']}` ({p['in']}): {one_line(p.get('description'))}" for p in params
            )
            rows.append([f"`{method.upper()} {path}`", op["summary"], text or "none"])
    return table(("Endpoint", "What", "Parameters"), rows)


def render_permissions() -> str:
    """Which commands each permission allows (``docs/security.md``)."""
    rows = []
    for permission in PERMISSIONS:
        methods = [c.method for c in COMMANDS.values() if c.permission == permission]
        allows = ", ".join(f"[`{m}`](commands.md#{slug(m)})" for m in methods) or "—"
        if permission == "read":
            allows = "every `GET` endpoint and the event stream; commands: " + allows
        elif permission == "admin":
            allows = "everything the other three allow; commands: " + allows
        rows.append([f"`{permission}`", allows])
    return table(("Permission", "Allows"), rows)


_BLOCK = re.compile(
    r"(<!-- BEGIN GENERATED (?P<name>[\w-]+)[^>]*-->\n)(?P<body>.*?)"
    r"(<!-- END GENERATED (?P=name) -->)",
    re.DOTALL,
)


def fill_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with every ``<!-- BEGIN GENERATED name -->`` block replaced by ``blocks[name]``.

    Raises ``ValueError`` when a block of ``blocks`` has no markers in ``text``.
    """
    found = {m.group("name") for m in _BLOCK.finditer(text)}
    missing = set(blocks) - found
    if missing:
        raise ValueError(f"no GENERATED markers for {', '.join(sorted(missing))}")
    return _BLOCK.sub(lambda m: m.group(1) + blocks[m.group("name")] + "\n" + m.group(4), text)


#: Hand-written pages with generated blocks: page -> block name -> renderer.
BLOCKS: dict[str, dict[str, Callable[[], str]]] = {
    "http-api.md": {"error-codes": render_error_codes, "endpoints": render_endpoints},
    "security.md": {"permissions": render_permissions},
}
#: Pages generated whole: page -> renderer.
PAGES: dict[str, Callable[[], str]] = {
    "configuration.md": render_configuration,
    "commands.md": render_commands,
    "events.md": render_events,
}


def expected_docs(docs_dir: Path) -> dict[Path, str]:
    """What each generated file (or file with generated blocks) should contain now."""
    out = {docs_dir / name: render() for name, render in PAGES.items()}
    for name, blocks in BLOCKS.items():
        path = docs_dir / name
        current = path.read_text(encoding="utf-8")
        out[path] = fill_blocks(current, {block: render() for block, render in blocks.items()})
    return out


def stale_docs(docs_dir: Path) -> list[Path]:
    """The generated files whose content differs from what the code generates now."""
    stale = []
    for path, text in expected_docs(docs_dir).items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            stale.append(path)
    return stale


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m spliceway.tools.docgen [--check] [--docs DIR]``."""
    parser = argparse.ArgumentParser(prog="python -m spliceway.tools.docgen", description=__doc__)
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if stale")
    parser.add_argument("--docs", type=Path, default=DOCS_DIR, help="the docs directory")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_docs(args.docs)
        for path in stale:
            print(f"stale: {path} (run python -m spliceway.tools.docgen)", file=sys.stderr)
        return 1 if stale else 0
    for path, text in expected_docs(args.docs).items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
