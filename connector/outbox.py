"""The durable outbox: each sink's undelivered events, on disk, in order.

Contract
--------
- **Accepted means durable.** The connector's intake appends a batch of event
  bodies and then ``commit()``s it: ``fdatasync`` of every segment written, and
  of the directory when a segment was created. Only committed records are given
  to the sink (``take``), and only after ``commit()`` returns may the intake
  advance its cursor in the event log. The intake commits every few
  milliseconds, well inside the 100 ms group-commit bound.
- **Leaves only after a 2xx and a durable ACK.** The sink ``ack``s records in
  order; ``flush_acks()`` writes the ACK ledger in place and ``fdatasync``s it;
  only then are fully acknowledged segments unlinked (ledger first, unlink
  second, so a crash in between leaves a segment the next start deletes).
- **Recovery** reads the ledger (two checksummed slots), then scans every
  segment: a record with an id at or below the ACK is done; the rest are
  delivered again, with the same body and so the same ``event_id``. A damaged
  region in the middle is skipped and the records it held are counted exactly
  from the id gap; damage running to the end of the newest segment is a write
  the crash tore before it was committed, and is truncated. Missing segments
  show up as id gaps too. Nothing in recovery raises for damaged data, so a
  bad file can never make the engine crash-loop.
- **Dead letters** go to their own segment log (``dead/``), fsynced before the
  original is acknowledged; they are kept, never compacted.
- **One process.** ``OutboxStore`` holds an exclusive ``flock`` on ``LOCK`` for
  its lifetime; a second engine on the same path is refused at start.

Layout::

    <outbox_path>/FORMAT                 "spliceway-outbox 1"
    <outbox_path>/LOCK                   flock'd by the running engine (holds its pid)
    <outbox_path>/sinks/t-<tag>/ledger   ACK ledger (ledger.py)
    <outbox_path>/sinks/t-<tag>/seg-*.log    records (segments.py; segment_log.py scans them)
    <outbox_path>/sinks/t-<tag>/dead/seg-*.log  dead letters

Threads: the intake calls ``append``/``commit``; the sink actor calls ``take``,
``ack``, ``flush_acks`` and ``dead_letter``. A lock guards what both touch.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import struct
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from spliceway.connector import openflows, segments
from spliceway.connector.ledger import Ledger, read_ledger
from spliceway.connector.openflows import OpenFlows
from spliceway.connector.segment_log import Recovery, SegmentLog, fsync_dir
from spliceway.errors import ApiError

logger = logging.getLogger(__name__)

FORMAT = b"spliceway-outbox 1\n"
#: Segments are the unit of reclaiming space.
SEGMENT_BYTES = 16 * 1024 * 1024
#: Without an outbox, sinks hold at most this many events in memory; past it the
#: intake stops taking events for that sink, as it does when the disk is full.
MEMORY_CAPACITY = 100_000
#: At most one warning this often per outbox while its checkpoint cannot be written.
_CHECKPOINT_WARN_S = 60.0
#: Longest percent-encoded tag used as is (file names are at most 255 bytes).
_MAX_QUOTED = 200


@dataclass(frozen=True, slots=True)
class Item:
    """One accepted event body, as the sink delivers it."""

    record_id: int
    body: bytes


class Outbox(Protocol):
    """What the intake and a sink need from an outbox (disk or memory)."""

    durable: bool
    recovery: Recovery

    @property
    def pending(self) -> int: ...
    @property
    def dead_letters(self) -> int: ...
    def append(self, bodies: Sequence[bytes]) -> None: ...
    def commit(self) -> int: ...
    def take(self, limit: int) -> list[Item]: ...
    def ack(self, record_id: int) -> None: ...
    def flush_acks(self) -> int: ...
    @property
    def unflushed_acks(self) -> int: ...
    def dead_letter(self, item: Item, meta: dict[str, Any]) -> None: ...
    def close(self) -> None: ...


def sink_dir_name(tag: str) -> str:
    """Directory name for a sink tag: any tag, no path tricks, within NAME_MAX.

    Percent-encoding is injective; a name too long for a directory keeps a prefix
    and the tag's SHA-256 after ``%h``, which percent-encoding never produces."""
    raw = tag.encode("utf-8", "surrogatepass")
    quoted = urllib.parse.quote(raw, safe="")
    if len(quoted) <= _MAX_QUOTED:
        return "t-" + quoted
    return "t-" + quoted[:120] + "%h" + hashlib.sha256(raw).hexdigest()


class DiskOutbox:
    """One sink's outbox in ``directory`` (see the module contract)."""

    durable = True

    def __init__(
        self,
        directory: str,
        *,
        readonly: bool = False,
        segment_bytes: int = SEGMENT_BYTES,
        track_flows: bool = False,
    ) -> None:
        """Open (and recover) the outbox in ``directory``. With ``track_flows`` (its sink
        selects ``flow.completed``) it keeps the open flows of its records (openflows.py);
        ``orphans`` are those a previous run left open."""
        self.directory = directory
        self.readonly = readonly
        if not readonly:
            os.makedirs(os.path.join(directory, "dead"), exist_ok=True)
        self.recovery = Recovery()
        #: The open flows of the committed records (None when not tracked).
        self.flows: OpenFlows | None = None
        #: Flow id -> its kept bodies, oldest first: the flows a previous run of the
        #: engine left started and not completed in this outbox, as it was opened.
        self.orphans: dict[str, list[bytes]] = {}
        checkpoint_damaged = False
        if track_flows and not readonly:
            try:
                self.flows = openflows.read_checkpoint(directory)
            except (OSError, ValueError) as ex:
                # Its flows can no longer be completed; the records on disk still count.
                self.recovery.errors.append(f"open-flows checkpoint ignored: {ex}")
                checkpoint_damaged = True
                self.flows = OpenFlows()
        elif not readonly:
            with contextlib.suppress(OSError):
                openflows.remove_checkpoint(directory)
        self._lock = threading.Lock()
        ledger_path = os.path.join(directory, "ledger")
        if readonly:
            state = read_ledger(ledger_path)
            self._ledger: Ledger | None = None
            acked = state.acked_id
            self.recovery.damaged_ledger_slots = state.damaged_slots
        else:
            self._ledger = Ledger(ledger_path)
            acked = self._ledger.acked_id
            self.recovery.damaged_ledger_slots = self._ledger.damaged_slots
        self._durable_acked = acked
        self._acked = acked
        self._acked_since_flush = 0
        self._log = SegmentLog(directory, readonly=readonly, segment_bytes=segment_bytes)
        visit = None
        flows = self.flows
        if flows is not None:
            through = flows.through_id

            def visit(record: segments.Record) -> None:
                if record.record_id > through:
                    flows.note(record.record_id, record.payload)

        held, self._read_pos = self._log.recover(
            acked, self.recovery, visit, delete_acked=flows is None
        )
        if flows is not None:
            self.orphans = {flow_id: flows.bodies(flow_id) for flow_id in flows.flows}
        self._held = held
        #: Appended and not yet committed: (first record id, bodies) per append.
        self._unnoted: list[tuple[int, Sequence[bytes]]] = []
        self._checkpoint_warn_at = 0.0
        self._committed = self._log.end()
        self._uncommitted = 0
        self._uncommitted_start = self._committed
        self._uncommitted_first = self._log.next_id
        dead_dir = os.path.join(directory, "dead")
        self._dead = SegmentLog(dead_dir, readonly=readonly, segment_bytes=segment_bytes)
        dead_recovery = Recovery()
        self._dead_count, _ = self._dead.recover(0, dead_recovery)
        self.recovery.damaged_regions += dead_recovery.damaged_regions
        r = self.recovery
        if flows is not None:
            # Acknowledged segments a crash left behind, once the checkpoint covers them.
            self._reclaim(acked)
        if (
            checkpoint_damaged
            or r.lost_records
            or r.damaged_regions
            or r.truncated_bytes
            or r.unreadable_segments
            or r.damaged_ledger_slots
        ):
            r.state = "repaired"

    # -- intake side ----------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Events accepted and not yet durably acknowledged (the whole disk backlog)."""
        return self._held + self._uncommitted

    @property
    def dead_letters(self) -> int:
        """Dead letters kept on disk."""
        return self._dead_count

    def append(self, bodies: Sequence[bytes]) -> None:
        """Write ``bodies`` as records; durable only after ``commit``. Raises OSError."""
        if not bodies:
            return
        if not self._uncommitted:
            self._uncommitted_start = self._log.end()
            self._uncommitted_first = self._log.next_id
        reclaimable = self._durable_acked >= self._log.next_id - 1
        first = self._log.next_id
        try:
            with self._lock:
                self._log.append(bodies, reclaimable)
        except OSError:
            self._rollback()
            raise
        self._uncommitted += len(bodies)
        if self.flows is not None:
            self._unnoted.append((first, bodies))

    def commit(self) -> int:
        """Make appended records durable and visible to ``take``; returns how many.
        On failure nothing appended since the last commit counts as written."""
        if not self._uncommitted:
            return 0
        try:
            self._log.sync()
        except OSError:
            # After a failed fsync the written pages' fate is unknown: drop them.
            self._rollback()
            raise
        n = self._uncommitted
        with self._lock:
            self._committed = self._log.end()
            self._held += n
            self._uncommitted = 0
            if self.flows is not None:
                for first, bodies in self._unnoted:
                    for i, body in enumerate(bodies):
                        self.flows.note(first + i, body)
                self._unnoted = []
        return n

    def _rollback(self) -> None:
        with self._lock:
            self._log.truncate_to(self._uncommitted_start)
        self._log.next_id = self._uncommitted_first
        self._uncommitted = 0
        self._unnoted = []

    # -- sink side ------------------------------------------------------------------

    def take(self, limit: int) -> list[Item]:
        """The next committed records after those already taken, at most ``limit``."""
        with self._lock:
            committed = self._committed
        records, self._read_pos = self._log.read(self._read_pos, committed, limit)
        return [Item(r.record_id, r.payload) for r in records if r.record_id > self._acked]

    def ack(self, record_id: int) -> None:
        """The record is delivered (or disposed of); in memory until ``flush_acks``."""
        if record_id <= self._acked:
            return  # already acknowledged: counting it again would skew ``pending``
        self._acked = record_id
        self._acked_since_flush += 1

    def flush_acks(self) -> int:
        """Write the ACK ledger durably, then reclaim whole acknowledged segments.
        Returns how many ACKs became durable; raises OSError (ACKs stay pending)."""
        if self._ledger is None or self._acked == self._durable_acked:
            return 0
        self._ledger.write(self._acked)
        n = self._acked_since_flush
        with self._lock:
            self._durable_acked = self._acked
            self._held -= n
            self._acked_since_flush = 0
            if self.flows is None:
                self._log.delete_through(self._durable_acked)
        if self.flows is not None:
            self._reclaim(self._durable_acked)
        return n

    def find_completions(self, flow_ids: set[str]) -> dict[str, bytes]:
        """The ``flow.completed`` bodies of ``flow_ids`` this outbox still holds on disk
        (a read-only scan of every segment; one deleted meanwhile is skipped)."""
        found: dict[str, bytes] = {}
        if not flow_ids:
            return found
        for _, path in segments.list_segments(self.directory):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError:
                continue
            for item in segments.scan(data):
                if isinstance(item, segments.Damage):
                    continue
                event = openflows.flow_event_of(item.payload)
                if event is not None and event[0] == "flow.completed" and event[1] in flow_ids:
                    found[event[1]] = item.payload
        return found

    def forget_flow(self, flow_id: str) -> None:
        """Stop tracking an open flow that cannot be completed (its kept events are not
        readable as flow events): the next checkpoint leaves it out."""
        self.orphans.pop(flow_id, None)
        if self.flows is not None:
            with self._lock:
                self.flows.forget(flow_id)

    def _reclaim(self, acked_id: int) -> None:
        """Delete the segments acknowledged through ``acked_id``, after a checkpoint of
        the open flows covers them, when they free at least what it writes
        (openflows.py); a checkpoint that cannot be written keeps them."""
        assert self.flows is not None
        with self._lock:
            doomed = self._log.deletable(acked_id)
            open_bytes = self.flows.bytes
        if not doomed or openflows.sizes(doomed) < open_bytes:
            return
        with self._lock:
            # The commits since only add records above the snapshot's id: never deleted here.
            snapshot = self.flows.copy()
        try:
            openflows.write_checkpoint(self.directory, snapshot)
        except OSError as ex:
            full = ex.errno in (errno.ENOSPC, errno.EDQUOT)
            now = time.monotonic()
            if now >= self._checkpoint_warn_at:
                self._checkpoint_warn_at = now + _CHECKPOINT_WARN_S
                logger.warning(
                    "outbox %s: cannot write the open-flows checkpoint: %s%s",
                    self.directory,
                    ex,
                    "; deleting acknowledged segments without it (flows they started will "
                    "not be completed after a crash)"
                    if full
                    else "",
                )
            if not full:
                return  # the segments stay until a checkpoint can be written
            # Space comes first on a full disk. The old checkpoint goes before the segments
            # do: with neither, recovery sees only the records left, which may miss a
            # flow's start but never shows a completed flow open.
            try:
                openflows.remove_checkpoint(self.directory)
                fsync_dir(self.directory)
            except OSError:
                return
        with self._lock:
            self._log.delete_through(acked_id)

    @property
    def unflushed_acks(self) -> int:
        """ACKs not yet durable."""
        return self._acked_since_flush

    def dead_letter(self, item: Item, meta: dict[str, Any]) -> None:
        """Keep ``item`` with why it failed, durably, before the caller acks it."""
        header = orjson.dumps(meta)
        start, first = self._dead.end(), self._dead.next_id
        try:
            self._dead.append([struct.pack("<I", len(header)) + header + item.body], False)
            self._dead.sync()
        except OSError:
            # Like a failed commit: drop the partial write, so a retry does not
            # append behind garbage (a damaged region at the next start).
            self._dead.truncate_to(start)
            self._dead.next_id = first
            raise
        self._dead_count += 1

    def iter_dead_letters(self) -> Iterator[tuple[dict[str, Any], bytes]]:
        """Every dead letter: ``(meta, body)``."""
        position = (0, 0)
        while True:
            records, position = self._dead.read(position, self._dead.end(), 256)
            if not records:
                return
            for r in records:
                (n,) = struct.unpack_from("<I", r.payload)
                yield orjson.loads(r.payload[4 : 4 + n]), r.payload[4 + n :]

    def close(self) -> None:
        """Close files (ACKs not flushed stay unacknowledged: redelivered next start)."""
        self._log.close()
        self._dead.close()
        if self._ledger is not None:
            self._ledger.close()


class MemoryOutbox:
    """A sink's queue when no ``api.outbox_path`` is configured: not durable."""

    durable = False

    def __init__(self, capacity: int = MEMORY_CAPACITY) -> None:
        self.capacity = capacity
        self.recovery = Recovery()
        self._items: deque[Item] = deque()
        self._next_id = 1
        self._read = 0
        self._lock = threading.Lock()
        self._dead = 0

    @property
    def pending(self) -> int:
        """Events accepted and not yet delivered."""
        return len(self._items)

    @property
    def dead_letters(self) -> int:
        """Events that failed for good (kept only as a count without an outbox)."""
        return self._dead

    @property
    def unflushed_acks(self) -> int:
        """Always 0: a memory ACK is final at once."""
        return 0

    def room(self) -> int:
        """How many more events fit."""
        return max(0, self.capacity - len(self._items))

    def has_room(self, n: int) -> bool:
        """Whether ``n`` more events fit."""
        return n <= self.room()

    def append(self, bodies: Sequence[bytes]) -> None:
        """Queue ``bodies``."""
        with self._lock:
            for body in bodies:
                self._items.append(Item(self._next_id, body))
                self._next_id += 1

    def commit(self) -> int:
        """Nothing to make durable."""
        return 0

    def take(self, limit: int) -> list[Item]:
        """The next queued items after those already taken."""
        with self._lock:
            out: list[Item] = []
            while self._read < len(self._items) and len(out) < limit:
                out.append(self._items[self._read])
                self._read += 1
        return out

    def ack(self, record_id: int) -> None:
        """Drop the head item (items are acked in order)."""
        with self._lock:
            if self._items and self._items[0].record_id == record_id:
                self._items.popleft()
                self._read = max(0, self._read - 1)

    def flush_acks(self) -> int:
        """Nothing to flush."""
        return 0

    def dead_letter(self, item: Item, meta: dict[str, Any]) -> None:
        """Count it; without an outbox there is nowhere to keep it."""
        self._dead += 1

    def close(self) -> None:
        """Nothing to close."""


class OutboxStore:
    """The outbox directory: format marker, process lock, one ``DiskOutbox`` per sink."""

    def __init__(
        self, path: str, *, readonly: bool = False, segment_bytes: int = SEGMENT_BYTES
    ) -> None:
        self.path = path
        self.readonly = readonly
        self.segment_bytes = segment_bytes
        self._lock_fd: int | None = None
        try:
            # Look before touching anything: an outbox of another format stays as is.
            new = self._check_format()
            if not readonly:
                os.makedirs(path, exist_ok=True)
            self._take_lock()
            if new and not readonly:
                self._write_format()
            if not readonly:
                os.makedirs(os.path.join(path, "sinks"), exist_ok=True)
        except OSError as ex:
            self.close()
            raise ApiError(
                "internal",
                f"cannot open the outbox at {path}: {ex.strerror or ex}",
                field_path="api.outbox_path",
            ) from ex

    def _check_format(self) -> bool:
        """Whether the outbox is new (no marker yet); raises ApiError for another format."""
        marker = os.path.join(self.path, "FORMAT")
        try:
            with open(marker, "rb") as f:
                found = f.read(64)
        except FileNotFoundError:
            if self.readonly:
                raise ApiError(
                    "not_found", f"no outbox at {self.path}", field_path="api.outbox_path"
                ) from None
            return True
        if found != FORMAT:
            raise ApiError(
                "unsupported",
                f"the outbox at {self.path} has format {found.strip()[:40]!r}; this build reads "
                f"{FORMAT.strip()!r} and will not touch it",
                field_path="api.outbox_path",
            )
        return False

    def _write_format(self) -> None:
        """Write the marker whole or not at all (a torn one would read as a foreign format)."""
        marker = os.path.join(self.path, "FORMAT")
        tmp = marker + ".tmp"
        with open(tmp, "wb") as f:
            f.write(FORMAT)
            os.fsync(f.fileno())
        os.replace(tmp, marker)
        fsync_dir(self.path)

    def _take_lock(self) -> None:
        lock_path = os.path.join(self.path, "LOCK")
        flags = os.O_RDONLY if self.readonly else os.O_RDWR | os.O_CREAT
        try:
            fd = os.open(lock_path, flags | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            return  # read-only look at an outbox no engine ever locked
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.readonly else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except OSError as ex:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            if ex.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise ApiError(
                    "conflict",
                    f"the outbox at {self.path} is in use by a running spliceway (pid {holder})",
                    field_path="api.outbox_path",
                ) from None
            raise
        if not self.readonly:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def sink_directory(self, tag: str) -> str:
        """Where sink ``tag`` keeps its files."""
        return os.path.join(self.path, "sinks", sink_dir_name(tag))

    def open_sink(self, tag: str, *, track_flows: bool = False) -> DiskOutbox:
        """The outbox of sink ``tag`` (recovered); ``track_flows`` as for DiskOutbox."""
        return DiskOutbox(
            self.sink_directory(tag),
            readonly=self.readonly,
            segment_bytes=self.segment_bytes,
            track_flows=track_flows,
        )

    def close(self) -> None:
        """Release the process lock."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
