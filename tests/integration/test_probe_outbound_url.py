"""``diagnostics.probe_outbound``: which URL it probes, proven by what real origins receive.

URL choice: ``runtime.latency_test_url`` (always wins), else the command's
``url``, else the url_test / fallback / load_balance group's own ``url`` when the
target is such a group, else the built-in default. Two local HTTP origins record
every request; groups probe every hour, so after their startup round the only
requests an origin sees are the command's.
"""

from __future__ import annotations

import http.server
import json
import threading
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.api.conftest import control_config
from tests.conftest import wait_until
from tests.helpers.servers import serving


class _Recorder(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _answer(self) -> None:
        server: RecordingOrigin = self.server  # type: ignore[assignment]
        with server.lock:
            server.requests.append((self.command, self.path))
        self.send_response(204)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = _answer
    do_GET = _answer


class RecordingOrigin(http.server.ThreadingHTTPServer):
    """An HTTP origin on 127.0.0.1 answering 204 and recording ``(method, path)``."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Recorder)
        self.lock = threading.Lock()
        self.requests: list[tuple[str, str]] = []

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}{path}"

    def take(self) -> list[tuple[str, str]]:
        """The requests recorded so far, forgetting them."""
        with self.lock:
            taken, self.requests = self.requests, []
        return taken


@pytest.fixture
def origins() -> Iterator[tuple[RecordingOrigin, RecordingOrigin]]:
    with serving(RecordingOrigin()) as a, serving(RecordingOrigin()) as b:
        yield a, b


def group_engine(
    make_engine: Callable[..., Any], kind: str, group_url: str, latency_test_url: str | None = None
) -> Any:
    """An engine whose group ``g`` (of ``kind``, over ``direct``) probes ``group_url``
    hourly, after its startup round has completed."""
    cfg = control_config()
    cfg["outbound_groups"] = [
        {
            "tag": "g",
            "kind": kind,
            "outbounds": ["direct"],
            "url": group_url,
            "interval_seconds": 3600,
        }
    ]
    if latency_test_url is not None:
        cfg["runtime"]["latency_test_url"] = latency_test_url
    engine = make_engine(cfg)

    def startup_round_done() -> bool:
        return any(
            e["event_type"] == "policy.probe.completed" and e["payload"]["policy_tag"] == "g"
            for e in engine.query("events", {"types": "policy.probe.completed"})["events"]
        )

    wait_until(startup_round_done, what="the group's startup probe round")
    return engine


def probe(engine: Any, **params: Any) -> dict[str, Any]:
    result: dict[str, Any] = engine.execute(
        "diagnostics.probe_outbound", {"target_tag": "g", **params}
    )
    assert result["reachable"] is True, result
    return result


@pytest.mark.parametrize("kind", ["url_test", "fallback", "load_balance"])
def test_group_url_is_probed(
    make_engine: Callable[..., Any],
    origins: tuple[RecordingOrigin, RecordingOrigin],
    kind: str,
) -> None:
    a, b = origins
    group_url = a.url("/group-probe")
    engine = group_engine(make_engine, kind, group_url)
    assert ("HEAD", "/group-probe") in a.take()  # the group's own startup round
    assert probe(engine)["url"] == group_url
    assert a.take() == [("HEAD", "/group-probe")]
    assert b.take() == []


def test_group_url_is_probed_over_http(
    make_engine: Callable[..., Any], origins: tuple[RecordingOrigin, RecordingOrigin]
) -> None:
    a, _ = origins
    group_url = a.url("/group-probe")
    engine = group_engine(make_engine, "url_test", group_url)
    a.take()
    body = json.dumps({"method": "diagnostics.probe_outbound", "params": {"target_tag": "g"}})
    request = urllib.request.Request(
        f"{engine.control_url}/api/v1/commands",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=15) as answer:
        result = json.loads(answer.read())["result"]
    assert (result["url"], result["reachable"]) == (group_url, True)
    assert a.take() == [("HEAD", "/group-probe")]


def test_command_url_beats_group_url(
    make_engine: Callable[..., Any], origins: tuple[RecordingOrigin, RecordingOrigin]
) -> None:
    a, b = origins
    engine = group_engine(make_engine, "url_test", a.url("/group-probe"))
    a.take()
    command_url = b.url("/command-probe")
    assert probe(engine, url=command_url)["url"] == command_url
    assert b.take() == [("HEAD", "/command-probe")]
    assert a.take() == []


def test_latency_test_url_beats_command_and_group_url(
    make_engine: Callable[..., Any], origins: tuple[RecordingOrigin, RecordingOrigin]
) -> None:
    a, b = origins
    latency_url = b.url("/latency-probe")
    # The group's own probes keep its own url; the command takes latency_test_url.
    engine = group_engine(make_engine, "url_test", a.url("/group-probe"), latency_url)
    assert ("HEAD", "/group-probe") in a.take()
    assert b.take() == []
    assert probe(engine, url=a.url("/command-probe"))["url"] == latency_url
    assert probe(engine)["url"] == latency_url
    assert b.take() == [("HEAD", "/latency-probe"), ("HEAD", "/latency-probe")]
    assert a.take() == []


def test_selector_group_has_no_url_of_its_own(
    make_engine: Callable[..., Any], origins: tuple[RecordingOrigin, RecordingOrigin]
) -> None:
    """A selector probes nothing itself: its target falls through to latency_test_url."""
    a, _ = origins
    cfg = control_config()
    cfg["outbound_groups"] = [
        {"tag": "s", "kind": "selector", "outbounds": ["direct"], "default": "direct"}
    ]
    cfg["runtime"]["latency_test_url"] = a.url("/latency-probe")
    engine = make_engine(cfg)
    result = engine.execute("diagnostics.probe_outbound", {"target_tag": "s"})
    assert (result["url"], result["reachable"]) == (a.url("/latency-probe"), True)
    assert a.take() == [("HEAD", "/latency-probe")]
