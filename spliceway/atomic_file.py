"""Replacing a file so that a crash at any moment leaves the old or the new one, whole.

The new bytes go to a temporary file in the same directory, which is fsynced,
renamed over the target (rename is atomic within a filesystem) and then the
directory is fsynced, so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import os
import stat


def replace_file(path: str, data: bytes) -> None:
    """Atomically and durably make ``path`` hold ``data`` (OSError on failure).

    The file keeps its permission bits; on failure the temporary file is removed
    and ``path`` is untouched.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        mode = 0o644
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fchmod(fd, mode)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_directory(directory)


def fsync_directory(directory: str) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
