"""Offline views of an outbox, for ``spliceway connector state`` while the engine is stopped.

They open the outbox read-only under a shared lock (so never while an engine
holds it) and change nothing on disk: recovery is computed, not applied.
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from typing import Any

import orjson
from spliceway.connector.diskgate import DiskGate
from spliceway.connector.outbox import DiskOutbox, OutboxStore, sink_dir_name

from spliceway.config import Config
from spliceway.errors import ApiError


def _store(config: Config) -> OutboxStore:
    if config.api.outbox_path is None:
        raise ApiError(
            "not_found", "the configuration has no api.outbox_path", field_path="api.outbox_path"
        )
    return OutboxStore(config.api.outbox_path, readonly=True)


def outbox_state(config: Config) -> dict[str, Any]:
    """Each sink's pending count, dead letters, storage and recovery state: the configured
    ones, then any the outbox still holds for a sink no longer configured (a reload removed
    it), with ``configured: false``."""
    api = config.api
    store = _store(config)
    try:
        gate = DiskGate(store.path, api.outbox_min_free_bytes, api.outbox_min_free_percent)
        storage = gate.read()
        blocked = not storage.allows(0)
        sinks = []
        configured = {sink_dir_name(spec.tag): spec for spec in api.event_sinks}
        unconfigured = sorted(set(_sink_dirs(store.path)) - set(configured))
        listed = [(spec.tag, spec.type, store.sink_directory(spec.tag)) for spec in api.event_sinks]
        listed += [
            (_tag_of(name), None, os.path.join(store.path, "sinks", name)) for name in unconfigured
        ]
        for name, kind, directory in listed:
            outbox = DiskOutbox(directory, readonly=True, segment_bytes=store.segment_bytes)
            try:
                sinks.append(
                    {
                        "name": name,
                        "type": kind,
                        "configured": kind is not None,
                        "pending": outbox.pending,
                        "dead_letters": outbox.dead_letters,
                        "outbox_storage": storage.to_dict(blocked),
                        "outbox_recovery": outbox.recovery.to_dict(),
                    }
                )
            finally:
                outbox.close()
    finally:
        store.close()
    return {"outbox_path": store.path, "sinks": sinks}


def _sink_dirs(path: str) -> list[str]:
    try:
        return [e.name for e in os.scandir(os.path.join(path, "sinks")) if e.is_dir()]
    except FileNotFoundError:
        return []


def _tag_of(directory: str) -> str:
    """The sink tag a directory name stands for (the name itself when it was shortened)."""
    quoted = directory.removeprefix("t-")
    if "%h" in quoted:
        return directory
    return urllib.parse.unquote(quoted, errors="surrogatepass")


def dead_letters(config: Config) -> Iterator[dict[str, Any]]:
    """Every dead letter of every configured sink, oldest first, with why it failed."""
    store = _store(config)
    try:
        for spec in config.api.event_sinks:
            outbox = store.open_sink(spec.tag)
            try:
                for meta, body in outbox.iter_dead_letters():
                    try:
                        envelope = orjson.loads(body)
                    except orjson.JSONDecodeError:
                        envelope = {}
                    yield {
                        "sink": spec.tag,
                        "event_id": envelope.get("event_id"),
                        "event_type": envelope.get("event_type"),
                        **meta,
                        "envelope": envelope,
                    }
            finally:
                outbox.close()
    finally:
        store.close()
