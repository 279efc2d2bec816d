"""Replacing a file so that a crash at any moment leaves the old or the new one, whole.

The new bytes go to a temporary file in the same directory, which is fsynced,
renamed over the target (rename is atomic within a filesystem) and then the
directory is fsynced, so the rename itself survives a power loss. The two halves
can be apart (:class:`StagedFile`): ``config.apply`` writes the new file first and
renames it only once the new configuration runs, keeping what the file held before
as ``<file>.prev``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat

logger = logging.getLogger(__name__)


def replace_file(path: str, data: bytes) -> None:
    """Atomically and durably make ``path`` hold ``data`` (OSError on failure).

    The file keeps its permission bits; on failure the temporary file is removed
    and ``path`` is untouched.
    """
    staged = StagedFile.write(path, data)
    staged.commit(strict=True)


PREVIOUS_SUFFIX = ".prev"


class StagedFile:
    """A file's next contents, written and fsynced beside it; :meth:`commit` renames it over
    the file (atomic), :meth:`discard` removes it. Keeps the file's permission bits.

    With ``keep_previous`` the file's current contents are kept as ``<path>.prev`` by the
    commit: one generation, itself replaced by an atomic rename, so a crash leaves the
    old ``.prev`` or the new one, whole."""

    def __init__(self, path: str, tmp: str, previous_tmp: str | None = None) -> None:
        self.path = path
        self._tmp: str | None = tmp
        self._previous_tmp = previous_tmp

    @property
    def staged_path(self) -> str:
        """The temporary file holding the new contents (until the commit or discard)."""
        assert self._tmp is not None
        return self._tmp

    @property
    def previous_path(self) -> str:
        """Where the commit keeps the file's contents before it (``<path>.prev``)."""
        return self.path + PREVIOUS_SUFFIX

    @classmethod
    def write(cls, path: str, data: bytes, *, keep_previous: bool = False) -> StagedFile:
        """Stage ``data`` for ``path`` (and, with ``keep_previous``, its current contents for
        ``<path>.prev``); OSError (nothing left behind) on failure."""
        tmp = _write_beside(path, data)
        previous_tmp = None
        if keep_previous:
            try:
                previous_tmp = _stage_previous(path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
        return cls(path, tmp, previous_tmp)

    def commit(self, *, strict: bool = False) -> None:
        """Rename the staged file over ``path`` and make that durable (OSError naming the
        file it could not replace when a rename fails; the file is then unchanged: the
        ``.prev`` is renamed first, and may then hold the file's current contents already,
        which loses nothing). A failed fsync of the directory after
        the rename is an OSError too when ``strict``, else logged: the new file is in
        place and visible, only its durability is in doubt."""
        tmp, self._tmp = self._tmp, None
        previous_tmp, self._previous_tmp = self._previous_tmp, None
        assert tmp is not None
        try:
            if previous_tmp is not None:
                _rename(previous_tmp, self.previous_path)
                previous_tmp = None
            _rename(tmp, self.path)
        except BaseException:
            for leftover in (tmp, previous_tmp):
                if leftover is not None:
                    with contextlib.suppress(OSError):
                        os.unlink(leftover)
            raise
        try:
            fsync_directory(os.path.dirname(os.path.abspath(self.path)))
        except OSError as ex:
            if strict:
                raise
            logger.warning("fsync of the directory of %s failed: %s", self.path, ex)

    def discard(self) -> None:
        """Remove the staged file (the apply did not go through)."""
        for leftover in (self._tmp, self._previous_tmp):
            if leftover is not None:
                with contextlib.suppress(OSError):
                    os.unlink(leftover)
        self._tmp = self._previous_tmp = None


def _write_beside(path: str, data: bytes, mode_of: str | None = None) -> str:
    """``data`` in a new fsynced temporary file beside ``path``, with the permission bits
    of ``mode_of`` (default ``path``; 0644 for a new file); its name. Nothing is left
    behind on failure."""
    try:
        mode = stat.S_IMODE(os.stat(mode_of or path).st_mode)
    except FileNotFoundError:
        mode = 0o644
    tmp = _temporary_name(path)
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
    return tmp


def _stage_previous(path: str) -> str | None:
    """A second name for ``path``'s current contents beside it, to be renamed to
    ``<path>.prev`` (None when there is no file yet). A hard link keeps the exact bytes,
    comments and all, without copying them; where the filesystem has no links, a copy."""
    previous = path + PREVIOUS_SUFFIX
    tmp = _temporary_name(previous)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # left by a process of this pid that was killed
    try:
        os.link(path, tmp)
    except FileNotFoundError:
        return None
    except OSError:
        try:
            with open(path, "rb") as current:
                data = current.read()
        except (FileNotFoundError, IsADirectoryError):
            # No file to keep; the commit's rename over a directory fails on its own.
            return None
        return _write_beside(previous, data, mode_of=path)
    return tmp


def remove_stale_staged(path: str) -> list[str]:
    """Remove the temporary files a killed process left beside ``path``: every
    ``.<name>.<pid>.tmp`` and ``.<name>.prev.<pid>.tmp`` whose pid is no live process,
    or is this process (call it only while this process stages nothing for ``path``:
    at start, or with the apply lock held). A file of a live process is kept: another
    engine may be applying to the same file. Returns the names removed; never raises
    (a file that cannot be removed is logged and stays)."""
    directory = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(rf"\.{re.escape(os.path.basename(path))}(?:\.prev)?\.(\d+)\.tmp")
    try:
        names = os.listdir(directory)
    except OSError as ex:
        logger.warning("cannot list %s for leftover temporary files: %s", directory, ex)
        return []
    removed = []
    for name in names:
        match = pattern.fullmatch(name)
        if match is None or pid_alive(int(match.group(1))):
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except FileNotFoundError:
            continue
        except OSError as ex:
            logger.warning("cannot remove leftover %s: %s", os.path.join(directory, name), ex)
            continue
        removed.append(name)
        logger.info("removed %s, left by an interrupted write", os.path.join(directory, name))
    return removed


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is another live process (one of another user's counts as live)."""
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


def _temporary_name(path: str) -> str:
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")


def _rename(source: str, target: str) -> None:
    """``os.rename``, its OSError naming ``target`` (the file a caller reports), not the
    temporary ``source``."""
    try:
        os.rename(source, target)
    except OSError as ex:
        raise OSError(ex.errno, ex.strerror, target) from ex


def fsync_directory(directory: str) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
