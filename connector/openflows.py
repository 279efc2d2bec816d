"""Which flows a sink's outbox shows started and not completed (crash completion).

A sink that selects ``flow.completed`` is owed exactly one final record per flow it
was told about, even when the engine is killed: at the next start the engine
completes every flow that sink's outbox holds a flow event of (``flow.started``,
``flow.routed``, ``flow.updated``) and no ``flow.completed`` for, with outcome
``engine_crashed`` (docs/events.md).

The outbox's records are the truth, but acknowledged segments are deleted, and a
long-lived flow's ``flow.started`` may be in one of them. So each tracking outbox
keeps, in memory, the open flows of the records it committed (per flow its newest
lifecycle body and its newest ``flow.updated`` body), and writes them to a
checkpoint file, ``flows``, *before* it deletes any segment: the checkpoint says
"these were open after record id M", and recovery replays the records above M that
are still on disk. Records at or below M may be deleted at any time after the
checkpoint is durable; records above it never are before the next one.

A checkpoint costs as many bytes as the open flows' bodies, so it is written only
when the segments it lets go hold at least as many bytes: the outbox never writes
more for the checkpoint than it reclaims (segments then stay a little longer).

File format: records framed as the segments' (``segments.frame``): first a header
record (id 0) ``spliceway-open-flows 1 <M>``, then each kept body with the record
id it had in the outbox, oldest first. It is replaced whole (temporary file, fsync,
rename, fsync of the directory), so a crash leaves the old or the new one; a damaged
one is ignored (its flows can no longer be completed) and counted in the recovery
errors, never raised.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

import orjson

from spliceway.connector import segments

FILE_NAME = "flows"
_MAGIC = b"spliceway-open-flows 1 "
_COMPLETED = "flow.completed"
_UPDATED = "flow.updated"
_OPENING = frozenset({"flow.started", "flow.routed"})
_TYPE_KEY = b'"event_type":"'
_FLOW_ID_KEY = b'"payload":{"flow_id":"'
_TYPE_LEN = len(_TYPE_KEY)
_FLOW_ID_LEN = len(_FLOW_ID_KEY)
#: The flow event types, by their bytes (one lookup instead of a decode per event).
_KINDS = {
    k.encode(): k for k in ("flow.started", "flow.routed", "flow.updated", "flow.completed")
}
#: The engine writes ``event_type`` third, well inside this many bytes of an envelope.
_HEAD = 256


def flow_event_of(body: bytes) -> tuple[str, str] | None:
    """``(event type, flow id)`` of a flow event's envelope JSON; None for any other event.

    The engine's envelopes have ``event_type`` among their first keys and ``flow_id``
    first in a flow event's payload, so both are found without decoding the body (this
    runs for every committed event); any other shape is decoded in full. Labels and the
    principal key are strings, so the quoted keys looked for cannot occur inside them.
    """
    at = body.find(_TYPE_KEY, 0, _HEAD)
    if at >= 0:
        start = at + _TYPE_LEN
        if not body.startswith(b"flow.", start):
            return None
        end = body.find(b'"', start)
        kind = _KINDS.get(body[start:end])
        at = body.find(_FLOW_ID_KEY, end)
        if kind is not None and at >= 0:
            id_start = at + _FLOW_ID_LEN
            id_end = body.find(b'"', id_start)
            flow_id = body[id_start:id_end]
            if id_end > id_start and b"\\" not in flow_id:
                return kind, flow_id.decode()
    try:
        doc = orjson.loads(body)
        kind, flow_id = doc["event_type"], doc["payload"]["flow_id"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        return None
    if isinstance(kind, str) and kind.startswith("flow.") and isinstance(flow_id, str):
        return kind, flow_id
    return None


class OpenFlows:
    """The open flows of one sink's committed records: flow id -> newest bodies."""

    def __init__(self) -> None:
        #: flow id -> [(record id, newest started/routed body) | None,
        #:             (record id, newest flow.updated body) | None]
        self.flows: dict[str, list[tuple[int, bytes] | None]] = {}
        #: The bodies' total size (what a checkpoint would write).
        self.bytes = 0
        #: Records up to this id are reflected here.
        self.through_id = 0

    def note(self, record_id: int, body: bytes) -> None:
        """Take one committed record into account (in record id order)."""
        if record_id > self.through_id:
            self.through_id = record_id
        found = flow_event_of(body)
        if found is None:
            return
        kind, flow_id = found
        if kind == _COMPLETED:
            slots = self.flows.pop(flow_id, None)
            if slots is not None:
                for slot in slots:
                    if slot is not None:
                        self.bytes -= len(slot[1])
            return
        if kind == _UPDATED:
            index = 1
        elif kind in _OPENING:
            index = 0
        else:
            return  # flow.snapshot never reaches a sink; anything newer is not tracked
        slots = self.flows.get(flow_id)
        if slots is None:
            slots = self.flows[flow_id] = [None, None]
        else:
            old = slots[index]
            if old is not None:
                self.bytes -= len(old[1])
        slots[index] = (record_id, body)
        self.bytes += len(body)

    def forget(self, flow_id: str) -> None:
        """Stop tracking ``flow_id`` (it can never be completed)."""
        for slot in self.flows.pop(flow_id, ()):
            if slot is not None:
                self.bytes -= len(slot[1])

    def bodies(self, flow_id: str) -> list[bytes]:
        """The kept bodies of ``flow_id``, oldest first."""
        return [s[1] for s in sorted(s for s in self.flows.get(flow_id, ()) if s is not None)]

    def copy(self) -> OpenFlows:
        """A copy to write out while the original goes on changing."""
        out = OpenFlows()
        out.flows = {k: list(v) for k, v in self.flows.items()}
        out.bytes = self.bytes
        out.through_id = self.through_id
        return out

    def encode(self) -> bytes:
        """The checkpoint file's bytes."""
        entries = sorted(s for slots in self.flows.values() for s in slots if s is not None)
        parts = [segments.frame(0, _MAGIC + str(self.through_id).encode())]
        parts.extend(segments.frame(record_id, body) for record_id, body in entries)
        return b"".join(parts)

    @classmethod
    def decode(cls, data: bytes) -> OpenFlows:
        """A checkpoint file's flows; ValueError when it is not one, whole."""
        items = list(segments.scan(data))
        if not items or not isinstance(items[0], segments.Record):
            raise ValueError("no header")
        header = items[0].payload
        if items[0].record_id != 0 or not header.startswith(_MAGIC):
            raise ValueError("not an open-flows checkpoint")
        out = cls()
        for item in items[1:]:
            if isinstance(item, segments.Damage):
                raise ValueError(f"damaged at byte {item.start}")
            out.note(item.record_id, item.payload)
        out.through_id = int(header[len(_MAGIC) :])
        return out


def read_checkpoint(directory: str) -> OpenFlows:
    """The checkpoint in ``directory`` (empty when there is none); ValueError or OSError
    when it cannot be read whole."""
    try:
        with open(os.path.join(directory, FILE_NAME), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return OpenFlows()
    return OpenFlows.decode(data)


def write_checkpoint(directory: str, flows: OpenFlows) -> None:
    """Replace the checkpoint in ``directory`` with ``flows``, durably (OSError)."""
    path = os.path.join(directory, FILE_NAME)
    tmp = path + ".tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(flows.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_checkpoint(directory: str) -> None:
    """Drop the checkpoint (a sink that no longer selects ``flow.completed``)."""
    for name in (FILE_NAME, FILE_NAME + ".tmp"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(directory, name))


def sizes(paths: Iterable[str]) -> int:
    """Total size of the files at ``paths`` (missing ones count 0)."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError):
            total += os.path.getsize(path)
    return total
