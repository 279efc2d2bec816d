"""``/storage/{key}``: small JSON documents dashboards keep on the engine (zashboard's
settings sync), on disk beside the fake-ip state.

mihomo's routes (``hub/route/storage.go``): ``GET`` answers the stored document as it
was sent, or ``null``; ``PUT`` takes any valid JSON document of at most 1 MiB (the
guard refuses a larger body with 413 before this reads it) and answers 204, a body that
is not JSON being 400 ``{"message": "Body invalid"}``; ``DELETE`` answers 204, also for
a key never stored.

Here each document is a file ``<key>.json`` in ``ClashContext.storage_dir`` (created
0700 at the first ``PUT``), replaced atomically (``spliceway.support.atomic_file``), so a
crash leaves the old document or the new one and the documents outlive the engine. Keys
are file names: 1 to 128 of ``A-Z a-z 0-9 . _ -``, not ``.`` or ``..`` (else 400). At
most :data:`MAX_DOCUMENTS` keys are kept (a new one past that is 507), so a client
cannot fill the disk one megabyte at a time.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import threading

import orjson
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from spliceway.api.clash.context import ClashContext
from spliceway.api.clash.guard import error_response
from spliceway.support.atomic_file import pid_alive, replace_file

__all__ = [
    "BODY_INVALID",
    "MAX_DOCUMENTS",
    "DocumentStore",
    "StoreFull",
    "key_problem",
    "storage_routes",
]

logger = logging.getLogger(__name__)

#: How many keys the store keeps at most (dashboards use one or two).
MAX_DOCUMENTS = 64
_KEY_RE = re.compile(r"[A-Za-z0-9._-]{1,128}")
_SUFFIX = ".json"
#: A temporary file ``atomic_file`` writes beside ``<key>.json``: ``.<key>.json.<pid>.tmp``.
_STAGED_RE = re.compile(r"\.[A-Za-z0-9._-]+\.json(?:\.prev)?\.(\d+)\.tmp")
_NULL = b"null"
BODY_INVALID = "Body invalid"


class StoreFull(Exception):
    """A new key past :data:`MAX_DOCUMENTS`."""


def key_problem(key: str) -> str | None:
    """Why ``key`` cannot name a document, or None when it can."""
    if _KEY_RE.fullmatch(key) is None:
        return "a storage key is 1 to 128 letters, digits, '.', '_' or '-'"
    if key in (".", ".."):
        return "a storage key cannot be '.' or '..'"
    return None


class DocumentStore:
    """The documents of one directory; blocking file I/O (call it off the event loop).

    Writes and deletions are serialised: ``atomic_file`` stages a file under a name
    fixed per process, so two threads writing one key at once would share it.
    """

    def __init__(self, directory: str) -> None:
        self._dir = directory
        self._lock = threading.Lock()
        self._swept = False

    def _path(self, key: str) -> str:
        return os.path.join(self._dir, key + _SUFFIX)

    def get(self, key: str) -> bytes | None:
        """The stored document, or None (an empty file, left by nothing of ours, too)."""
        try:
            with open(self._path(key), "rb") as file:
                data = file.read()
        except FileNotFoundError:
            return None
        return data or None

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key`` (StoreFull for a new key past the cap; OSError)."""
        with self._lock:
            os.makedirs(self._dir, mode=0o700, exist_ok=True)
            if not self._swept:
                self._sweep()
            path = self._path(key)
            if not os.path.exists(path) and self._count() >= MAX_DOCUMENTS:
                raise StoreFull
            replace_file(path, data)

    def delete(self, key: str) -> None:
        """Forget ``key`` (nothing to do when it is not stored)."""
        with self._lock, contextlib.suppress(FileNotFoundError):
            os.unlink(self._path(key))

    def _count(self) -> int:
        return sum(1 for name in os.listdir(self._dir) if name.endswith(_SUFFIX))

    def _sweep(self) -> None:
        """Remove what a killed engine left staged here (once; another live engine's
        staged files are kept)."""
        self._swept = True
        for name in os.listdir(self._dir):
            match = _STAGED_RE.fullmatch(name)
            if match is None or pid_alive(int(match.group(1))):
                continue
            try:
                os.unlink(os.path.join(self._dir, name))
            except OSError as ex:
                logger.warning("cannot remove leftover %s: %s", name, ex)


def storage_routes(ctx: ClashContext) -> list[BaseRoute]:
    """``GET``, ``PUT`` and ``DELETE /storage/{key}``."""
    store = None if ctx.storage_dir is None else DocumentStore(ctx.storage_dir)

    async def document(request: Request) -> Response:
        key: str = request.path_params["key"]
        problem = key_problem(key)
        if problem is not None:
            return error_response(400, f"invalid storage key {key!r}: {problem}")
        if store is None:
            return error_response(503, "storage is unavailable: no directory for it")
        try:
            if request.method == "PUT":
                return await _put(request, store, key)
            if request.method == "DELETE":
                await run_in_threadpool(store.delete, key)
                return Response(status_code=204)
            data = await run_in_threadpool(store.get, key)
        except OSError as ex:
            logger.warning("Clash API storage: %s %s failed: %s", request.method, key, ex)
            reason = os.strerror(ex.errno) if ex.errno else str(ex)
            status = 507 if ex.errno in (errno.ENOSPC, errno.EDQUOT) else 500
            return error_response(status, f"storage {key!r} failed: {reason}")
        return Response(data or _NULL, media_type="application/json")

    return [Route("/storage/{key}", document, methods=["GET", "PUT", "DELETE"])]


async def _put(request: Request, store: DocumentStore, key: str) -> Response:
    # The guard has refused a body over MAX_BODY_BYTES before the route runs.
    body = await request.body()
    try:
        orjson.loads(body)
    except orjson.JSONDecodeError:
        return error_response(400, BODY_INVALID)
    try:
        await run_in_threadpool(store.put, key, body)
    except StoreFull:
        return error_response(
            507, f"storage is full: at most {MAX_DOCUMENTS} keys; delete one to store {key!r}"
        )
    return Response(status_code=204)
