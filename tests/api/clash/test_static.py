"""``external_ui`` at ``/ui/`` on a real engine's Clash listener: the redirect, the files
byte for byte, no secret needed, nothing outside the directory reachable, and a start
refused when the directory is not usable."""

from __future__ import annotations

import os
import socket
import urllib.parse
from collections.abc import Callable
from pathlib import Path

import pytest

from spliceway.api.clash.static import check_external_ui
from spliceway.config import ClashApi
from spliceway.errors import ApiError
from tests.api.clash.conftest import ClashEngine
from tests.api.clash.test_guard import SECRET, bearer, message_of, port_of, request

INDEX = b"<!doctype html><title>board</title><script src=./assets/app.js></script>\n"
APP_JS = b"console.log('board');\n" * 100
SECRET_FILE = b"not for the web\n"


@pytest.fixture
def board(tmp_path: Path) -> Path:
    """A dashboard's built files, with a secret file beside (not inside) them."""
    root = tmp_path / "board"
    (root / "assets").mkdir(parents=True)
    (root / "index.html").write_bytes(INDEX)
    (root / "assets" / "app.js").write_bytes(APP_JS)
    (tmp_path / "secret.txt").write_bytes(SECRET_FILE)
    # A link out of the directory must not be followed out of it either.
    os.symlink(tmp_path / "secret.txt", root / "assets" / "link.txt")
    return root


def raw_get(base_url: str, target: bytes) -> tuple[int, bytes]:
    """``GET target`` exactly as given (no client normalises the path); status, body."""
    url = urllib.parse.urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        sock.sendall(
            b"GET " + target + b" HTTP/1.1\r\nHost: " + url.netloc.encode() + b"\r\n"
            b"Connection: close\r\n\r\n"
        )
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def test_ui_redirects_and_serves_the_files(
    make_clash: Callable[..., ClashEngine], board: Path
) -> None:
    clash = make_clash(external_ui=str(board))
    status, headers, raw = request(clash.url, "GET", "/ui")
    assert (status, headers["location"], raw) == (307, "/ui/", b"")
    # Yacd reads its backend from the query string: the redirect keeps it.
    status, headers, _ = request(clash.url, "GET", "/ui?hostname=127.0.0.1&port=9097")
    assert (status, headers["location"]) == (307, "/ui/?hostname=127.0.0.1&port=9097")
    status, headers, raw = request(clash.url, "GET", "/ui/")
    assert (status, raw) == (200, INDEX)
    assert headers["content-type"] == "text/html; charset=utf-8"
    status, headers, raw = request(clash.url, "GET", "/ui/index.html")
    assert (status, raw) == (200, INDEX)
    status, headers, raw = request(clash.url, "GET", "/ui/assets/app.js")
    assert (status, raw) == (200, APP_JS)
    assert headers["content-length"] == str(len(APP_JS))


def test_ui_needs_no_secret_but_the_api_does(
    make_clash: Callable[..., ClashEngine], board: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SW_CLASH_SECRET", SECRET)
    clash = make_clash(external_ui=str(board), secret_env="SW_CLASH_SECRET")
    assert request(clash.url, "GET", "/ui")[0] == 307
    assert request(clash.url, "GET", "/ui/")[2] == INDEX
    assert request(clash.url, "GET", "/ui/assets/app.js")[2] == APP_JS
    message_of(request(clash.url, "GET", "/storage/k"), 401)
    # A path that only looks like the dashboard's is not exempt.
    message_of(request(clash.url, "GET", "/uix"), 401)
    assert request(clash.url, "GET", "/storage/k", headers=bearer())[2] == b"null"


def test_keyless_ui_still_refuses_a_foreign_host(
    make_clash: Callable[..., ClashEngine], board: Path
) -> None:
    clash = make_clash(external_ui=str(board))
    answer = request(
        clash.url, "GET", "/ui/", headers={"Host": f"evil.example:{port_of(clash.url)}"}
    )
    assert "Host evil.example" in message_of(answer, 403)


@pytest.mark.parametrize(
    "target",
    [
        b"/ui/../secret.txt",
        b"/ui/%2e%2e/secret.txt",
        b"/ui/%2E%2E%2Fsecret.txt",
        b"/ui/..%2fsecret.txt",
        b"/ui/assets/../../secret.txt",
        b"/ui/assets/%2e%2e/%2e%2e/secret.txt",
        b"/ui//etc/passwd",
        b"/ui/%2Fetc%2Fpasswd",
        b"/ui/assets/link.txt",
        b"/ui/../../../../../../etc/passwd",
    ],
)
def test_nothing_outside_the_directory_is_served(
    make_clash: Callable[..., ClashEngine], board: Path, target: bytes
) -> None:
    clash = make_clash(external_ui=str(board))
    assert raw_get(clash.url, target) == (404, b'{"message":"Resource not found"}')
    # The same normalisation inside the directory finds its file.
    assert raw_get(clash.url, b"/ui/assets/../index.html") == (200, INDEX)


def test_missing_file_and_wrong_method(make_clash: Callable[..., ClashEngine], board: Path) -> None:
    clash = make_clash(external_ui=str(board))
    assert message_of(request(clash.url, "GET", "/ui/nope.js"), 404) == "Resource not found"
    answer = request(clash.url, "POST", "/ui/index.html", body=b"{}")
    assert message_of(answer, 405) == "Method not allowed"


def test_no_external_ui_no_ui(clash: ClashEngine) -> None:
    assert message_of(request(clash.url, "GET", "/ui/"), 404) == "Resource not found"
    assert message_of(request(clash.url, "GET", "/ui"), 404) == "Resource not found"


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_unusable_external_ui_refuses_the_start(
    make_clash: Callable[..., ClashEngine], tmp_path: Path, kind: str
) -> None:
    path = tmp_path / "board"
    if kind == "file":
        path.write_bytes(INDEX)
    with pytest.raises(ApiError) as info:
        make_clash(external_ui=str(path))
    assert info.value.code == "invalid_argument"
    assert info.value.field_path == "api.clash.external_ui"
    expected = "does not exist" if kind == "missing" else "is not a directory"
    assert f"external_ui {path} {expected}" in info.value.message


def test_check_external_ui(tmp_path: Path, board: Path) -> None:
    check_external_ui(ClashApi(enabled=True, external_ui=str(board)))
    check_external_ui(ClashApi(enabled=True))
    # Nothing is checked for a listener that is off.
    check_external_ui(ClashApi(enabled=False, external_ui=str(tmp_path / "missing")))
    with pytest.raises(ApiError) as info:
        check_external_ui(ClashApi(enabled=True, external_ui=str(tmp_path / "missing")))
    assert info.value.field_path == "api.clash.external_ui"
    if os.geteuid() != 0:  # root reads every directory
        locked = tmp_path / "locked"
        locked.mkdir(mode=0)
        with pytest.raises(ApiError) as info:
            check_external_ui(ClashApi(enabled=True, external_ui=str(locked)))
        assert "cannot be read" in info.value.message
