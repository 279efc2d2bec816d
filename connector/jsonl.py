"""The JSONL sink's file: append whole batches of envelopes, one per line, durably."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence

__all__ = ["JsonlWriter"]

_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC


class JsonlWriter:
    """Appends batches of JSON documents to one file, one per line, fsynced per batch.

    Each batch is a single ``write`` on an ``O_APPEND`` descriptor, so lines from one batch are
    never interleaved with another writer's, and an ``fsync`` makes the batch durable before
    :meth:`write_batch` returns.
    """

    def __init__(self, path: str) -> None:
        """Open ``path`` for appending (mode 0o644), creating it and its parent directories."""
        self.path = path
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        existed = os.path.exists(path)
        self._fd: int | None = os.open(path, _FLAGS, 0o644)
        # A crash mid-write can leave a partial last line; starting the next batch on a fresh
        # line keeps every complete line one parseable document.
        self._needs_newline = _ends_mid_line(path)
        if not existed:
            # The new directory entry must survive a crash as well as the data written to it.
            _fsync_dir(parent)

    def write_batch(self, lines: Sequence[bytes]) -> None:
        """Append ``lines`` (JSON documents without newlines) and fsync; raises ``OSError``."""
        if self._fd is None:
            raise OSError(f"{self.path}: writer is closed")
        if not lines:
            return
        data = b"\n".join(lines) + b"\n"
        if self._needs_newline:
            data = b"\n" + data
        view = memoryview(data)
        written = 0
        try:
            while written < len(view):
                written += os.write(self._fd, view[written:])
        except OSError:
            # Bytes already in the file end mid-line; the next batch must begin on a new one.
            if written:
                self._needs_newline = True
            raise
        self._needs_newline = False
        os.fsync(self._fd)

    def close(self) -> None:
        """Close the file; idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


def _ends_mid_line(path: str) -> bool:
    with open(path, "rb") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return False
        f.seek(size - 1)
        return f.read(1) != b"\n"


def _fsync_dir(path: str) -> None:
    # Some filesystems refuse to fsync a directory; the file's own fsync still stands.
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
