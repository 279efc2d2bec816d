"""``/storage/{key}`` on a real engine: mihomo's answers, documents kept as sent, on disk
beside the fake-ip state, through a restart; keys that are no safe file name refused."""

from __future__ import annotations

import json
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from starlette.applications import Starlette

from spliceway.api.clash import guard
from spliceway.api.clash.context import ClashContext
from spliceway.api.clash.server import ClashServer
from spliceway.api.clash.storage import MAX_DOCUMENTS, DocumentStore, key_problem, storage_routes
from spliceway.config import ClashApi
from tests.api.clash.conftest import ClashEngine
from tests.api.clash.test_guard import SECRET, bearer, message_of, request


def storage_dir(tmp_path: Path) -> Path:
    """Where the fixture's engine keeps the documents: beside its fake-ip table."""
    return tmp_path / "clash-storage"


def test_absent_key_is_null(clash: ClashEngine) -> None:
    status, headers, raw = request(clash.url, "GET", "/storage/zashboard")
    assert (status, raw) == (200, b"null")
    assert headers["content-type"] == "application/json"


def test_round_trip_keeps_the_document_as_sent(clash: ClashEngine, tmp_path: Path) -> None:
    document = b'{ "theme": "dark",\n  "list": [1, 2.50, "\\u00e9"] }'
    status, _, raw = request(clash.url, "PUT", "/storage/zashboard", body=document)
    assert (status, raw) == (204, b"")
    status, headers, raw = request(clash.url, "GET", "/storage/zashboard")
    assert (status, raw) == (200, document)
    assert headers["content-type"] == "application/json"
    directory = storage_dir(tmp_path)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    assert sorted(os.listdir(directory)) == ["zashboard.json"]
    assert (directory / "zashboard.json").read_bytes() == document
    # Any JSON value is a document, null and scalars included.
    for value in (b"null", b"0", b'"text"', b"[]", b"true"):
        assert request(clash.url, "PUT", "/storage/other", body=value)[0] == 204
        assert request(clash.url, "GET", "/storage/other")[2] == value


def test_replacing_and_deleting(clash: ClashEngine, tmp_path: Path) -> None:
    assert request(clash.url, "PUT", "/storage/k", body=b"[1]")[0] == 204
    assert request(clash.url, "PUT", "/storage/k", body=b"[2]")[0] == 204
    assert request(clash.url, "GET", "/storage/k")[2] == b"[2]"
    assert request(clash.url, "DELETE", "/storage/k")[:1] == (204,)
    assert request(clash.url, "GET", "/storage/k")[2] == b"null"
    assert os.listdir(storage_dir(tmp_path)) == []
    # Deleting what is not there is no error (mihomo).
    assert request(clash.url, "DELETE", "/storage/k")[:1] == (204,)
    assert request(clash.url, "DELETE", "/storage/never")[:1] == (204,)


@pytest.mark.parametrize("body", [b"", b"{", b"{'a': 1}", b"[1,]", b"NaN", b'{"a":1} x'])
def test_invalid_json_is_refused_and_nothing_stored(clash: ClashEngine, body: bytes) -> None:
    request(clash.url, "PUT", "/storage/k", body=b'{"kept": true}')
    answer = request(clash.url, "PUT", "/storage/k", body=body)
    assert message_of(answer, 400) == "Body invalid"
    assert request(clash.url, "GET", "/storage/k")[2] == b'{"kept": true}'


@pytest.mark.parametrize(
    "path",
    [
        "/storage/..",
        "/storage/%2E%2E",
        "/storage/.",
        "/storage/a%20b",
        "/storage/caf%C3%A9",
        "/storage/a:b",
        "/storage/" + "k" * 129,
    ],
)
def test_unsafe_keys_are_refused(clash: ClashEngine, tmp_path: Path, path: str) -> None:
    for method, body in (("PUT", b"1"), ("GET", None), ("DELETE", None)):
        answer = request(clash.url, method, path, body=body)
        assert "invalid storage key" in message_of(answer, 400), (method, path)
    assert not storage_dir(tmp_path).exists()


def test_slashes_never_reach_a_file(clash: ClashEngine, tmp_path: Path) -> None:
    # A key cannot hold a "/": an encoded one is decoded to a path no route has.
    for path in ("/storage/a%2Fb", "/storage/..%2F..%2Fx", "/storage/"):
        answer = request(clash.url, "PUT", path, body=b"1")
        assert message_of(answer, 404) == "Resource not found", path
    assert not storage_dir(tmp_path).exists()
    assert not (tmp_path / "x.json").exists()


def test_longest_key(clash: ClashEngine) -> None:
    key = "A-z_0.9" + "k" * 121
    assert len(key) == 128 and key_problem(key) is None
    assert request(clash.url, "PUT", f"/storage/{key}", body=b"1")[0] == 204
    assert request(clash.url, "GET", f"/storage/{key}")[2] == b"1"


def test_documents_survive_a_restart(
    make_clash: Callable[..., ClashEngine], tmp_path: Path
) -> None:
    first = make_clash()
    assert request(first.url, "PUT", "/storage/zashboard", body=b'{"v": 1}')[0] == 204
    first.engine.stop()
    second = make_clash()
    assert request(second.url, "GET", "/storage/zashboard")[2] == b'{"v": 1}'


def test_storage_needs_the_secret(
    make_clash: Callable[..., ClashEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SW_CLASH_SECRET", SECRET)
    clash = make_clash(secret_env="SW_CLASH_SECRET")
    message_of(request(clash.url, "PUT", "/storage/k", body=b"1"), 401)
    assert request(clash.url, "PUT", "/storage/k", body=b"1", headers=bearer())[0] == 204
    message_of(request(clash.url, "GET", "/storage/k"), 401)
    assert request(clash.url, "GET", "/storage/k", headers=bearer())[2] == b"1"


def test_key_count_is_capped(clash: ClashEngine) -> None:
    for index in range(MAX_DOCUMENTS):
        assert request(clash.url, "PUT", f"/storage/k{index}", body=b"1")[0] == 204
    answer = request(clash.url, "PUT", "/storage/one-more", body=b"1")
    assert message_of(answer, 507).startswith(f"storage is full: at most {MAX_DOCUMENTS} keys")
    # A stored key may still be replaced, and deleting one makes room.
    assert request(clash.url, "PUT", "/storage/k0", body=b"2")[0] == 204
    assert request(clash.url, "DELETE", "/storage/k1")[0] == 204
    assert request(clash.url, "PUT", "/storage/one-more", body=b"1")[0] == 204


def test_concurrent_writers_leave_one_whole_document(clash: ClashEngine) -> None:
    documents = [json.dumps({"writer": n, "pad": "x" * 50_000}).encode() for n in range(4)]
    statuses: list[int] = []

    def write(document: bytes) -> None:
        for _ in range(5):
            statuses.append(request(clash.url, "PUT", "/storage/shared", body=document)[0])

    threads = [threading.Thread(target=write, args=(doc,)) for doc in documents]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert statuses == [204] * 20
    assert request(clash.url, "GET", "/storage/shared")[2] in documents


def test_leftovers_of_a_killed_engine_are_swept(tmp_path: Path) -> None:
    directory = tmp_path / "store"
    directory.mkdir()
    dead = 4_194_305  # above Linux's largest pid_max: no process has it
    stale = directory / f".k.json.{dead}.tmp"
    stale.write_bytes(b"half a docu")
    alive = directory / f".k.json.{os.getppid()}.tmp"
    alive.write_bytes(b"another engine's")
    store = DocumentStore(str(directory))
    store.put("k", b"1")
    assert sorted(os.listdir(directory)) == sorted([alive.name, "k.json"])
    assert store.get("k") == b"1"


def test_no_directory_is_503(clash: ClashEngine) -> None:
    # A listener whose context has no directory for storage: each call says so.
    ctx = ClashContext(clash.engine.control_plane, ClashApi(enabled=True), None)
    app = Starlette(routes=storage_routes(ctx), exception_handlers=guard.exception_handlers())
    server = ClashServer(guard.wrap(app, ctx), "127.0.0.1", 0)
    ctx.listen = server.bind()
    server.start()
    try:
        for method, body in (("GET", None), ("PUT", b"1"), ("DELETE", None)):
            answer = request(server.base_url, method, "/storage/k", body=body)
            assert message_of(answer, 503) == "storage is unavailable: no directory for it"
    finally:
        server.stop()
