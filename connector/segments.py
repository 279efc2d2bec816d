"""Checksummed records in append-only segment files: the outbox's on-disk format.

A segment is a file ``seg-<first record id, 20 digits>.log`` holding records
back to back. A record is a 20-byte header and its payload::

    magic u32 | length u32 | record id u64 | crc32 u32 | payload (length bytes)

little-endian; the CRC covers the length, the id and the payload, so a torn or
flipped byte anywhere in a record is caught. Record ids grow by one per record
across segments, which is what lets a reader count exactly how many records a
damaged region held: the gap between the ids on either side of it.

This module parses and frames; it does no fsync and keeps no state beyond the
file it is given. The outbox (outbox.py) owns ordering and durability.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

MAGIC = 0x31525753  # b"SWR1" read little-endian
_MAGIC_BYTES = struct.pack("<I", MAGIC)
HEADER = struct.Struct("<IIQI")
HEADER_SIZE = HEADER.size
#: Larger records are refused at append: a poison record must never reach disk.
MAX_RECORD = 8 * 1024 * 1024
_NAME = re.compile(r"^seg-(\d{20})\.log$")


def segment_name(first_id: int) -> str:
    """File name of the segment whose first record id is ``first_id``."""
    return f"seg-{first_id:020d}.log"


def list_segments(directory: str) -> list[tuple[int, str]]:
    """``(first record id, path)`` of every segment in ``directory``, oldest first."""
    found = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    for name in names:
        m = _NAME.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(directory, name)))
    found.sort()
    return found


def frame(record_id: int, payload: bytes) -> bytes:
    """One record, header and payload, ready to append."""
    if len(payload) > MAX_RECORD:
        raise ValueError(f"record of {len(payload)} bytes exceeds {MAX_RECORD}")
    tail = struct.pack("<IQ", len(payload), record_id)
    crc = zlib.crc32(payload, zlib.crc32(tail))
    return HEADER.pack(MAGIC, len(payload), record_id, crc) + payload


@dataclass(frozen=True, slots=True)
class Record:
    """A record read back from a segment."""

    record_id: int
    payload: bytes
    offset: int
    end: int


@dataclass(frozen=True, slots=True)
class Damage:
    """Bytes ``[start, end)`` that hold no valid record (``end`` is the next valid one
    or the end of the data)."""

    start: int
    end: int


def _valid_at(buf: bytes | memoryview, pos: int) -> Record | None:
    if pos + HEADER_SIZE > len(buf):
        return None
    magic, length, record_id, crc = HEADER.unpack_from(buf, pos)
    if magic != MAGIC or length > MAX_RECORD or pos + HEADER_SIZE + length > len(buf):
        return None
    end = pos + HEADER_SIZE + length
    payload = bytes(buf[pos + HEADER_SIZE : end])
    if zlib.crc32(payload, zlib.crc32(struct.pack("<IQ", length, record_id))) != crc:
        return None
    return Record(record_id, payload, pos, end)


def scan(buf: bytes, start: int = 0) -> Iterator[Record | Damage]:
    """Every record in ``buf`` from ``start``, with a ``Damage`` for each run of bytes
    that is not one. After damage the scan resynchronises on the next position that
    starts a record with a valid CRC, so one bad record never hides the rest."""
    pos = start
    while pos < len(buf):
        rec = _valid_at(buf, pos)
        if rec is not None:
            yield rec
            pos = rec.end
            continue
        nxt = buf.find(_MAGIC_BYTES, pos + 1)
        while nxt != -1 and _valid_at(buf, nxt) is None:
            nxt = buf.find(_MAGIC_BYTES, nxt + 1)
        end = len(buf) if nxt == -1 else nxt
        yield Damage(pos, end)
        pos = end
