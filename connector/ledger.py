"""The ACK ledger: how far a sink's outbox is durably acknowledged.

One small file with two 512-byte slots, each ``magic u32 | generation u64 |
acked id u64 | crc32 u32``. A write goes to the slot the current generation does
not occupy, in place, then ``fdatasync``; the reader takes the valid slot with
the higher generation. A write torn by a crash therefore leaves the other slot,
one ACK older: the events after it are delivered again (a duplicate, never a
loss). Writing in place needs no new disk blocks, so ACKs keep working on a full
disk (the outbox's emergency reserve is for the rest).
"""

from __future__ import annotations

import os
import struct
import zlib
from dataclasses import dataclass

_MAGIC = 0x31475753  # b"SWG1"
_SLOT = struct.Struct("<IQQ")
_SLOT_SIZE = 512


@dataclass(frozen=True, slots=True)
class LedgerState:
    """What a ledger file held when it was opened."""

    acked_id: int
    generation: int
    #: A slot failed its checksum (torn write or damage); the other one was used.
    damaged_slots: int


def _pack(generation: int, acked_id: int) -> bytes:
    body = _SLOT.pack(_MAGIC, generation, acked_id)
    return (body + struct.pack("<I", zlib.crc32(body))).ljust(_SLOT_SIZE, b"\0")


def _unpack(raw: bytes) -> tuple[int, int] | None:
    if len(raw) < _SLOT.size + 4:
        return None
    body = raw[: _SLOT.size]
    (crc,) = struct.unpack_from("<I", raw, _SLOT.size)
    magic, generation, acked_id = _SLOT.unpack(body)
    if magic != _MAGIC or zlib.crc32(body) != crc:
        return None
    return generation, acked_id


def read_ledger(path: str) -> LedgerState:
    """The newest valid slot of the ledger at ``path`` (acked id 0 when none is)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(2 * _SLOT_SIZE)
    except FileNotFoundError:
        return LedgerState(0, 0, 0)
    slots = [_unpack(raw[i * _SLOT_SIZE : (i + 1) * _SLOT_SIZE]) for i in range(2)]
    valid = [s for s in slots if s is not None]
    written = sum(1 for i in range(2) if raw[i * _SLOT_SIZE : (i + 1) * _SLOT_SIZE].strip(b"\0"))
    damaged = written - len(valid)
    if not valid:
        return LedgerState(0, 0, damaged)
    generation, acked_id = max(valid)
    return LedgerState(acked_id, generation, damaged)


class Ledger:
    """The writable ledger of one outbox; single writer."""

    def __init__(self, path: str) -> None:
        state = read_ledger(path)
        self.acked_id = state.acked_id
        self.generation = state.generation
        self.damaged_slots = state.damaged_slots
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(self._fd).st_size < 2 * _SLOT_SIZE:
            # Sized once at creation, so later writes never allocate blocks.
            os.posix_fallocate(self._fd, 0, 2 * _SLOT_SIZE)
            os.fsync(self._fd)

    def write(self, acked_id: int) -> None:
        """Durably record ``acked_id``; raises OSError (and changes nothing) on failure."""
        generation = self.generation + 1
        os.pwrite(self._fd, _pack(generation, acked_id), (generation % 2) * _SLOT_SIZE)
        os.fdatasync(self._fd)
        self.generation = generation
        self.acked_id = acked_id

    def close(self) -> None:
        """Close the file; idempotent (a second close must never hit a reused fd number)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)
