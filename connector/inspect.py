"""Offline views of an outbox, for ``spliceway connector state`` while the engine is stopped.

They open the outbox read-only under a shared lock (so never while an engine
holds it) and change nothing on disk: recovery is computed, not applied.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import orjson
from spliceway.connector.diskgate import DiskGate
from spliceway.connector.outbox import OutboxStore

from spliceway.config import Config
from spliceway.errors import ApiError


def _store(config: Config) -> OutboxStore:
    if config.api.outbox_path is None:
        raise ApiError(
            "not_found", "the configuration has no api.outbox_path", field_path="api.outbox_path"
        )
    return OutboxStore(config.api.outbox_path, readonly=True)


def outbox_state(config: Config) -> dict[str, Any]:
    """Each configured sink's pending count, dead letters, storage and recovery state."""
    api = config.api
    store = _store(config)
    try:
        gate = DiskGate(store.path, api.outbox_min_free_bytes, api.outbox_min_free_percent)
        storage = gate.read()
        blocked = not storage.allows(0)
        sinks = []
        for spec in api.event_sinks:
            outbox = store.open_sink(spec.tag)
            try:
                sinks.append(
                    {
                        "name": spec.tag,
                        "type": spec.type,
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
