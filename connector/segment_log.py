"""The outbox's segment log: records in append-only segment files, and their recovery.

A :class:`SegmentLog` is one directory of ``seg-*.log`` files (the record format is
segments.py's): it appends records with the next ids, makes them durable when asked
(``sync``), reads them back from a position, unlinks fully acknowledged segments, and on
opening scans every segment, truncating a torn tail and counting damage and id gaps into
a :class:`Recovery`. It has no durability policy of its own: the outbox (outbox.py)
decides when to sync, what is acknowledged and when segments go.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from spliceway.connector import segments

#: A fully acknowledged segment at least this big is closed early, so a small
#: disk gets its space back without waiting for the segment to fill.
RECLAIM_BYTES = 1024 * 1024
_READ_CHUNK = 1024 * 1024


@dataclass(slots=True)
class Recovery:
    """What opening the outbox found (``outbox_recovery`` in the sinks resource)."""

    #: ``clean``, or ``repaired`` (damage was found and worked around).
    state: str = "clean"
    recovered_records: int = 0
    lost_records: int = 0
    damaged_regions: int = 0
    truncated_bytes: int = 0
    damaged_ledger_slots: int = 0
    unreadable_segments: int = 0
    errors: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON shape."""
        return asdict(self)


def fsync_dir(path: str) -> None:
    """``fsync`` a directory, so the files created or unlinked in it stay so."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclass(slots=True)
class _Segment:
    first_id: int
    path: str
    #: Highest record id written to it (0 if none yet).
    last_id: int = 0


@dataclass(slots=True)
class _Scan:
    """One segment as recovery read it."""

    seg: _Segment
    size: int
    first_pending_offset: int | None = None


class SegmentLog:
    """An append-only log of records in segment files (no durability policy of its own)."""

    def __init__(self, directory: str, *, readonly: bool, segment_bytes: int) -> None:
        self.directory = directory
        self.readonly = readonly
        self.segment_bytes = segment_bytes
        self.segments: list[_Segment] = []
        self._fd: int | None = None
        self._size = 0
        self.next_id = 1
        self._dirty: set[int] = set()
        self._created = False

    # -- recovery -------------------------------------------------------------------

    def recover(
        self,
        acked_id: int,
        recovery: Recovery,
        visit: Callable[[segments.Record], None] | None = None,
        *,
        delete_acked: bool = True,
    ) -> tuple[int, tuple[int, int]]:
        """Scan every segment; return ``(records pending above acked_id, read position)``.

        The read position is ``(segment first id, offset)`` of the first pending record.
        ``visit`` sees every intact record, acknowledged or not, in id order. Segments a
        crash left behind fully acknowledged are deleted unless ``delete_acked`` is
        false (the caller deletes them once its own state no longer needs them).
        """
        scans: list[_Scan] = []
        found = segments.list_segments(self.directory)
        expect = acked_id + 1
        pending = 0
        for index, (first_id, path) in enumerate(found):
            seg = _Segment(first_id, path)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as ex:
                recovery.unreadable_segments += 1
                recovery.errors.append(f"{os.path.basename(path)}: {ex.strerror or ex}")
                continue
            scan = _Scan(seg, len(data))
            last = index == len(found) - 1
            for item in segments.scan(data):
                if isinstance(item, segments.Damage):
                    if last and item.end == len(data):
                        # Never committed: the crash tore the write it was in.
                        recovery.truncated_bytes += item.end - item.start
                        scan.size = item.start
                    else:
                        recovery.damaged_regions += 1
                    continue
                seg.last_id = max(seg.last_id, item.record_id)
                self.next_id = max(self.next_id, item.record_id + 1)
                if visit is not None:
                    visit(item)
                if item.record_id <= acked_id:
                    continue
                if item.record_id > expect:
                    recovery.lost_records += item.record_id - expect
                expect = max(expect, item.record_id + 1)
                pending += 1
                if scan.first_pending_offset is None:
                    scan.first_pending_offset = item.offset
            self.next_id = max(self.next_id, first_id)
            if not self.readonly and scan.size < len(data):
                with open(path, "r+b") as f:
                    f.truncate(scan.size)
                    os.fsync(f.fileno())
            scans.append(scan)
        self.next_id = max(self.next_id, acked_id + 1)
        recovery.recovered_records = pending
        return pending, self._resume(scans, acked_id, recovery, delete_acked)

    def _resume(
        self, scans: list[_Scan], acked_id: int, recovery: Recovery, delete_acked: bool
    ) -> tuple[int, int]:
        """Take the scanned segments as the log (the last one open for appends unless
        read-only); return the read position (see :meth:`recover`)."""
        # Nothing pending: the reader starts at the end of the log, which the next
        # append may well extend in place (not at a segment yet to be created).
        position = (scans[-1].seg.first_id, scans[-1].size) if scans else (self.next_id, 0)
        for scan in scans:
            if scan.first_pending_offset is not None:
                position = (scan.seg.first_id, scan.first_pending_offset)
                break
        self.segments = [s.seg for s in scans]
        if scans:
            self._size = scans[-1].size
            if not self.readonly:
                self._open_active(scans[-1].seg, scans[-1].size)
                # A crash between the ledger write and the unlinks left these behind.
                if delete_acked:
                    try:
                        self.delete_through(acked_id)
                    except OSError as ex:
                        recovery.errors.append(f"cannot delete acknowledged segments: {ex}")
        return position

    # -- writing (intake thread) ----------------------------------------------------

    def _open_active(self, seg: _Segment, size: int) -> None:
        self._fd = os.open(seg.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        self._size = size

    def _rotate(self) -> None:
        if self._fd is not None:
            self._dirty.add(self._fd)
        seg = _Segment(
            self.next_id, os.path.join(self.directory, segments.segment_name(self.next_id))
        )
        self._open_active(seg, 0)
        self.segments.append(seg)
        self._created = True

    def append(self, payloads: Sequence[bytes], reclaimable: bool) -> None:
        """Write records with the next ids (not yet durable). A full segment, or a fully
        acknowledged one past ``RECLAIM_BYTES`` (``reclaimable``), is closed first."""
        framed = [segments.frame(self.next_id + i, p) for i, p in enumerate(payloads)]
        size = sum(len(f) for f in framed)
        if self._fd is None or (
            self._size > 0
            and (
                self._size + size > self.segment_bytes
                or (reclaimable and self._size >= RECLAIM_BYTES)
            )
        ):
            self._rotate()
        assert self._fd is not None
        self.next_id += len(framed)
        view = memoryview(b"".join(framed))
        while view:
            n = os.pwrite(self._fd, view, self._size)
            self._size += n
            view = view[n:]
        self._dirty.add(self._fd)
        self.segments[-1].last_id = self.next_id - 1

    def sync(self) -> None:
        """``fdatasync`` what was written since the last sync (and the directory if a
        segment was created)."""
        for fd in self._dirty:
            os.fdatasync(fd)
        old = [fd for fd in self._dirty if fd != self._fd]
        self._dirty.clear()
        for fd in old:
            os.close(fd)
        if self._created:
            fsync_dir(self.directory)
            self._created = False

    def end(self) -> tuple[int, int]:
        """Position after the last written record."""
        if not self.segments:
            return (self.next_id, 0)
        return (self.segments[-1].first_id, self._size)

    def truncate_to(self, position: tuple[int, int]) -> None:
        """Undo unsynced writes back to ``position`` (a failed commit)."""
        first_id, offset = position
        while self.segments and self.segments[-1].first_id > first_id:
            seg = self.segments.pop()
            with contextlib.suppress(OSError):
                os.unlink(seg.path)
        self.close()
        if self.segments:
            seg = self.segments[-1]
            self._open_active(seg, offset)
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, offset)  # type: ignore[arg-type]

    # -- reading (sink thread) ------------------------------------------------------

    def read(
        self, position: tuple[int, int], limit_pos: tuple[int, int], limit: int
    ) -> tuple[list[segments.Record], tuple[int, int]]:
        """Up to ``limit`` records from ``position`` up to ``limit_pos``; returns them
        and the position after them."""
        out: list[segments.Record] = []
        segs = list(self.segments)
        first_id, offset = position
        while len(out) < limit:
            index = next((i for i, s in enumerate(segs) if s.first_id >= first_id), None)
            if index is None:
                break
            seg = segs[index]
            if seg.first_id != first_id:
                offset = 0
            first_id = seg.first_id
            if seg.first_id == limit_pos[0]:
                end = limit_pos[1]
            elif seg.first_id > limit_pos[0]:
                break
            else:
                end = os.path.getsize(seg.path)
            if offset >= end:
                if index + 1 < len(segs) and segs[index + 1].first_id <= limit_pos[0]:
                    first_id, offset = segs[index + 1].first_id, 0
                    continue
                break
            records, new_offset = _read_range(seg.path, offset, end, limit - len(out))
            if not records and new_offset == offset:
                break  # the file ends early (changed under us): nothing more to read
            offset = new_offset
            out.extend(records)
        return out, (first_id, offset)

    def deletable(self, acked_id: int) -> list[str]:
        """The segments ``delete_through(acked_id)`` would unlink."""
        out = []
        for seg, after in zip(self.segments, self.segments[1:], strict=False):
            if after.first_id - 1 > acked_id:
                break
            out.append(seg.path)
        return out

    def delete_through(self, acked_id: int) -> int:
        """Unlink every segment, but the active one, whose records are all at or below
        ``acked_id``; returns how many."""
        removed = 0
        while len(self.segments) > 1 and self.segments[1].first_id - 1 <= acked_id:
            seg = self.segments.pop(0)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(seg.path)
            removed += 1
        if removed:
            fsync_dir(self.directory)
        return removed

    def close(self) -> None:
        """Close open files (unsynced writes are not made durable)."""
        for fd in self._dirty:
            if fd != self._fd:
                os.close(fd)
        self._dirty.clear()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _read_range(path: str, start: int, end: int, limit: int) -> tuple[list[segments.Record], int]:
    """Records in ``[start, end)`` of a segment, at most ``limit``; skips damage."""
    out: list[segments.Record] = []
    with open(path, "rb") as f:
        f.seek(start)
        data = f.read(min(end - start, _READ_CHUNK))
        pos = 0
        while len(out) < limit and pos < len(data):
            item = next(segments.scan(data, pos))
            if isinstance(item, segments.Damage):
                if item.end == len(data) and start + len(data) < end:
                    # The chunk cut a record (or the resync point lies beyond it).
                    data += f.read(end - start - len(data))
                    continue
                pos = item.end
                continue
            out.append(item)
            pos = item.end
    return out, start + pos
