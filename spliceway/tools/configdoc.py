"""``docs/configuration.md``: every key of the configuration, with its type, default
and meaning, from the configuration models' JSON Schema (``spliceway.tools.docgen``
writes it).
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from typing import Any

from pydantic import BaseModel

from spliceway.config import Config, parse_config
from spliceway.tools.markdown import NOTICE, Schema, code, slug, table, words

__all__ = ["CONFIG_EXAMPLE", "render_configuration"]

# ---------------------------------------------------------------------------
# docs/configuration.md
# ---------------------------------------------------------------------------

#: A configuration using every section; rendering validates it, so the page never shows
#: an example the engine would refuse.
CONFIG_EXAMPLE: dict[str, Any] = {
    "mode": {"kind": "rule"},
    "inbounds": [
        {
            "tag": "mixed-in",
            "protocol": "mixed",
            "listen": {"address": "127.0.0.1", "port": 7890},
            "users": [{"username": "alice", "password": "s3cret", "principal_key": "alice"}],
        },
        {"tag": "socks-in", "protocol": "socks5", "listen": {"port": 1080}},
    ],
    "outbounds": [
        {"tag": "direct", "protocol": "direct", "connect_timeout_ms": 5000},
        {"tag": "block", "protocol": "block"},
        {"tag": "hop-a", "protocol": "socks5", "server": "10.0.0.2", "port": 1080},
        {
            "tag": "hop-b",
            "protocol": "http",
            "server": "proxy.example.net",
            "port": 3128,
            "username": "u",
            "password": "p",
        },
        {
            "tag": "ss",
            "protocol": "shadowsocks",
            "server": "203.0.113.7",
            "port": 8388,
            "method": "chacha20-ietf-poly1305",
            "password": "shared secret",
        },
    ],
    "outbound_groups": [
        {"tag": "proxy", "kind": "selector", "outbounds": ["auto", "chain", "direct"]},
        {
            "tag": "auto",
            "kind": "url_test",
            "outbounds": ["hop-a", "hop-b", "ss"],
            "interval_seconds": 300,
            "tolerance_ms": 50,
        },
        {"tag": "backup", "kind": "fallback", "outbounds": ["hop-a", "hop-b"]},
        {
            "tag": "spread",
            "kind": "load_balance",
            "outbounds": ["hop-a", "hop-b"],
            "strategy": "consistent_hashing",
        },
        {"tag": "chain", "kind": "relay", "outbounds": ["hop-a", "ss"]},
        {
            "tag": "subscribed",
            "kind": "url_test",
            "outbounds": [],
            "providers": ["airport"],
        },
    ],
    "providers": {
        "proxies": {
            "airport": {
                "url": "https://sub.example.net/clash?token=...",
                "interval_seconds": 3600,
                "via": "hop-a",
                "exclude_filter": ["(?i)expire|traffic"],
            }
        },
        "rules": {
            "ads": {
                "url": "https://rules.example.net/ads.txt",
                "behavior": "domain",
                "format": "text",
            },
            "lan": {"path": "/etc/spliceway/lan.yaml", "behavior": "ipcidr"},
        },
    },
    "rules": [
        {"domain_keyword": ["ads", "tracker"], "action": "block"},
        {"rule_set": "ads", "action": "block"},
        {"rule_set": "lan", "no_resolve": True, "outbound": "direct"},
        {"geosite": "google", "outbound": "subscribed"},
        {"geoip": ["cn", "private"], "outbound": "direct"},
        {"domain_suffix": ["example.com"], "port": ["443", "8000-8100"], "outbound": "proxy"},
        {"ip_cidr": "10.0.0.0/8", "outbound": "direct"},
        {"inbound_tag": "socks-in", "outbound": "spread"},
        {"principal_key": "alice", "outbound": "backup"},
    ],
    "route": {"final": "direct"},
    "runtime": {
        "log_level": "info",
        "log_files": ["/var/log/spliceway/spliceway.log"],
        "tcp_idle_timeout_seconds": 600,
        "stats_interval_ms": 1000,
        "dns": {
            "servers": ["udp://1.1.1.1", "tcp://[2606:4700:4700::1111]", "system"],
            "cache": {"max_entries": 4096, "min_ttl_seconds": 30},
        },
        "geodata": {
            "geoip_path": "/var/lib/spliceway/Country.mmdb",
            "geosite_path": "/var/lib/spliceway/geosite.dat",
        },
    },
    "api": {
        "control": {
            "listen": {"address": "127.0.0.1", "port": 9090},
            "api_key_env": "SPLICEWAY_API_KEY",
            "keys": [{"name": "dashboard", "key_env": "DASHBOARD_KEY", "permissions": ["read"]}],
        },
        "event_sinks": [
            {
                "type": "webhook",
                "tag": "central",
                "url": "https://events.example.net/hook",
                "events": ["flow.completed", "engine.started", "engine.stopped"],
                "source_id": "node-1",
                "headers": {"Authorization": "Bearer receiver-token"},
            },
            {"type": "jsonl", "tag": "audit", "path": "/var/log/spliceway/events.jsonl"},
        ],
        "outbox_path": "/var/lib/spliceway/outbox",
        "dispatcher": {"retry_threshold": 10, "on_exhausted": "dead_letter"},
    },
}

_CONFIG_INTRO = """\
# Configuration reference

{notice}

The engine reads one document: `spliceway run -c FILE` (without `-c`, an embedded
default: a `mixed` inbound on `127.0.0.1:7890`, everything `direct`, a keyless control
API on `127.0.0.1:9090`). `spliceway validate FILE` checks a file without starting
anything. `spliceway config-schema` prints the same rules as a JSON Schema (draft
2020-12) for editors and CI; its descriptions are the ones below.

## The file

- **Format.** JSON, or YAML when the file name ends in `.yaml` or `.yml`. A key given
  twice in one object is an error in both formats (YAML merge keys `<<` still work).
  JSON must be UTF-8 (a byte-order mark is allowed); `NaN` and `Infinity` are refused.
- **Types are strict.** `"7890"` is not a port and `"yes"` is not a boolean.
- **Unknown keys are errors**, at every level, so a typo cannot be silently ignored.
- **Every problem is reported**, each with its field path, e.g.
  `inbounds[0].listen.port: must be an integer`; `spliceway validate` prints one per
  line. Besides the types below, the engine checks tags are unique (outbounds and
  groups share one namespace), that every tag named exists, that groups form no
  cycle, and that no two listeners share an address and port.
- **Defaults.** Every key that is not *required* may be left out. A default `{{}}`
  means the object with each of its own keys at their defaults.
- **`null` turns an optional feature off** where the key allows it: `users: null`
  (no authentication), `runtime.dns.cache: null` (no cache), `api.outbox_path: null`
  (in-memory queues), `api.control.api_key_env: null` (no admin key).
- **Environment.** Secrets for the control API are not written in the file: it
  names environment variables (`api_key_env`, `keys[].key_env`). The engine refuses
  to start when one is unset, and `spliceway validate` reports it.
- **Tags and paths.** Key paths below use `[]` for "every item of the list":
  `inbounds[].listen.port` is the `port` of the `listen` object of each inbound.
"""


def _pretty(value: Any, indent: int = 0, used: int = 0, width: int = 88) -> str:
    """JSON with every value that fits on its line (``used`` columns taken) kept on it."""
    flat = json.dumps(value, ensure_ascii=False)
    if used + len(flat) <= width or not isinstance(value, dict | list) or not value:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, dict):
        items = []
        for key, item in value.items():
            head = f"{pad}{json.dumps(key)}: "
            items.append(head + _pretty(item, indent + 2, len(head), width))
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + _pretty(item, indent + 2, len(pad), width) for item in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def _walk_models(
    model: type[BaseModel], seen: set[type[BaseModel]] | None = None
) -> Iterator[type[BaseModel]]:
    # ``seen``: a model may hold itself (a logical rule's ``rules``).
    seen = set() if seen is None else seen
    if model in seen:
        return
    seen.add(model)
    yield model
    for field in model.model_fields.values():
        yield from _models_in(field.annotation, seen)


def _models_in(annotation: Any, seen: set[type[BaseModel]]) -> Iterator[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        yield from _walk_models(annotation, seen)
    for arg in typing.get_args(annotation):
        yield from _models_in(arg, seen)


def _factory_default(model: type[BaseModel], name: str) -> Any:
    """The JSON of a ``default_factory`` default, keeping only what differs from its own
    defaults (an object of defaults is ``{}``)."""
    value = model.model_fields[name].default_factory()  # type: ignore[misc,call-arg]
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json", exclude_defaults=True)
    return value


class _ConfigPage:
    """Renders the configuration page from the schema (a helper object, no side effects)."""

    def __init__(self) -> None:
        schema = Config.model_json_schema()
        self.defs: dict[str, Schema] = schema.pop("$defs")
        self.defs["Config"] = schema
        self.models = {m.__name__: m for m in _walk_models(Config)}
        self.sections: list[str] = []

    def render(self) -> str:
        self.plan("Config", "Top level", "")
        body = "\n\n".join(self.sections)
        parse_config(CONFIG_EXAMPLE)
        tail = (
            "## A complete example\n\nEvery section in use. `spliceway validate` accepts it "
            "once `SPLICEWAY_API_KEY` and `DASHBOARD_KEY` are set; to run, the servers, "
            "directories and files it names must exist.\n\n"
            f"```json\n{_pretty(CONFIG_EXAMPLE)}\n```\n"
        )
        return _CONFIG_INTRO.format(notice=NOTICE) + "\n" + body + "\n\n" + tail

    def plan(
        self,
        name: str,
        heading: str,
        path: str,
        lead: str = "",
        ancestors: dict[str, str] | None = None,
    ) -> None:
        """Add the section of object ``name`` at ``path``, then its sub-objects' sections.

        ``ancestors``: the sections (by def name) this one is nested in; an object that
        holds itself (a logical rule's ``rules``) links back to its section instead of
        nesting forever."""
        schema = self.defs[name]
        ancestors = {**(ancestors or {}), name: heading}
        children: list[tuple[str, str, str, str]] = []  # def name, heading, path, lead
        rows = []
        for key, prop in schema.get("properties", {}).items():
            key_path = f"{path}.{key}" if path else key
            titles: dict[str, str] = {}
            for child, child_path, child_lead in self.objects_in(prop, key_path):
                if child in ancestors:
                    titles[child] = ancestors[child]
                    continue
                title = f"`{child_path}`" + (f" — {child_lead}" if child_lead else "")
                titles[child] = title
                children.append((child, title, child_path, child_lead))
            rows.append(self.row(name, key, prop, key_path, titles))
        section = f"## {heading}"
        if lead:
            section += "\n\n" + lead
        section += "\n\n" + table(("Key", "Type", "Default", "Description"), rows)
        self.sections.append(section)
        for child, title, child_path, child_lead in children:
            variant_note = ""
            if child_lead:
                tag_key, tag_value = child_lead.split(": ", 1)
                variant_note = f"Keys of `{child_path}` when {tag_key} is {tag_value}."
            self.plan(child, title, child_path, variant_note, ancestors)

    def objects_in(self, prop: Schema, path: str) -> Iterator[tuple[str, str, str]]:
        """``(def name, key path, variant)`` of every object a property holds."""
        if "$ref" in prop:
            yield prop["$ref"].rsplit("/", 1)[-1], path, ""
        elif prop.get("type") == "array":
            yield from self.objects_in(prop.get("items", {}), f"{path}[]")
        elif prop.get("type") == "object" and isinstance(prop.get("additionalProperties"), dict):
            # A map of named objects (providers.proxies.<name>).
            yield from self.objects_in(prop["additionalProperties"], f"{path}.<name>")
        elif "discriminator" in prop:
            key = prop["discriminator"]["propertyName"]
            for alt in prop["oneOf"]:
                name = alt["$ref"].rsplit("/", 1)[-1]
                value = self.defs[name]["properties"][key]["const"]
                yield name, path, f"`{key}`: `{value}`"
        else:
            for alt in prop.get("anyOf", ()):
                yield from self.objects_in(alt, path)

    def row(
        self, name: str, key: str, prop: Schema, key_path: str, titles: dict[str, str]
    ) -> list[str]:
        """The table row of key ``key`` of object ``name``; ``titles`` names its sub-objects'
        sections by def name."""

        def link(child: str) -> str:
            title = titles.get(child)
            return f"object ([{title}](#{slug(title)}))" if title else "object"

        kind = words(prop, self.defs, link)
        if "(see below)" in kind:
            variants = ", ".join(
                f"[{title.rsplit(': ', 1)[-1]}](#{slug(title)})" for title in titles.values()
            )
            kind = kind.replace("(see below)", f"({variants})")

        required = key in self.defs[name].get("required", ())
        if required:
            default = "**required**"
        elif "default" in prop:
            default = code(prop["default"])
        elif name in self.models and self.models[name].model_fields[key].default_factory:
            default = code(_factory_default(self.models[name], key))
        else:
            default = "see description"
        return [f"`{key_path}`", kind, default, prop.get("description", "")]


def render_configuration() -> str:
    """``docs/configuration.md``: every key of the configuration with type, default, meaning."""
    return _ConfigPage().render()
