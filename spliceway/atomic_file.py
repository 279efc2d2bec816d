"""Replacing a file so that a crash at any moment leaves the old or the new one, whole.

The new bytes go to a temporary file in the same directory, which is fsynced,
renamed over the target (rename is atomic within a filesystem) and then the
directory is fsynced, so the rename itself survives a power loss. The two halves
can be apart (:class:`StagedFile`): ``config.apply`` writes the new file first and
renames it only once the new configuration runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat

logger = logging.getLogger(__name__)


def replace_file(path: str, data: bytes) -> None:
    """Atomically and durably make ``path`` hold ``data`` (OSError on failure).

    The file keeps its permission bits; on failure the temporary file is removed
    and ``path`` is untouched.
    """
    staged = StagedFile.write(path, data)
    staged.commit(strict=True)


class StagedFile:
    """A file's next contents, written and fsynced beside it; :meth:`commit` renames it over
    the file (atomic), :meth:`discard` removes it. Keeps the file's permission bits."""

    def __init__(self, path: str, tmp: str) -> None:
        self.path = path
        self._tmp: str | None = tmp

    @classmethod
    def write(cls, path: str, data: bytes) -> StagedFile:
        """Stage ``data`` for ``path``; OSError (nothing left behind) on failure."""
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
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return cls(path, tmp)

    def commit(self, *, strict: bool = False) -> None:
        """Rename the staged file over ``path`` and make that durable (OSError when the
        rename fails; the file is then unchanged). A failed fsync of the directory after
        the rename is an OSError too when ``strict``, else logged: the new file is in
        place and visible, only its durability is in doubt."""
        tmp, self._tmp = self._tmp, None
        assert tmp is not None
        try:
            os.rename(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        try:
            fsync_directory(os.path.dirname(os.path.abspath(self.path)))
        except OSError as ex:
            if strict:
                raise
            logger.warning("fsync of the directory of %s failed: %s", self.path, ex)

    def discard(self) -> None:
        """Remove the staged file (the apply did not go through)."""
        tmp, self._tmp = self._tmp, None
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def fsync_directory(directory: str) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
