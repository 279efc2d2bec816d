"""Views of an outbox for ``spliceway connector state`` and ``connector dead-letters``.

Offline (:func:`outbox_state`, :func:`dead_letters`), while no engine holds the
outbox: they open it read-only under a shared lock (so never while an engine holds
it) and change nothing on disk: recovery is computed, not applied.

Live (:func:`live_state`, the IPC request ``connector_state``), from the engine that
holds the outbox: the configured sinks as the ``sinks`` query reports them, and the
outboxes of sinks a reload removed read from disk the same read-only way (no part of
the engine writes them; the apply lock keeps a reload from re-adding one meanwhile).
"""

from __future__ import annotations

import os
import urllib.parse
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import orjson

from spliceway.config import Config
from spliceway.connector.diskgate import DiskGate, Storage
from spliceway.connector.outbox import DiskOutbox, OutboxStore, sink_dir_name
from spliceway.errors import ApiError

if TYPE_CHECKING:
    from spliceway.engine.core import EngineCore

#: How long a live read waits for an apply in progress to finish.
APPLY_WAIT_S = 10.0


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
        sinks = []
        for spec in api.event_sinks:
            item = _read_sink(store.sink_directory(spec.tag), store.segment_bytes, storage)
            sinks.append({"name": spec.tag, "type": spec.type, "configured": True, **item})
        sinks += _removed_sinks(store, {spec.tag for spec in api.event_sinks}, storage)
    finally:
        store.close()
    return {"outbox_path": store.path, "source": "disk", "sinks": sinks}


def live_state(core: EngineCore) -> dict[str, Any]:
    """:func:`outbox_state`'s shape from the running engine that holds the outbox: each
    configured sink's live status item (``configured: true``), then each sink a reload
    removed, its backlog read from disk. ``not_found`` when the engine has no outbox open.
    """
    if not core.apply_lock.acquire(timeout=APPLY_WAIT_S):
        raise ApiError("conflict", "a configuration apply is in progress; try again")
    try:
        connector = core.connector
        store = connector.store
        if store is None:
            raise ApiError(
                "not_found",
                "the running engine has no outbox open (no api.outbox_path, or no sink)",
                field_path="api.outbox_path",
            )
        sinks = [{**item, "configured": True} for item in connector.status()]
        storage = None
        if connector.gate is not None:
            try:
                storage = connector.gate.read()
            except OSError:
                storage = None
        configured = {spec.tag for spec in connector.api.event_sinks}
        sinks += _removed_sinks(store, configured, storage)
        return {"outbox_path": store.path, "source": "engine", "sinks": sinks}
    finally:
        core.apply_lock.release()


def _removed_sinks(
    store: OutboxStore, configured: set[str], storage: Storage | None
) -> list[dict[str, Any]]:
    """The outboxes ``store`` holds for sinks not in ``configured``, by directory name."""
    names = {sink_dir_name(tag) for tag in configured}
    items = []
    for name in sorted(set(_sink_dirs(store.path)) - names):
        directory = os.path.join(store.path, "sinks", name)
        item = _read_sink(directory, store.segment_bytes, storage)
        items.append({"name": _tag_of(name), "type": None, "configured": False, **item})
    return items


def _read_sink(directory: str, segment_bytes: int, storage: Storage | None) -> dict[str, Any]:
    """One sink's outbox on disk, read-only: pending, dead letters, storage, recovery."""
    outbox = DiskOutbox(directory, readonly=True, segment_bytes=segment_bytes)
    try:
        item: dict[str, Any] = {"pending": outbox.pending, "dead_letters": outbox.dead_letters}
        if storage is not None:
            item["outbox_storage"] = storage.to_dict(not storage.allows(0))
        item["outbox_recovery"] = outbox.recovery.to_dict()
        return item
    finally:
        outbox.close()


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
