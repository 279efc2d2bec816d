"""``GET /api/v1/logs``: the engine's ring of recent log records over real HTTP (and the
same query over IPC and gRPC): what it keeps, its filters, its bounds, its permission."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from spliceway.events.logring import LOG_RING_CAPACITY, MESSAGE_MAX_CHARS, ROOT_LOGGER
from tests.api.conftest import control_config
from tests.conftest import spliceway_logs_at, wait_until
from tests.helpers.socks import socks5_connect
from tests.helpers.upstreams import refused_port

TIMEOUT = 10.0


@pytest.fixture(autouse=True)
def _spliceway_at_debug() -> Iterator[None]:
    """Let every ``spliceway`` record through, as ``spliceway run`` at ``debug`` does."""
    with spliceway_logs_at(logging.DEBUG):
        yield


def get(base_url: str, path: str, key: str | None = None) -> tuple[int, dict[str, Any]]:
    """``(status, envelope)`` of one GET on the control API."""
    request = urllib.request.Request(base_url + path)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as ex:
        return ex.code, json.loads(ex.read())


def logs(base_url: str, query: str = "", key: str | None = None) -> dict[str, Any]:
    status, body = get(base_url, f"/api/v1/logs{query}", key)
    assert status == 200 and body["ok"], body
    result: dict[str, Any] = body["result"]
    return result


def mine(result: dict[str, Any], marker: str) -> list[dict[str, Any]]:
    return [r for r in result["records"] if marker in r["message"]]


def test_a_failed_flows_line_is_in_the_ring_with_its_logger_and_level(
    make_engine: Callable[..., Any],
) -> None:
    cfg = control_config()
    cfg["runtime"]["log_level"] = "debug"
    engine = make_engine(cfg)
    port = refused_port()
    with pytest.raises(ConnectionError, match="socks reply 5"):  # the target refuses
        socks5_connect(engine.listen_address("socks-in"), "127.0.0.1", port)
    target = f"target=127.0.0.1:{port}"
    found = wait_until(
        lambda: mine(logs(engine.control_url), target), TIMEOUT, "the flow's log line"
    )
    line = found[0]
    assert line["logger"] == "spliceway.flow"
    assert line["level"] == "info"
    assert "outcome=failed" in line["message"]
    assert set(line) == {"sequence", "time_unix_ms", "level", "logger", "message", "thread"}
    # level=warn leaves the info line out.
    assert mine(logs(engine.control_url, "?level=warn"), target) == []
    assert mine(logs(engine.control_url, "?level=info"), target)


def test_since_limit_and_level_page_through_the_ring(make_engine: Callable[..., Any]) -> None:
    cfg = control_config()
    cfg["runtime"]["log_level"] = "debug"
    engine = make_engine(cfg)
    log = logging.getLogger("spliceway.test_logs")
    start = logs(engine.control_url)["latest_sequence"]
    log.debug("paging debug %d", 1)
    log.info("paging info %d", 2)
    log.warning("paging warn %d", 3)
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("paging error %d", 4)

    after = logs(engine.control_url, f"?since={start}")
    texts = [r["message"].splitlines()[0] for r in mine(after, "paging")]
    assert texts == ["paging debug 1", "paging info 2", "paging warn 3", "paging error 4"]
    levels = [r["level"] for r in mine(after, "paging")]
    assert levels == ["debug", "info", "warn", "error"]
    sequences = [r["sequence"] for r in after["records"]]
    assert sequences == sorted(sequences) and sequences[0] > start
    error = mine(after, "paging error")[0]
    assert "ValueError: boom" in error["message"]  # the traceback comes along

    # limit: the oldest matching ones first, so ``since`` = the last one pages forward.
    first = logs(engine.control_url, f"?since={start}&limit=2")["records"]
    assert [r["message"] for r in first] == ["paging debug 1", "paging info 2"]
    rest = logs(engine.control_url, f"?since={first[-1]['sequence']}&level=warn")["records"]
    assert [r["message"].splitlines()[0] for r in mine({"records": rest}, "paging")] == [
        "paging warn 3",
        "paging error 4",
    ]
    # trace is debug (as spliceway run maps it).
    assert len(mine(logs(engine.control_url, f"?since={start}&level=trace"), "paging")) == 4


def test_the_ring_is_bounded_and_long_messages_are_cut(make_engine: Callable[..., Any]) -> None:
    engine = make_engine(control_config())
    log = logging.getLogger("spliceway.test_logs")
    log.warning("x" * (MESSAGE_MAX_CHARS * 3))
    for i in range(LOG_RING_CAPACITY + 50):
        log.warning("bounded %d", i)
    result = logs(engine.control_url)
    assert result["capacity"] == LOG_RING_CAPACITY
    assert len(result["records"]) == LOG_RING_CAPACITY
    assert result["records"][-1]["message"] == f"bounded {LOG_RING_CAPACITY + 49}"
    assert result["oldest_sequence"] == result["latest_sequence"] - LOG_RING_CAPACITY + 1
    # The long one went first; cut, it would have been at most the bound.
    assert all(len(r["message"]) <= MESSAGE_MAX_CHARS for r in result["records"])


def test_runtime_log_level_is_the_rings_floor(make_engine: Callable[..., Any]) -> None:
    cfg = control_config()
    cfg["runtime"]["log_level"] = "warn"
    engine = make_engine(cfg)
    log = logging.getLogger("spliceway.test_logs")
    log.info("floor info")
    log.warning("floor warn")
    got = [r["message"] for r in mine(logs(engine.control_url), "floor")]
    assert got == ["floor warn"]


def test_other_loggers_stay_out_and_a_stopped_engine_lets_go(
    make_engine: Callable[..., Any],
) -> None:
    engine = make_engine(control_config())
    logging.getLogger("waitress.somewhere").warning("not ours")
    logging.getLogger("spliceway").warning("ours")
    messages = [r["message"] for r in logs(engine.control_url)["records"]]
    assert "ours" in messages and "not ours" not in messages
    ring = engine._core.logs
    assert ring in logging.getLogger(ROOT_LOGGER).handlers
    engine.stop()
    assert ring not in logging.getLogger(ROOT_LOGGER).handlers


@pytest.mark.parametrize(
    ("query", "field"),
    [
        ("?level=verbose", "level"),
        ("?level=", "level"),
        ("?limit=0", "limit"),
        (f"?limit={LOG_RING_CAPACITY + 1}", "limit"),
        ("?since=-1", "since"),
        ("?types=flow.started", "types"),
        ("?level=info&level=warn", "level"),
    ],
)
def test_bad_parameters_are_invalid_argument(base_url: str, query: str, field: str) -> None:
    status, body = get(base_url, f"/api/v1/logs{query}")
    assert status == 400
    assert (body["error"]["code"], body["error"]["field_path"]) == ("invalid_argument", field)


def test_logs_need_the_read_permission(
    make_engine: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SW_TEST_LOGS_READ", "logs-read-key")
    monkeypatch.setenv("SW_TEST_LOGS_CFG", "logs-config-key")
    engine = make_engine(
        control_config(
            keys=[
                {"name": "dash", "key_env": "SW_TEST_LOGS_READ", "permissions": ["read"]},
                {"name": "cfg", "key_env": "SW_TEST_LOGS_CFG", "permissions": ["config"]},
            ]
        )
    )
    assert get(engine.control_url, "/api/v1/logs")[0] == 401
    status, body = get(engine.control_url, "/api/v1/logs", "logs-config-key")
    assert (status, body["error"]["code"]) == (403, "permission_denied")
    assert "records" in logs(engine.control_url, "", "logs-read-key")


def test_log_set_level_moves_the_floor_until_the_configuration_changes(
    make_engine: Callable[..., Any],
) -> None:
    """log.set_level (mihomo's PATCH /configs log-level): the ring's floor and the
    ``spliceway`` logger's level at once, shown by the runtime query; a configuration
    that changes runtime.log_level wins, as a restart would; stopping gives the logger
    back its own level."""
    cfg = control_config()
    cfg["runtime"]["log_level"] = "warn"
    root = logging.getLogger(ROOT_LOGGER)
    own_level = root.level
    engine = make_engine(cfg)
    log = logging.getLogger("spliceway.test_logs")
    assert engine.query("runtime")["log_level"] == "warn"

    answer = engine.execute("log.set_level", {"level": "debug"})
    assert answer == {"level": "debug", "previous": "warn"}
    assert engine.query("runtime")["log_level"] == "debug"
    assert root.level == logging.DEBUG
    log.debug("set-level debug")
    assert [r["level"] for r in mine(logs(engine.control_url), "set-level")] == ["debug"]

    engine.execute("log.set_level", {"level": "error"})
    log.warning("set-level warn")
    assert [r["message"] for r in mine(logs(engine.control_url), "set-level")] == [
        "set-level debug"
    ]
    with pytest.raises(Exception, match=r"params\.level") as info:
        engine.execute("log.set_level", {"level": "verbose"})
    assert info.value.code == "invalid_argument"  # type: ignore[attr-defined]

    # A configuration naming another level wins.
    cfg["runtime"]["log_level"] = "info"
    engine.execute("config.apply_runtime", {"config": cfg})
    assert engine.query("runtime")["log_level"] == "info"
    log.info("set-level info")
    assert mine(logs(engine.control_url), "set-level info")

    engine.stop()
    assert root.level == own_level
