"""Clash ``proxy-providers`` and ``rule-providers`` as spliceway ``providers``.

``type: http`` is a provider with ``url`` (mihomo's ``path`` for it is only where mihomo
keeps its copy: spliceway keeps its own under ``runtime.providers_cache_dir``);
``type: file`` one with ``path``, resolved as mihomo resolves it (against its home
directory: the source file's directory); ``type: inline`` has its ``payload`` written
to a file beside the output (``<output>.providers/``) and read from there. ``interval``
is ``interval_seconds`` (mihomo's 0, never refresh, cannot be said: spliceway's default
is kept and reported), ``proxy`` is ``via`` (``DIRECT``: none), ``size-limit``
``size_limit_bytes``. Proxy providers: ``filter``/``exclude-filter`` (backtick-separated
lists), ``health-check`` ``{enable, url, interval}``, ``override`` ``additional-prefix``
and ``additional-suffix`` (``name_prefix``/``name_suffix``); everything else is
reported. Rule providers: ``behavior`` and ``format``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

from spliceway.clash.groups import python_regex, split_filter
from spliceway.clash.state import ImportState
from spliceway.clash.weak import (
    MISSING,
    WeakTypeError,
    lookup,
    unknown_keys,
    weak_bool,
    weak_int,
    weak_str,
)
from spliceway.support.probe_url import parse_probe_url

__all__ = [
    "convert_proxy_providers",
    "convert_rule_providers",
    "finish_providers",
    "resolve_via",
]

_PROXY_KEYS = (
    "type",
    "url",
    "path",
    "proxy",
    "interval",
    "filter",
    "exclude-filter",
    "size-limit",
    "payload",
    "health-check",
    "override",
)
_PROXY_NOT_CARRIED = {
    "header": "spliceway sends no extra request headers when fetching",
    "exclude-type": "spliceway's providers filter by name only",
    "dialer-proxy": "spliceway cannot chain a provider's proxies through another proxy",
}
_HEALTH_KEYS = ("enable", "url", "interval")
_HEALTH_NOT_CARRIED = {
    "timeout": "spliceway's probes have a fixed 5 s budget",
    "lazy": "spliceway probes on the interval whether the provider is used or not",
    "expected-status": "spliceway's probes accept any HTTP answer",
}
_OVERRIDE_KEYS = ("additional-prefix", "additional-suffix")
_RULE_KEYS = (
    "type",
    "behavior",
    "format",
    "url",
    "path",
    "proxy",
    "interval",
    "size-limit",
    "payload",
)
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _write_inline(state: ImportState, kind: str, name: str, document: Any) -> str:
    """Write an inline provider's content beside the output; its absolute path."""
    digestless = _SAFE.sub("_", name).strip("_")[:40] or "provider"
    path = os.path.join(state.files_dir, f"{kind}-{digestless}.json")
    n = 1
    while path in state.files:
        n += 1
        path = os.path.join(state.files_dir, f"{kind}-{digestless}-{n}.json")
    # JSON is YAML: the provider reader takes it as a Clash document.
    state.files[path] = json.dumps(document, ensure_ascii=False, indent=1) + "\n"
    return path


def resolve_via(text: str, path: str, name: str, state: ImportState) -> str | None:
    """A provider's ``proxy`` (what it is fetched through) as a tag; None for direct."""
    if text in ("", "DIRECT"):
        return None
    info = state.names.get(text)
    if info is None or info.kind not in ("proxy", "group") or not info.tag:
        why = f"the proxy {text!r} was skipped" if info is not None else f"no proxy {text!r}"
        state.report.add("changed", path, name, "fetched directly", why)
        return None
    return info.tag


def _source(
    raw: Mapping[Any, Any], path: str, name: str, kind: str, state: ImportState
) -> dict[str, Any] | None:
    """``url`` or ``path`` of a provider (``None``: it cannot be carried, reported)."""
    ptype = raw.get("type")
    if ptype == "http":
        url = lookup(raw, "url", dashes=False)
        url = "" if url is MISSING else weak_str(url, "url")
        if not re.match(r"^https?://", url):
            state.report.add(
                "skipped", path, name, f"{kind} provider", f"url {url!r} is not http(s)"
            )
            return None
        if lookup(raw, "path", dashes=False) is not MISSING:
            state.report.add(
                "changed",
                f"{path}.path",
                name,
                "cached under runtime.providers_cache_dir",
                "mihomo's path is only where it keeps its downloaded copy",
            )
        return {"url": url}
    if ptype == "file":
        file = lookup(raw, "path", dashes=False)
        if file is MISSING or not weak_str(file, "path"):
            state.report.add("skipped", path, name, f"{kind} provider", "key 'path' missing")
            return None
        resolved = state.resolve(weak_str(file, "path"))
        if not state.inside_home(resolved):
            state.report.add(
                "skipped",
                f"{path}.path",
                name,
                f"{kind} provider",
                f"{resolved} is outside mihomo's home {state.home} (mihomo refuses it too "
                "unless SAFE_PATHS lists it): write it into spliceway's providers yourself",
            )
            return None
        state.report.add(
            "converted", f"{path}.path", name, f"reads {resolved}", "resolved against mihomo's home"
        )
        return {"path": resolved}
    if ptype == "inline":
        payload = lookup(raw, "payload", dashes=False)
        if not isinstance(payload, list):
            state.report.add(
                "skipped", path, name, f"{kind} provider", "inline without a payload list"
            )
            return None
        document = {"proxies": payload} if kind == "proxy" else {"payload": payload}
        written = _write_inline(state, "proxies" if kind == "proxy" else "rules", name, document)
        state.report.add(
            "changed",
            path,
            name,
            f"inline payload written to {written}",
            "spliceway reads a provider from a URL or a file",
        )
        return {"path": written}
    state.report.add(
        "skipped",
        path,
        name,
        f"{kind} provider",
        f"unsupported vehicle type: {ptype} (mihomo refuses it)",
    )
    return None


def _interval(raw: Mapping[Any, Any], path: str, name: str, state: ImportState) -> int | None:
    value = lookup(raw, "interval", dashes=False)
    if value is MISSING:
        if raw.get("type") == "http":
            state.report.add(
                "changed",
                f"{path}.interval",
                name,
                "refreshed on spliceway's default interval",
                "mihomo fetches it once and never refreshes it without an interval",
            )
        return None
    interval = weak_int(value, "interval")
    if interval <= 0:
        state.report.add(
            "changed",
            f"{path}.interval",
            name,
            "refreshed on spliceway's default interval",
            "an interval of 0 (never refresh) cannot be written in spliceway",
        )
        return None
    return interval


def _common(
    raw: Mapping[Any, Any], path: str, name: str, state: ImportState, spec: dict[str, Any]
) -> None:
    interval = _interval(raw, path, name, state)
    if interval is not None:
        spec["interval_seconds"] = interval
    proxy = lookup(raw, "proxy", dashes=False)
    if proxy is not MISSING:
        # Resolved once every proxy and group has its tag (finish_providers).
        spec["_via"] = (weak_str(proxy, "proxy"), f"{path}.proxy", name)
    limit = lookup(raw, "size-limit", dashes=False)
    if limit is not MISSING:
        size = weak_int(limit, "size-limit")
        if size > 0:
            spec["size_limit_bytes"] = size


def _regex_list(text: str, key: str, path: str, name: str, state: ImportState) -> list[str]:
    out = []
    for part in split_filter(text):
        if python_regex(part) is None:
            state.report.add(
                "changed",
                f"{path}.{key}",
                name,
                f"{key} {part!r} dropped",
                "Python's re cannot compile it (mihomo uses .NET-style regexp2)",
            )
            continue
        out.append(part)
    return out


def _health(raw: Any, path: str, name: str, state: ImportState) -> dict[str, Any] | None:
    if not isinstance(raw, Mapping):
        return None
    out: dict[str, Any] = {}
    enable = lookup(raw, "enable", dashes=False)
    out["enabled"] = False if enable is MISSING else weak_bool(enable, "enable")
    url = lookup(raw, "url", dashes=False)
    if url is not MISSING and weak_str(url, "url"):
        try:
            parse_probe_url(weak_str(url, "url"))
            out["url"] = weak_str(url, "url")
        except ValueError as ex:
            state.report.add("changed", f"{path}.url", name, "default probe URL", str(ex))
    interval = lookup(raw, "interval", dashes=False)
    if interval is not MISSING and weak_int(interval, "interval") > 0:
        out["interval_seconds"] = weak_int(interval, "interval")
    for key, why in _HEALTH_NOT_CARRIED.items():
        if lookup(raw, key, dashes=False) is not MISSING:
            state.report.add("skipped", f"{path}.{key}", name, key, why)
    for key in unknown_keys(raw, (*_HEALTH_KEYS, *_HEALTH_NOT_CARRIED), dashes=False):
        state.report.add(
            "skipped", f"{path}.{key}", name, key, "unknown key (mihomo ignores it too)"
        )
    return out


def _override(raw: Any, path: str, name: str, state: ImportState) -> dict[str, Any] | None:
    if not isinstance(raw, Mapping):
        return None
    out: dict[str, Any] = {}
    prefix = lookup(raw, "additional-prefix", dashes=False)
    if prefix is not MISSING:
        out["name_prefix"] = weak_str(prefix, "additional-prefix")
    suffix = lookup(raw, "additional-suffix", dashes=False)
    if suffix is not MISSING:
        out["name_suffix"] = weak_str(suffix, "additional-suffix")
    for key in unknown_keys(raw, _OVERRIDE_KEYS, dashes=False):
        state.report.add(
            "skipped",
            f"{path}.{key}",
            name,
            f"override {key}",
            "spliceway's provider override sets name prefix/suffix and connect timeout only",
        )
    return out


def _one_proxy_provider(name: str, raw: Any, state: ImportState) -> dict[str, Any] | None:
    path = f"proxy-providers.{name}"
    if not isinstance(raw, Mapping):
        state.report.add("skipped", path, name, "proxy provider", "must be a mapping")
        return None
    spec = _source(raw, path, name, "proxy", state)
    if spec is None:
        return None
    _common(raw, path, name, state, spec)
    text = lookup(raw, "filter", dashes=False)
    if text is not MISSING:
        filters = _regex_list(weak_str(text, "filter"), "filter", path, name, state)
        if filters:
            spec["filter"] = filters
    text = lookup(raw, "exclude-filter", dashes=False)
    if text is not MISSING:
        excludes = _regex_list(
            weak_str(text, "exclude-filter"), "exclude-filter", path, name, state
        )
        if excludes:
            spec["exclude_filter"] = excludes
    health = _health(lookup(raw, "health-check", dashes=False), f"{path}.health-check", name, state)
    if health:
        spec["health_check"] = health
    override = _override(lookup(raw, "override", dashes=False), f"{path}.override", name, state)
    if override:
        spec["override"] = override
    for key, why in _PROXY_NOT_CARRIED.items():
        if lookup(raw, key, dashes=False) is not MISSING:
            state.report.add("skipped", f"{path}.{key}", name, key, why)
    for key in unknown_keys(raw, (*_PROXY_KEYS, *_PROXY_NOT_CARRIED), dashes=False):
        state.report.add(
            "skipped", f"{path}.{key}", name, key, "unknown key (mihomo ignores it too)"
        )
    return spec


def convert_proxy_providers(raw: Any, state: ImportState) -> None:
    """``proxy-providers`` into ``state.proxy_providers`` (see the module)."""
    if raw is None:
        return
    if not isinstance(raw, Mapping):
        state.report.add("skipped", "proxy-providers", "", "proxy-providers", "must be a mapping")
        return
    for key, value in raw.items():
        name = str(key)
        if not name:
            continue
        try:
            spec = _one_proxy_provider(name, value, state)
        except WeakTypeError as ex:
            state.report.add("skipped", f"proxy-providers.{name}", name, "proxy provider", str(ex))
            continue
        if spec is not None:
            state.proxy_providers[name] = spec
            state.report.add("converted", f"proxy-providers.{name}", name, "proxy provider")


def _one_rule_provider(name: str, raw: Any, state: ImportState) -> dict[str, Any] | None:
    path = f"rule-providers.{name}"
    if not isinstance(raw, Mapping):
        state.report.add("skipped", path, name, "rule provider", "must be a mapping")
        return None
    behavior = lookup(raw, "behavior", dashes=False)
    behavior = "" if behavior is MISSING else weak_str(behavior, "behavior")
    if behavior not in ("domain", "ipcidr", "classical"):
        state.report.add(
            "skipped",
            path,
            name,
            "rule provider",
            f"behavior {behavior!r} is not domain, ipcidr or classical",
        )
        return None
    fmt = lookup(raw, "format", dashes=False)
    fmt = "yaml" if fmt is MISSING or fmt == "" else weak_str(fmt, "format")
    if fmt not in ("yaml", "text", "mrs"):
        state.report.add(
            "skipped", path, name, "rule provider", f"format {fmt!r} is not yaml, text or mrs"
        )
        return None
    if fmt == "mrs" and behavior == "classical":
        state.report.add(
            "skipped", path, name, "rule provider", "mrs holds domain or ipcidr sets only"
        )
        return None
    spec = _source(raw, path, name, "rule", state)
    if spec is None:
        return None
    if raw.get("type") == "inline":
        fmt = "yaml"
    spec["behavior"] = behavior
    spec["format"] = fmt
    _common(raw, path, name, state, spec)
    for key in unknown_keys(raw, _RULE_KEYS, dashes=False):
        state.report.add("skipped", f"{path}.{key}", name, key, "not carried by spliceway")
    return spec


def convert_rule_providers(raw: Any, state: ImportState) -> None:
    """``rule-providers`` into ``state.rule_providers`` (see the module)."""
    if raw is None:
        return
    if not isinstance(raw, Mapping):
        state.report.add("skipped", "rule-providers", "", "rule-providers", "must be a mapping")
        return
    for key, value in raw.items():
        name = str(key)
        if not name:
            continue
        try:
            spec = _one_rule_provider(name, value, state)
        except WeakTypeError as ex:
            state.report.add("skipped", f"rule-providers.{name}", name, "rule provider", str(ex))
            continue
        if spec is not None:
            state.rule_providers[name] = spec
            state.report.add(
                "converted",
                f"rule-providers.{name}",
                name,
                f"rule provider ({spec['behavior']}, {spec['format']})",
            )


def finish_providers(state: ImportState) -> None:
    """Resolve every provider's ``proxy`` to a tag, now that proxies and groups have
    theirs."""
    for specs in (state.proxy_providers, state.rule_providers):
        for spec in specs.values():
            pending = spec.pop("_via", None)
            if pending is None:
                continue
            text, path, name = pending
            via = resolve_via(text, path, name, state)
            if via is not None:
                spec["via"] = via
